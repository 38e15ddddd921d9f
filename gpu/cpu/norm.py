"""RMSNorm and rotary embedding through the compiled CPU kernel (gpu/cpu/csrc/norm_rope.cpp).

On CPU in float32 the loader points the model's RMSNorm modules and attention layers here: each
row is normalized (and, for Q and K, rotated) in one pass, instead of torch's ten element-wise
ops. Qwen3's per-head Q/K norms are where it shows: on the 77M benchmark model a 4,096-token
prefill ran them (48k rows of 64) in 12 ms per norm with torch.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from gpu.cpu import build as cpu_build

log = logging.getLogger("weir.cpu_norm")


def _rows_view(x: torch.Tensor) -> tuple[int, int, int, int]:
    """(tokens, heads, dim, token stride) of a [tokens, dim] or [tokens, heads, dim] float32 CPU
    tensor whose rows are contiguous."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"cpu norm: needs float32 on the CPU, got {x.dtype} on {x.device}")
    t, d = x.shape[0], x.shape[-1]
    heads = x.shape[1] if x.dim() == 3 else 1
    if x.stride(-1) != 1 or (x.dim() == 3 and x.stride(1) != d):
        raise ValueError("cpu norm: rows must be contiguous")
    return t, heads, d, x.stride(0)


class CpuNorm:
    """Callables over the loaded kernel library."""

    def __init__(self) -> None:
        self._fn = cpu_build.load().rms_norm_rope

    def _run(self, x, weight, eps, cos, sin) -> torch.Tensor:
        _rows_view(x)
        return self._fn(x, weight, eps, cos, sin)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._run(x, weight, eps, None, None)

    def norm_rope(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        eps: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """x: [tokens, heads, dim]; RMSNorm per head row with `weight` (none if None), then the
        rotation by cos/sin [tokens, dim] (float32, contiguous)."""
        if cos.dtype != torch.float32 or not (cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError("cpu norm: cos/sin must be contiguous float32")
        return self._run(x, weight, eps, cos, sin)


def use_kernels(model: nn.Module) -> bool:
    """Point `model`'s RMSNorm modules and attention layers at the kernel; False (and the model
    left on torch ops) when it cannot be built here."""
    from gpu.models.decoder import Attention, RMSNorm

    try:
        ops = CpuNorm()
    except cpu_build.BuildError as e:
        log.warning("CPU norm kernel unavailable, using torch ops: %s", e)
        return False
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.kernel = ops
        elif isinstance(module, Attention):
            module.norm_rope = ops.norm_rope
    return True
