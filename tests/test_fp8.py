"""FP8 weights (gpu/quant/fp8.py): the scaled product against the float product over the same
quantized values, FP8 checkpoints (AutoFP8's layout: float8 weights with weight_scale, and
input_scale when static) and `--quantization fp8`, on the CUDA backend (its products on
torch._scaled_mm on a GPU, the same float32 product on a CPU; its input's quantization in one
Triton kernel) and dequantized on weir's CPU kernels."""

from __future__ import annotations

import json

import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file

from core.config import CheckpointError, EngineConfig
from core.request import EngineRequest
from core.sampling import SamplingParams
from gpu.launch import load
from gpu.cuda.kernels.fp8_quant import quantize_rows
from gpu.quant.fp8 import (
    FP8,
    FP8_MAX,
    Fp8Scheme,
    Fp8Tensor,
    cat_rows,
    fp8_linear,
    quantize_activations,
)
from gpu.tiny_model import build_tiny_model

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_quantized_weights_and_the_scaled_product():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g)
    w[3] = 0  # a row of zeros keeps a usable scale
    q = Fp8Tensor.quantize(w)
    assert q.weight.dtype == FP8 and q.scale.shape == (48,) and q.scale[3] == 1
    err = (q.dequantize(torch.float32) - w).abs().amax(dim=1)
    assert (err <= w.abs().amax(dim=1) / 16 + 1e-6).all()  # 3 mantissa bits
    x = torch.randn(5, 64, generator=g, dtype=torch.float32)
    bias = torch.randn(48, generator=g)
    got = fp8_linear(x, q, bias)
    # the same quantization of x by hand, then float products
    xs = (x.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    xq = (x / xs).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * xs
    want = xq @ q.dequantize(torch.float32).T + bias
    torch.testing.assert_close(got, want, atol=2e-2 * want.abs().max().item(), rtol=1e-2)
    # a static activation scale, and rows stacked with their own scales
    q2 = Fp8Tensor.quantize(torch.randn(16, 64, generator=g))
    both = cat_rows([Fp8Tensor(q.weight, q.scale, 0.05), Fp8Tensor(q2.weight, q2.scale, 0.08)])
    assert both.input_scale == 0.08 and both.weight.shape == (64, 64)
    y = fp8_linear(x, both)
    xq = (x / 0.08).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * 0.08
    want = xq @ both.dequantize(torch.float32).T
    torch.testing.assert_close(y, want, atol=2e-2 * want.abs().max().item(), rtol=1e-2)


@pytest.mark.parametrize("static", [None, 0.05])
def test_the_input_quantization_kernel_gives_torchs_values(static):
    """The kernel's scales and values equal torch's ops' bit for bit: rows of 1030 (two blocks,
    the second ragged) in bfloat16, a row of zeros, a row past the FP8 range (static: clamped),
    a strided view. On a GPU the FP8 values themselves; interpreted on CPU the values before the
    cast to FP8 (the interpreter does not round to float8 as a GPU does)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(3)
    base = torch.randn(6, 1100, generator=g) * 3
    base[2] = 0
    base[4, 7] = 1e4
    rows = base.to(device, torch.bfloat16)[:, :1030]  # rows 1100 apart
    out_dtype = FP8 if device == "cuda" else torch.float32
    values, scales = quantize_rows(rows, static, out_dtype)
    want_values, want_scales = quantize_activations(rows, static)
    assert scales.shape == (6, 1) and torch.equal(scales, want_scales)
    if device == "cpu":  # torch's values before its cast
        want_values = (rows.float() / want_scales).clamp(-FP8_MAX, FP8_MAX)
    assert torch.equal(values.float(), want_values.float())
    assert scales[2].item() == pytest.approx(1e-12 if static is None else 0.05)
    with pytest.raises(ValueError, match="contiguous"):
        quantize_rows(rows.t())


def test_the_scheme_refuses_what_it_cannot_serve():
    assert Fp8Scheme.from_config({"quant_method": "fp8"}, "m").static is False
    assert Fp8Scheme.from_config({"activation_scheme": "static"}, "m").static is True
    with pytest.raises(CheckpointError, match="block-wise"):
        Fp8Scheme.from_config({"weight_block_size": [128, 128]}, "m")
    with pytest.raises(CheckpointError, match="e5m2"):
        Fp8Scheme.from_config({"fmt": "e5m2"}, "m")
    with pytest.raises(CheckpointError, match="rows"):
        Fp8Tensor.from_checkpoint(torch.zeros(4, 8).to(FP8), torch.ones(3), None)


def fp8_checkpoint(src, dst, static: bool):
    """The tiny model as AutoFP8 writes one: each linear's weight float8 with a per-tensor
    weight_scale (and an input_scale when static); embeddings, norms and the head unquantized."""
    import shutil

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if any(f".{lin}.weight" in name for lin in LINEARS):
            scale = t.float().abs().max() / FP8_MAX
            out[name] = (t.float() / scale).to(FP8)
            out[name.replace(".weight", ".weight_scale")] = scale.reshape(())
            if static:
                out[name.replace(".weight", ".input_scale")] = torch.tensor(0.1)
        else:
            out[name] = t
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "static" if static else "dynamic",
    }
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def first_logits(config: EngineConfig, monkeypatch=None, backend=None):
    if backend is not None:
        from gpu import assemble

        monkeypatch.setattr(assemble, "choose_backend", backend)
    core = load(config).core
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    core.add(EngineRequest("a", list(range(11, 40)), params))
    while core.has_work:
        core.step()
    return core, core.runner.last_logits[0].float()


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Logits within FP8's error (3 mantissa bits; on this random two-layer model rounding the
    weights alone moves them by 1.7% of their spread on average, the activations too by 2.1%):
    near on average, never far, and a best token that is near-best under the reference."""
    spread = want.max() - want.min()
    diff = (got - want).abs()
    assert diff.mean() < 0.03 * spread and diff.max() < 0.12 * spread, (diff.mean(), diff.max())
    assert want[got.argmax()] >= want.max() - 0.1 * spread


def cuda_backend(**kw):
    from gpu.attention.select import get_backend
    from gpu.cuda.backend import CudaBackend

    return lambda c, d, t: CudaBackend(get_backend("triton", d), **kw)


@pytest.mark.parametrize("static", [False, True])
def test_an_fp8_checkpoint_on_the_gpu_path_and_on_cpu(tmp_path, monkeypatch, static):
    hf = build_tiny_model(tmp_path / "hf", "qwen3", hidden_size=128, intermediate_size=256)
    path = fp8_checkpoint(hf, tmp_path / "fp8", static)
    config = EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64)
    # the reference: the same FP8 weights dequantized, on torch's ops
    from gpu.attention.select import get_backend
    from gpu.backend import TorchBackend

    _, want = first_logits(
        config,
        monkeypatch,
        lambda c, d, t: TorchBackend(get_backend("triton", d), fuse=True),
    )
    # on the CUDA backend (interpreted here): FP8 products, activations quantized per token
    core, got = first_logits(config, monkeypatch, cuda_backend())
    qkv = core.runner.model.model.layers[0].self_attn.qkv[0]
    assert isinstance(qkv, Fp8Tensor) and qkv.weight.dtype == FP8
    assert (qkv.input_scale is not None) == static
    from gpu.assemble import resident_weights

    assert resident_weights(core.runner.model)["fp8"] > 0
    close(got, want)
    # on weir's CPU kernels: dequantized once, served as bfloat16 blocks
    monkeypatch.undo()
    cpu = load(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64))
    assert "bf16" in cpu.weight_bytes and "fp8" not in cpu.weight_bytes


def test_quantization_fp8_at_load(tmp_path, monkeypatch):
    hf = build_tiny_model(tmp_path / "hf", "llama", hidden_size=128, intermediate_size=256)
    base = EngineConfig(model=str(hf), dtype="float32", num_kv_blocks=64)
    _, want = first_logits(base, monkeypatch, cuda_backend())
    fp8 = EngineConfig(model=str(hf), dtype="float32", num_kv_blocks=64, quantization="fp8")
    core, got = first_logits(fp8, monkeypatch, cuda_backend(quantize_fp8=True))
    layer = core.runner.model.model.layers[0]
    assert isinstance(layer.mlp.gate_up[1][0], Fp8Tensor)
    assert isinstance(layer.mlp.down[0], Fp8Tensor)
    close(got, want)
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match="FP8 products run on GPUs"):
        load(EngineConfig(model=str(hf), device="cpu", quantization="fp8", num_kv_blocks=8))
    with pytest.raises(CheckpointError, match="already quantized"):
        path = fp8_checkpoint(hf, tmp_path / "fp8", False)
        load(EngineConfig(model=str(path), device="cpu", quantization="q8_0", num_kv_blocks=8))


@pytest.mark.parametrize("algo", ["FP8", "FP8_PER_CHANNEL_PER_TOKEN"])
def test_a_modelopt_checkpoint(tmp_path, algo):
    """NVIDIA ModelOpt's layout: the same FP8 tensors, the scheme in hf_quant_config.json (not
    config.json), K/V scales as `k_proj.k_scale` / `v_proj.v_scale`: the same logits as the
    AutoFP8 checkpoint of those tensors, and the scales on their layers; other algorithms are
    refused naming them."""
    hf = build_tiny_model(tmp_path / "hf", "qwen3", hidden_size=128, intermediate_size=256)
    static = algo == "FP8"
    autofp8 = fp8_checkpoint(hf, tmp_path / "autofp8", static)
    path = fp8_checkpoint(hf, tmp_path / "modelopt", static)
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    quant = {"quant_algo": algo, "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]}
    (path / "hf_quant_config.json").write_text(
        json.dumps({"producer": {"name": "modelopt"}, "quantization": quant})
    )
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.1.self_attn.k_proj.k_scale"] = torch.tensor(0.5)
    tensors["model.layers.1.self_attn.v_proj.v_scale"] = torch.tensor(0.25)
    save_file(tensors, str(path / "model.safetensors"))
    core, got = first_logits(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64))
    _, want = first_logits(EngineConfig(model=str(autofp8), device="cpu", num_kv_blocks=64))
    # (the scales unused under the model's own cache dtype; the files' different layouts can
    # move a float32 sum by an ulp: within 1e-6 of the spread, not bit for bit)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6 * float(want.max() - want.min()))
    layers = core.runner.model.model.layers
    assert [layer.self_attn.kv_scales for layer in layers] == [[1.0, 1.0], [0.5, 0.25]]
    config = EngineConfig(model=str(path), device="cpu", num_kv_blocks=64)
    with pytest.raises(CheckpointError, match="--quantization awq"):
        load(msgspec.structs.replace(config, quantization="awq"))
    assert load(msgspec.structs.replace(config, quantization="modelopt")).core is not None
    quant["quant_algo"] = "NVFP4"
    (path / "hf_quant_config.json").write_text(json.dumps({"quantization": quant}))
    with pytest.raises(CheckpointError, match="ModelOpt quant_algo 'NVFP4' is not served"):
        load(config)
