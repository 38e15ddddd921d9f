"""weir's quantizers: float weights to GGUF's block formats (gpu/quant/formats.py), by rounding to
nearest, the bytes exactly as llama.cpp lays them out (the `gguf` package's dequantization reads
them back: tests/test_quantize.py). `--quantization q8_0 | q4_0 | q4_k` quantizes a checkpoint at
load with these; the tests also write GGUF files of every type with them.

Q8_0 and Q4_0 round as llama.cpp's reference does. The k-quants fit each 32-weight sub-block's
scale (and, for Q4_K/Q5_K, its minimum) directly and round those to the super-block's 6-bit (or,
for Q6_K, 8-bit) grid: plain rounding, not llama.cpp's search for the best scale, so a weight's
error is at most about one step of its sub-block's grid.
"""

from __future__ import annotations

import numpy as np

from gpu.quant.formats import FORMATS
from gpu.quant.iq_grids import QUANTIZERS as GRID_QUANTIZERS
from gpu.quant.iq_grids import xs_blocks
from gpu.quant.mxfp4 import quantize_ggml as _mxfp4


def _round(x: np.ndarray) -> np.ndarray:
    """Half away from zero, as ggml's roundf."""
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(*x.shape[:-1], -1)


def quantize(weight: np.ndarray, fmt: str) -> np.ndarray:
    """[n, k] float weights -> [n, row_bytes] uint8 in `fmt`'s GGUF layout."""
    w = np.ascontiguousarray(weight, dtype=np.float32)
    n, k = w.shape
    f = FORMATS[fmt]
    if k % f.block_size:
        raise ValueError(f"{fmt}: rows of {k} weights are not whole blocks of {f.block_size}")
    blocks = w.reshape(n * (k // f.block_size), f.block_size)
    if fmt == "f32":
        out = blocks.view(np.uint8)
    elif fmt == "f16":
        out = blocks.astype(np.float16).view(np.uint8)
    elif fmt == "bf16":
        out = _bf16(blocks)
    else:
        out = QUANTIZERS[fmt](blocks)
    return np.ascontiguousarray(out).reshape(n, f.row_bytes(k))


def _bf16(x: np.ndarray) -> np.ndarray:
    """Round to nearest even, as torch's conversion (NaN kept a NaN)."""
    u = x.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    rounded[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return rounded.view(np.uint8)


def _q8_0(b: np.ndarray) -> np.ndarray:
    d = np.abs(b).max(axis=1, keepdims=True) / 127
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
    q = _round(b * inv).astype(np.int8).view(np.uint8)
    return np.concatenate([_f16_bytes(d), q], axis=1)


def _q4_0(b: np.ndarray) -> np.ndarray:
    imax = np.abs(b).argmax(axis=1)[:, None]
    d = np.take_along_axis(b, imax, axis=1) / -8
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
    q = np.clip(np.trunc(b * inv + 8.5), 0, 15).astype(np.uint8)
    q = q[:, :16] | (q[:, 16:] << 4)
    return np.concatenate([_f16_bytes(d), q], axis=1)


def _q4_1(b: np.ndarray) -> np.ndarray:
    lo = b.min(axis=1, keepdims=True)
    d = (b.max(axis=1, keepdims=True) - lo) / 15
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
    q = np.clip(np.trunc((b - lo) * inv + np.float32(0.5)), 0, 15).astype(np.uint8)
    q = q[:, :16] | (q[:, 16:] << 4)
    return np.concatenate([_f16_bytes(d), _f16_bytes(lo), q], axis=1)


def _fifth_bits(q: np.ndarray) -> np.ndarray:
    """[blocks, 32] 5-bit values -> ggml's 4 bytes of their fifth bits (bit i: weight i) and the
    16 bytes of nibbles (weight j low, j + 16 high)."""
    high = ((q >> 4) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)
    qh = high.sum(axis=1, dtype=np.uint32).astype("<u4").view(np.uint8).reshape(len(q), 4)
    low = q & 0x0F
    return np.concatenate([qh, low[:, :16] | (low[:, 16:] << 4)], axis=1)


def _q5_0(b: np.ndarray) -> np.ndarray:
    imax = np.abs(b).argmax(axis=1)[:, None]
    d = np.take_along_axis(b, imax, axis=1) / -16
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
    q = np.clip(np.trunc(b * inv + np.float32(16.5)), 0, 31).astype(np.uint8)
    return np.concatenate([_f16_bytes(d), _fifth_bits(q)], axis=1)


def _q5_1(b: np.ndarray) -> np.ndarray:
    lo = b.min(axis=1, keepdims=True)
    d = (b.max(axis=1, keepdims=True) - lo) / 31
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
    q = np.clip(np.trunc((b - lo) * inv + np.float32(0.5)), 0, 31).astype(np.uint8)
    return np.concatenate([_f16_bytes(d), _f16_bytes(lo), _fifth_bits(q)], axis=1)


# IQ4_NL's and IQ4_XS's values (llama.cpp's kvalues_iq4nl)
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])


def _iq4_indices(b: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """[rows, 32] weights over their scale [rows, 1] -> the nearest value's index, packed into
    16 bytes as Q4_0's nibbles (weight j low, j + 16 high)."""
    inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale != 0)
    q = np.abs((b * inv)[:, :, None] - IQ4_VALUES).argmin(axis=2).astype(np.uint8)
    return q[:, :16] | (q[:, 16:] << 4)


def _iq4_nl(b: np.ndarray) -> np.ndarray:
    """The largest magnitude maps to the first value, -127 (as llama.cpp's does)."""
    imax = np.abs(b).argmax(axis=1)[:, None]
    d = (np.take_along_axis(b, imax, axis=1) / -127).astype(np.float16).astype(np.float32)
    return np.concatenate([_f16_bytes(d), _iq4_indices(b, d)], axis=1)


def _signed_scales(sub: np.ndarray, lowest: int) -> tuple[np.ndarray, np.ndarray]:
    """[blocks, subs, weights]: each sub-block's scale mapping its largest magnitude to the
    format's `lowest` level, on a signed 6-bit grid of the block's f16 d: (d [blocks, 1], the
    grid's integers [blocks, subs], -32..31)."""
    imax = np.abs(sub).argmax(axis=2)[..., None]
    s = np.take_along_axis(sub, imax, axis=2)[..., 0] / lowest
    d = (np.abs(s).max(axis=1, keepdims=True) / 32).astype(np.float16).astype(np.float32)
    inv_d = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
    return d, np.clip(_round(s * inv_d), -32, 31)


def _iq4_xs(b: np.ndarray) -> np.ndarray:
    """Each 32's scale from its largest magnitude (as IQ4_NL's), on a signed 6-bit grid of d."""
    sub = b.reshape(len(b), 8, 32)
    d, ls = _signed_scales(sub, -127)
    qs = _iq4_indices(sub.reshape(-1, 32), (d * ls).reshape(-1, 1)).reshape(len(b), 128)
    return xs_blocks(d, ls + 32, qs)


def _grid(values: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """Non-negative per-sub-block values [blocks, subs] on a grid of `top` steps: (the f16 step
    per block [blocks, 1], the integer multiples [blocks, subs])."""
    step = (values.max(axis=1, keepdims=True) / top).astype(np.float16).astype(np.float32)
    inv = np.divide(1.0, step, out=np.zeros_like(step), where=step != 0)
    return step, np.clip(_round(values * inv), 0, top).astype(np.uint8)


def _scale_min(b: np.ndarray, levels: int):
    """Q4_K / Q5_K: each 32-weight sub-block's w ~ d sc q - dmin m, q in [0, levels]."""
    sub = b.reshape(len(b), 8, 32)
    lo = np.minimum(sub.min(axis=2), 0)
    hi = sub.max(axis=2)
    d, sc = _grid((hi - lo) / levels, 63)
    dmin, m = _grid(-lo, 63)
    scale = d * sc
    offset = (dmin * m)[:, :, None]
    inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale != 0)[:, :, None]
    q = np.clip(_round((sub + offset) * inv), 0, levels).astype(np.uint8)
    return d, dmin, sc, m, q


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins into ggml's 12 bytes (the inverse of gguf's get_scale_min)."""
    out = np.empty((len(sc), 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return out


def _nibbles(q: np.ndarray) -> np.ndarray:
    """[blocks, 8 sub-blocks, 32] 4-bit values -> 128 bytes: sub-blocks 2i (low nibble) and
    2i + 1 (high) share 32 bytes."""
    return (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(len(q), 128)


def _q4_k(b: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _scale_min(b, 15)
    return np.concatenate(
        [_f16_bytes(d), _f16_bytes(dmin), _pack_scales(sc, m), _nibbles(q)], axis=1
    )


def _q5_k(b: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _scale_min(b, 31)
    qh = np.zeros((len(b), 32), dtype=np.uint8)
    for s in range(8):  # bit s of byte l: the fifth bit of sub-block s's weight l
        qh |= ((q[:, s, :] >> 4) & 1) << s
    return np.concatenate(
        [_f16_bytes(d), _f16_bytes(dmin), _pack_scales(sc, m), qh, _nibbles(q & 0x0F)], axis=1
    )


def _low_bits(q: np.ndarray) -> np.ndarray:
    """[blocks, 256] -> ggml's 64 bytes of their low two bits: weight 128 c + 32 j + l at bits
    2j, 2j + 1 of byte 32 c + l (Q2_K's and Q3_K's qs)."""
    qs = np.zeros((len(q), 64), dtype=np.uint8)
    for c in range(2):
        for j in range(4):
            part = q[:, 128 * c + 32 * j : 128 * c + 32 * j + 32]
            qs[:, 32 * c : 32 * c + 32] |= (part & 3) << (2 * j)
    return qs


def _q2_k(b: np.ndarray) -> np.ndarray:
    """Each 16 weights w ~ d sc q - dmin m, q in 0..3, sc and m on 4-bit grids."""
    sub = b.reshape(len(b), 16, 16)
    lo = np.minimum(sub.min(axis=2), 0)
    d, sc = _grid((sub.max(axis=2) - lo) / 3, 15)
    dmin, m = _grid(-lo, 15)
    scale = d * sc
    inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale != 0)[:, :, None]
    q = np.clip(_round((sub + (dmin * m)[:, :, None]) * inv), 0, 3).astype(np.uint8)
    q = q.reshape(len(b), 256)
    return np.concatenate([sc | (m << 4), _low_bits(q), _f16_bytes(d), _f16_bytes(dmin)], axis=1)


def _q3_k(b: np.ndarray) -> np.ndarray:
    """Each 16 weights w ~ d sc (q - 4), q in 0..7: the largest magnitude maps to -4 (as Q4_0's
    does to -8), sc on a signed 6-bit grid of the super-block's d."""
    sub = b.reshape(len(b), 16, 16)
    d, sc = _signed_scales(sub, -4)
    scale = d * sc
    inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale != 0)[:, :, None]
    q = (np.clip(_round(sub * inv), -4, 3) + 4).astype(np.uint8).reshape(len(b), 256)
    # weight 128 c + 32 j + l: its low bits in qs (_low_bits), its third at bit 4c + j of hmask[l]
    qs = _low_bits(q)
    hmask = np.zeros((len(b), 32), dtype=np.uint8)
    for c in range(2):
        for j in range(4):
            hmask |= ((q[:, 128 * c + 32 * j : 128 * c + 32 * j + 32] >> 2) & 1) << (4 * c + j)
    s6 = (sc + 32).astype(np.uint8)  # ggml's 12 bytes (the inverse of dequantize_row_q3_K's)
    raw = np.empty((len(b), 12), dtype=np.uint8)
    raw[:, 0:4] = (s6[:, 0:4] & 0x0F) | ((s6[:, 8:12] & 0x0F) << 4)
    raw[:, 4:8] = (s6[:, 4:8] & 0x0F) | ((s6[:, 12:16] & 0x0F) << 4)
    raw[:, 8:12] = (
        (s6[:, 0:4] >> 4) | ((s6[:, 4:8] >> 4) << 2) | ((s6[:, 8:12] >> 4) << 4)
        | ((s6[:, 12:16] >> 4) << 6)
    )  # fmt: skip
    return np.concatenate([hmask, qs, raw, _f16_bytes(d)], axis=1)


def _q6_k(b: np.ndarray) -> np.ndarray:
    sub = b.reshape(len(b), 16, 16)
    amax = np.abs(sub).max(axis=2)
    d = (amax.max(axis=1, keepdims=True) / 31 / 127).astype(np.float16).astype(np.float32)
    inv_d = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
    sc = np.clip(_round(amax / 31 * inv_d), 0, 127).astype(np.int8)
    scale = d * sc
    inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale != 0)[:, :, None]
    q = (np.clip(_round(sub * inv), -32, 31) + 32).astype(np.uint8).reshape(len(b), 2, 128)
    # Per half of 128 weights v = 32 t + j (t = 0..3): the low nibble in ql[64 h + 32 (t % 2)
    # + j] (low for t < 2, high for t >= 2), the top two bits in qh[32 h + j] >> 2 t.
    ql = np.empty((len(b), 2, 64), dtype=np.uint8)
    qh = np.zeros((len(b), 2, 32), dtype=np.uint8)
    for t in range(4):
        part = q[:, :, 32 * t : 32 * t + 32]
        lo = part & 0x0F
        half = slice(32 * (t % 2), 32 * (t % 2) + 32)
        if t < 2:
            ql[:, :, half] = lo
        else:
            ql[:, :, half] |= lo << 4
        qh |= (part >> 4) << (2 * t)
    return np.concatenate(
        [ql.reshape(len(b), 128), qh.reshape(len(b), 64), sc.view(np.uint8), _f16_bytes(d)],
        axis=1,
    )


QUANTIZERS = {
    "q8_0": _q8_0,
    "q4_0": _q4_0,
    "q4_1": _q4_1,
    "q5_0": _q5_0,
    "q5_1": _q5_1,
    "q2_k": _q2_k,
    "q3_k": _q3_k,
    "q4_k": _q4_k,
    "q5_k": _q5_k,
    "q6_k": _q6_k,
    "iq4_nl": _iq4_nl,
    "iq4_xs": _iq4_xs,
    "mxfp4": _mxfp4,
    **GRID_QUANTIZERS,
}
