"""Models that turn each whole head by adjacent pairs (GLM's rotation: Q/K heads reordered at load,
gpu/models/partial_rope.py): ERNIE 4.5 (Ernie4_5ForCausalLM, as ERNIE-4.5-0.3B: `use_bias` on
every product but the head) and Helium (HeliumForCausalLM, kyutai's Helium-1 2B: Q/K/V biases,
none on O), against transformers on the same random weights, in the one-call CPU stack, layer by
layer and on the CUDA backend's kernels; ERNIE from llama.cpp's "ernie4_5" GGUF files too, whose
Q/K rows are the checkpoint's (llama.cpp turns adjacent pairs)."""

from __future__ import annotations

import pytest

from core.config import EngineConfig
from gpu.launch import load
from tests.test_phi3 import assert_as_transformers, backend_config, prompt


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from gpu.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("ernie")
    return {
        "plain": build_tiny_model(root / "plain", "ernie4_5", num_layers=3),
        "biased": build_tiny_model(root / "biased", "ernie4_5", num_layers=2, attention_bias=True),
        "helium": build_tiny_model(root / "helium", "helium", num_layers=2),
    }


@pytest.mark.parametrize("backend", ["stack", "modules", "cuda-backend"])
def test_ernie_matches_transformers(models, backend, monkeypatch):
    """A 30-token prompt's logits and six greedy tokens."""
    config = backend_config(backend, monkeypatch)
    assert_as_transformers(models["plain"], models["plain"], prompt(30), **config)
    if backend == "stack":
        model = load(EngineConfig(model=str(models["plain"]), num_kv_blocks=16)).core.runner.model
        assert model.stack is not None and model.spec.rope_interleaved


@pytest.mark.parametrize("backend", ["stack", "modules"])
def test_helium_matches_transformers(models, backend):
    """Helium: GLM's rotation of whole heads, Q/K/V biases (drawn) and none on O."""
    config = {"stack": {}, "modules": {"cpu_forward": "modules"}}[backend]
    assert_as_transformers(models["helium"], models["helium"], prompt(30), **config)
    model = load(EngineConfig(model=str(models["helium"]), num_kv_blocks=16)).core.runner.model
    assert model.spec.qkv_bias and not model.spec.o_bias and model.stack is not None


def test_biases_on_every_product(models):
    """use_bias: Q/K/V, O, gate, up and down biased (drawn), layer by layer (the one-call stack
    takes no MLP bias but gpt-oss's, and says so)."""
    model = load(EngineConfig(model=str(models["biased"]), num_kv_blocks=16)).core.runner.model
    spec = model.spec
    assert spec.qkv_bias and spec.o_bias and spec.mlp_bias and model.stack is None
    assert_as_transformers(models["biased"], models["biased"], prompt(30))


def test_a_gguf_file_serves_as_its_checkpoint(models, tmp_path):
    from gpu.gguf_file import GgufCheckpoint
    from gpu.quant.gguf_write import uniform, write_gguf

    path = write_gguf(models["plain"], tmp_path / "ernie.gguf", uniform("f32"))
    assert GgufCheckpoint(path).arch == "ernie4_5"
    assert_as_transformers(path, models["plain"], prompt(30))

