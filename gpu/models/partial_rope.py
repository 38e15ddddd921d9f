"""A partial rotation (Phi-4-mini's partial_rotary_factor, GPT-NeoX's rotary_pct) served by the
full-head rotation weir's kernels apply, through a reordering of each query and key head.

transformers rotates the first r of a head's D elements (element j < r/2 with j + r/2) and passes
the rest through. weir's kernels rotate element j < D/2 with j + D/2. So each Q and K head's
elements are reordered at load, [rot 0..r/2, pass r..r+(D-r)/2, rot r/2..r, pass r+(D-r)/2..D],
which puts every rotated pair D/2 apart and pairs passed elements with passed ones, whose
frequency is 0 (cos 1, sin 0: rope.py pads the frequencies, and scales only the rotated
elements). Attention reads q . k, which the same reordering of both leaves unchanged; values are
not reordered.

GLM's rotation pairs adjacent elements instead (2j with 2j + 1, at frequency j: GPT-J's
interleaved form, over its first r elements); `interleaved` reorders its heads so too, [rot 0, 2,
.., r-2, pass .., rot 1, 3, .., r-1, pass ..]."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from core.config import CheckpointError
from gpu.quant.tensor import BlockTensor

REORDERED = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.q_norm", "self_attn.k_norm")


def head_order(head_dim: int, rotary_dim: int, interleaved: bool = False) -> np.ndarray:
    """new[i] = old[order[i]] within a head (`interleaved`: the rotated pairs adjacent)."""
    r, half, rest = rotary_dim // 2, head_dim // 2, (head_dim - rotary_dim) // 2
    pairs = (range(0, rotary_dim, 2), range(1, rotary_dim, 2)) if interleaved else None
    if pairs is None:
        pairs = (range(r), range(r, rotary_dim))
    first = [*pairs[0], *range(rotary_dim, rotary_dim + rest)]
    second = [*pairs[1], *range(rotary_dim + rest, head_dim)]
    assert len(first) == len(second) == half
    return np.array(first + second)


def reordered(name: str) -> bool:
    """Whether a checkpoint tensor's rows (or a norm's elements) are Q or K head elements."""
    stem = name.rpartition(".")[0]
    return stem.endswith(REORDERED)


def for_kernels(spec, name: str, value: Any) -> Any:
    """A checkpoint's (or a LoRA adapter's B, named as its base weight) Q/K tensor as weir's
    kernels rotate it: its heads reordered where the spec's rotation is partial or interleaved,
    else `value` itself. (An encoder's spec has neither field.)"""
    interleaved = getattr(spec, "rope_interleaved", False)
    if not ((getattr(spec, "rotary_dim", 0) or interleaved) and reordered(name)):
        return value
    if not isinstance(value, torch.Tensor | BlockTensor):
        raise CheckpointError(
            f"{name}: a partial rotation over {type(value).__name__} weights is not served"
        )
    return reorder_heads(value, spec.head_dim, spec.rotary_dim or spec.head_dim, interleaved)


def reorder_heads(value: Any, head_dim: int, rotary_dim: int, interleaved: bool = False) -> Any:
    """A Q/K weight, bias or per-head norm weight with each head's elements reordered: a tensor
    or a GGUF BlockTensor (whole rows move; nothing requantized)."""
    order = head_order(head_dim, rotary_dim, interleaved)
    rows = value.shape[0]
    index = (np.arange(rows // head_dim)[:, None] * head_dim + order[None, :]).reshape(-1)
    if isinstance(value, torch.Tensor):
        return value[torch.from_numpy(index)]
    return value.take_rows(index)
