"""Nemotron (NemotronForCausalLM: Nemotron-Mini-4B-Instruct, Minitron-4B/8B): Arcee's ungated MLP
(relu squared) under layer norms with a bias whose weights are stored as w where 1 + w
multiplies (LayerNorm1P), half of each head rotated. Against transformers on the same random
weights (norm weights and biases drawn): in the one-call CPU stack (bitwise the module path's:
tests/test_cpu_forward.py), layer by layer and on the CUDA backend's kernels; from a "nemotron"
GGUF file as llama.cpp reads one (its norms' 1 + w stored, Q/K rows as the checkpoint's: checked
against llama-server), F32 and Q8_0 on weir's block kernels."""

from __future__ import annotations

import pytest

from gpu.models.spec import ModelSpec
from tests.test_phi3 import assert_as_transformers, backend_config, prompt


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory):
    from gpu.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("nemotron")
    return build_tiny_model(root / "nemotron", "nemotron", num_layers=2)


@pytest.mark.parametrize("backend", ["stack", "modules", "cuda-backend"])
def test_nemotron_matches_transformers(nemotron, backend, monkeypatch):
    config = backend_config(backend, monkeypatch)
    assert_as_transformers(nemotron, nemotron, prompt(30), **config)


def test_the_spec_and_the_stack(nemotron):
    from transformers import AutoConfig

    from core.config import EngineConfig
    from gpu.launch import load

    spec = ModelSpec.from_hf_config(AutoConfig.from_pretrained(nemotron))
    assert spec.layer_norm and spec.norm_bias and spec.norm_plus_one and not spec.gated_mlp
    assert spec.rotary_dim == spec.head_dim // 2 and spec.rms_norm_eps == 1e-5
    model = load(EngineConfig(model=str(nemotron), num_kv_blocks=16)).core.runner.model
    assert model.stack is not None


@pytest.mark.parametrize("fmt", ["f32", "q8_0"])
def test_a_gguf_file_serves_as_its_checkpoint(nemotron, fmt, tmp_path):
    from gpu.gguf_file import GgufCheckpoint
    from gpu.quant.gguf_write import uniform, write_gguf

    path = write_gguf(nemotron, tmp_path / "nemotron.gguf", uniform(fmt))
    ckpt = GgufCheckpoint(path)
    assert ckpt.arch == "nemotron" and "blk.0.attn_norm.bias" in ckpt.tensors
    assert int(ckpt.get("nemotron.rope.dimension_count")) == 8  # half of a head of 16
    if fmt == "f32":
        assert_as_transformers(path, nemotron, prompt(30))
    else:  # against transformers on the `gguf` package's dequantization of the file
        from tests.gguf_reference import assert_near_dequantized

        assert_near_dequantized(path, nemotron, tmp_path / "ref", prompt(30))
