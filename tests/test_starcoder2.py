"""StarCoder2 (Starcoder2ForCausalLM: starcoder2-3b, -7b, -15b): layer norms with a bias, an
ungated MLP of gelu (tanh) named c_fc and c_proj, biases on every product, one window for every
layer. Against transformers on the same random weights (biases and norm weights drawn; a window
of 8 under a 30-token prompt): in the one-call CPU stack (its MLP's biases and activation in the
call, bitwise the module path's: tests/test_cpu_forward.py), layer by layer and on the CUDA
backend's kernels; from llama.cpp's "starcoder2" GGUF file too (checked against its converter
and llama-server), which holds no window: served as llama.cpp serves it, attending to all."""

from __future__ import annotations

import pytest

from gpu.models.spec import ModelSpec
from tests.test_phi3 import assert_as_transformers, backend_config, prompt


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from gpu.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("starcoder2")
    return {
        "windowed": build_tiny_model(root / "w", "starcoder2", num_layers=2, sliding_window=8),
        "whole": build_tiny_model(root / "a", "starcoder2", num_layers=2),
    }


@pytest.mark.parametrize("backend", ["stack", "modules", "cuda-backend"])
def test_starcoder2_matches_transformers(models, backend, monkeypatch):
    config = backend_config(backend, monkeypatch)
    assert_as_transformers(models["windowed"], models["windowed"], prompt(30), **config)


def test_the_spec_and_the_stack(models):
    from transformers import AutoConfig

    from core.config import EngineConfig
    from gpu.launch import load

    spec = ModelSpec.from_hf_config(AutoConfig.from_pretrained(models["windowed"]))
    assert spec.layer_norm and spec.norm_bias and not spec.gated_mlp and not spec.norm_plus_one
    assert spec.qkv_bias and spec.o_bias and spec.mlp_bias and spec.sliding_window == 8
    assert spec.hidden_act == "gelu_pytorch_tanh"
    path = str(models["windowed"])
    model = load(EngineConfig(model=path, num_kv_blocks=16)).core.runner.model
    assert model.stack is not None


@pytest.mark.parametrize("fmt", ["f32", "q8_0"])
def test_a_gguf_file_serves_as_its_checkpoint(models, fmt, tmp_path):
    from gpu.gguf_file import GgufCheckpoint
    from gpu.quant.gguf_write import uniform, write_gguf

    path = write_gguf(models["whole"], tmp_path / "starcoder2.gguf", uniform(fmt))
    ckpt = GgufCheckpoint(path)
    assert ckpt.arch == "starcoder2" and "blk.0.ffn_up.bias" in ckpt.tensors
    if fmt == "f32":
        assert_as_transformers(path, models["whole"], prompt(30))
    else:  # against transformers on the `gguf` package's dequantization of the file
        from tests.gguf_reference import assert_near_dequantized

        assert_near_dequantized(path, models["whole"], tmp_path / "ref", prompt(30))
