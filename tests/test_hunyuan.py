"""Hunyuan's dense models (HunYuanDenseV1ForCausalLM: Hunyuan-0.5B to -7B-Instruct): Llama's layer
with Q and K normalized per head after their rotation (gpu/models/hunyuan.py), the rotation's base
stretched by NTK's alpha, against transformers on the same random weights (norm weights drawn: a
norm taken before the rotation would differ), in the one-call CPU stack, layer by layer and on
the CUDA backend's kernels; from llama.cpp's "hunyuan-dense" GGUF files too (the stretched base
written as the file's own)."""

from __future__ import annotations

import pytest

from core.config import EngineConfig
from gpu.launch import load
from gpu.models.hunyuan import checkpoint_name, ntk_alpha_base
from gpu.models.spec import ModelSpec
from tests.test_phi3 import assert_as_transformers, backend_config, prompt


@pytest.fixture(scope="module")
def hunyuan(tmp_path_factory):
    from gpu.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("hunyuan") / "h", "hunyuan", num_layers=3)


@pytest.mark.parametrize("backend", ["stack", "modules", "cuda-backend"])
def test_hunyuan_matches_transformers(hunyuan, backend, monkeypatch):
    """A 30-token prompt's logits and six greedy tokens."""
    config = backend_config(backend, monkeypatch)
    assert_as_transformers(hunyuan, hunyuan, prompt(30), **config)
    if backend == "stack":
        model = load(EngineConfig(model=str(hunyuan), num_kv_blocks=16)).core.runner.model
        assert model.stack is not None and model.spec.qk_norm_after_rope


def test_the_names_and_the_base():
    assert checkpoint_name("model.layers.2.self_attn.query_layernorm.weight") == (
        "model.layers.2.self_attn.q_norm.weight"
    )
    assert checkpoint_name("model.layers.2.self_attn.key_layernorm.bias").endswith("k_norm.bias")
    params = {"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1000.0}
    assert ntk_alpha_base(params, 128) == pytest.approx(10000.0 * 1000.0 ** (128 / 126))
    assert ntk_alpha_base({"rope_type": "dynamic", "rope_theta": 1.0, "factor": 2.0}, 64) is None


def test_a_gguf_file_serves_as_its_checkpoint(hunyuan, tmp_path):
    """As llama.cpp's converter writes Hunyuan (checked against its files): "hunyuan-dense", Q/K
    rows as the checkpoint's, its norms as attn_q_norm and attn_k_norm, the base stretched by
    alpha written as rope.freq_base. In float32, transformers' logits and greedy tokens."""
    from gpu.gguf_file import GgufCheckpoint
    from gpu.quant.gguf_write import uniform, write_gguf

    path = write_gguf(hunyuan, tmp_path / "hunyuan.gguf", uniform("f32"))
    ckpt = GgufCheckpoint(path)
    assert ckpt.arch == "hunyuan-dense" and "blk.0.attn_q_norm.weight" in ckpt.tensors
    assert ModelSpec.from_hf_config(ckpt.config()).qk_norm_after_rope
    assert_as_transformers(path, hunyuan, prompt(30))
