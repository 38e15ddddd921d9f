"""StableLM (StableLmForCausalLM: stablelm-2-1_6b, stablelm-zephyr-3b, stablelm-3b-4e1t): Llama's
layer under layer norms with a bias, a quarter of each head rotated, Q/K/V biases
(use_qkv_bias), and with use_parallel_residual both blocks on one norm. Against transformers on
the same random weights (biases and norm weights drawn), both forms: in the one-call CPU stack,
layer by layer and on the CUDA backend's kernels; from llama.cpp's "stablelm" GGUF files too
(checked against its converter and llama-server). Q/K layer norms are refused by name."""

from __future__ import annotations

import pytest

from core.config import CheckpointError
from gpu.models.spec import ModelSpec
from tests.test_phi3 import assert_as_transformers, backend_config, prompt


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from gpu.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("stablelm")
    return {  # (global_every 1: use_parallel_residual)
        "sequential": build_tiny_model(root / "s", "stablelm", num_layers=2, global_every=0),
        "parallel": build_tiny_model(root / "p", "stablelm", num_layers=2, global_every=1),
    }


@pytest.mark.parametrize("form", ["sequential", "parallel"])
@pytest.mark.parametrize("backend", ["stack", "modules", "cuda-backend"])
def test_stablelm_matches_transformers(models, form, backend, monkeypatch):
    config = backend_config(backend, monkeypatch)
    assert_as_transformers(models[form], models[form], prompt(30), **config)


def test_the_spec_and_what_is_refused(models):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(models["parallel"])
    spec = ModelSpec.from_hf_config(config)
    assert spec.layer_norm and spec.norm_bias and spec.parallel_block and spec.qkv_bias
    assert spec.rotary_dim == spec.head_dim // 4 and not spec.o_bias
    config.qk_layernorm = True
    with pytest.raises(CheckpointError, match="qk_layernorm"):
        ModelSpec.from_hf_config(config)


@pytest.mark.parametrize("form", ["sequential", "parallel"])
def test_a_gguf_file_serves_as_its_checkpoint(models, form, tmp_path):
    from gpu.gguf_file import GgufCheckpoint
    from gpu.quant.gguf_write import uniform, write_gguf

    path = write_gguf(models[form], tmp_path / "stablelm.gguf", uniform("f32"))
    ckpt = GgufCheckpoint(path)
    assert ckpt.arch == "stablelm"
    assert bool(ckpt.get("stablelm.use_parallel_residual")) == (form == "parallel")
    assert_as_transformers(path, models[form], prompt(30))
