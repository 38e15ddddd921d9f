"""A checkpoint's FP8 KV cache scales (gpu/kv_scales.py): each layer's K and V written divided by
its k_scale and v_scale, the scores and the output scaled back.

The test's checkpoints are a tiny model "blown up": each layer's K and V made 2^10 (2^8 in the
second layer) times larger (k_proj's or k_norm's weights and v_proj's times that, q_proj's or
q_norm's and o_proj's divided by it), which leaves the model the same function, exactly in
floating point (powers of two), but puts its K and V far past E4M3's 448. With k_scale and
v_scale equal to those factors, the FP8 cache holds exactly what it holds for the original model,
so every backend (weir's compiled CPU stack, its layers one by one, torch's reference attention,
the Triton kernels and the CUDA backend's fused write in the interpreter) gives the original
model's tokens and logits bit for bit; without the scales the same cache saturates.
"""

from __future__ import annotations

import json
import logging
import shutil

import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file

from core.config import CheckpointError, EngineConfig
from gpu.launch import load
from tests.test_kv_cache_dtype import run_greedy

FACTORS = (2.0**10, 2.0**8)  # layer 0's, layer 1's


def blown_up(src, out, scales=True, arch="llama", extra=None):
    """`src`'s model with each layer's K and V `FACTORS` times larger (and what reads them that
    much smaller), with the factors as its KV scales (or none)."""
    shutil.copytree(src, out)
    tensors = load_file(src / "model.safetensors")
    for i, f in enumerate(FACTORS):
        p = f"model.layers.{i}.self_attn."
        if arch == "qwen3":  # K through its norm's weight, Q's norm smaller
            tensors[p + "k_norm.weight"] = tensors[p + "k_norm.weight"] * f
            tensors[p + "q_norm.weight"] = tensors[p + "q_norm.weight"] / f
        else:
            tensors[p + "k_proj.weight"] = tensors[p + "k_proj.weight"] * f
            tensors[p + "q_proj.weight"] = tensors[p + "q_proj.weight"] / f
        tensors[p + "v_proj.weight"] = tensors[p + "v_proj.weight"] * f
        tensors[p + "o_proj.weight"] = tensors[p + "o_proj.weight"] / f
        if scales:  # one layer's as [1] (llm-compressor's), the other's as a 0-d tensor
            shape = (1,) if i == 0 else ()
            tensors[p + "k_scale"] = torch.full(shape, f)
            tensors[p + "v_scale"] = torch.full(shape, f)
    tensors.update(extra or {})
    save_file(tensors, out / "model.safetensors")
    return out


@pytest.fixture(scope="module")
def models(model_dir, tmp_path_factory):
    made = {}

    def get(arch, scales=True):
        if (arch, scales) not in made:
            src = model_dir(arch, num_layers=2)
            out = tmp_path_factory.mktemp("blown") / f"{arch}-{scales}"
            made[arch, scales] = (src, blown_up(src, out, scales, arch))
        return made[arch, scales]

    return get


def run(path, **kw):
    kw = {"device": "cpu", **kw}  # the CUDA backend's tests name theirs
    config = EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64, **kw)
    return run_greedy(load(config), max_tokens=6)


def assert_same(a, b):
    (tokens_a, steps_a), (tokens_b, steps_b) = a, b
    assert tokens_a == tokens_b
    assert len(steps_a) == len(steps_b)
    for (ids_a, x), (ids_b, y) in zip(steps_a, steps_b):
        assert ids_a == ids_b and torch.equal(x, y)


@pytest.mark.parametrize(
    "arch,kv,how",
    [
        ("llama", "fp8", {}),  # the compiled CPU stack
        ("qwen3", "fp8", {}),
        ("qwen3", "fp8_e5m2", {}),
        ("llama", "fp8", {"cpu_forward": "modules"}),  # layer by layer, weir's CPU attention
        ("qwen3", "fp8", {"attention_backend": "torch"}),  # torch's reference attention
    ],
)
def test_the_scaled_cache_holds_the_original_models(models, arch, kv, how):
    original, scaled = models(arch)
    want = run(original, kv_cache_dtype=kv, **how)
    loaded = load(
        EngineConfig(
            model=str(scaled), dtype="float32", device="cpu", num_kv_blocks=64, kv_cache_dtype=kv,
            **how,
        )
    )  # fmt: skip
    attn = [layer.self_attn for layer in loaded.core.runner.model.model.layers]
    assert [a.kv_scales for a in attn] == [[f, f] for f in FACTORS]
    if not how:
        assert loaded.core.runner.model.stack is not None  # the compiled path takes them
    assert_same(run_greedy(loaded, max_tokens=6), want)


def test_without_its_scales_the_cache_saturates(models):
    original, _ = models("llama")
    _, unscaled = models("llama", scales=False)
    tokens_a, steps_a = run(original, kv_cache_dtype="fp8")
    tokens_b, steps_b = run(unscaled, kv_cache_dtype="fp8")
    gap = max(float((a - b).abs().max()) for (_, a), (_, b) in zip(steps_a, steps_b))
    assert gap > 1.0  # V past 448 saturates: not the same model (the test above could fail)


def test_unused_under_a_wider_cache_and_said_so(models, caplog):
    original, scaled = models("llama")
    with caplog.at_level(logging.WARNING, logger="weir.kv_cache"):
        got = run(scaled)
    assert "FP8 KV cache scales (2 layers) are unused" in caplog.text
    assert_same(got, run(original))  # the blown-up model is the same function


@pytest.mark.parametrize("arch,backend", [("llama", "triton"), ("qwen3", "cuda")])
def test_the_triton_kernels_write_the_scaled_cache(models, arch, backend, monkeypatch):
    """Triton's store (under torch's layers) and the CUDA backend's fused rotation and write
    (Qwen3's head norms), in the interpreter: the original model's run on the same kernels."""
    from tests.test_phi3 import use_cuda_backend

    original, scaled = models(arch)
    kw = {"kv_cache_dtype": "fp8", "attention_backend": "triton"}
    if backend == "cuda":
        kw.update(use_cuda_backend(monkeypatch))
    else:
        kw["cpu_forward"] = "modules"
    assert_same(run(scaled, **kw), run(original, **kw))


@pytest.mark.parametrize(
    "extra,message",
    [
        ({"model.layers.0.self_attn.k_scale": torch.ones(2)}, r"shape \(2,\) \(per head\)"),
        ({"model.layers.1.self_attn.v_scale": torch.zeros(())}, "positive and finite, got 0"),
        ({"model.layers.7.self_attn.k_scale": torch.ones(())}, "unexpected weight"),
    ],
)
def test_scales_that_are_not_served_are_refused(model_dir, tmp_path, extra, message):
    path = blown_up(model_dir("llama", num_layers=2), tmp_path / "bad", extra=extra)
    with pytest.raises(CheckpointError, match=message):
        load(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64))


def test_the_older_names_and_a_compressed_tensors_scheme(models, tmp_path):
    """`kv_scale` (both) and `k_proj.output_scale` / `v_proj.output_scale`, as vLLM reads them;
    a compressed-tensors kv_cache_scheme other than FP8 per tensor is refused."""
    original, scaled = models("llama")
    tensors = load_file(scaled / "model.safetensors")
    renamed = {}
    for name, t in tensors.items():
        if name == "model.layers.0.self_attn.k_scale":
            renamed["model.layers.0.self_attn.kv_scale"] = t
        elif name == "model.layers.0.self_attn.v_scale":
            continue
        elif name.startswith("model.layers.1.self_attn.") and name.endswith("_scale"):
            renamed[
                name.replace("self_attn.k_scale", "self_attn.k_proj.output_scale").replace(
                    "self_attn.v_scale", "self_attn.v_proj.output_scale"
                )
            ] = t
        else:
            renamed[name] = t
    out = tmp_path / "older"
    shutil.copytree(scaled, out)
    save_file(renamed, out / "model.safetensors")
    assert_same(run(out, kv_cache_dtype="fp8"), run(original, kv_cache_dtype="fp8"))

    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["re:^$"], "weights": {
            "type": "float", "num_bits": 8, "strategy": "channel"}}},
        "kv_cache_scheme": {"type": "int", "num_bits": 8, "strategy": "tensor"},
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="kv_cache_scheme .* is not served"):
        load(EngineConfig(model=str(out), device="cpu", num_kv_blocks=64))
    config["quantization_config"]["kv_cache_scheme"].update(type="float", dynamic=False)
    (out / "config.json").write_text(json.dumps(config))
    got = run(out, kv_cache_dtype="fp8")  # no layer quantized, the scales taken
    assert_same(got, run(original, kv_cache_dtype="fp8"))


def test_a_draft_models_own_scales(models):
    """A draft model's checkpoint scales its own cache (gpu/launch.py)."""
    original, scaled = models("llama")
    spec = {"model": str(scaled), "method": "draft_model", "num_speculative_tokens": 2}
    base = EngineConfig(
        model=str(original), dtype="float32", device="cpu", num_kv_blocks=64, kv_cache_dtype="fp8"
    )
    loaded = load(msgspec.structs.replace(base, speculative_config=json.dumps(spec)))
    draft = loaded.core.runner.draft.model
    assert all(layer.self_attn.kv_applied is not None for layer in draft.model.layers)
    target = loaded.core.runner.model
    assert all(layer.self_attn.kv_applied is None for layer in target.model.layers)
