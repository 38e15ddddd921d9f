"""Arcee (ArceeForCausalLM: AFM-4.5B): Llama's layer with an ungated MLP, down(relu(up(x))^2).
Against transformers on the same random weights: in the one-call CPU stack (its product then the
activation in the call; bitwise the module path's: tests/test_cpu_forward.py), layer by layer and
on the CUDA backend's kernels; from llama.cpp's "arcee" GGUF file too (Q/K rows permuted as
Llama's). LoRA adapters on its attention serve as PEFT computes them; one on its MLP is refused
by name."""

from __future__ import annotations

import pytest

from core.lora import LoraError, read_adapter
from gpu.models.spec import ModelSpec
from tests.lora_adapters import LORA_PROMPTS, engine, make_adapter, peft_greedy, run
from tests.test_phi3 import assert_as_transformers, backend_config, prompt


@pytest.fixture(scope="module")
def arcee(tmp_path_factory):
    from gpu.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("arcee") / "arcee", "arcee", num_layers=2)


@pytest.mark.parametrize("backend", ["stack", "modules", "cuda-backend"])
def test_arcee_matches_transformers(arcee, backend, monkeypatch):
    config = backend_config(backend, monkeypatch)
    assert_as_transformers(arcee, arcee, prompt(30), **config)


def test_the_spec_and_the_stack(arcee):
    from transformers import AutoConfig

    from core.config import EngineConfig
    from gpu.launch import load

    spec = ModelSpec.from_hf_config(AutoConfig.from_pretrained(arcee))
    assert not spec.gated_mlp and spec.hidden_act == "relu2"
    model = load(EngineConfig(model=str(arcee), num_kv_blocks=16)).core.runner.model
    assert model.stack is not None
    mlp = model.model.layers[0].mlp
    assert not mlp.is_gated and mlp.gate_up is None and mlp.up is not None


@pytest.mark.parametrize("fmt", ["f32", "q8_0"])
def test_a_gguf_file_serves_as_its_checkpoint(arcee, fmt, tmp_path):
    """As llama.cpp's converter writes it (checked against its file and llama-server): Llama's
    keys and permuted Q/K rows, ffn_up and ffn_down alone; Q8_0 on weir's block kernels."""
    from gpu.gguf_file import GgufCheckpoint
    from gpu.quant.gguf_write import uniform, write_gguf

    path = write_gguf(arcee, tmp_path / "arcee.gguf", uniform(fmt))
    ckpt = GgufCheckpoint(path)
    assert ckpt.arch == "arcee" and "blk.0.ffn_gate.weight" not in ckpt.tensors
    if fmt == "f32":
        assert_as_transformers(path, arcee, prompt(30))
    else:  # against transformers on the `gguf` package's dequantization of the file
        from tests.gguf_reference import assert_near_dequantized

        assert_near_dequantized(path, arcee, tmp_path / "ref", prompt(30))


def test_lora_on_attention_serves_and_on_the_mlp_is_refused(arcee, tmp_path):
    """An adapter on Q and V: PEFT's greedy tokens, in the stack. One on up/down: a LoraError
    naming the adapter and the ungated MLP."""
    qv = make_adapter(arcee, tmp_path / "qv", "qv8")
    loaded = engine(arcee, num_kv_blocks=64)
    assert loaded.core.runner.model.stack is not None
    prompts = [loaded.tokenizer.encode(p) for p in LORA_PROMPTS[:2]]
    ref = read_adapter("qv", qv, loaded.lora_base, 16).ref
    got = run(loaded.core, [(str(i), ids, ref) for i, ids in enumerate(prompts)])
    want = peft_greedy(arcee, qv, prompts, len(got["0"]))
    assert [got[str(i)] for i in range(len(prompts))] == want
    mlp = make_adapter(arcee, tmp_path / "mlp", "mlp", spec=(4, 8, ["up_proj"], False))
    with pytest.raises(LoraError, match="'mlp'.*ungated MLP"):
        read_adapter("mlp", mlp, loaded.lora_base, 16)
