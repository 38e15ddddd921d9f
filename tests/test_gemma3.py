"""Gemma 3 (Gemma3ForCausalLM, text): norms before and after each block with weights 1 + w,
scaled embeddings, query_pre_attn_scalar, sliding layers with their own rotation beside global
ones (gpu/models/gemma.py, spec.py), against transformers on the same random weights."""

from __future__ import annotations

import pytest
import torch

from core.config import CheckpointError
from gpu.models.spec import ModelSpec
from gpu.tiny_model import build_tiny_model
from tests.test_phi3 import assert_as_transformers, prompt, use_cuda_backend


def gemma(path, arch="gemma3", **shape):
    """A tiny Gemma 3 of three layers (sliding, sliding, global; a window of 8; Gemma 2's:
    sliding, global, sliding) whose norm weights are random: transformers initializes them to
    0, where 1 + w and w could not be told apart."""
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(path, arch, num_layers=3, **shape)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_gemma3_matches_transformers(tmp_path, monkeypatch, backend):
    """A 30-token prompt (past the window of the sliding layers): the prompt's logits and six
    greedy tokens, on weir's CPU kernels and on the CUDA backend's (Triton's interpreter)."""
    path = gemma(tmp_path / "gemma")
    config = use_cuda_backend(monkeypatch) if backend == "cuda" else {}
    assert_as_transformers(path, path, prompt(30), **config)


def test_gemma3_spec_and_what_is_refused():
    from transformers import Gemma3TextConfig

    common = dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        num_hidden_layers=7,
        intermediate_size=128,
        vocab_size=100,
        sliding_window=16,
        query_pre_attn_scalar=16,
    )
    config = Gemma3TextConfig(**common)
    config.architectures = ["Gemma3ForCausalLM"]
    spec = ModelSpec.from_hf_config(config)
    assert spec.layer_windows == (16, 16, 16, 16, 16, 0, 16)  # every sixth layer global
    assert spec.embed_scale == 8.0 and spec.attn_scale == 0.25
    assert spec.hidden_act == "gelu_pytorch_tanh" and spec.sandwich_norms and spec.qk_norm
    # soft caps (Gemma 2's) are computed where a config gives them (tests/test_gemma2.py)
    capped = Gemma3TextConfig(**common, final_logit_softcapping=30.0)
    capped.architectures = ["Gemma3ForCausalLM"]
    assert ModelSpec.from_hf_config(capped).final_softcap == 30.0
    windowless = Gemma3TextConfig(**{**common, "sliding_window": None})
    windowless.architectures = ["Gemma3ForCausalLM"]
    with pytest.raises(CheckpointError, match="sliding layers but no sliding_window"):
        ModelSpec.from_hf_config(windowless)


def test_a_gemma3_gguf_file_serves_as_its_checkpoint(tmp_path):
    """Gemma 3 as llama.cpp's converter writes it (norms stored as 1 + w, post_attention_norm,
    ffn_norm before the MLP and post_ffw_norm after it, the window, the sliding layers' flags and
    rotation base; written here by weir's writer, whose names and keys were checked against
    that converter's file of a six-layer model, served by weir within 3e-6 of transformers),
    with the file's own tokenizer. Its attention scale is llama.cpp's derivation (the file has
    no key for it), so the model's query_pre_attn_scalar is its head size."""
    from gpu.quant.gguf_write import uniform, write_gguf

    hf = gemma(tmp_path / "hf", query_pre_attn_scalar=16)
    assert_as_transformers(write_gguf(hf, tmp_path / "gemma.gguf", uniform("f32")), hf, prompt(30))
    with pytest.raises(ValueError, match="query_pre_attn_scalar must be 16"):
        write_gguf(gemma(tmp_path / "other"), tmp_path / "x.gguf", uniform("f32"))


def test_the_text_model_of_a_multimodal_gemma3_checkpoint(tmp_path):
    """Gemma 3's 4B-27B checkpoints (Gemma3ForConditionalGeneration): the language model served
    alone under its checkpoint names (language_model.model.*), the vision tower and projector
    not loaded: the logits of the same weights as a text-only model."""
    import shutil

    from transformers import (
        AutoModelForCausalLM,
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        SiglipVisionConfig,
    )

    text = gemma(tmp_path / "text", query_pre_attn_scalar=16)
    lm = AutoModelForCausalLM.from_pretrained(text, dtype=torch.float32)
    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    vocab = lm.config.vocab_size
    config = Gemma3Config(
        text_config=lm.config,
        vision_config=vision,
        mm_tokens_per_image=4,
        boi_token_index=vocab - 3,
        eoi_token_index=vocab - 2,
        image_token_index=vocab - 1,
    )
    both = Gemma3ForConditionalGeneration(config)
    both.model.language_model.load_state_dict(lm.model.state_dict())
    both.lm_head.weight = both.model.language_model.embed_tokens.weight
    mm = tmp_path / "mm"
    both.save_pretrained(mm)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(text / f, mm / f)
    assert_as_transformers(mm, text, prompt(30))


def test_a_gguf_files_sliding_pattern_reads_as_llama_cpps():
    from gpu.gguf_families import sliding_layers

    assert sliding_layers(6, 7) == [True] * 5 + [False, True]  # every sixth layer global
    assert sliding_layers(0, 3) == [True] * 3 and sliding_layers(1, 3) == [False] * 3
    assert sliding_layers([1, 0, 1], 3) == [True, False, True]
