"""weir's quantizers (gpu/quant/quantize.py) against the `gguf` package: the bytes it writes
where it has a quantizer (Q8_0, Q4_0, BF16, F16), and for every format the error of its own
dequantization of weir's bytes (weir's kernels read the same weights: tests/test_cpu_quant.py)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from gpu.quant.formats import FORMATS, QUANTIZED
from gpu.quant.quantize import quantize


def dequant(rows: np.ndarray, fmt: str) -> np.ndarray:
    return gguf.quants.dequantize(rows, gguf.GGMLQuantizationType(FORMATS[fmt].ggml_type))


def weights(seed: int, n: int = 24, k: int = 1024) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.02
    w[0, :256] = 0  # an all-zero super-block
    w[1, :32] = 0.5  # a constant block
    w[2, 256:512] *= 1000  # a block of large weights beside small ones
    return w


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "bf16", "f16"])
def test_bytes_equal_the_gguf_package_quantizer(fmt):
    w = weights(0)
    theirs = gguf.quants.quantize(w, gguf.GGMLQuantizationType(FORMATS[fmt].ggml_type))
    assert np.array_equal(quantize(w, fmt), theirs.view(np.uint8).reshape(w.shape[0], -1))


# The rms error of the dequantized weights over the rms of the weights (round to nearest on
# Gaussian weights: about 0.004, 0.06, 0.06, 0.06, 0.03, 0.015), and the largest error over the
# largest weight of its block (32 weights; the k-quants' super-block of 256): half a step of the
# grid, 1/254 and 1/8 (Q4_0 gives the far side one level less), 1/15 (Q4_1: of a range up to
# twice the largest), 1/15, 1/31, 1/63 of the range, with the scales' own rounding; Q3_K
# (0.15 rms) a quarter: its largest magnitude maps to -4 and the far side stops at +3; Q2_K
# (0.33 rms) about a third: half of one of three steps, and the 4-bit scales' rounding.
# The grid i-quants (IQ3_XXS 0.20, IQ3_S 0.14, IQ2_XXS 0.36, IQ2_XS 0.31, IQ2_S 0.26 rms on plain
# Gaussian rows): each 4 or 8 weights the nearest of the grid's 256 to 1024 entries, not of all
# level tuples, so a tuple mixing large and small magnitudes lands far; IQ3_XXS, IQ2_XXS and
# IQ2_XS also flip the smallest sign of 8 to keep their count even, and the constant block here
# drives its neighbours' 4-bit scales to the floor.
ERRORS = {
    "q8_0": (0.006, 0.005, 32),
    "q4_0": (0.08, 0.13, 32),
    "q4_1": (0.08, 0.07, 32),
    "q5_0": (0.04, 0.065, 32),
    "q5_1": (0.04, 0.035, 32),
    "q2_k": (0.4, 0.4, 256),
    "q3_k": (0.2, 0.3, 256),
    "q4_k": (0.08, 0.07, 256),
    "q5_k": (0.04, 0.035, 256),
    "q6_k": (0.02, 0.02, 256),
    "iq4_nl": (0.09, 0.13, 32),
    "iq4_xs": (0.09, 0.15, 256),
    "iq3_xxs": (0.32, 0.75, 256),
    "iq3_s": (0.26, 0.45, 256),
    "iq2_xxs": (0.45, 0.85, 256),
    "iq2_xs": (0.26, 0.82, 256),
    "iq2_s": (0.22, 0.42, 256),
    "mxfp4": (0.12, 0.34, 32),
}


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_dequantized_by_gguf_within_the_formats_error(fmt):
    w = weights(1)
    rows = quantize(w, fmt)
    assert rows.shape == (w.shape[0], FORMATS[fmt].row_bytes(w.shape[1]))
    back = dequant(rows, fmt)
    assert np.isfinite(back).all()
    err = back - w
    rms, worst, block = ERRORS[fmt]
    normal = np.ones_like(w, dtype=bool)
    normal[2, 256:512] = False
    assert np.sqrt((err[normal] ** 2).mean() / (w[normal] ** 2).mean()) < rms
    block_max = np.abs(w).reshape(-1, block).max(axis=1, keepdims=True)
    assert (np.abs(err).reshape(-1, block) <= worst * block_max + 1e-12).all()
    assert (back[0, :256] == 0).all()


def test_rows_that_are_not_whole_blocks_are_refused():
    with pytest.raises(ValueError, match="not whole blocks of 256"):
        quantize(np.zeros((2, 288), dtype=np.float32), "q4_k")


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k", "iq4_xs", "iq3_xxs", "iq3_s", "iq2_xs", "iq2_s"])
def test_random_blocks_are_weights_of_a_trained_models_size(fmt):
    """The benchmarks' fast random files (gguf_random.random_blocks), every block format: |w| up
    to about 0.1 (the grid i-quants had been refused)."""
    from gpu.quant.gguf_random import random_blocks

    rows = random_blocks(fmt, 8, 512, np.random.default_rng(0))
    w = dequant(rows, fmt)
    assert np.isfinite(w).all() and 0.02 < np.abs(w).max() <= 0.11
