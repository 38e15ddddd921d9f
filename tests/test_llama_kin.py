"""Llama's layer under other names: InternLM3 (InternLM3ForCausalLM, as internlm3-8b-instruct: its
own config keys, read by transformers as Llama's) and Seed-OSS (SeedOssForCausalLM: Q/K/V
biases, O's apart), against transformers."""

from __future__ import annotations

import pytest

from tests.test_phi3 import assert_as_transformers, prompt


def test_internlm3_is_served_as_llama(tmp_path):
    """InternLM3ForCausalLM (internlm3-8b-instruct's config, model_type internlm3, read by
    transformers as Llama's): transformers' logits and greedy tokens, its biases drawn."""
    import json

    from gpu.tiny_model import build_tiny_model

    path = build_tiny_model(
        tmp_path / "internlm3", "llama", num_layers=2, attention_bias=True, mlp_bias=True
    )
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=["InternLM3ForCausalLM"], model_type="internlm3")
    config["qkv_bias"] = config.pop("attention_bias")
    config["bias"] = config.pop("mlp_bias")
    (path / "config.json").write_text(json.dumps(config))
    assert_as_transformers(path, path, prompt(30), cpu_forward="modules")


@pytest.mark.parametrize("out_bias", [False, True])
def test_seed_oss_matches_transformers(tmp_path, out_bias):
    """Seed-OSS (SeedOssForCausalLM): Llama's layer with Q/K/V biases and, apart, O's
    (attention_out_bias), drawn: in the one-call CPU stack and layer by layer; from a GGUF file
    as llama.cpp's converter writes it (checked against its files; its MLP's input norm named
    post_attention_norm)."""
    from gpu.gguf_file import GgufCheckpoint
    from gpu.quant.gguf_write import uniform, write_gguf
    from gpu.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path / "seed", "seed_oss", num_layers=2, attention_bias=out_bias)
    for config in ({}, {"cpu_forward": "modules"}):
        assert_as_transformers(path, path, prompt(30), **config)
    gguf = write_gguf(path, tmp_path / "seed.gguf", uniform("f32"))
    assert "blk.0.post_attention_norm.weight" in GgufCheckpoint(gguf).tensors
    assert_as_transformers(gguf, path, prompt(30))
