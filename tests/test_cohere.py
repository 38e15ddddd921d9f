"""Cohere (CohereForCausalLM: aya-expanse-8b, command-r) and Cohere 2 (Cohere2ForCausalLM:
command-r7b): attention and MLP side by side on one mean-centred layer norm (weight, no bias),
GLM's rotation of adjacent pairs, the logits times logit_scale; Cohere 2's sliding layers rotated
beside global layers that are not. Against transformers on the same random weights (norm weights
drawn): in the one-call CPU stack, layer by layer and on the CUDA backend's kernels; from
llama.cpp's "command-r" and "cohere2" GGUF files too (the stack's bits equal the modules':
tests/test_cpu_forward.py; tensor parallelism: tests/test_tensor_parallel.py). Per-head Q/K
norms are refused by name."""

from __future__ import annotations

import pytest

from core.config import CheckpointError, EngineConfig
from gpu.launch import load
from gpu.models.spec import ModelSpec
from tests.test_phi3 import assert_as_transformers, backend_config, prompt


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Cohere 2 with llama.cpp's pattern (every fourth layer global) and a window of 8."""
    from gpu.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("cohere")
    return {
        "cohere": build_tiny_model(root / "cohere", "cohere", num_layers=2),
        "cohere2": build_tiny_model(root / "cohere2", "cohere2", num_layers=4, global_every=4),
    }


@pytest.mark.parametrize("arch", ["cohere", "cohere2"])
@pytest.mark.parametrize("backend", ["stack", "modules", "cuda-backend"])
def test_cohere_matches_transformers(models, arch, backend, monkeypatch):
    """A 30-token prompt's logits (times 0.25) and six greedy tokens (Cohere 2 past its
    window)."""
    config = backend_config(backend, monkeypatch)
    assert_as_transformers(models[arch], models[arch], prompt(30), **config)


def test_the_spec_and_what_runs_it(models):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(models["cohere2"])
    spec = ModelSpec.from_hf_config(config)
    assert spec.layer_norm and spec.parallel_block and spec.rope_interleaved
    assert spec.layer_windows == (8, 8, 8, 0) and spec.nope_layers == (3,)
    assert spec.logits_scaling == 4.0
    model = load(EngineConfig(model=str(models["cohere"]), num_kv_blocks=16)).core.runner.model
    assert model.stack is not None  # the one-call stack: its layer norm, its blocks side by side
    config.use_qk_norm = True
    with pytest.raises(CheckpointError, match="use_qk_norm"):
        ModelSpec.from_hf_config(config)


@pytest.mark.parametrize("arch,gguf_arch", [("cohere", "command-r"), ("cohere2", "cohere2")])
def test_a_gguf_file_serves_as_its_checkpoint(models, arch, gguf_arch, tmp_path):
    """As llama.cpp's converter writes them (checked against its files): Q/K rows as the
    checkpoint's, one norm a layer (attn_norm), the layer norm's epsilon and logit_scale, Cohere
    2's window with llama.cpp's default pattern (three of every four layers sliding)."""
    from gpu.gguf_file import GgufCheckpoint
    from gpu.quant.gguf_write import uniform, write_gguf

    path = write_gguf(models[arch], tmp_path / f"{arch}.gguf", uniform("f32"))
    ckpt = GgufCheckpoint(path)
    assert ckpt.arch == gguf_arch and ckpt.get(f"{gguf_arch}.logit_scale") == 0.25
    assert_as_transformers(path, models[arch], prompt(30))
