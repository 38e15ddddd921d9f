"""Gemma 1 (GemmaForCausalLM: gemma-2b/7b, CodeGemma): Llama's layer with Gemma's norms (weights
stored as w where 1 + w multiplies), embeddings scaled by sqrt(hidden), gelu's tanh form on its
gate and a head size of its own. Against transformers on the same random weights (norm weights
drawn): in the one-call CPU stack, layer by layer and on the CUDA backend's kernels; from a
"gemma" GGUF file as llama.cpp reads one (its norms stored as 1 + w; checked against
llama-server), F32 and Q8_0."""

from __future__ import annotations

import pytest

from gpu.models.spec import ModelSpec
from tests.test_phi3 import assert_as_transformers, backend_config, prompt


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    from gpu.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("gemma1")
    return build_tiny_model(root / "gemma", "gemma", num_layers=2, head_dim=32)


@pytest.mark.parametrize("backend", ["stack", "modules", "cuda-backend"])
def test_gemma_matches_transformers(gemma, backend, monkeypatch):
    config = backend_config(backend, monkeypatch)
    assert_as_transformers(gemma, gemma, prompt(30), **config)


def test_the_spec_and_the_stack(gemma):
    from transformers import AutoConfig

    from core.config import EngineConfig
    from gpu.launch import load

    spec = ModelSpec.from_hf_config(AutoConfig.from_pretrained(gemma))
    assert spec.norm_plus_one and spec.embed_scale == spec.hidden_size**0.5
    assert spec.head_dim == 32 and not spec.sandwich_norms and spec.tie_word_embeddings
    model = load(EngineConfig(model=str(gemma), num_kv_blocks=16)).core.runner.model
    assert model.stack is not None


@pytest.mark.parametrize("fmt", ["f32", "q8_0"])
def test_a_gguf_file_serves_as_its_checkpoint(gemma, fmt, tmp_path):
    from gpu.gguf_file import GgufCheckpoint
    from gpu.quant.gguf_write import uniform, write_gguf

    path = write_gguf(gemma, tmp_path / "gemma.gguf", uniform(fmt))
    assert GgufCheckpoint(path).arch == "gemma"
    if fmt == "f32":
        assert_as_transformers(path, gemma, prompt(30))
    else:  # against transformers on the `gguf` package's dequantization of the file
        from tests.gguf_reference import assert_near_dequantized

        assert_near_dequantized(path, gemma, tmp_path / "ref", prompt(30))
