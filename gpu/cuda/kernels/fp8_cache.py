"""K/V rows written to the paged cache in its dtype, FP8 included (--kv-cache-dtype fp8,
fp8_e4m3, fp8_e5m2), rounded as torch's `.to()` rounds, so that a GPU's cache holds what the CPU
path's holds: E4M3 saturated to +-448 first (vLLM's writes at a scale of 1), then to nearest,
ties to even.

On a GPU the conversion is the hardware's (cvt.rn.satfinite). Triton's CPU interpreter rounds
FP8 wrongly (a mantissa that rounds up loses its carry: 1.99 becomes 1.0), so there each value
is first rounded in float32 to one the FP8 format holds exactly (`_round_fp8`), which the
interpreter then converts exactly. The attention kernels widen the cache as they read it
(gpu/cuda/kernels/paged_attention.py `_attend`); widening is exact in both.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from gpu.kv_cache import E4M3_MAX

PLAIN, E4M3, E5M2 = 0, 1, 2  # how a cache is written (`cache_kind`; `to_cache`'s KIND)
_E4M3: tl.constexpr = tl.constexpr(E4M3)
_E5M2: tl.constexpr = tl.constexpr(E5M2)
_E4M3_MAX: tl.constexpr = tl.constexpr(E4M3_MAX)


def cache_kind(cache: torch.Tensor) -> int:
    return {torch.float8_e4m3fn: E4M3, torch.float8_e5m2: E5M2}.get(cache.dtype, PLAIN)


def emulate(cache: torch.Tensor) -> bool:
    """FP8 rounded in float32 first: only in Triton's interpreter (see the module's note)."""
    return not cache.is_cuda and os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _round_fp8(x, MANT: tl.constexpr, EMIN: tl.constexpr):
    """x (float32) rounded to nearest, ties to even, on FP8's grid of MANT mantissa bits and
    smallest normal exponent EMIN, as a float32 (past the largest finite: powers of two and
    more, which the caller takes to infinity's code)."""
    bits = x.to(tl.uint32, bitcast=True)
    drop: tl.constexpr = 23 - MANT
    lsb = (bits >> drop) & 1
    keep = ((bits + ((1 << (drop - 1)) - 1) + lsb) >> drop) << drop
    normal = keep.to(tl.float32, bitcast=True)
    # below 2^EMIN the grid is 2^(EMIN - MANT) apart: float32's own rounding of a sum whose
    # last bit is that step
    magic: tl.constexpr = 2.0 ** (EMIN - MANT + 23)
    a = tl.abs(x)
    small = (a + magic) - magic
    small = tl.where((bits >> 31) != 0, -small, small)
    return tl.where(a < 2.0**EMIN, small, normal)


@triton.jit
def to_cache(x, cache_ptr, KIND: tl.constexpr, EMULATE: tl.constexpr):
    """x in the cache's dtype, KIND and EMULATE as `cache_kind` and `emulate` say (E4M3:
    saturated to its largest finite first)."""
    if KIND == _E4M3:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -_E4M3_MAX), _E4M3_MAX)
        if EMULATE:
            x = _round_fp8(x, 3, -6)
    elif KIND == _E5M2:
        if EMULATE:  # past E5M2's largest finite, 2^16: the code the interpreter reads as inf
            x = _round_fp8(x.to(tl.float32), 2, -14)
            x = tl.minimum(tl.maximum(x, -65536.0), 65536.0)
    return x.to(cache_ptr.dtype.element_ty)
