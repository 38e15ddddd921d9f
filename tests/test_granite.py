"""Granite (GraniteForCausalLM, Granite 3.x; GraniteMoeForCausalLM, its mixtures of experts; and
Granite 4.0's transformer-only GraniteMoeHybridForCausalLM):
Llama's layer with four factors of its config, the
embeddings' (embedding_multiplier), the attention's scale (attention_multiplier), each block's
output before its residual add (residual_multiplier, taken on the O and down products' inputs)
and the logits' divisor (logits_scaling), against transformers on the same random weights, in
the one-call CPU stack, layer by layer and on the CUDA backend's kernels; from llama.cpp's
"granite" GGUF files too (the factors as its converter names them)."""

from __future__ import annotations

import pytest

from core.config import CheckpointError, EngineConfig
from gpu.launch import load
from gpu.models.spec import ModelSpec
from tests.test_phi3 import assert_as_transformers, backend_config, prompt


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    from gpu.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("granite") / "granite", "granite", num_layers=3)


@pytest.fixture(scope="module")
def granitemoe(tmp_path_factory):
    from tests.test_moe import moe

    return moe(tmp_path_factory.mktemp("granitemoe") / "granitemoe", "granitemoe")


@pytest.mark.parametrize("backend", ["modules", "cuda-backend"])
def test_granitemoe_matches_transformers(granitemoe, backend, monkeypatch):
    """GraniteMoE: the factors over 8 experts, 2 a token (the softmax of their logits), every
    expert used by some token; its checkpoint's stacked experts (input_linear: gate's rows then
    up's, output_linear) and router (router.layer) read as each expert's. (Float32 experts run
    layer by layer; the one-call stack takes them in block formats: the Q8_0 test below.)"""
    config = backend_config(backend, monkeypatch)
    assert_as_transformers(granitemoe, granitemoe, prompt(30), **config)


def test_a_granitemoe_gguf_file_serves_as_its_checkpoint(granitemoe, tmp_path):
    """As llama.cpp's converter writes GraniteMoE: "granitemoe", input_linear cut into
    ffn_gate_exps and ffn_up_exps, the factors under its own keys."""
    from gpu.gguf_file import GgufCheckpoint
    from gpu.quant.gguf_write import uniform, write_gguf

    path = write_gguf(granitemoe, tmp_path / "granitemoe.gguf", uniform("f32"))
    ckpt = GgufCheckpoint(path)
    assert ckpt.arch == "granitemoe" and "blk.0.ffn_gate_exps.weight" in ckpt.tensors
    assert ckpt.config().residual_multiplier == pytest.approx(0.45)
    assert_as_transformers(path, granitemoe, prompt(30))


@pytest.fixture(scope="module")
def granite4(tmp_path_factory):
    """Granite 4.0's transformer-only shape, rotated, and the same weights unrotated
    (position_embedding_type none)."""
    import json
    import shutil

    from gpu.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("granite4")
    rope = build_tiny_model(root / "rope", "granite4", num_layers=3)
    nope = root / "nope"
    shutil.copytree(rope, nope)
    config = json.loads((nope / "config.json").read_text())
    config["position_embedding_type"] = None
    (nope / "config.json").write_text(json.dumps(config))
    return {"rope": rope, "nope": nope}


@pytest.mark.parametrize("kind", ["rope", "nope"])
@pytest.mark.parametrize("backend", ["stack", "modules", "cuda-backend"])
def test_granite4_matches_transformers(granite4, kind, backend, monkeypatch):
    """GraniteMoeHybridForCausalLM with attention layers only and no experts (granite-4.0-micro,
    -1b, -350m): Granite's factors, its MLP read from shared_mlp's fused input_linear and its
    output_linear; with no position embedding, every layer unrotated."""
    config = backend_config(backend, monkeypatch)
    assert_as_transformers(granite4[kind], granite4[kind], prompt(30), **config)


def test_granite4_with_mamba_layers_or_experts_is_refused_by_name(granite4):
    config = _config(granite4["rope"])
    spec = ModelSpec.from_hf_config(config)
    assert spec.intermediate_size == 128 and spec.nope_layers == () and spec.residual_scale == 0.45
    assert ModelSpec.from_hf_config(_config(granite4["nope"])).nope_layers == (0, 1, 2)
    config.layer_types = ["full_attention", "linear_attention", "full_attention"]
    with pytest.raises(CheckpointError, match="linear_attention"):
        ModelSpec.from_hf_config(config)
    config = _config(granite4["rope"])
    config.num_local_experts = 4
    with pytest.raises(CheckpointError, match="experts"):
        ModelSpec.from_hf_config(config)


@pytest.mark.parametrize("backend", ["stack", "modules", "cuda-backend"])
def test_granite_matches_transformers(granite, backend, monkeypatch):
    """A 30-token prompt's logits (divided by 8) and six greedy tokens, each factor far from 1
    (the embeddings times 2.5, the scores by 1/16, each block's output times 0.45)."""
    config = backend_config(backend, monkeypatch)
    assert_as_transformers(granite, granite, prompt(30), **config)


def test_the_spec_and_what_runs_it(granite):
    config = _config(granite)
    spec = ModelSpec.from_hf_config(config)
    assert (spec.embed_scale, spec.attn_scale) == (2.5, 0.0625)
    assert (spec.residual_scale, spec.logits_scaling) == (0.45, 8.0)
    model = load(EngineConfig(model=str(granite), num_kv_blocks=16)).core.runner.model
    assert model.stack is not None  # the one-call CPU stack runs it
    config.attention_bias = True  # the factor on O's input would not hold beside its bias
    with pytest.raises(CheckpointError, match="attention_bias"):
        ModelSpec.from_hf_config(config)


def test_a_gguf_file_serves_as_its_checkpoint(granite, tmp_path):
    """As llama.cpp's converter writes Granite: "granite", Llama's Q/K row order, the factors
    as granite.attention.scale, embedding_scale, residual_scale and logit_scale. In float32,
    transformers' logits and greedy tokens."""
    from gpu.gguf_file import GgufCheckpoint
    from gpu.quant.gguf_write import uniform, write_gguf

    path = write_gguf(granite, tmp_path / "granite.gguf", uniform("f32"))
    ckpt = GgufCheckpoint(path)
    assert ckpt.arch == "granite" and ckpt.get("granite.residual_scale") == pytest.approx(0.45)
    config = ckpt.config()
    assert config.architectures == ["GraniteForCausalLM"]
    assert (config.embedding_multiplier, config.logits_scaling) == (2.5, 8.0)
    assert_as_transformers(path, granite, prompt(30))


@pytest.mark.parametrize("arch", ["granite", "granitemoe"])
def test_a_quantized_file_against_its_dequantized_weights(granite, granitemoe, arch, tmp_path):
    """Granite and GraniteMoE in Q8_0 on weir's kernels, in the one-call stack (GraniteMoE's
    factor on its routing weights there): at each of the prompt's positions the token weir
    ranks first is transformers' first, or within 0.1 of it in log-probability on average, on
    the `gguf` package's dequantization of the same file."""
    from gpu.quant.gguf_write import uniform, write_gguf
    from tests.gguf_reference import assert_near_dequantized

    hf = {"granite": granite, "granitemoe": granitemoe}[arch]
    path = write_gguf(hf, tmp_path / f"{arch}.gguf", uniform("q8_0"))
    model = load(EngineConfig(model=str(path), num_kv_blocks=16)).core.runner.model
    assert model.stack is not None  # the one-call CPU stack runs it
    assert_near_dequantized(path, hf, tmp_path / "ref", prompt(30))


def _config(path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)
