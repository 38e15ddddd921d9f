"""OLMo 2 (Olmo2ForCausalLM: norms after attention and after the MLP, none before them), OLMo 3
(Olmo3ForCausalLM: OLMo 2's layer, sliding layers with their own rotation beside global ones)
and OLMoE (OlmoeForCausalLM: Llama's layer over a mixture of experts), all with Q/K norms over
all heads at once (gpu/models/decoder.py, spec.qk_norm_whole), against transformers on the same
random weights (their norm weights drawn too), in the one-call CPU stack, layer by layer and on
the CUDA backend's kernels; tensor parallelism and clip_qkv are refused naming the reason."""

from __future__ import annotations

import json

import pytest
import torch

from core.config import CheckpointError, EngineConfig
from gpu.launch import load
from gpu.models.spec import ModelSpec
from tests.test_moe import moe
from tests.test_phi3 import assert_as_transformers, backend_config, prompt


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from gpu.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("olmo")
    olmo3 = build_tiny_model(root / "olmo3", "olmo3", num_layers=3)
    config = json.loads((olmo3 / "config.json").read_text())
    config["rope_parameters"] = {  # each layer kind its own rotation: a window of 8 at 100
        "full_attention": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                           "original_max_position_embeddings": 2048},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
    }  # fmt: skip
    (olmo3 / "config.json").write_text(json.dumps(config))
    return {
        "olmo2": build_tiny_model(root / "olmo2", "olmo2", num_layers=3),
        "olmo3": olmo3,
        "olmoe": moe(root / "olmoe", "olmoe", norm_topk_prob=False),
    }


@pytest.mark.parametrize("arch", ["olmo2", "olmo3", "olmoe"])
@pytest.mark.parametrize("backend", ["stack", "modules", "cuda-backend"])
def test_olmo_matches_transformers(models, arch, backend, monkeypatch):
    """A 30-token prompt's logits and six greedy tokens (OLMo 3: past its sliding layers' window
    of 8, which turn with their own rotation; OLMoE: every expert used by some token, its top 2
    of 8 not renormalized), in the one-call CPU stack, layer by layer, and on
    the CUDA backend's kernels (Triton's interpreter)."""
    config = backend_config(backend, monkeypatch)
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
    olmo3 = ModelSpec.from_hf_config(_config(models["olmo3"]))
    assert olmo3.layer_windows == (8, 8, 0) and olmo3.post_norms_only
    config = _config(models["olmoe"])
    config.clip_qkv = 8.0
    with pytest.raises(CheckpointError, match="clip_qkv"):
        ModelSpec.from_hf_config(config)


@pytest.mark.parametrize("arch", ["olmo2", "olmo3", "olmoe"])
def test_a_gguf_file_serves_as_its_checkpoint(models, arch, tmp_path):
    """As llama.cpp's converter writes them (checked against its files): OLMo 2 and 3 as
    "olmo2" (the norms after the blocks as post_attention_norm and post_ffw_norm, no Q/K row
    reordering: llama.cpp turns them NEOX-style), OLMo 3's window, layer pattern, its sliding
    layers' own base and the global layers' YaRN as metadata; OLMoE as "olmoe" with stacked
    experts, never renormalized. In float32, transformers' logits and greedy tokens."""
    from gpu.gguf_file import GgufCheckpoint
    from gpu.quant.gguf_write import uniform, write_gguf

    path = write_gguf(models[arch], tmp_path / f"{arch}.gguf", uniform("f32"))
    ckpt = GgufCheckpoint(path)
    assert ckpt.arch == ("olmoe" if arch == "olmoe" else "olmo2")
    config, want = ckpt.config(), _config(models[arch])
    assert config.architectures == want.architectures
    if arch == "olmo3":
        assert config.layer_types == want.layer_types and config.sliding_window == 8
        assert config.rope_parameters["sliding_attention"]["rope_theta"] == 100.0
        assert config.rope_parameters["full_attention"]["rope_type"] == "yarn"
    assert_as_transformers(path, models[arch], prompt(30))


def test_a_quantized_olmo_file_against_its_dequantized_weights(models, tmp_path):
    """OLMo 3 in Q8_0 on weir's kernels, which round the activations to 8 bits as llama.cpp's
    do: at each of the prompt's positions the token weir ranks first is transformers' first,
    or within 0.1 of it in log-probability on average, on the `gguf` package's dequantization
    of the same file."""
    from gpu.quant.gguf_write import uniform, write_gguf
    from tests.gguf_reference import assert_near_dequantized

    path = write_gguf(models["olmo3"], tmp_path / "olmo3.gguf", uniform("q8_0"))
    assert_near_dequantized(path, models["olmo3"], tmp_path / "ref", prompt(30))


def test_tensor_parallelism_is_refused_by_name(models):
    with pytest.raises(CheckpointError, match="span every head"):
        load(EngineConfig(model=str(models["olmo2"]), tensor_parallel_size=2, num_kv_blocks=16))


def _config(path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)
