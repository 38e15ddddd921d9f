"""Ministral 3 (Ministral3ForCausalLM; the text model of Mistral 3's multimodal checkpoints,
Mistral3ForConditionalGeneration, as Ministral-3-3B/8B/14B and Mistral Small 3.1/3.2):
Mistral's layer with YaRN and Llama 4's attention temperature past the pretrained context
(gpu/models/query_scale.py: each rotated query times 1 + beta * log(1 + floor(position /
length))), against transformers on the same random weights, in the one-call CPU stack, layer by
layer and on the CUDA backend's kernels, the tiny model's pretrained context 8 so that a 30-token
prompt reaches three factors."""

from __future__ import annotations

import pytest
import torch

from core.config import CheckpointError, EngineConfig
from gpu.launch import load
from gpu.models.query_scale import QueryScale
from gpu.models.spec import ModelSpec
from tests.test_phi3 import assert_as_transformers, backend_config, prompt


@pytest.fixture(scope="module")
def ministral3(tmp_path_factory):
    from gpu.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("ministral3")
    return build_tiny_model(root / "ministral3", "ministral3", num_layers=2)


@pytest.mark.parametrize("backend", ["stack", "modules", "cuda-backend"])
def test_ministral3_matches_transformers(ministral3, backend, monkeypatch):
    """A 30-token prompt's logits and six greedy tokens (positions 0..35: factors 1, then
    1 + 0.1 log 2 from 8, 1 + 0.1 log 3 from 16, ...)."""
    config = backend_config(backend, monkeypatch)
    assert_as_transformers(ministral3, ministral3, prompt(30), **config)
    if backend == "stack":
        model = load(EngineConfig(model=str(ministral3), num_kv_blocks=16)).core.runner.model
        assert model.stack is not None


def test_the_factors_and_the_spec(ministral3):
    from transformers import AutoConfig

    scale = QueryScale(0.1, 8)
    scale.set(torch.tensor([0, 7, 8, 15, 16, 40]))
    want = [1.0, 1.0, 1 + 0.1 * 2.0**0 * torch.log(torch.tensor(2.0)).item()]
    assert scale.value[:3].tolist() == pytest.approx(want)
    assert scale.value[4].item() == pytest.approx(1 + 0.1 * torch.log(torch.tensor(3.0)).item())
    config = AutoConfig.from_pretrained(ministral3)
    spec = ModelSpec.from_hf_config(config)
    assert (spec.query_scale_beta, spec.query_scale_length) == (0.1, 8)
    config.rope_parameters.pop("original_max_position_embeddings")
    config.rope_parameters["rope_type"] = "default"
    with pytest.raises(CheckpointError, match="original_max_position_embeddings"):
        ModelSpec.from_hf_config(config)


def test_the_text_model_of_a_mistral3_checkpoint(ministral3, tmp_path):
    """Mistral3ForConditionalGeneration (its Pixtral vision tower and projector not loaded):
    its language model served alone under its checkpoint names, the logits of the same weights
    as the text-only model; a text model of another kind refused by name."""
    import json
    import shutil

    from transformers import (
        AutoModelForCausalLM,
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        PixtralVisionConfig,
    )

    lm = AutoModelForCausalLM.from_pretrained(ministral3, dtype=torch.float32)
    vision = PixtralVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=28, patch_size=14, head_dim=16,
    )  # fmt: skip
    config = Mistral3Config(
        text_config=lm.config,
        vision_config=vision,
        image_token_index=lm.config.vocab_size - 1,
        tie_word_embeddings=False,  # (its class's default ties; a released file has its head)
    )
    both = Mistral3ForConditionalGeneration(config)
    both.model.language_model.load_state_dict(lm.model.state_dict())
    both.lm_head.load_state_dict(lm.lm_head.state_dict())
    mm = tmp_path / "mm"
    both.save_pretrained(mm)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(ministral3 / f, mm / f)
    assert_as_transformers(mm, ministral3, prompt(30))
    saved = json.loads((mm / "config.json").read_text())
    saved["text_config"]["model_type"] = "qwen3"
    (mm / "config.json").write_text(json.dumps(saved))
    with pytest.raises(CheckpointError, match="'qwen3' text model"):
        load(EngineConfig(model=str(mm), num_kv_blocks=16))


def test_a_gguf_file_serves_as_its_checkpoint(ministral3, tmp_path):
    """As llama.cpp's converter writes Ministral 3 (checked against its files): "mistral3",
    Llama's Q/K row order, YaRN's betas and log multiplier, the temperature's beta as
    attention.temperature_scale over YaRN's original context. In float32, transformers' logits
    and greedy tokens."""
    from gpu.gguf_file import GgufCheckpoint
    from gpu.quant.gguf_write import uniform, write_gguf

    path = write_gguf(ministral3, tmp_path / "ministral3.gguf", uniform("f32"))
    ckpt = GgufCheckpoint(path)
    assert ckpt.arch == "mistral3"
    assert ckpt.get("mistral3.attention.temperature_scale") == pytest.approx(0.1)
    assert ckpt.config().architectures == ["Ministral3ForCausalLM"]
    assert_as_transformers(path, ministral3, prompt(30))
