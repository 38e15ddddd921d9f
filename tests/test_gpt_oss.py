"""gpt-oss (GptOssForCausalLM, gpu/models/gpt_oss.py) against transformers on the same random
weights: attention sinks and biases, every other layer sliding (a window of 8 under a 30-token
prompt), YaRN, a biased router, biased experts with the clamped SwiGLU (weights large enough to
reach the clamp); from bf16-style fused expert tensors and from MXFP4 blocks as OpenAI's files
hold them."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from core.config import CheckpointError, EngineConfig
from core.request import EngineRequest, SamplingParams
from gpu.launch import load
from gpu.tiny_model import build_tiny_model
from tests.test_phi3 import first_logits, prompt, transformers_run


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("gpt-oss") / "hf", "gpt_oss")
    return path, transformers_run(path, prompt(30), attn_implementation="eager")


@pytest.mark.parametrize("config", [{}, {"attention_backend": "torch"}], ids=["cpu", "torch"])
def test_gpt_oss_matches_transformers(model, config):
    """The logits after the prompt and six greedy tokens, on weir's CPU attention kernel and
    on the torch reference; the layers run on the module path (float32 experts: the one-call
    stack takes block formats only)."""
    path, (want, want_tokens) = model
    got, tokens = first_logits(path, prompt(30), num_kv_blocks=64, **config)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert tokens == want_tokens


def test_the_sinks_and_biases_matter(model, monkeypatch):
    """Every layer's sinks are loaded (none zero), and without them the logits move: the
    check above would see them dropped."""
    path, (want, _) = model
    from gpu.models import decoder

    made = []
    real = decoder.DecoderForCausalLM.prepare

    def prepare(self):
        real(self)
        made.append(self)

    monkeypatch.setattr(decoder.DecoderForCausalLM, "prepare", prepare)
    first_logits(path, prompt(30), num_kv_blocks=64)
    layers = made[-1].model.layers
    assert all(layer.self_attn.sinks.abs().sum() > 0 for layer in layers)

    def zero_sinks(self):
        real(self)
        for layer in self.model.layers:
            layer.self_attn.sinks.data.zero_()

    monkeypatch.setattr(decoder.DecoderForCausalLM, "prepare", zero_sinks)
    got, _ = first_logits(path, prompt(30), num_kv_blocks=64)
    assert (got - want).abs().max() > 1e-2


def test_a_config_without_the_activations_constants_gets_gpt_osss(model):
    """A config that names neither the clamp nor alpha (transformers 5.17's GptOssConfig has no
    such fields; gpt-oss's own config.json names the limit alone) gets the reference's 7.0 and
    1.702, where the load had failed on the missing attribute."""
    from transformers import AutoConfig

    from gpu.models.spec import ModelSpec

    config = AutoConfig.from_pretrained(model[0])
    config.swiglu_limit, config.swiglu_alpha = 3.0, 1.5
    spec = ModelSpec.from_hf_config(config)
    assert (spec.swiglu_limit, spec.swiglu_alpha) == (3.0, 1.5)

    class Older(type(config)):  # as transformers 5.17's: no such attributes, not even defaults
        def __getattribute__(self, name):
            if name in ("swiglu_limit", "swiglu_alpha"):
                raise AttributeError(name)
            return super().__getattribute__(name)

    config.__class__ = Older
    assert not hasattr(config, "swiglu_limit")
    spec = ModelSpec.from_hf_config(config)
    assert (spec.swiglu_limit, spec.swiglu_alpha) == (7.0, 1.702)


def test_a_batch_routes_and_attends_per_sequence(model):
    """Four prompts decoded together (each step's tokens spread over the experts and the
    windows differently) give each prompt's greedy tokens from transformers alone."""
    path, _ = model
    prompts = [prompt(n)[k:] for k, n in enumerate((9, 17, 23, 31))]
    want = [transformers_run(path, ids, attn_implementation="eager")[1] for ids in prompts]
    core = load(EngineConfig(model=str(path), dtype="float32", device="cpu", num_kv_blocks=64)).core
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i, ids in enumerate(prompts):
        core.add(EngineRequest(str(i), ids, params))
    got = {str(i): [] for i in range(len(prompts))}
    while core.has_work:
        for out in core.step():
            got[out.request_id] += out.new_token_ids
    assert [got[str(i)] for i in range(len(prompts))] == want


def test_mxfp4_experts_as_openais_files_hold_them(model, tmp_path):
    """The experts' weights as MXFP4 blocks and scales ([E, out, in / 32, ...], the checkpoint's
    quantization_config mxfp4): weir's dequantization, ggml's blocks it holds them in and the
    kernels' 4-bit form it serves them in are transformers' dequantization bit for bit; weir on
    that file is close to transformers on the same weights dequantized (by transformers) into a
    float checkpoint: the same top token and first greedy tokens, the logits within the block
    kernels' 8-bit activations (as llama.cpp's are) of them."""
    import gguf
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from gpu.cpu import quant
    from gpu.quant.formats import FORMATS
    from gpu.quant.mxfp4 import dequantize, to_ggml, write_folder

    path, _ = model
    quantized, dequantized = tmp_path / "mxfp4", tmp_path / "float"
    write_folder(path, quantized)
    shutil.copytree(path, dequantized)
    q = load_file(quantized / "model.safetensors")
    f = load_file(path / "model.safetensors")
    for name in [n for n in q if n.endswith("_blocks")]:
        blocks, scales = q[name], q[name.replace("_blocks", "_scales")]
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
        assert torch.equal(dequantize(blocks, scales, torch.float32), theirs.transpose(1, 2))
        rows = to_ggml(blocks.numpy(), scales.numpy())  # [E, out, in / 32 * 17]
        mx = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType.MXFP4)
        assert torch.equal(torch.from_numpy(mx), theirs.transpose(1, 2))
        n, k = mx.shape[1:]
        packed = quant.pack(rows[0], FORMATS["mxfp4"], (n, k))  # the kernels' 4-bit form
        assert packed.fmt.name == "mxfp4" and packed.resident_bytes < n * k * 18 / 32 * 1.1
        assert torch.equal(quant.dequantize(packed), theirs[0].T)
        f[name.removesuffix("_blocks")] = theirs.contiguous()
    save_file(f, dequantized / "model.safetensors")
    want, want_tokens = transformers_run(dequantized, prompt(30), attn_implementation="eager")
    got, tokens = first_logits(quantized, prompt(30), num_kv_blocks=64)
    assert got.argmax() == want.argmax() and (got - want).abs().mean() < 0.05 * want.std()
    assert tokens[:2] == want_tokens[:2]
    # the scales without their blocks: refused by name
    del q[next(n for n in q if n.endswith("down_proj_blocks"))]
    save_file(q, quantized / "model.safetensors")
    with pytest.raises(CheckpointError, match="down_proj: MXFP4 scales without its blocks"):
        first_logits(quantized, prompt(30), num_kv_blocks=64)


def test_mxfp4_experts_stay_4_bit_on_the_cuda_backend(model, tmp_path, monkeypatch):
    """On the CUDA backend (Triton's interpreter here) the MXFP4 experts keep their 4 bits,
    stacked for the two-launch mixture (gpu/cuda/kernels/fused_moe.py decoding E2M1's codes as
    the W4A16 product does), where a GPU had held them dequantized in the model's dtype; with
    float32 activations, transformers' logits and tokens on the same weights dequantized."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from gpu.cuda.int4_weight import Int4Weight
    from gpu.quant.mxfp4 import write_folder
    from tests.test_phi3 import use_cuda_backend

    path, _ = model
    quantized, dequantized = tmp_path / "mxfp4", tmp_path / "float"
    write_folder(path, quantized)
    shutil.copytree(path, dequantized)
    q, f = load_file(quantized / "model.safetensors"), load_file(path / "model.safetensors")
    for name in [n for n in q if n.endswith("_blocks")]:
        scales = q[name.replace("_blocks", "_scales")]
        f[name.removesuffix("_blocks")] = convert_moe_packed_tensors(q[name], scales).float()
    save_file({k: v.contiguous() for k, v in f.items()}, dequantized / "model.safetensors")
    want, want_tokens = transformers_run(dequantized, prompt(12), attn_implementation="eager")
    config = use_cuda_backend(monkeypatch)
    core = load(EngineConfig(model=str(quantized), dtype="float32", num_kv_blocks=64, **config))
    mlp = core.core.runner.model.model.layers[0].mlp
    assert all(isinstance(e.gate_up[0], Int4Weight) and e.gate_up[0].fp4 for e in mlp.experts)
    assert all(isinstance(e.down[0], Int4Weight) and e.down[0].mins is None for e in mlp.experts)
    assert mlp.stacked.gate_up.fp4 and mlp.stacked.down.fp4  # one pass, the codes stacked
    core.core.close()
    got, tokens = first_logits(quantized, prompt(12), num_kv_blocks=64, **config)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert tokens == want_tokens


def test_on_the_cuda_backend(tmp_path, monkeypatch):
    """The CUDA backend's kernels (Triton's interpreter here: the sinks in the prefill and
    decode kernels, a window of 8 under a 12-token prompt), the experts run eagerly."""
    from tests.test_phi3 import use_cuda_backend

    path = build_tiny_model(tmp_path / "hf", "gpt_oss", num_layers=2)
    want, want_tokens = transformers_run(path, prompt(12), attn_implementation="eager")
    config = use_cuda_backend(monkeypatch)
    got, tokens = first_logits(path, prompt(12), num_kv_blocks=64, **config)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert tokens == want_tokens


@pytest.mark.parametrize("experts", ["bfloat16", "mxfp4"])
def test_the_one_call_stack_runs_gpt_oss_as_the_modules_do(model, tmp_path, experts):
    """Sinks, the O and router biases, the experts' biases and clamped SwiGLU, sliding and full
    layers, in the compiled stack (gpu/cpu/csrc/moe.cpp plain_experts): the module path's
    tokens, and its log-probs within the routing's float32 differences (moe.cpp), the experts
    in bfloat16 or in MXFP4 blocks."""
    from gpu.quant.mxfp4 import write_folder
    from tests.test_moe import assert_stack_as_modules

    path, _ = model
    if experts == "mxfp4":
        write_folder(path, tmp_path / "mxfp4")
        path = tmp_path / "mxfp4"
    assert_stack_as_modules(path, dtype="bfloat16", atol=1e-4, rtol=1e-4)


def test_tensor_parallel_ranks_give_the_single_process_tokens(model, tmp_path):
    """Two ranks (gloo) on the MXFP4 folder: each its heads' sinks and Q/K/V rows, its rows of
    every expert's gate and up (MXFP4 blocks cut by whole rows) and their biases, whole blocks
    of down's columns; rank 0 alone adds the O and down biases, the router replicated: the
    single process's greedy tokens."""
    from gpu.quant.mxfp4 import write_folder
    from tests.test_tensor_parallel import generate

    path, _ = model
    write_folder(path, tmp_path / "mxfp4")
    prompts = [prompt(n)[k:] for k, n in enumerate((9, 17, 30))]
    config = {"model": str(tmp_path / "mxfp4"), "dtype": "float32", "device": "cpu"}
    want = generate(load(EngineConfig(**config, num_kv_blocks=64)).core, prompts)
    core = load(EngineConfig(**config, num_kv_blocks=64, tensor_parallel_size=2)).core
    try:
        assert len(core.runner.workers) == 2
        assert generate(core, prompts) == want
    finally:
        core.close()


def write_gpt_oss_gguf(hf_dir, out) -> dict:
    """A `gpt-oss` GGUF of the folder's weights as llama.cpp's converter writes one (its names
    and keys; the experts split into gate, up and down stacks in ggml's MXFP4, the rest F32),
    with the gguf package; returns the experts' weights as that MXFP4 dequantizes them (HF
    names, the folder's fused layout)."""
    import gguf
    from safetensors.torch import load_file

    from gpu.quant.gguf_tokens import write_tokenizer

    config = json.loads((hf_dir / "config.json").read_text())
    w = gguf.GGUFWriter(str(out), "gpt-oss")
    heads, rope = config["num_attention_heads"], config["rope_parameters"]
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_expert_count(config["num_local_experts"])
    w.add_expert_used_count(config["num_experts_per_tok"])
    w.add_sliding_window(config["sliding_window"])
    w.add_expert_feed_forward_length(config["intermediate_size"])
    write_tokenizer(w, hf_dir, config)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.sinks": "attn_sinks", "mlp.router": "ffn_gate_inp"}  # fmt: skip
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}  # fmt: skip
    mxfp4 = gguf.GGMLQuantizationType.MXFP4
    dequantized = {}
    for name, t in load_file(hf_dir / "model.safetensors").items():
        a = t.float().numpy()
        if name in top:
            w.add_tensor(top[name], a)
            continue
        layer, rest = name.split(".")[2], ".".join(name.split(".")[3:])
        if rest.startswith("mlp.experts."):
            kind = rest.removeprefix("mlp.experts.")
            if kind == "down_proj":  # [E, inter, hidden] -> [E, hidden, inter]
                parts = {"ffn_down_exps": a.transpose(0, 2, 1)}
            elif kind == "down_proj_bias":
                parts = {"ffn_down_exps.bias": a}
            elif kind == "gate_up_proj":  # [E, hidden, 2 inter], gate and up interleaved
                a = a.transpose(0, 2, 1)
                parts = {"ffn_gate_exps": a[:, 0::2], "ffn_up_exps": a[:, 1::2]}
            else:
                parts = {"ffn_gate_exps.bias": a[:, 0::2], "ffn_up_exps.bias": a[:, 1::2]}
            for gname, part in parts.items():
                if gname.endswith(".bias"):
                    w.add_tensor(f"blk.{layer}.{gname}", part.copy())
                    continue
                raw = gguf.quants.quantize(part.copy(), mxfp4)
                w.add_tensor(f"blk.{layer}.{gname}.weight", raw, raw_dtype=mxfp4)
                dequantized[f"{layer}.{gname}"] = gguf.quants.dequantize(raw, mxfp4)
            continue
        stem, _, kind = rest.rpartition(".")
        if rest == "self_attn.sinks":
            stem, kind = rest, "weight"
        w.add_tensor(f"blk.{layer}.{names[stem]}.{kind}", a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out_weights = {}
    for layer in range(config["num_hidden_layers"]):
        gate, up = dequantized[f"{layer}.ffn_gate_exps"], dequantized[f"{layer}.ffn_up_exps"]
        both = np.empty((gate.shape[0], 2 * gate.shape[1], gate.shape[2]), dtype=np.float32)
        both[:, 0::2], both[:, 1::2] = gate, up
        prefix = f"model.layers.{layer}.mlp.experts."
        out_weights[prefix + "gate_up_proj"] = torch.from_numpy(both.transpose(0, 2, 1).copy())
        down = dequantized[f"{layer}.ffn_down_exps"]
        out_weights[prefix + "down_proj"] = torch.from_numpy(down.transpose(0, 2, 1).copy())
    return out_weights


def test_a_gguf_file_as_llama_cpps_converter_writes_it(model, tmp_path):
    """A `gpt-oss` GGUF (ggml's MXFP4 experts, served as Q8_0 exactly; stacked biases; the sinks
    as attn_sinks.weight; YaRN's betas): close to transformers on the folder's weights with the
    experts as the file's MXFP4 dequantizes them (the same checks as the MXFP4 folder's)."""
    from safetensors.torch import load_file, save_file

    path, _ = model
    dequantized = tmp_path / "float"
    shutil.copytree(path, dequantized)
    experts = write_gpt_oss_gguf(path, tmp_path / "m.gguf")
    save_file(load_file(path / "model.safetensors") | experts, dequantized / "model.safetensors")
    want, want_tokens = transformers_run(dequantized, prompt(30), attn_implementation="eager")
    got, tokens = first_logits(tmp_path / "m.gguf", prompt(30), num_kv_blocks=64)
    assert got.argmax() == want.argmax() and (got - want).abs().mean() < 0.05 * want.std()
    assert tokens[:2] == want_tokens[:2]
