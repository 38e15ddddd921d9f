"""weir's kernels on 16-bit and GGUF block-format weights (gpu/cpu/quant.py, csrc/quant*.cpp).

Each format's packed weight must stand for exactly the weights the `gguf` package's own
dequantization gives; every fast path this CPU runs (AVX2, AVX-512 VNNI/BF16) must give the
reference path's results bit for bit, whatever the batch; and the reference must be the float
product of the GGUF weights with the activations as the format takes them, within float32's
rounding, and so the float32 product within the activations' quantization error (bounds below).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from gpu.cpu import build as cpu_build, quant
from gpu.quant.formats import FORMATS
from gpu.quant.iq_grids import GRIDS, transcoded_bytes
from gpu.quant.quantize import quantize

KERNEL_FORMATS = [
    "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl",
    "iq4_xs", "iq3_xxs", "iq3_s", "iq2_xxs", "iq2_xs", "iq2_s", "mxfp4", "bf16", "f16",
]  # fmt: skip
FAST_PATHS = [p for p in quant.available_paths() if p != "ref"]


def gguf_dequant(rows: np.ndarray, fmt: str) -> torch.Tensor:
    """The gguf package's dequantization of GGUF rows [n, row_bytes]."""
    qtype = gguf.GGMLQuantizationType(FORMATS[fmt].ggml_type)
    return torch.from_numpy(gguf.quants.dequantize(rows, qtype).astype(np.float32))


def random_rows(fmt: str, n: int, k: int, seed: int) -> np.ndarray:
    """Rows with every byte random except the f16 scales (kept finite and modest): integers,
    6-bit scales and minimums, high bits all take values a quantizer might never write."""
    rng = np.random.default_rng(seed)
    f = FORMATS[fmt]
    if not f.quantized:
        return quantize(rng.standard_normal((n, k)).astype(np.float32), fmt)
    blocks = rng.integers(0, 256, size=(n * k // f.block_size, f.block_bytes), dtype=np.uint8)
    scale_offsets = {
        "q8_0": [0], "q4_0": [0], "q4_1": [0, 2], "q5_0": [0], "q5_1": [0, 2],
        "q2_k": [80, 82], "q3_k": [108], "q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208],
        "iq4_nl": [0], "iq4_xs": [0], "iq3_xxs": [0], "iq3_s": [0], "iq2_xxs": [0],
        "iq2_xs": [0], "iq2_s": [0],
    }  # fmt: skip
    for off in scale_offsets.get(fmt, []):
        d = rng.uniform(-0.05, 0.05, size=len(blocks)).astype(np.float16)
        blocks[:, off : off + 2] = d.view(np.uint8).reshape(-1, 2)
    if fmt == "mxfp4":  # E8M0 scale bytes: 2^-23 .. 2^-2 (2^-2 times 6 the largest weight)
        blocks[:, 0] = rng.integers(105, 126, size=len(blocks))
    return blocks.reshape(n, f.row_bytes(k))


def quantized_x(x: torch.Tensor) -> torch.Tensor:
    """x as the block formats take it: per 32, int8 of scale amax / 127, rounded to even."""
    b = x.reshape(x.shape[0], -1, 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(b * inv).clamp(-127, 127) * d).reshape(x.shape)


@pytest.mark.parametrize("fmt", KERNEL_FORMATS)
@pytest.mark.parametrize("source", ["quantizer", "random bytes"])
def test_packed_weight_is_the_gguf_dequantization(fmt, source):
    n, k = 40, 512  # n: two whole panels and a partial one
    rows = (
        quantize(np.random.default_rng(1).standard_normal((n, k)).astype(np.float32), fmt)
        if source == "quantizer"
        else random_rows(fmt, n, k, seed=2)
    )
    w = quant.pack(rows, FORMATS[fmt], (n, k))
    assert torch.equal(quant.dequantize(w), gguf_dequant(rows, fmt))
    # repacked, the bytes of the rows padded to 48 (3 panels), k-quants' 6-bit scales unpacked
    # (Q3_K's twelve bytes of scales to sixteen: 1,824 bytes where the file has 1,760); the grid
    # i-quants' blocks held transcoded (gpu/quant/iq_grids.py)
    held = 1.04 if fmt == "q3_k" else 1.03
    if fmt in GRIDS:
        held *= transcoded_bytes(fmt) / GRIDS[fmt].block_bytes
    if fmt == "mxfp4":  # each scale byte held as a float16
        held *= 18 / 17
    assert w.resident_bytes <= held * rows.nbytes * 48 / 40


@pytest.mark.parametrize("fmt", KERNEL_FORMATS)
@pytest.mark.parametrize("m,n,k", [(1, 40, 512), (5, 16, 256), (70, 33, 768), (0, 16, 256)])
def test_reference_is_the_float_product(fmt, m, n, k):
    """The reference against float64 products of the GGUF weights with x as the format takes
    it (int8 per 32, bf16, or x itself): equal within float32 rounding of the sums (1e-5 of
    |x| |W|); and against the float32 product of x itself within the bound its quantization
    error allows."""
    torch.manual_seed(m * 100 + n + k)
    rows = random_rows(fmt, n, k, seed=m + n)
    w_deq = gguf_dequant(rows, fmt).double()
    w = quant.pack(rows, FORMATS[fmt], (n, k))
    x = torch.randn(m, k)
    got = quant.linear(x, w, path="ref").double()
    assert got.shape == (m, n)
    if m == 0:
        return
    taken = {"bf16": x.bfloat16().float(), "f16": x}.get(fmt, quantized_x(x) if m else x)
    scale = x.abs().double() @ w_deq.abs().T
    assert ((got - taken.double() @ w_deq.T).abs() <= 1e-5 * scale + 1e-30).all()
    # the float32 product of x itself: the activations' rounding is at most half a step
    step = {"bf16": x.abs() * 2**-9, "f16": torch.zeros_like(x)}.get(
        fmt, (x.reshape(m, -1, 32).abs().amax(-1, keepdim=True) / 254).expand(m, k // 32, 32)
    )
    bound = step.reshape(m, k).double() @ w_deq.abs().T + 1e-5 * scale
    assert ((got - x.double() @ w_deq.T).abs() <= bound).all()


@pytest.mark.parametrize("path", FAST_PATHS)
@pytest.mark.parametrize("fmt", KERNEL_FORMATS)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 9, 16, 64, 130])
def test_fast_paths_equal_the_reference(path, fmt, m):
    """Bit for bit: rows in register groups of 8 and their remainders (the last pass over a panel
    fetching the next), past one 64-row chunk;
    k with an odd number of blocks (q8_0, q4_0) and of pairs past the two sums (16-bit)."""
    k = 256 * 3 if FORMATS[fmt].block_size == 256 else 32 * 7 if FORMATS[fmt].quantized else 70
    n = 50
    torch.manual_seed(m)
    rows = random_rows(fmt, n, k, seed=m)
    w = quant.pack(rows, FORMATS[fmt], (n, k))
    x = torch.randn(m, k) * 3
    want = quant.linear(x, w, path="ref")
    assert torch.equal(quant.linear(x, w, path=path), want)


@pytest.mark.parametrize("fmt", KERNEL_FORMATS)
def test_each_row_is_the_same_whatever_the_batch(fmt):
    k = 512
    rows = random_rows(fmt, 64, k, seed=3)
    w = quant.pack(rows, FORMATS[fmt], (64, k))
    x = torch.randn(67, k)
    batch = quant.linear(x, w)
    for r in (0, 3, 64, 66):
        assert torch.equal(quant.linear(x[r : r + 1], w), batch[r : r + 1])


@pytest.mark.parametrize("fmt", ["q4_k", "q8_0", "bf16", "iq3_xxs", "iq2_s"])
def test_bias_residual_and_gated_pair(fmt):
    n, k = 48, 256
    g_rows, u_rows = random_rows(fmt, n, k, seed=4), random_rows(fmt, n, k, seed=5)
    bias, x, res = torch.randn(n), torch.randn(9, k), torch.randn(9, n)
    plain = quant.linear(x, quant.pack(g_rows, FORMATS[fmt], (n, k)))
    with_bias = quant.pack(g_rows, FORMATS[fmt], (n, k), bias)
    assert torch.equal(quant.linear(x, with_bias, res), plain + bias + res)
    up = quant.linear(x, quant.pack(u_rows, FORMATS[fmt], (n, k)))
    pair = quant.pack(g_rows, FORMATS[fmt], (n, k), up=u_rows, act="silu")
    want = torch.nn.functional.silu(plain) * up
    torch.testing.assert_close(quant.linear(x, pair), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("path", ["auto", *FAST_PATHS, "ref"])
@pytest.mark.parametrize(
    "fmts",
    [
        ("q4_k", "q4_k", "q6_k"),
        ("bf16", "q8_0", "f16"),
        ("q5_k", "q4_0"),
        ("iq3_s", "iq3_xxs", "iq4_xs"),
        ("iq2_s", "iq2_xs", "iq2_xxs"),
    ],
)
@pytest.mark.parametrize("m", [1, 5, 70])
def test_parts_in_one_pass_are_each_part_bit_for_bit(path, fmts, m):
    """Q, K and V of a Q4_K_M file (V in Q6_K) as one product: each part's columns are its own
    product's, with and without a bias over all the outputs and a residual; m = 70 crosses a
    64-row chunk."""
    k = 512
    ns = [48, 16, 16][: len(fmts)]
    rows = [random_rows(f, n, k, seed=i) for i, (f, n) in enumerate(zip(fmts, ns))]
    parts = [quant.pack(r, FORMATS[f], (n, k)) for r, f, n in zip(rows, fmts, ns)]
    bias = torch.randn(sum(ns))
    biased = [  # each part with its share of the bias: what its product alone adds
        quant.pack(r, FORMATS[f], (n, k), b) for r, f, n, b in zip(rows, fmts, ns, bias.split(ns))
    ]
    x, res = torch.randn(m, k) * 2, torch.randn(m, sum(ns))
    plain = torch.cat([quant.linear(x, p, path=path) for p in parts], dim=-1)
    want = torch.cat([quant.linear(x, p, path=path) for p in biased], dim=-1)
    assert torch.equal(quant.linear_parts(x, parts, path=path), plain)
    assert torch.equal(quant.linear_parts(x, parts, bias, path=path), want)
    assert torch.equal(quant.linear_parts(x, parts, bias, res, path=path), want + res)
    ops = cpu_build.load()
    with pytest.raises(ValueError, match="ns"):
        ops.wgemm_parts(x, [parts[0].packed], [parts[0].fmt.ggml_type], [48, 16], None, None, 0)
    with pytest.raises(ValueError, match="packed"):
        ops.wgemm_parts(x, [parts[0].packed], [parts[0].fmt.ggml_type], [80], None, None, 0)


@pytest.mark.parametrize("path", ["ref", *FAST_PATHS])
@pytest.mark.parametrize("fmt", ["q4_k", "q6_k", "q8_0", "bf16"])
def test_experts_in_one_pass_are_each_experts_product(path, fmt):
    """A mixture's experts (gpu/models/moe.py): x's rows ordered by expert, one expert with none,
    one with 70 (crossing a 64-row chunk); each row's outputs are its expert's own product bit
    for bit, as gated pairs (gate/up) and as plain weights (down)."""
    k, n = 256, 48
    counts = [3, 0, 70, 1]
    gate = [random_rows(fmt, n, k, seed=10 + e) for e in range(4)]
    up = [random_rows(fmt, n, k, seed=20 + e) for e in range(4)]
    pairs = [quant.pack(g, FORMATS[fmt], (n, k), up=u, act="silu") for g, u in zip(gate, up)]
    plain = [quant.pack(g, FORMATS[fmt], (n, k)) for g in gate]
    x = torch.randn(sum(counts), k) * 2
    for ws in (pairs, plain):
        want = torch.cat([quant.linear(part, w, path=path) for part, w in zip(x.split(counts), ws)])
        assert torch.equal(quant.linear_experts(x, ws, counts, path=path), want)
    ops, fmt_code = cpu_build.load(), FORMATS[fmt].ggml_type
    with pytest.raises(ValueError, match="counts: 74 rows of x's 75"):
        ops.wgemm_experts(
            torch.randn(75, k), [w.packed for w in plain], [fmt_code] * 4, n, counts, 0, 0
        )
    with pytest.raises(ValueError, match="packed"):  # plain weights read as gated pairs
        ops.wgemm_experts(x, [w.packed for w in plain], [fmt_code] * 4, n, counts, 1, 0)


def test_bad_arguments_are_errors_not_crashes():
    rows = random_rows("q4_k", 16, 256, seed=6)
    w = quant.pack(rows, FORMATS["q4_k"], (16, 256))
    with pytest.raises(ValueError, match="multiple of the format's 256"):
        quant.pack(random_rows("q8_0", 16, 96, seed=7), FORMATS["q4_k"], (16, 96))
    with pytest.raises(ValueError, match="rows: needs"):
        quant.pack(rows[:8], FORMATS["q4_k"], (16, 256))
    with pytest.raises(ValueError, match="x: needs float32"):
        quant.linear(torch.randn(2, 256, dtype=torch.float64), w)
    with pytest.raises(ValueError, match="k: 4 is not a multiple"):
        quant.linear(torch.randn(2, 4), w)
    with pytest.raises(ValueError, match="packed: needs"):
        quant.linear(torch.randn(2, 256), w._replace(out_features=40))
    ops = quant.cpu_build.load()
    with pytest.raises(ValueError, match="unknown block format"):
        ops.wgemm(torch.randn(1, 256), w.packed, 4, 16, 0, None, None, 0)  # ggml Q4_2: gone
    with pytest.raises(ValueError, match="path: 0 to 3"):
        ops.wgemm(torch.randn(1, 256), w.packed, 12, 16, 0, None, None, 9)


def test_mxfp4_scales_float16_does_not_hold_serve_the_weight_as_q8_0():
    """MXFP4's scale bytes 104..143 become the kernels' float16 scales (a block of zeros takes
    any: byte 0 here); a weight with a block past them (144..146: Q8_0's integers doubled) is
    served as Q8_0, still the gguf package's weights exactly."""
    rows = random_rows("mxfp4", 16, 256, seed=5)
    blocks = rows.reshape(-1, 17)
    blocks[0, 0], blocks[0, 1:] = 0, 0x80  # +0 and -0 under 2^-128
    w = quant.pack(rows, FORMATS["mxfp4"], (16, 256))
    assert w.fmt.name == "mxfp4"
    assert torch.equal(quant.dequantize(w), gguf_dequant(rows, "mxfp4"))
    blocks[1, 0], blocks[2, 0] = 144, 146
    w = quant.pack(rows, FORMATS["mxfp4"], (16, 256))
    assert w.fmt.name == "q8_0"
    assert torch.equal(quant.dequantize(w), gguf_dequant(rows, "mxfp4"))
