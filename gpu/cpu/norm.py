"""RMSNorm and rotary embedding through the compiled CPU kernel (gpu/cpu/csrc/norm_rope.cpp,
torch.ops.weir.rms_norm_rope), float32: each row normalized (and, for Q and K, rotated) in one
pass, instead of torch's ten element-wise ops. Qwen3's per-head Q/K norms are where it shows
(figures: docs/benchmarks.md). Cohere's mean-centred layer norm beside it."""

from __future__ import annotations

import torch

from gpu.cpu import build as cpu_build


def _check_rows(x: torch.Tensor) -> None:
    """A [tokens, dim] or [tokens, heads, dim] float32 CPU tensor whose rows are contiguous."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"cpu norm: needs float32 on the CPU, got {x.dtype} on {x.device}")
    d = x.shape[-1]
    if x.stride(-1) != 1 or (x.dim() == 3 and x.stride(1) != d):
        raise ValueError("cpu norm: rows must be contiguous")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check_rows(x)
    return cpu_build.load().rms_norm_rope(x, weight, eps, None, None)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """A mean-centred layer norm (Cohere's: a weight; Nemotron's: and a bias) of each row of x
    [..., dim]: the kernel the one-call stack runs too, so both paths give the same bits."""
    _check_rows(x)
    flat = x.reshape(-1, x.shape[-1])
    b = None if bias is None else bias.detach().float()
    return cpu_build.load().layer_norm(flat, weight.float(), eps, b).view(x.shape)


def norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """x: [tokens, heads, dim]; RMSNorm per head row with `weight` (none if None), then the
    rotation by cos/sin [tokens, dim] (float32, contiguous)."""
    _check_rows(x)
    if cos.dtype != torch.float32 or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("cpu norm: cos/sin must be contiguous float32")
    return cpu_build.load().rms_norm_rope(x, weight, eps, cos, sin)
