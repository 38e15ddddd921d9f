"""SmolLM3 (SmolLM3ForCausalLM): Llama's layer, every fourth layer attending without rotating Q
and K (its config's no_rope_layers), against transformers on the same random weights, in the
one-call CPU stack, layer by layer and on the CUDA backend's kernels; from llama.cpp's
"smollm3" GGUF files too (whose reader fixes the NoPE layers at every fourth)."""

from __future__ import annotations

import json

import pytest

from core.config import CheckpointError, EngineConfig
from gpu.launch import load
from gpu.models.spec import ModelSpec
from tests.test_phi3 import assert_as_transformers, backend_config, prompt


@pytest.fixture(scope="module")
def smollm3(tmp_path_factory):
    from gpu.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("smollm3") / "smollm3", "smollm3", num_layers=4)


@pytest.mark.parametrize("backend", ["stack", "modules", "cuda-backend"])
def test_smollm3_matches_transformers(smollm3, backend, monkeypatch):
    """A 30-token prompt's logits and six greedy tokens, its fourth layer unrotated."""
    config = backend_config(backend, monkeypatch)
    assert_as_transformers(smollm3, smollm3, prompt(30), **config)


def test_the_nope_layers_as_the_config_lists_them(smollm3, tmp_path):
    """Any layers the config lists, not only every fourth: here the first and the third."""
    import shutil

    path = tmp_path / "listed"
    shutil.copytree(smollm3, path)
    config = json.loads((path / "config.json").read_text())
    config["no_rope_layers"] = [0, 1, 0, 1]
    (path / "config.json").write_text(json.dumps(config))
    assert ModelSpec.from_hf_config(_config(path)).nope_layers == (0, 2)
    assert_as_transformers(path, path, prompt(30))


def test_the_spec_and_what_runs_it(smollm3):
    config = _config(smollm3)
    assert ModelSpec.from_hf_config(config).nope_layers == (3,)
    model = load(EngineConfig(model=str(smollm3), num_kv_blocks=16)).core.runner.model
    assert model.stack is not None  # the one-call CPU stack runs it
    assert [layer.local_rope for layer in model.model.layers] == [False, False, False, True]
    config.use_sliding_window, config.sliding_window = True, 8
    with pytest.raises(CheckpointError, match="use_sliding_window"):
        ModelSpec.from_hf_config(config)


def test_a_gguf_file_serves_as_its_checkpoint(smollm3, tmp_path):
    """As llama.cpp's converter writes SmolLM3: "smollm3", Llama's Q/K row order, no key for
    the NoPE layers (llama.cpp's reader: every fourth). In float32, transformers' logits and
    greedy tokens."""
    from gpu.gguf_file import GgufCheckpoint
    from gpu.quant.gguf_write import uniform, write_gguf

    path = write_gguf(smollm3, tmp_path / "smollm3.gguf", uniform("f32"))
    ckpt = GgufCheckpoint(path)
    assert ckpt.arch == "smollm3"
    assert ckpt.config().no_rope_layers == [1, 1, 1, 0]
    assert_as_transformers(path, smollm3, prompt(30))


def _config(path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)
