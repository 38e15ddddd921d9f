"""Gemma 2 (Gemma2ForCausalLM): Gemma 3's layer without Q/K norms, every other layer sliding, and
its soft caps: each attention score becomes c * tanh(score / c) before the softmax, each logit
likewise with its own c (gpu/models/spec.py, the attention backends, decoder.soft_capped),
against transformers' eager attention (the one that caps) on the same random weights."""

from __future__ import annotations

import pytest
import torch

from gpu.models.spec import ModelSpec
from tests.test_gemma3 import gemma
from tests.test_phi3 import first_logits, prompt, transformers_run, use_cuda_backend

# Caps small enough that tanh bends the tiny model's scores and logits (Gemma 2's own are 50 and
# 30, which a random model's values would rarely reach)
CAPS = (0.8, 3.0)


def gemma2(path, caps=CAPS, **shape):
    """Three layers (sliding, global, sliding; a window of 8) with random norm weights."""
    return gemma(path, "gemma2", softcaps=caps, **shape)


def eager_run(path, ids) -> tuple[torch.Tensor, list[int]]:
    """transformers' logits after the prompt and six greedy tokens, its attention eager."""
    return transformers_run(path, ids, attn_implementation="eager")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = gemma2(tmp_path_factory.mktemp("gemma2"))
    return path, eager_run(path, prompt(30))


@pytest.mark.parametrize(
    "config",
    [{}, {"cpu_forward": "modules"}, {"attention_backend": "torch"}, "cuda"],
    ids=["stack", "modules", "torch-attention", "cuda-backend"],
)
def test_gemma2_matches_transformers(model, config, monkeypatch):
    """A 30-token prompt (past the sliding layers' window): the logits after it and six greedy
    tokens, in the one-call stack, on the module path, on the torch reference attention, and on
    the CUDA backend's kernels (Triton's interpreter)."""
    path, (want, want_tokens) = model
    if config == "cuda":
        config = use_cuda_backend(monkeypatch)
    got, tokens = first_logits(path, prompt(30), num_kv_blocks=64, **config)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert tokens == want_tokens
    assert got.abs().max() <= CAPS[1]  # the logits' cap holds


def test_the_caps_change_the_answer(model, tmp_path):
    """Without its caps the same model gives other logits: they are computed, not ignored."""
    path, (want, _) = model
    uncapped = gemma2(tmp_path / "uncapped", caps=(None, None))
    got, _ = first_logits(uncapped, prompt(30), num_kv_blocks=64)
    assert (got - want).abs().max() > 0.1


def test_a_gemma2_gguf_file_serves_as_its_checkpoint(tmp_path):
    """Gemma 2 as llama.cpp's converter writes it (norms as 1 + w, Gemma 3's norm names, the
    window and both caps as keys; the layer pattern and the attention scale derived as llama.cpp
    derives them, so the model's query_pre_attn_scalar is its head size). (The block formats'
    products are the other models' kernels: tests/test_gguf.py.)"""
    from gpu.quant.gguf_write import uniform, write_gguf

    hf = gemma2(tmp_path / "hf", query_pre_attn_scalar=16)
    want, want_tokens = eager_run(hf, prompt(30))
    got, tokens = first_logits(write_gguf(hf, tmp_path / "f32.gguf", uniform("f32")), prompt(30))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert tokens == want_tokens
    with pytest.raises(ValueError, match="query_pre_attn_scalar must be 16"):
        write_gguf(gemma2(tmp_path / "other"), tmp_path / "x.gguf", uniform("f32"))


def test_gemma2_spec():
    from transformers import Gemma2Config

    config = Gemma2Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=4,
        intermediate_size=128,
        vocab_size=100,
        sliding_window=16,
        query_pre_attn_scalar=16,
    )
    config.architectures = ["Gemma2ForCausalLM"]
    spec = ModelSpec.from_hf_config(config)
    assert (spec.attn_softcap, spec.final_softcap) == (50.0, 30.0)
    assert spec.layer_windows == (16, 0, 16, 0) and not spec.qk_norm
    assert spec.sandwich_norms and spec.attn_scale == 0.25 and spec.embed_scale == 8.0
