"""OLMo 1 (OlmoForCausalLM: OLMo-1B/7B, 0424, 0724): Llama's layer under layer norms without
weights (their epsilon fixed at 1e-5) and Q/K/V clamped to [-clip_qkv, clip_qkv] after their
products (0.5 here, where the tiny model's products reach past it: the clip changes its logits).
Against transformers on the same random weights: in the one-call CPU stack (bitwise the module
path's: tests/test_cpu_forward.py), layer by layer, on the CUDA backend's kernels and over
tensor-parallel ranks; from llama.cpp's "olmo" GGUF file too (attention.clamp_kqv; checked
against its converter and llama-server)."""

from __future__ import annotations

import pytest

from gpu.models.spec import ModelSpec
from tests.test_phi3 import assert_as_transformers, backend_config, prompt


@pytest.fixture(scope="module")
def olmo(tmp_path_factory):
    from gpu.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("olmo1") / "olmo", "olmo", num_layers=2)


@pytest.mark.parametrize("backend", ["stack", "modules", "cuda-backend"])
def test_olmo_matches_transformers(olmo, backend, monkeypatch):
    config = backend_config(backend, monkeypatch)
    assert_as_transformers(olmo, olmo, prompt(30), **config)


def test_the_spec_and_the_stack(olmo):
    from transformers import AutoConfig

    from core.config import EngineConfig
    from gpu.launch import load

    spec = ModelSpec.from_hf_config(AutoConfig.from_pretrained(olmo))
    assert spec.layer_norm and spec.norm_weightless and spec.qkv_clip == 0.5
    model = load(EngineConfig(model=str(olmo), num_kv_blocks=16)).core.runner.model
    assert model.stack is not None
    assert bool((model.model.norm.weight == 1).all())  # (the model is built uninitialized)


def test_a_gguf_file_serves_as_its_checkpoint(olmo, tmp_path):
    from gpu.gguf_file import GgufCheckpoint
    from gpu.quant.gguf_write import uniform, write_gguf

    path = write_gguf(olmo, tmp_path / "olmo.gguf", uniform("f32"))
    ckpt = GgufCheckpoint(path)
    assert ckpt.arch == "olmo" and ckpt.get("olmo.attention.clamp_kqv") == 0.5
    assert "output_norm.weight" not in ckpt.tensors
    assert_as_transformers(path, olmo, prompt(30))
