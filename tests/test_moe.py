"""Mixtures of experts (Mixtral, Qwen3-MoE; gpu/models/moe.py): the router's top k experts per
token, their gated MLPs weighted and summed, against transformers on the same random weights."""

from __future__ import annotations

import pytest
import torch

from core.config import CheckpointError, EngineConfig
from core.request import EngineRequest
from core.sampling import SamplingParams
from gpu.launch import load
from gpu.models.moe import checkpoint_name
from gpu.models.spec import ModelSpec
from gpu.tiny_model import build_tiny_model
from tests.test_phi3 import assert_as_transformers, prompt, transformers_run, use_cuda_backend


def moe(path, arch="qwen3_moe", **shape):
    """A tiny mixture of 8 experts, 2 per token. Its router's weights are scaled up so that the
    tokens of a prompt spread over the experts with clear margins (transformers' initialization
    leaves the router's logits near zero, where a rounding could swap two choices)."""
    from transformers import AutoModelForCausalLM

    shape = {"num_experts": 8, "experts_per_token": 2, **shape}
    path = build_tiny_model(path, arch, **shape)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight") and p.shape[0] == shape["num_experts"]:
                p.mul_(8.0)
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize(
    "arch,shape",
    [
        ("qwen3_moe", {}),
        ("qwen3_moe", {"norm_topk_prob": False, "experts_per_token": 3}),
        ("mixtral", {}),
    ],
    ids=["qwen3-moe", "qwen3-moe-unnormalized", "mixtral"],
)
def test_moe_matches_transformers(tmp_path, arch, shape):
    """A 30-token prompt's logits and six greedy tokens: every expert is used by some token."""
    path = moe(tmp_path / arch, arch, **shape)
    assert_as_transformers(path, path, prompt(30))


def test_moe_on_the_cuda_backend(tmp_path, monkeypatch):
    """The same model on the CUDA backend's kernels (Triton's interpreter), run eagerly."""
    path = moe(tmp_path / "moe", num_layers=1)
    use_cuda_backend(monkeypatch)
    assert_as_transformers(path, path, prompt(12))


def test_a_batch_routes_each_token_on_its_own(tmp_path):
    """Four prompts decoded together (each step's tokens spread over the experts differently)
    give each prompt's greedy tokens from transformers alone."""
    path = moe(tmp_path / "moe")
    prompts = [prompt(n)[k:] for k, n in enumerate((9, 17, 23, 31))]
    core = load(EngineConfig(model=str(path), dtype="float32", device="cpu", num_kv_blocks=64)).core
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i, ids in enumerate(prompts):
        core.add(EngineRequest(f"r{i}", ids, params))
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while core.has_work:
        for o in core.step():
            got[o.request_id] += o.new_token_ids
    for i, ids in enumerate(prompts):
        assert got[f"r{i}"] == transformers_run(path, ids)[1]


def test_moe_spec_and_names():
    from transformers import MixtralConfig, Qwen3MoeConfig

    common = dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=4,
        vocab_size=100,
    )
    config = Qwen3MoeConfig(
        **common,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[0],
        decoder_sparse_step=2,
    )
    config.architectures = ["Qwen3MoeForCausalLM"]
    spec = ModelSpec.from_hf_config(config)
    assert (spec.num_experts, spec.experts_per_token, spec.moe_intermediate_size) == (8, 2, 32)
    assert spec.norm_topk_prob and spec.qk_norm
    # transformers' rule: layer i is sparse unless listed in mlp_only_layers or (i + 1) % step
    assert [spec.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    mixtral = MixtralConfig(**common, intermediate_size=48, num_local_experts=4, sliding_window=16)
    mixtral.architectures = ["MixtralForCausalLM"]
    spec = ModelSpec.from_hf_config(mixtral)
    assert (spec.num_experts, spec.moe_intermediate_size, spec.norm_topk_prob) == (4, 48, True)
    assert spec.sliding_window == 16 and spec.dense_layers == ()
    bad = MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=5)
    bad.architectures = ["MixtralForCausalLM"]
    with pytest.raises(CheckpointError, match="5 experts per token of 4"):
        ModelSpec.from_hf_config(bad)
    assert (
        checkpoint_name("model.layers.3.block_sparse_moe.experts.12.w3.weight")
        == "model.layers.3.mlp.experts.12.up_proj.weight"
    )
    assert checkpoint_name("model.layers.3.block_sparse_moe.gate.weight") == (
        "model.layers.3.mlp.gate.weight"
    )
    assert checkpoint_name("model.layers.3.mlp.w1.weight") == "model.layers.3.mlp.w1.weight"


def test_adapters_on_a_mixture_of_experts_are_refused(tmp_path):
    path = build_tiny_model(tmp_path / "moe", "qwen3_moe", num_layers=1)
    config = EngineConfig(model=str(path), device="cpu", num_kv_blocks=16, enable_lora=True)
    with pytest.raises(CheckpointError, match="mixture of experts"):
        load(config)
