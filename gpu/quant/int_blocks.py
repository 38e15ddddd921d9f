"""Integer weights with a scale (and a zero) per group of inputs, as GGUF's 32-weight blocks:
what AWQ, GPTQ (gpu/quant/int4.py) and compressed-tensors (gpu/quant/compressed.py) checkpoints
hold, moved into the blocks weir's kernels serve without requantizing.

A group is whole 32-weight blocks, so each block takes its group's scale unchanged (as an f16,
GGUF's scale type):
- 4-bit, w = s (u - z) with u, z in 0..15: Q4_0 where every z is 8 (w = d (u - 8), d = s),
  else Q4_1 (w = d u + m, d = s, m = -s z rounded to f16: within 2^-11 of s z, as AWQ's own
  kernels hold s z in f16);
- 8-bit symmetric, w = s q with q in -128..127: Q8_0 (w = d q, d = s).
"""

from __future__ import annotations

import numpy as np

from core.config import CheckpointError
from gpu.quant.formats import FORMATS
from gpu.quant.tensor import BlockTensor


def _group(name: str, k: int, groups: int) -> int:
    """The inputs per group of a [n, k] weight with `groups` scales a row: whole 32-weight
    blocks, or the layer is refused naming it."""
    if groups < 1 or k % groups or (k // groups) % 32:
        raise CheckpointError(
            f"{name}: {groups} groups of a {k}-input row are not whole 32-weight blocks "
            "(served: groups of a multiple of 32 inputs, or one a row)"
        )
    return k // groups


def _block_scales(s: np.ndarray, per_block: int) -> np.ndarray:
    """f16 scales [n, groups] -> their bytes once a block [n, blocks, 2]."""
    n = s.shape[0]
    return (
        np.repeat(s.astype(np.float16), per_block, axis=1)[..., None]
        .view(np.uint8)
        .reshape(n, -1, 2)
    )


def q4_blocks(name: str, q: np.ndarray, z: np.ndarray, s: np.ndarray) -> BlockTensor:
    """q uint8 [n, k] in 0..15, z [n, groups] in 0..15, s float16 [n, groups]."""
    n, k = q.shape
    if z.shape != s.shape or s.shape[0] != n:
        raise CheckpointError(f"{name}: zeros {z.shape} and scales {s.shape} do not fit {n} rows")
    per_block = _group(name, k, s.shape[1]) // 32
    q = q.reshape(n, k // 32, 32)
    nib = q[..., :16] | (q[..., 16:] << 4)
    d = _block_scales(s, per_block)
    if bool((z == 8).all()):
        fmt, parts = FORMATS["q4_0"], [d, nib]
    else:
        m = (-(s.astype(np.float32) * z.astype(np.float32))).astype(np.float16)
        fmt, parts = FORMATS["q4_1"], [d, _block_scales(m, per_block), nib]
    blocks = np.concatenate(parts, axis=2)
    return BlockTensor(np.ascontiguousarray(blocks.reshape(n, -1)), fmt, (n, k))


def q8_blocks(name: str, q: np.ndarray, s: np.ndarray) -> BlockTensor:
    """q int8 [n, k], s float16 [n, groups]."""
    n, k = q.shape
    if s.shape[0] != n:
        raise CheckpointError(f"{name}: scales {s.shape} do not fit {n} rows")
    per_block = _group(name, k, s.shape[1]) // 32
    values = q.astype(np.int8).view(np.uint8).reshape(n, k // 32, 32)
    blocks = np.concatenate([_block_scales(s, per_block), values], axis=2)
    return BlockTensor(np.ascontiguousarray(blocks.reshape(n, -1)), FORMATS["q8_0"], (n, k))
