"""llama.cpp's grid i-quants, IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS and IQ2_S (the tensors of the
IQ3_*, IQ2_* files; IQ3_XXS files hold IQ2_S attention): each 4 or 8 weights of a 256-weight
block are one entry of a grid of tuples of magnitudes, their signs stored apart, with a 4-bit
scale ls per 32 or 16 weights:

  IQ3_XXS  w = d (2 ls + 1) / 4 g s  per 32, g in {4, 12, ..., 52, 62}, 4-tuples   3.06 bits
  IQ3_S    w = d (2 ls + 1) g s      per 32, g in {1, 3, ..., 15},     4-tuples   3.44 bits
  IQ2_XXS  w = d (2 ls + 1) / 8 g s  per 32, g in {8, 25, 43},         8-tuples   2.06 bits
  IQ2_XS   the same                  per 16                                       2.31 bits
  IQ2_S    the same                  per 16                                       2.56 bits

(IQ3_XXS, IQ2_XXS and IQ2_XS keep 7 sign bits per 8 weights: the eighth makes the count of
negatives even.) So every weight is one of at most sixteen signed values times its group's
scale, which is how IQ4_XS holds its own: `transcode` rewrites the blocks at load into 4-bit
indices into the format's own table of signed g (gpu/cpu/csrc/quant_layout.h), with f16 d per
256 and an int8 scale 2 ls + 1 per group (the kernels take its quarter or eighth), in IQ4_XS's
layout for scales per 32 (136 bytes a block, 4.25 bits) or in 146 bytes with sixteen int8
scales for those per 16 (4.56 bits). weir's IQ4_XS and Q6_K-scaled kernels read them; every
product is exact, so the weights are the file's bit for bit (the gguf package's
dequantization). The grids are the gguf package's.

The quantizers (`QUANTIZERS`) round to the nearest grid entry, for the tests' files.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Grid(NamedTuple):
    name: str  # the gguf package's class
    width: int  # weights per entry
    levels: int  # magnitudes (table values per sign)
    unit: float  # d (2 ls + 1) unit is a group's scale
    group: int  # weights per scale
    block_bytes: int  # the file's


GRIDS = {
    "iq3_xxs": Grid("IQ3_XXS", 4, 8, 0.25, 32, 98),
    "iq3_s": Grid("IQ3_S", 4, 8, 1.0, 32, 110),
    "iq2_xxs": Grid("IQ2_XXS", 8, 3, 0.125, 32, 66),
    "iq2_xs": Grid("IQ2_XS", 8, 3, 0.125, 16, 74),
    "iq2_s": Grid("IQ2_S", 8, 3, 0.125, 16, 82),
}
_CHUNK = 1 << 16  # blocks transcoded at a time (bounds the temporaries)
_TABLES: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}


def is_grid(fmt: str) -> bool:
    return fmt in GRIDS


def transcoded_bytes(fmt: str) -> int:
    return 136 if GRIDS[fmt].group == 32 else 146


def table(fmt: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the grid's magnitudes [entries, width] float32, each one's level index [entries,
    width], the levels ascending)."""
    if fmt not in _TABLES:
        import gguf.quants

        cls = getattr(gguf.quants, GRIDS[fmt].name)
        cls.init_grid()
        values = cls.grid.reshape(-1, GRIDS[fmt].width).astype(np.float32)
        levels = np.array(cls.grid_map, dtype=np.float32)
        _TABLES[fmt] = values, np.searchsorted(levels, values).astype(np.uint8), levels
    return _TABLES[fmt]


def _parity_signs() -> np.ndarray:
    """The 128 sign bytes of the 7-bit sign indices: 7 stored bits, the eighth their parity."""
    i = np.arange(128, dtype=np.uint8)
    ones = np.unpackbits(i[:, None], axis=1).sum(axis=1)
    return (i | ((ones & 1) << 7)).astype(np.uint8)


KSIGNS = _parity_signs()


def _bits(b: np.ndarray) -> np.ndarray:
    """Bytes [blocks, n] -> their bits [blocks, 8 n], each byte's lowest first."""
    return np.unpackbits(b, axis=1, bitorder="little")


def _nibbles(b: np.ndarray) -> np.ndarray:
    """Bytes [blocks, n] -> their 4-bit halves [blocks, 2 n], low first."""
    return np.stack([b & 0x0F, b >> 4], axis=2).reshape(len(b), -1).astype(np.int64)


def _parity_bits(b: np.ndarray, shifts: np.ndarray, words: np.ndarray) -> np.ndarray:
    """Sign bits of 8-weight groups from 7-bit indices (words >> shifts) & 127."""
    seven = (words[..., None] >> shifts) & 127
    return _bits(KSIGNS[seven].reshape(len(b), -1))


def _decode(b: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Blocks [n, block_bytes] -> (grid entry per tuple [n, 256 / width], sign bit per weight
    [n, 256], ls per group [n, 256 / group])."""
    n = len(b)
    if fmt == "iq3_xxs":
        aux = b[:, 66:98].copy().view("<u4")  # per 32: four 7-bit sign indices, ls in 28..31
        neg = _parity_bits(b, 7 * np.arange(4, dtype=np.uint32), aux)
        return b[:, 2:66].astype(np.int64), neg, (aux >> 28).astype(np.int64)
    if fmt == "iq3_s":
        entry = b[:, 2:66].astype(np.int64) | (_bits(b[:, 66:74]).astype(np.int64) << 8)
        return entry, _bits(b[:, 74:106]), _nibbles(b[:, 106:110])
    if fmt == "iq2_xxs":
        q = b[:, 2:66].copy().view("<u4").reshape(n, 8, 2)  # per 32: four entries; signs, ls
        neg = _parity_bits(b, 7 * np.arange(4, dtype=np.uint32), q[:, :, 1])
        entry = q[:, :, 0].copy().view(np.uint8).reshape(n, 32).astype(np.int64)
        return entry, neg, (q[:, :, 1] >> 28).astype(np.int64)
    if fmt == "iq2_xs":
        q = b[:, 2:66].copy().view("<u2").astype(np.int64)  # per 8: a 9-bit entry, 7 sign bits
        neg = _bits(KSIGNS[q >> 9])
        return q & 511, neg, _nibbles(b[:, 66:74])
    high = (b[:, 66:74, None] >> np.arange(0, 8, 2, dtype=np.uint8)) & 3  # iq2_s
    entry = b[:, 2:34].astype(np.int64) | (high.reshape(n, 32).astype(np.int64) << 8)
    return entry, _bits(b[:, 34:66]), _nibbles(b[:, 74:82])


def xs_blocks(d: np.ndarray, l6: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """IQ4_XS's bytes of blocks [blocks]: f16 d [blocks, 1], the eight 6-bit scales l6 (the
    signed scale + 32) [blocks, 8], and the indices' 128 bytes of nibbles [blocks, 128]."""
    l6 = l6.astype(np.uint16)
    high = ((l6 >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(axis=1, dtype=np.uint16)
    low = (l6[:, 0::2] & 0x0F) | ((l6[:, 1::2] & 0x0F) << 4)
    f16 = d.astype(np.float16).view(np.uint8)
    two = high.astype("<u2").view(np.uint8).reshape(-1, 2)
    return np.concatenate([f16, two, low.astype(np.uint8), qs], axis=1)


def _transcode_blocks(b: np.ndarray, fmt: str) -> np.ndarray:
    g = GRIDS[fmt]
    entry, neg, ls = _decode(b, fmt)
    level = table(fmt)[1][entry].reshape(len(b), 256)
    # the table of each format: its levels' negatives descending, then the levels ascending
    # (index levels + level, or levels - 1 - level where negative; in uint8, never below 0)
    idx = (g.levels + level) - neg * (2 * level + 1)
    sub = idx.reshape(len(b), 8, 32)
    qs = (sub[:, :, :16] | (sub[:, :, 16:] << 4)).reshape(len(b), 128)
    d = b[:, :2].copy().view(np.float16)
    sc = 2 * ls + 1
    if g.group == 32:
        return xs_blocks(d, sc + 32, qs)
    return np.concatenate([d.view(np.uint8), sc.astype(np.int8).view(np.uint8), qs], axis=1)


def transcode(rows: np.ndarray, fmt: str) -> np.ndarray:
    """[n, row_bytes] of a grid-format weight -> its rows in the kernels' transcoded blocks."""
    size = GRIDS[fmt].block_bytes
    blocks = np.ascontiguousarray(rows).view(np.uint8).reshape(-1, size)
    out = np.empty((len(blocks), transcoded_bytes(fmt)), np.uint8)
    for start in range(0, len(blocks), _CHUNK):
        out[start : start + _CHUNK] = _transcode_blocks(blocks[start : start + _CHUNK], fmt)
    return out.reshape(rows.shape[0], -1)


# ---- quantizers (round to nearest; the tests' files) ----
def _nearest(t: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Tuples of magnitudes over their scale [tuples, width] -> the nearest grid entry."""
    out = np.empty(len(t), np.int64)
    for s in range(0, len(t), 4096):
        part = t[s : s + 4096]
        dist = (part * part).sum(1)[:, None] - 2 * part @ values.T + (values * values).sum(1)
        out[s : s + 4096] = dist.argmin(axis=1)
    return out


def _quantize_parts(b: np.ndarray, fmt: str):
    """(f16 d [blocks, 1], ls per group, grid entry per tuple, sign bit per weight) of the
    nearest grid entries under each group's scale (its largest magnitude to the top level)."""
    g = GRIDS[fmt]
    values, _, levels = table(fmt)
    want = np.abs(b.reshape(len(b), -1, g.group)).max(axis=2) / levels[-1]
    d = (want.max(axis=1, keepdims=True) / (31 * g.unit)).astype(np.float16).astype(np.float32)
    inv = np.divide(1.0, d * g.unit, out=np.zeros_like(d), where=d != 0)
    ls = np.clip(np.floor((want * inv - 1) / 2 + 0.5), 0, 15).astype(np.int64)
    scale = np.repeat(d * g.unit * (2 * ls + 1), g.group, axis=1)
    t = np.abs(b) * np.divide(1.0, scale, out=np.zeros_like(scale), where=scale != 0)
    entry = _nearest(t.reshape(-1, g.width), values).reshape(len(b), -1)
    return d, ls, entry, (b < 0).astype(np.uint8)


def _even_signs(b: np.ndarray, neg: np.ndarray) -> np.ndarray:
    """Each 8's sign bits with an even count of negatives (the smallest weight's sign flipped
    where it was odd) -> their 7 stored bits [blocks, 32]."""
    neg = neg.reshape(len(b), 32, 8).copy()
    odd = neg.sum(axis=2) % 2 == 1
    smallest = np.abs(b).reshape(len(b), 32, 8).argmin(axis=2)
    flip = np.zeros_like(neg)
    np.put_along_axis(flip, smallest[..., None], odd[..., None].astype(np.uint8), axis=2)
    return np.packbits(neg ^ flip, axis=2, bitorder="little")[..., 0] & 127


def _words(sevens: np.ndarray, ls: np.ndarray) -> np.ndarray:
    """Per 32: four 7-bit sign indices and ls in the top four bits, as little-endian bytes."""
    shifted = sevens.reshape(len(ls), 8, 4).astype(np.uint32) << (7 * np.arange(4, dtype=np.uint32))
    return (shifted.sum(axis=2, dtype=np.uint32) | (ls.astype(np.uint32) << 28)).view(np.uint8)


def _pairs(ls: np.ndarray) -> np.ndarray:
    return (ls[:, 0::2] | (ls[:, 1::2] << 4)).astype(np.uint8)


def _f16(d: np.ndarray) -> np.ndarray:
    return d.astype(np.float16).view(np.uint8)


def _quantize(b: np.ndarray, fmt: str) -> np.ndarray:
    """[blocks, 256] -> the format's bytes."""
    d, ls, entry, neg = _quantize_parts(b, fmt)
    n = len(b)
    if fmt == "iq3_xxs":
        return np.concatenate([_f16(d), entry.astype(np.uint8), _words(_even_signs(b, neg), ls)], 1)
    if fmt == "iq3_s":
        high = np.packbits((entry >> 8).astype(np.uint8), axis=1, bitorder="little")
        signs = np.packbits(neg, axis=1, bitorder="little")
        return np.concatenate([_f16(d), (entry & 255).astype(np.uint8), high, signs, _pairs(ls)], 1)
    if fmt == "iq2_xxs":
        aux = entry.astype(np.uint8).reshape(n, 8, 4)
        words = _words(_even_signs(b, neg), ls).reshape(n, 8, 4)
        return np.concatenate([_f16(d), np.concatenate([aux, words], axis=2).reshape(n, 64)], 1)
    if fmt == "iq2_xs":
        q = (entry | (_even_signs(b, neg).astype(np.int64) << 9)).astype("<u2")
        return np.concatenate([_f16(d), q.view(np.uint8), _pairs(ls)], 1)
    high = (entry >> 8).reshape(n, 8, 4) << np.arange(0, 8, 2)  # iq2_s
    signs = np.packbits(neg, axis=1, bitorder="little")
    qh = high.sum(axis=2).astype(np.uint8)
    return np.concatenate([_f16(d), (entry & 255).astype(np.uint8), signs, qh, _pairs(ls)], 1)


QUANTIZERS = {fmt: (lambda b, fmt=fmt: _quantize(b, fmt)) for fmt in GRIDS}
