"""EXAONE 4.0 (Exaone4ForCausalLM: EXAONE-4.0-1.2B and -32B): OLMo 2's layer (norms after the
blocks only) with Q/K norms per head; with a sliding window, sliding layers that turn beside
global layers that attend without rotation (NoPE: the second rotation's path at angle 0), against
transformers on the same random weights (norm weights drawn), in the one-call CPU stack, layer by
layer and on the CUDA backend's kernels; from llama.cpp's "exaone4" GGUF files too."""

from __future__ import annotations

import json
import shutil

import pytest

from core.config import EngineConfig
from gpu.launch import load
from gpu.models.spec import ModelSpec
from tests.test_phi3 import assert_as_transformers, backend_config, prompt


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The hybrid model (every third layer global, a window of 8), and the same weights without a
    window (every layer global and rotated, as EXAONE-4.0-1.2B)."""
    from gpu.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("exaone4")
    hybrid = build_tiny_model(root / "hybrid", "exaone4", num_layers=3)
    dense = root / "dense"
    shutil.copytree(hybrid, dense)
    config = json.loads((dense / "config.json").read_text())
    config.update(sliding_window=None, sliding_window_pattern=0, layer_types=["full_attention"] * 3)
    (dense / "config.json").write_text(json.dumps(config))
    return {"hybrid": hybrid, "dense": dense}


@pytest.mark.parametrize("kind", ["hybrid", "dense"])
@pytest.mark.parametrize("backend", ["stack", "modules", "cuda-backend"])
def test_exaone4_matches_transformers(models, kind, backend, monkeypatch):
    """A 30-token prompt's logits and six greedy tokens (the hybrid past its window of 8)."""
    config = backend_config(backend, monkeypatch)
    assert_as_transformers(models[kind], models[kind], prompt(30), **config)


def test_the_spec_and_what_runs_it(models):
    from transformers import AutoConfig

    spec = ModelSpec.from_hf_config(AutoConfig.from_pretrained(models["hybrid"]))
    assert spec.layer_windows == (8, 8, 0) and spec.nope_layers == (2,)
    assert spec.post_norms_only and spec.qk_norm and not spec.qk_norm_whole
    dense = ModelSpec.from_hf_config(AutoConfig.from_pretrained(models["dense"]))
    assert dense.layer_windows == () and dense.nope_layers == ()
    model = load(EngineConfig(model=str(models["hybrid"]), num_kv_blocks=16)).core.runner.model
    assert model.stack is not None  # the one-call CPU stack runs it
    assert [layer.local_rope for layer in model.model.layers] == [False, False, True]


@pytest.mark.parametrize("kind", ["hybrid", "dense"])
def test_a_gguf_file_serves_as_its_checkpoint(models, kind, tmp_path):
    """As llama.cpp's converter writes EXAONE 4 (checked against its files): "exaone4", Q/K rows
    as the checkpoint's, OLMo 2's norm names, the window and a flag a layer for the sliding
    ones. In float32, transformers' logits and greedy tokens."""
    from gpu.gguf_file import GgufCheckpoint
    from gpu.quant.gguf_write import uniform, write_gguf

    path = write_gguf(models[kind], tmp_path / "exaone4.gguf", uniform("f32"))
    config = GgufCheckpoint(path).config()
    assert config.architectures == ["Exaone4ForCausalLM"]
    assert_as_transformers(path, models[kind], prompt(30))
