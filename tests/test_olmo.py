"""OLMo 2 (Olmo2ForCausalLM: norms after attention and after the MLP, none before them) and OLMoE
(OlmoeForCausalLM: Llama's layer over a mixture of experts), both with Q/K norms over all heads
at once (gpu/models/decoder.py, spec.qk_norm_whole), against transformers on the same random
weights (their norm weights drawn too), in the one-call CPU stack, layer by layer and on the
CUDA backend's kernels; tensor parallelism and clip_qkv are refused naming the reason."""

from __future__ import annotations

import pytest
import torch

from core.config import CheckpointError, EngineConfig
from gpu.launch import load
from gpu.models.spec import ModelSpec
from tests.test_moe import moe
from tests.test_phi3 import assert_as_transformers, prompt, use_cuda_backend


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from gpu.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("olmo")
    return {
        "olmo2": build_tiny_model(root / "olmo2", "olmo2", num_layers=3),
        "olmoe": moe(root / "olmoe", "olmoe", norm_topk_prob=False),
    }


@pytest.mark.parametrize("arch", ["olmo2", "olmoe"])
@pytest.mark.parametrize("backend", ["stack", "modules", "cuda-backend"])
def test_olmo_matches_transformers(models, arch, backend, monkeypatch):
    """A 30-token prompt's logits and six greedy tokens (OLMoE: every expert used by some
    token, its top 2 of 8 not renormalized), in the one-call CPU stack, layer by layer, and on
    the CUDA backend's kernels (Triton's interpreter)."""
    config = {"stack": {}, "modules": {"cpu_forward": "modules"}}.get(backend)
    if config is None:
        config = use_cuda_backend(monkeypatch)
    assert_as_transformers(models[arch], models[arch], prompt(30), **config)


def test_the_spec_and_what_runs_it(models):
    olmo2 = ModelSpec.from_hf_config(_config(models["olmo2"]))
    assert olmo2.qk_norm_whole and olmo2.post_norms_only and olmo2.sandwich_norms
    olmoe = ModelSpec.from_hf_config(_config(models["olmoe"]))
    assert olmoe.qk_norm_whole and not olmoe.post_norms_only and not olmoe.sandwich_norms
    assert (olmoe.num_experts, olmoe.experts_per_token, olmoe.norm_topk_prob) == (8, 2, False)
    core = load(EngineConfig(model=str(models["olmo2"]), num_kv_blocks=16)).core
    model = core.runner.model
    assert model.stack is not None  # the one-call CPU stack runs it
    attn = model.model.layers[0].self_attn
    assert attn.q_norm.weight.shape == (olmo2.num_heads * olmo2.head_dim,)
    assert isinstance(model.model.layers[0].input_layernorm, torch.nn.Identity)
    config = _config(models["olmoe"])
    config.clip_qkv = 8.0
    with pytest.raises(CheckpointError, match="clip_qkv"):
        ModelSpec.from_hf_config(config)


def test_tensor_parallelism_is_refused_by_name(models):
    with pytest.raises(CheckpointError, match="span every head"):
        load(EngineConfig(model=str(models["olmo2"]), tensor_parallel_size=2, num_kv_blocks=16))


def _config(path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)
