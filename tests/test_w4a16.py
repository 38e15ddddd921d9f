"""The 4-bit GPU product (gpu/cuda/kernels/w4a16.py) over the GPU form of Q4_0 / Q4_1 blocks
(gpu/cuda/int4_weight.py): the form holds exactly the weights the gguf package dequantizes,
and the product equals the float product over them (Triton's interpreter on CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu.cuda.int4_weight import Int4Weight
from gpu.cuda.kernels import w4a16
from gpu.cuda.kernels.w4a16 import dequantize_int4, split_k_for, w4a16_linear
from gpu.quant.formats import FORMATS
from gpu.quant.quantize import quantize
from core.request import EngineRequest
from core.sampling import SamplingParams
from gpu.quant.tensor import BlockTensor

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def blocks(fmt: str, n: int, k: int, seed: int = 0) -> BlockTensor:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    return BlockTensor(quantize(w, fmt), FORMATS[fmt], (n, k))


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "mxfp4", "q8_0"])
def test_the_gpu_form_holds_the_blocks_weights(fmt):
    t = blocks(fmt, 24, 96)
    w = Int4Weight.from_blocks(t, DEVICE)
    assert w.qweight.shape == (96 * w.bits // 32, 24) and w.scales.shape == (3, 24)
    assert torch.equal(w.dequantize().cpu(), t.dequantize(torch.float32))


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "mxfp4", "q8_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,split_k", [(1, 1), (1, 3), (5, 2), (33, 1), (70, 1)])
def test_the_product_equals_the_float_product(fmt, dtype, m, split_k):
    n, k = 80, 160  # n not a multiple of the 64-column tile, k of the 64-deep one
    t = blocks(fmt, n, k, seed=m)
    w = Int4Weight.from_blocks(t, DEVICE)
    g = torch.Generator().manual_seed(m)
    x = torch.randn((m, k), generator=g).to(DEVICE, dtype)
    bias = torch.randn(n, generator=g).to(DEVICE, dtype)
    got = w4a16_linear(
        x, w.qweight, w.scales, w.mins, 32, bias, split_k=split_k, fp4=w.fp4, int8=w.bits == 8
    )
    want = x.float() @ t.dequantize(torch.float32).to(DEVICE).T + bias.float()
    assert got.dtype == dtype and got.shape == (m, n)
    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    scale = want.abs().max().item()
    torch.testing.assert_close(got.float(), want, atol=tol * scale, rtol=tol)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "mxfp4", "q8_0"])
def test_the_dequantized_weight_is_the_forms(fmt):
    """The weight the product reads from DEQUANT_ROWS rows on: in float32 exactly the form's
    weight, in 16 bits that rounded once (to nearest on a GPU; Triton's interpreter cuts a
    bfloat16 toward zero whatever the rounding asked)."""
    t = blocks(fmt, 80, 160)  # n not a multiple of the 64-column tile
    w = Int4Weight.from_blocks(t, DEVICE)
    want = w.dequantize().T
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = dequantize_int4(w.qweight, w.scales, w.mins, 32, dtype, w.fp4, w.bits == 8)
        assert got.dtype == dtype and got.shape == (160, 80)
        if dtype == torch.bfloat16 and DEVICE == "cpu":
            cut = (want.contiguous().view(torch.int32) & -65536).view(torch.float32)
            assert torch.equal(got, cut.to(dtype))
        else:
            assert torch.equal(got, want.to(dtype))


def test_from_dequant_rows_on_the_weight_is_dequantized_once(monkeypatch):
    """Below DEQUANT_ROWS the tiled product; from it on one dequantization and torch's product
    (bias added by it): the same values either way, within bf16's rounding of the sums."""
    t = blocks("q4_1", 80, 160)
    w = Int4Weight.from_blocks(t, DEVICE)
    calls = []
    real = w4a16.dequantize_int4
    monkeypatch.setattr(w4a16, "dequantize_int4", lambda *a: calls.append(a[4]) or real(*a))
    g = torch.Generator().manual_seed(0)
    rows = w4a16.DEQUANT_ROWS
    x = torch.randn((rows, 160), generator=g).to(DEVICE, torch.bfloat16)
    bias = torch.randn(80, generator=g).to(DEVICE, torch.bfloat16)
    fewer = w4a16_linear(x[: rows - 1], w.qweight, w.scales, w.mins, 32, bias)
    assert calls == []
    whole = w4a16_linear(x, w.qweight, w.scales, w.mins, 32, bias)
    assert calls == [torch.bfloat16] and whole.dtype == torch.bfloat16
    monkeypatch.setattr(w4a16, "DEQUANT_ROWS", None)  # never: the tiles at every row count
    tiled = w4a16_linear(x, w.qweight, w.scales, w.mins, 32, bias)
    assert torch.equal(tiled[: rows - 1], fewer)
    scale = tiled.float().abs().max().item()
    torch.testing.assert_close(whole.float(), tiled.float(), atol=2e-2 * scale, rtol=2e-2)


def test_strided_rows_and_bad_arguments():
    t = blocks("q4_0", 16, 64)
    w = Int4Weight.from_blocks(t, DEVICE)
    wide = torch.randn(3, 100).to(DEVICE)
    x = wide[:, :64]  # rows with a stride past k
    want = x @ t.dequantize(torch.float32).to(DEVICE).T
    got = w4a16_linear(x, w.qweight, w.scales, w.mins, 32)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="k = 63"):
        w4a16_linear(torch.randn(2, 63).to(DEVICE), w.qweight, w.scales, w.mins, 32)
    with pytest.raises(ValueError, match="scales"):
        w4a16_linear(x, w.qweight, w.scales.float(), w.mins, 32)
    with pytest.raises(ValueError, match="contiguous rows"):
        w4a16_linear(wide.T, w.qweight, w.scales, w.mins, 32)
    with pytest.raises(ValueError, match="no GPU block form"):
        Int4Weight.from_blocks(blocks("q5_0", 16, 64), DEVICE)
    with pytest.raises(ValueError, match="fp4 and int8"):
        w4a16_linear(x, w.qweight, w.scales, None, 32, fp4=True, int8=True)
    with pytest.raises(ValueError, match="mins are given"):
        w4a16_linear(x, w.qweight, w.scales, w.mins, 32, fp4=True)


def test_mxfp4_scales_float16_holds_and_blocks_of_zeros():
    """MXFP4's form: a block of zeros under any scale byte holds zeros; a weight with a scale
    float16 does not hold has no 4-bit form (the CUDA backend then dequantizes it)."""
    from gpu.cuda.int4_weight import fits

    t = blocks("mxfp4", 16, 64)
    t.rows.reshape(-1, 17)[0] = [0] + [0x80] * 16  # +0 and -0 under 2^-128
    w = Int4Weight.from_blocks(t, DEVICE)
    assert w.mins is None and torch.equal(w.dequantize().cpu(), t.dequantize(torch.float32))
    t.rows.reshape(-1, 17)[1, 0] = 150
    assert not fits(t)
    with pytest.raises(ValueError, match="no GPU block form"):
        Int4Weight.from_blocks(t, DEVICE)


def test_the_k_split_fills_the_gpu_only_for_few_rows():
    assert split_k_for(1, 1024, 4096, 16, 64, 64, 132) == 16  # decode: 16 tiles, 132 SMs
    assert split_k_for(512, 4096, 4096, 64, 64, 64, 132) == 1  # a prefill fills it alone
    assert split_k_for(1, 64, 128, 16, 64, 64, 132) == 1  # k too short to share


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
def test_a_4_bit_gguf_on_the_cuda_backend(fmt, tmp_path, monkeypatch):
    """A Q4_0 / Q4_1 file on the CUDA backend keeps its products 4-bit (W4A16: Q/K/V stacked,
    gate/up one product; a Q8_0 file 8-bit, W8A16) and gives the tokens and logits of the same
    file dequantized to float32 on torch's ops (the interpreter on CPU), its prompts past
    DEQUANT_ROWS."""
    from core.config import EngineConfig
    from gpu import assemble
    from gpu.assemble import resident_weights
    from gpu.attention.select import get_backend
    from gpu.backend import TorchBackend
    from gpu.cuda.backend import CudaBackend
    from gpu.launch import load
    from gpu.quant.gguf_write import uniform, write_gguf
    from gpu.tiny_model import build_tiny_model
    from tests.test_async_scheduling import drive

    shape = dict(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, num_layers=1)
    hf = build_tiny_model(tmp_path / "hf", "qwen3", **shape)
    path = write_gguf(hf, tmp_path / f"m-{fmt}.gguf", uniform(fmt))
    runs = {}
    for name, make in (("cuda", CudaBackend), ("torch", lambda a: TorchBackend(a, fuse=True))):
        if not (torch.cuda.is_available() and name == "cuda"):
            monkeypatch.setattr(
                assemble,
                "choose_backend",
                lambda c, d, t, make=make: make(get_backend("triton", d)),
            )
        config = EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64, block_size=4)
        core = load(config).core
        model = core.runner.model
        if name == "cuda":
            layer = model.model.layers[0]
            assert isinstance(layer.self_attn.qkv[0], Int4Weight)
            assert isinstance(layer.mlp.gate_up[1][0], Int4Weight)
            assert isinstance(layer.mlp.down[0], Int4Weight)
            assert resident_weights(model)[fmt] > 0
        # the prompts' step (75 rows) on the dequantized weight, the decode steps on the tiles
        prompts = [[11, 12, 13, 14, 15], list(range(20, 90))]
        requests = [
            EngineRequest(str(i), p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
            for i, p in enumerate(prompts)
        ]
        got, _ = drive(core, requests)
        runs[name] = (got, core.runner.last_logits.clone())
    assert {k: v[0] for k, v in runs["cuda"][0].items()} == {
        k: v[0] for k, v in runs["torch"][0].items()
    }
    torch.testing.assert_close(runs["cuda"][1], runs["torch"][1], atol=1e-3, rtol=1e-3)
