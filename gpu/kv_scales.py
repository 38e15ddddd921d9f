"""A checkpoint's FP8 KV cache scales: one float per layer for its keys and one for its values,
calibrated so that K / k_scale and V / v_scale fit E4M3 (llm-compressor's `kv_cache_scheme`,
AutoFP8's and ModelOpt's FP8-KV checkpoints), as vLLM reads them:
`model.layers.N.self_attn.k_scale` / `v_scale`, the older `kv_scale` (both),
`k_proj.output_scale` / `v_proj.output_scale`, and ModelOpt's `k_proj.k_scale` / `v_proj.v_scale`.

Under an FP8 cache (--kv-cache-dtype fp8 / fp8_e4m3 / fp8_e5m2) each layer writes K times
k_mul = 1 / k_scale and V times 1 / v_scale (float32), scores q.k with the attention's scale
times k_scale, and multiplies the attention's output by v_scale, which is the attention over
the scaled-back cache. No kernel reads a scale: the writes take a multiplier (every backend's
`rope_store_kv`, weir's compiled CPU stack), the rest is the scale and one product. Under a 16-
or 32-bit cache the scales are unused, and a warning says so. Scales per head are refused.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch

from core.config import CheckpointError

log = logging.getLogger("weir.kv_cache")

_NAME = re.compile(
    r"^model\.layers\.(\d+)\.self_attn\."
    r"(?:(k|v|kv)_scale|(k|v)_proj\.output_scale|k_proj\.(k)_scale|v_proj\.(v)_scale)$"
)


def which(name: str) -> tuple[int, str] | None:
    """(layer, "k" | "v" | "kv") of a KV scale's checkpoint name, else None."""
    m = _NAME.match(name)
    if m is None:
        return None
    return int(m.group(1)), next(g for g in m.groups()[1:] if g)


def value(name: str, tensor: torch.Tensor) -> float:
    """The scale a checkpoint tensor holds: one positive finite float."""
    if tensor.numel() != 1:
        raise CheckpointError(
            f"{name}: KV cache scales of shape {tuple(tensor.shape)} (per head) are not "
            "served; one scale per layer is"
        )
    s = float(tensor.float().item())
    if not (s > 0 and s < float("inf")):
        raise CheckpointError(f"{name}: a KV cache scale must be positive and finite, got {s}")
    return s


def place(model, name: str, tensor: torch.Tensor) -> None:
    """Record the scale `name` on its layer's attention (`kv_scales`: the checkpoint's)."""
    layer, kind = which(name)
    layers = model.model.layers
    if layer >= len(layers):
        raise CheckpointError(f"unexpected weight {name!r} in the checkpoint")
    s = value(name, tensor)
    scales = layers[layer].self_attn.kv_scales
    if kind in ("k", "kv"):
        scales[0] = s
    if kind in ("v", "kv"):
        scales[1] = s


@dataclass(frozen=True)
class Applied:
    """A layer's use of its scales under an FP8 cache (float32 values)."""

    k_mul: float  # K times this before its cache write (1 / k_scale)
    v_mul: float
    score_scale: float  # the attention's scale times k_scale
    out_scale: float  # the attention's output times this (v_scale)

    @classmethod
    def of(cls, attn_scale: float, k_scale: float, v_scale: float) -> Applied:
        one, k, v, scale = (
            torch.tensor(x, dtype=torch.float32) for x in (1.0, k_scale, v_scale, attn_scale)
        )
        return cls(float(one / k), float(one / v), float(scale * k), float(v))


def use(model, fp8_cache: bool) -> bool:
    """Put the checkpoint's scales to use (an FP8 cache) or say they are unused; True when any
    layer's scales are in use."""
    layers = model.model.layers
    scaled = [layer.self_attn for layer in layers if layer.self_attn.kv_scales != [1.0, 1.0]]
    if not scaled:
        return False
    if not fp8_cache:
        log.warning(
            "the checkpoint's FP8 KV cache scales (%d layers) are unused: the cache is not FP8 "
            "(--kv-cache-dtype fp8 uses them)",
            len(scaled),
        )
        return False
    for attn in scaled:
        attn.kv_applied = Applied.of(attn.scale, *attn.kv_scales)
    if model.stack is not None and hasattr(model.stack, "unbind"):
        model.stack.unbind()  # the compiled stack takes them when it next binds
    log.info("FP8 KV cache with the checkpoint's scales (%d layers)", len(scaled))
    return True
