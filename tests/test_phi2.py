"""Phi-2 and Phi-1.5 (PhiForCausalLM): attention and an ungated gelu MLP side by side on one layer
norm with a bias, biases on every product and on the LM head, 0.4 of each head rotated, its
tensors by their own names (dense, fc1, fc2, final_layernorm). Against transformers on the same
random weights (biases and norm weights drawn): in the one-call CPU stack (bitwise the module
path's: tests/test_cpu_forward.py; the biased head after the call), layer by layer and on the
CUDA backend's kernels; from llama.cpp's "phi2" GGUF file too (checked against its converter
and llama-server). Q/K layer norms and tensor parallelism are refused by name."""

from __future__ import annotations

import pytest

from core.config import CheckpointError, EngineConfig
from gpu.models.spec import ModelSpec
from tests.test_phi3 import assert_as_transformers, backend_config, prompt


@pytest.fixture(scope="module")
def phi(tmp_path_factory):
    from gpu.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("phi2")  # (llama.cpp's files say an MLP of 4 x hidden)
    return build_tiny_model(root / "phi", "phi", num_layers=2, intermediate_size=256)


@pytest.mark.parametrize("backend", ["stack", "modules", "cuda-backend"])
def test_phi2_matches_transformers(phi, backend, monkeypatch):
    config = backend_config(backend, monkeypatch)
    assert_as_transformers(phi, phi, prompt(30), **config)


def test_the_spec_the_stack_and_what_is_refused(phi):
    from transformers import AutoConfig

    from gpu.launch import load

    config = AutoConfig.from_pretrained(phi)
    spec = ModelSpec.from_hf_config(config)
    assert spec.parallel_block and spec.layer_norm and spec.norm_bias and spec.head_bias
    assert spec.hidden_act == "gelu_pytorch_tanh" and spec.rotary_dim == 6  # 0.4 of 16
    model = load(EngineConfig(model=str(phi), num_kv_blocks=16)).core.runner.model
    assert model.stack is not None and model.stack.lm_head is None  # (the biased head: torch)
    with pytest.raises(CheckpointError, match="bias"):
        load(EngineConfig(model=str(phi), tensor_parallel_size=2, num_kv_blocks=16))
    config.qk_layernorm = True
    with pytest.raises(CheckpointError, match="qk_layernorm"):
        ModelSpec.from_hf_config(config)


@pytest.mark.parametrize("fmt", ["f32", "q8_0"])
def test_a_gguf_file_serves_as_its_checkpoint(phi, fmt, tmp_path):
    from gpu.gguf_file import GgufCheckpoint
    from gpu.quant.gguf_write import uniform, write_gguf

    path = write_gguf(phi, tmp_path / "phi2.gguf", uniform(fmt))
    ckpt = GgufCheckpoint(path)
    assert ckpt.arch == "phi2" and "output.bias" in ckpt.tensors
    if fmt == "f32":
        assert_as_transformers(path, phi, prompt(30))
    else:  # against transformers on the `gguf` package's dequantization of the file
        from tests.gguf_reference import assert_near_dequantized

        assert_near_dequantized(path, phi, tmp_path / "ref", prompt(30))
