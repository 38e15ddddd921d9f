"""Structured outputs in tensors: the batch's allowed-token bitmask (filled by llguidance for the
constrained rows only); the backend (gpu/backend.py) applies it to the logits, before any other
logits processor.

Unconstrained batches pay nothing: no mask is built unless a sampled request has a grammar.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger("weir.grammar_mask")

# Bit b of an int32 word: token 32 * word + b. 1 << 31 wraps to the sign bit, which is the bit
# that `&` must test.
_BITS: dict[torch.device, torch.Tensor] = {}


def _bits(device: torch.device) -> torch.Tensor:
    bits = _BITS.get(device)
    if bits is None:
        bits = _BITS[device] = (
            (torch.ones(32, dtype=torch.int64).bitwise_left_shift(torch.arange(32)))
            .to(torch.int32)
            .to(device)
        )
    return bits


def build(requests: list[Any], grammars: Any, device: torch.device):
    """(rows, bitmask) for the requests (one per sampled row) that have a grammar, else None:
    rows [k] int64 on `device`, bitmask [k, words] int32 on `device`."""
    constrained = [(r.grammar, i) for i, r in enumerate(requests) if r.grammar is not None]
    if not constrained:
        return None
    k = len(constrained)
    mask = torch.empty((k, grammars.words), dtype=torch.int32)
    if device.type == "cuda":
        mask = mask.pin_memory()
    grammars.fill([(m, j) for j, (m, _) in enumerate(constrained)], mask.data_ptr(), k)
    rows = torch.tensor([i for _, i in constrained], dtype=torch.int64)
    if device.type == "cuda":
        return rows.to(device, non_blocking=True), mask.to(device, non_blocking=True)
    return rows, mask


def allowed(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[k, words] int32 bitmask -> [k, vocab] bool."""
    k = mask.shape[0]
    expanded = mask.unsqueeze(-1).bitwise_and(_bits(mask.device)) != 0
    return expanded.view(k, -1)[:, :vocab]
