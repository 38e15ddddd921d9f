"""Structured outputs in tensors: the batch's allowed-token bitmask (filled by llguidance for the
constrained rows only); the backend (gpu/backend.py) applies it to the logits, before any other
logits processor.

Unconstrained batches pay nothing: no mask is built unless a sampled request has a grammar.
"""

from __future__ import annotations

import logging

import torch

from core.runner_step import GrammarBatch

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


def build(grammar: GrammarBatch, device: torch.device):
    """(rows, bitmask) of a step's constrained rows: rows [k] int64 and bitmask [k, words]
    int32 on `device`, the bitmask filled by the engine's matchers (GrammarBatch.fill)."""
    k = len(grammar.rows)
    mask = torch.empty((k, grammar.words), dtype=torch.int32)
    if device.type == "cuda":
        mask = mask.pin_memory()
    grammar.fill(mask.data_ptr())
    rows = torch.tensor(grammar.rows, dtype=torch.int64)
    if device.type == "cuda":
        return rows.to(device, non_blocking=True), mask.to(device, non_blocking=True)
    return rows, mask


def allowed(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[k, words] int32 bitmask -> [k, vocab] bool."""
    k = mask.shape[0]
    expanded = mask.unsqueeze(-1).bitwise_and(_bits(mask.device)) != 0
    return expanded.view(k, -1)[:, :vocab]
