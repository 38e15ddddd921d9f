"""GLM (GlmForCausalLM: glm-4-9b-chat-hf, GLM-Edge) and GLM-4 (Glm4ForCausalLM: GLM-4-9B-0414):
Llama's layer with Q/K/V biases, gate and up one tensor, half of each head turned by adjacent
pairs (reordered at load for the kernels' rotation by halves), and GLM-4's norms after both
blocks under its own names (Gemma's sandwich: gpu/models/glm.py), against transformers on the
same random weights (biases and norm weights drawn), in the one-call CPU stack, layer by layer
and on the CUDA backend's kernels; GLM-4 from llama.cpp's "glm4" GGUF files too."""

from __future__ import annotations

import pytest

from core.config import EngineConfig
from gpu.launch import load
from gpu.models.partial_rope import head_order
from gpu.models.spec import ModelSpec
from tests.test_phi3 import assert_as_transformers, backend_config, prompt


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from gpu.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("glm")
    return {arch: build_tiny_model(root / arch, arch, num_layers=3) for arch in ("glm", "glm4")}


@pytest.mark.parametrize("arch", ["glm", "glm4"])
@pytest.mark.parametrize("backend", ["stack", "modules", "cuda-backend"])
def test_glm_matches_transformers(models, arch, backend, monkeypatch):
    """A 30-token prompt's logits and six greedy tokens."""
    config = backend_config(backend, monkeypatch)
    assert_as_transformers(models[arch], models[arch], prompt(30), **config)


def test_the_heads_reordered_for_adjacent_pairs():
    """Rotated pairs (0, 1) and (2, 3) of a head of 8 turning its first 4: 0 and 2 first, 1 and
    3 half a head later, the passed elements 4..7 paired with each other."""
    assert head_order(8, 4, interleaved=True).tolist() == [0, 2, 4, 5, 1, 3, 6, 7]
    assert head_order(8, 8, interleaved=True).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]


def test_the_spec_and_what_runs_it(models):
    from transformers import AutoConfig

    glm4 = ModelSpec.from_hf_config(AutoConfig.from_pretrained(models["glm4"]))
    assert glm4.rope_interleaved and glm4.sandwich_norms and not glm4.norm_plus_one
    assert (glm4.rotary_dim, glm4.head_dim, glm4.qkv_bias, glm4.o_bias) == (8, 16, True, False)
    glm = ModelSpec.from_hf_config(AutoConfig.from_pretrained(models["glm"]))
    assert glm.rope_interleaved and not glm.sandwich_norms
    for arch in ("glm", "glm4"):
        model = load(EngineConfig(model=str(models[arch]), num_kv_blocks=16)).core.runner.model
        assert model.stack is not None  # the one-call CPU stack runs it


def test_a_glm4_gguf_file_serves_as_its_checkpoint(models, tmp_path):
    """As llama.cpp's converter writes GLM-4 (checked against its files): "glm4", Q/K rows as
    the checkpoint holds them (llama.cpp turns adjacent pairs), the rotated part as
    rope.dimension_count, the norms after attention and the MLP as post_attention_norm and
    post_ffw_norm, the MLP's input norm as ffn_norm, gate and up as one ffn_up. In float32,
    transformers' logits and greedy tokens."""
    from gpu.gguf_file import GgufCheckpoint
    from gpu.quant.gguf_write import uniform, write_gguf

    path = write_gguf(models["glm4"], tmp_path / "glm4.gguf", uniform("f32"))
    ckpt = GgufCheckpoint(path)
    assert ckpt.arch == "glm4" and ckpt.get("glm4.rope.dimension_count") == 8
    names = set(ckpt.tensors)
    assert {"blk.0.post_attention_norm.weight", "blk.0.post_ffw_norm.weight"} <= names
    assert ckpt.tensors["blk.0.ffn_up.weight"].shape[-1] == 2 * 128
    assert_as_transformers(path, models["glm4"], prompt(30))
