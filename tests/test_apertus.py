"""Apertus (ApertusForCausalLM: Apertus-8B, -70B): Llama's layer with Q/K norms, its norms under
their own names (attention_layernorm, feedforward_layernorm) and an ungated MLP of xIELU whose
four parameters are each layer's own (drawn here). Against transformers on the same random
weights: in the one-call CPU stack (xIELU's constants in the call, bitwise the module path's:
tests/test_cpu_forward.py), layer by layer, on the CUDA backend's kernels and over
tensor-parallel ranks; from an "apertus" GGUF file too, its xIELU parameters as
metadata (`xielu.*`, a value a layer) as llama.cpp's converter writes them (checked against its
converter and llama-server)."""

from __future__ import annotations

import pytest

from tests.test_phi3 import assert_as_transformers, backend_config, prompt


@pytest.fixture(scope="module")
def apertus(tmp_path_factory):
    from gpu.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("apertus") / "ap", "apertus", num_layers=2)


@pytest.mark.parametrize("backend", ["stack", "modules", "cuda-backend"])
def test_apertus_matches_transformers(apertus, backend, monkeypatch):
    config = backend_config(backend, monkeypatch)
    assert_as_transformers(apertus, apertus, prompt(30), **config)


def test_each_layer_keeps_its_own_parameters_in_the_stack(apertus):
    from core.config import EngineConfig
    from gpu.launch import load

    model = load(EngineConfig(model=str(apertus), num_kv_blocks=16)).core.runner.model
    assert model.stack is not None
    first, second = (layer.mlp.act_fn.constants() for layer in model.model.layers)
    assert first != second and len(first) == 4


@pytest.mark.parametrize("fmt", ["f32", "q8_0"])
def test_a_gguf_file_serves_as_its_checkpoint(apertus, fmt, tmp_path):
    import gguf

    from gpu.quant.gguf_write import uniform, write_gguf

    path = write_gguf(apertus, tmp_path / "apertus.gguf", uniform(fmt))
    fields = gguf.GGUFReader(path).fields
    assert len(fields["xielu.alpha_p"].contents()) == 2  # a value a layer
    if fmt == "f32":
        assert_as_transformers(path, apertus, prompt(30))
    else:  # against transformers on the `gguf` package's dequantization of the file
        from tests.gguf_reference import assert_near_dequantized

        assert_near_dequantized(path, apertus, tmp_path / "ref", prompt(30))
