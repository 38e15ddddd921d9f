"""Sampling's two CPU kernels (gpu/cpu/csrc/sample.cpp, mask.cpp): the argmax of greedy rows
and the grammar's bitmask applied to the logits, each through torch.ops.weir, with the torch
ops as the fallback where the kernels cannot be built (a warning says so once)."""

from __future__ import annotations

import logging

import torch

from gpu.cpu import build as cpu_build

log = logging.getLogger("weir.cpu")

_ops = None  # torch.ops.weir once loaded; False: the kernels cannot be built here


def ops():
    global _ops
    if _ops is None:
        try:
            _ops = cpu_build.load()
        except cpu_build.BuildError as e:
            log.warning("CPU sampling kernels unavailable (%s); using torch ops", e)
            _ops = False
    return _ops


def argmax(logits: torch.Tensor) -> torch.Tensor | None:
    """torch.argmax over the last dimension of [rows, vocab] float32 CPU logits (the first of
    equal maxima, NaN above all), on weir's pool: torch's wakes its OpenMP team for a step's
    logits. None where the kernel does not apply."""
    if (
        logits.dtype != torch.float32
        or logits.dim() != 2
        or logits.shape[1] == 0
        or logits.stride(1) != 1
        or not ops()
    ):
        return None
    return _ops.argmax(logits)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor) -> bool:
    """-inf, in place, on every token of `rows` whose bit in `mask` is clear; False (nothing
    done) where the kernel does not apply."""
    if (
        logits.dtype != torch.float32
        or logits.stride(1) != 1
        or not mask.is_contiguous()
        or not ops()
    ):
        return False
    _ops.apply_token_bitmask_(logits, rows.contiguous(), mask)
    return True
