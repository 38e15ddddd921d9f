"""IQ3_XXS and IQ3_S, llama.cpp's 3-bit i-quants (the tensors of IQ3_XXS, IQ3_XS and IQ3_M
files). Each 4 weights of a 256-weight block are one entry of a grid of 4-tuples of magnitudes
(256 entries for IQ3_XXS, 512 for IQ3_S), their signs stored apart, with a 4-bit scale ls per 32:

  IQ3_XXS  w = d (0.5 + ls) / 2 g s, g in {4, 12, 20, ..., 52, 62}   98 bytes, 3.06 bits a weight
  IQ3_S    w = d (1 + 2 ls) g s,     g in {1, 3, 5, ..., 15}         110 bytes, 3.44 bits

(IQ3_XXS keeps 7 sign bits per 8 weights: the eighth makes the count of negatives even.) So every
weight is one of sixteen signed values times its 32's scale, which is how IQ4_XS holds its own:
`transcode` rewrites the blocks at load into IQ4_XS's layout (f16 d per 256, a 6-bit scale per
32, a 4-bit index per weight: 4.25 bits) with the format's own table of sixteen signed g
(gpu/cpu/csrc/quant_layout.h), the scale 2 ls + 1 (IQ3_XXS's kernels take a quarter of it) or
1 + 2 ls, d unchanged; weir's IQ4_XS kernels read them. Every product is exact, so the weights
are the file's bit for bit (the gguf package's dequantization). The grids are the gguf
package's.

`quantize_iq3_xxs` and `quantize_iq3_s` round to the nearest grid entry, for the tests' files.
"""

from __future__ import annotations

import numpy as np

XS_BYTES = 136  # a transcoded block: IQ4_XS's bytes
_CHUNK = 1 << 16  # blocks transcoded at a time (bounds the temporaries)


def _grid(name: str) -> tuple[np.ndarray, np.ndarray]:
    """(the grid's magnitudes [entries, 4] as float32, their indices 0..7 into grid_map)."""
    import gguf.quants

    cls = getattr(gguf.quants, name)
    cls.init_grid()
    values = cls.grid.reshape(-1, 4).astype(np.float32)
    levels = np.array(cls.grid_map, dtype=np.float32)
    return values, np.searchsorted(levels, values).astype(np.uint8)


def xs_blocks(d: np.ndarray, l6: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """IQ4_XS's bytes of blocks [blocks]: f16 d [blocks, 1], the eight 6-bit scales l6 (the
    signed scale + 32) [blocks, 8], and the indices' 128 bytes of nibbles [blocks, 128]."""
    l6 = l6.astype(np.uint16)
    high = ((l6 >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(axis=1, dtype=np.uint16)
    low = (l6[:, 0::2] & 0x0F) | ((l6[:, 1::2] & 0x0F) << 4)
    return np.concatenate(
        [
            d.astype(np.float16).view(np.uint8),
            high.astype("<u2").view(np.uint8).reshape(-1, 2),
            low.astype(np.uint8),
            qs,
        ],
        axis=1,
    )


_GRIDS: dict[str, tuple[np.ndarray, np.ndarray]] = {}


def grid(name: str) -> tuple[np.ndarray, np.ndarray]:
    if name not in _GRIDS:
        _GRIDS[name] = _grid(name)
    return _GRIDS[name]


def _parity_signs() -> np.ndarray:
    """IQ3_XXS's (and IQ2's) 128 sign bytes: 7 stored bits, the eighth their parity."""
    i = np.arange(128, dtype=np.uint8)
    ones = np.unpackbits(i[:, None], axis=1).sum(axis=1)
    return (i | ((ones & 1) << 7)).astype(np.uint8)


KSIGNS = _parity_signs()


def _nibbles(idx: np.ndarray) -> np.ndarray:
    """Indices [blocks, 256] -> IQ4_XS's 128 bytes: per 32, weight j low, j + 16 high."""
    sub = idx.reshape(len(idx), 8, 32)
    return (sub[:, :, :16] | (sub[:, :, 16:] << 4)).reshape(len(idx), 128)


def _table_index(mag: np.ndarray, neg: np.ndarray) -> np.ndarray:
    """A magnitude's level m (0..7) and its sign -> its index in the ascending table of sixteen."""
    return np.where(neg != 0, 7 - mag, 8 + mag).astype(np.uint8)


def _xxs_blocks(b: np.ndarray) -> np.ndarray:
    d = b[:, :2].copy().view(np.float16).astype(np.float32)
    mag = grid("IQ3_XXS")[1][b[:, 2:66]].reshape(len(b), 256)
    aux = b[:, 66:98].copy().view("<u4")  # [blocks, 8]: four 7-bit sign indices, ls in 28..31
    seven = (aux[:, :, None] >> (7 * np.arange(4, dtype=np.uint32))) & 127
    neg = np.unpackbits(KSIGNS[seven].reshape(len(b), 32), axis=1, bitorder="little")
    ls = (aux >> 28).astype(np.int64)
    return xs_blocks(d, 2 * ls + 1 + 32, _nibbles(_table_index(mag, neg)))


def _s_blocks(b: np.ndarray) -> np.ndarray:
    d = b[:, :2].copy().view(np.float16).astype(np.float32)
    high = np.unpackbits(b[:, 66:74], axis=1, bitorder="little").astype(np.int64)
    entry = b[:, 2:66].astype(np.int64) | (high << 8)
    mag = grid("IQ3_S")[1][entry].reshape(len(b), 256)
    neg = np.unpackbits(b[:, 74:106], axis=1, bitorder="little")
    sc = b[:, 106:110]
    ls = np.stack([sc & 0x0F, sc >> 4], axis=2).reshape(len(b), 8).astype(np.int64)
    return xs_blocks(d, 2 * ls + 1 + 32, _nibbles(_table_index(mag, neg)))


_TRANSCODERS = {"iq3_xxs": (98, _xxs_blocks), "iq3_s": (110, _s_blocks)}


def transcode(rows: np.ndarray, fmt: str) -> np.ndarray:
    """[n, row_bytes] of an IQ3_XXS or IQ3_S weight -> [n, k / 256 * 136] in IQ4_XS's layout."""
    size, fn = _TRANSCODERS[fmt]
    blocks = np.ascontiguousarray(rows).view(np.uint8).reshape(-1, size)
    out = np.empty((len(blocks), XS_BYTES), np.uint8)
    for start in range(0, len(blocks), _CHUNK):
        out[start : start + _CHUNK] = fn(blocks[start : start + _CHUNK])
    return out.reshape(rows.shape[0], -1)


def is_iq3(fmt: str) -> bool:
    return fmt in _TRANSCODERS


# ---- quantizers (round to nearest; the tests' files) ----
def _nearest(t: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Groups of 4 magnitudes [groups, 4] over their scale -> the nearest grid entry's index."""
    out = np.empty(len(t), np.int64)
    for s in range(0, len(t), 4096):
        part = t[s : s + 4096]
        dist = (part * part).sum(1)[:, None] - 2 * part @ values.T + (values * values).sum(1)
        out[s : s + 4096] = dist.argmin(axis=1)
    return out


def _scales(b: np.ndarray, top: float, unit: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each 32's scale mapping its largest magnitude to the grid's `top`, on the block's f16 d
    grid of (2 ls + 1) unit d: (d [blocks, 1], ls [blocks, 8], the scale [blocks, 8])."""
    want = np.abs(b.reshape(len(b), 8, 32)).max(axis=2) / top
    d = (want.max(axis=1, keepdims=True) / (31 * unit)).astype(np.float16).astype(np.float32)
    inv = np.divide(1.0, d * unit, out=np.zeros_like(d), where=d != 0)
    ls = np.clip(np.floor((want * inv - 1) / 2 + 0.5), 0, 15).astype(np.int64)
    return d, ls, d * unit * (2 * ls + 1)


def _magnitudes(b: np.ndarray, scale: np.ndarray, name: str) -> np.ndarray:
    inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale != 0)
    t = np.abs(b).reshape(len(b), 8, 32) * inv[:, :, None]
    return _nearest(t.reshape(-1, 4), grid(name)[0]).reshape(len(b), 64)


def quantize_iq3_xxs(b: np.ndarray) -> np.ndarray:
    """[blocks, 256] -> IQ3_XXS's 98 bytes each. Where 8 weights have an odd count of negatives,
    the smallest one's sign is flipped (the format keeps the count even)."""
    d, ls, scale = _scales(b, 62.0, 0.25)
    entry = _magnitudes(b, scale, "IQ3_XXS")
    neg = (b < 0).reshape(len(b), 32, 8)
    odd = neg.sum(axis=2) % 2 == 1
    smallest = np.abs(b).reshape(len(b), 32, 8).argmin(axis=2)
    flip = np.zeros_like(neg)
    np.put_along_axis(flip, smallest[..., None], odd[..., None], axis=2)
    bits = np.packbits(neg ^ flip, axis=2, bitorder="little")[..., 0] & 127  # [blocks, 32]
    seven = bits.reshape(len(b), 8, 4).astype(np.uint32) << (7 * np.arange(4, dtype=np.uint32))
    aux = seven.sum(axis=2, dtype=np.uint32) | (ls.astype(np.uint32) << 28)
    return np.concatenate(
        [
            d.astype(np.float16).view(np.uint8),
            entry.astype(np.uint8),
            aux.astype("<u4").view(np.uint8),
        ],
        axis=1,
    )


def quantize_iq3_s(b: np.ndarray) -> np.ndarray:
    """[blocks, 256] -> IQ3_S's 110 bytes each."""
    d, ls, scale = _scales(b, 15.0, 1.0)
    entry = _magnitudes(b, scale, "IQ3_S")
    high = np.packbits((entry >> 8).astype(np.uint8), axis=1, bitorder="little")
    signs = np.packbits((b < 0).astype(np.uint8), axis=1, bitorder="little")
    sc = (ls[:, 0::2] | (ls[:, 1::2] << 4)).astype(np.uint8)
    return np.concatenate(
        [d.astype(np.float16).view(np.uint8), (entry & 255).astype(np.uint8), high, signs, sc],
        axis=1,
    )
