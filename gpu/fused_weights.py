"""Checkpoint tensors that hold several of weir's weights: Phi-3's `qkv_proj` (Q, K and V
stacked by output rows) and `gate_up_proj` (gate, then up). Each is cut by rows into the
tensors a Llama checkpoint would have, which the model then stacks again as it stacks a
Llama's (one product for Q/K/V, one for gate/up). A GGUF file's blocks are cut by whole rows."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from core.config import CheckpointError
from gpu.quant.tensor import BlockTensor

FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def fused_parts(name: str) -> tuple[str, tuple[str, ...]] | None:
    """(the fused layer, its parts) when `name` is a fused layer's tensor, else None."""
    prefix, _, kind = name.rpartition(".")
    for fused, parts in FUSED.items():
        if prefix.endswith("." + fused):
            return fused, tuple(f"{prefix[: -len(fused)]}{p}.{kind}" for p in parts)
    return None


def split_fused(name: str, value: Any, spec: Any) -> list[tuple[str, torch.Tensor]]:
    """A fused tensor's parts, [(name, rows)], sized by the model (`spec`: gpu/models/spec.py);
    a quantized one, or one of another size, is a CheckpointError."""
    fused, names = fused_parts(name)
    if fused == "self_attn.qkv_proj":
        kv = spec.num_kv_heads * spec.head_dim
        sizes = [spec.num_heads * spec.head_dim, kv, kv]
    else:
        sizes = [spec.intermediate_size] * 2
    if not isinstance(value, torch.Tensor | BlockTensor):
        raise CheckpointError(f"{name}: a fused layer in {type(value).__name__} is not served")
    if value.shape[0] != sum(sizes):
        raise CheckpointError(
            f"weight {name!r} has {value.shape[0]} rows, the model expects {sum(sizes)}"
        )
    if isinstance(value, torch.Tensor):
        return list(zip(names, torch.split(value, sizes)))
    ends = np.cumsum([0, *sizes])  # a GGUF file's blocks: whole rows move, none requantized
    return [(n, value.take_rows(np.arange(a, b))) for n, a, b in zip(names, ends, ends[1:])]
