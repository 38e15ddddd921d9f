"""Mixtures of experts (Mixtral, Qwen3-MoE, Qwen2-MoE; gpu/models/moe.py): the router's top k
experts per token, their gated MLPs weighted and summed (and Qwen2-MoE's shared expert beside
them), against transformers on the same random weights."""

from __future__ import annotations

import msgspec
import pytest
import torch

from core.config import CheckpointError, EngineConfig
from core.request import EngineRequest
from core.sampling import SamplingParams
from gpu.launch import load
from gpu.models.moe import checkpoint_name
from gpu.models.spec import ModelSpec
from gpu.tiny_model import build_tiny_model
from tests.gguf_reference import dequantized, prompt_choices
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
            router = name.endswith(("gate.weight", "block_sparse_moe.router.weight"))
            if router and p.shape[0] == shape["num_experts"]:
                p.mul_(8.0)
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize(
    "arch,shape",
    [
        ("qwen3_moe", {}),
        ("qwen3_moe", {"norm_topk_prob": False, "experts_per_token": 3}),
        ("mixtral", {}),
        ("qwen2_moe", {"norm_topk_prob": False}),
    ],
    ids=["qwen3-moe", "qwen3-moe-unnormalized", "mixtral", "qwen2-moe-shared-expert"],
)
def test_moe_matches_transformers(tmp_path, arch, shape):
    """A 30-token prompt's logits and six greedy tokens: every expert is used by some token."""
    path = moe(tmp_path / arch, arch, **shape)
    assert_as_transformers(path, path, prompt(30))


def test_moe_on_the_cuda_backend(tmp_path, monkeypatch):
    """The same model on the CUDA backend's kernels (Triton's interpreter), run eagerly."""
    path = moe(tmp_path / "moe", num_layers=1)
    assert_as_transformers(path, path, prompt(12), **use_cuda_backend(monkeypatch))


def test_q8_0_experts_on_the_cuda_backend(tmp_path, monkeypatch):
    """Q8_0 experts on the CUDA backend (Triton's interpreter): each keeps its own 8-bit product
    (the fused kernel has no int8 mode), and the file gives transformers' logits on the gguf
    package's dequantization of it."""
    from gpu.cuda.int4_weight import Int4Weight
    from gpu.quant.gguf_write import uniform, write_gguf

    hf = moe(tmp_path / "hf", num_layers=1)
    path = write_gguf(hf, tmp_path / "moe-q8_0.gguf", uniform("q8_0"))
    ref = dequantized(path, hf, tmp_path / "ref")
    config = EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64)
    core = load(msgspec.structs.replace(config, **use_cuda_backend(monkeypatch))).core
    mlp = core.runner.model.model.layers[0].mlp
    assert mlp.stacked is None and isinstance(mlp.experts[0].down[0], Int4Weight)
    assert_as_transformers(path, ref, prompt(12), **use_cuda_backend(monkeypatch))


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
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

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
    qwen2 = Qwen2MoeConfig(
        **common, moe_intermediate_size=32, shared_expert_intermediate_size=96, num_experts=8
    )
    qwen2.architectures = ["Qwen2MoeForCausalLM"]
    spec = ModelSpec.from_hf_config(qwen2)
    assert (spec.shared_expert_size, spec.qkv_bias, spec.qk_norm) == (96, True, False)
    assert spec.num_experts == 8 and not spec.dense_layers
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


def test_adapters_on_a_mixture_of_experts_modify_its_attention(tmp_path):
    """PEFT adapters on a Qwen3-MoE's attention, in one batch with the base model: PEFT's greedy
    tokens; in bfloat16 the one-call stack gives the module path's tokens with them. An adapter
    on the experts, the router or a mixture's MLP is refused by name."""
    import json

    from safetensors.torch import load_file, save_file

    from core.lora import LoraError, read_adapter
    from tests.lora_adapters import engine, make_adapter, peft_greedy, refs_of, run

    path = moe(tmp_path / "moe", num_layers=2)
    attention = (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"], False)
    adapters = {
        "qv": make_adapter(path, tmp_path / "qv", "qv8", seed=1),
        "attn": make_adapter(path, tmp_path / "attn", "", seed=2, spec=attention),
    }
    prompts = [prompt(n)[k:] for k, n in enumerate((9, 23))]
    jobs = lambda refs: [  # noqa: E731
        (f"{name}-{i}", ids, refs.get(name)) for name in ("base", *adapters)
        for i, ids in enumerate(prompts)
    ]  # fmt: skip
    loaded = engine(path, num_kv_blocks=64)
    got = run(loaded.core, jobs(refs_of(loaded, adapters)), max_tokens=6)
    for name in ("base", *adapters):
        want = peft_greedy(path, adapters.get(name), prompts, 6)
        assert [got[f"{name}-{i}"] for i in range(len(prompts))] == want, name
    assert got["qv-0"] != got["base-0"] or got["attn-1"] != got["base-1"]
    tokens = []
    for forward in ("auto", "modules"):
        loaded = engine(path, num_kv_blocks=64, dtype="bfloat16", cpu_forward=forward, device="cpu")
        assert (loaded.core.runner.model.stack is not None) == (forward == "auto")
        tokens.append(run(loaded.core, jobs(refs_of(loaded, adapters)), max_tokens=6))
    assert tokens[0] == tokens[1]
    # refused: an expert's product, and the MLP of a layer that is a mixture
    base = loaded.lora_base
    assert base.sparse_layers == (0, 1)
    weights = load_file(str(adapters["qv"] / "adapter_model.safetensors"))
    a = next(t for k, t in weights.items() if "lora_A" in k)
    for key, says in (
        ("base_model.model.model.layers.0.mlp.experts.3.gate_proj.lora_A.weight", "experts"),
        ("base_model.model.model.layers.1.mlp.gate_proj.lora_A.weight", "layer 1's MLP"),
    ):
        bad = tmp_path / f"bad-{len(says)}"
        bad.mkdir()
        config = json.loads((adapters["qv"] / "adapter_config.json").read_text())
        config["target_modules"] = ["q_proj", "v_proj", "gate_proj"]
        (bad / "adapter_config.json").write_text(json.dumps(config))
        b = key.replace("lora_A", "lora_B")
        pair = {key: a.clone(), b: torch.zeros(base.shapes["gate_proj"][1], a.shape[0])}
        save_file({**weights, **pair}, str(bad / "adapter_model.safetensors"))
        with pytest.raises(LoraError, match=says):
            read_adapter("bad", bad, base, 16)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_a_gguf_file_of_experts_serves_as_its_checkpoint(tmp_path, arch):
    """Experts stacked in 3-D tensors (ffn_*_exps), the router as ffn_gate_inp, the counts as
    metadata, as llama.cpp's converter writes them (a Mixtral: a "llama" file with experts; weir's
    writer checked against that converter's files; Qwen2-MoE's shared expert as ffn_*_shexp,
    its gate a vector): in float32, transformers' logits."""
    from gpu.quant.gguf_write import uniform, write_gguf

    shape = {"norm_topk_prob": False} if arch == "qwen2_moe" else {}
    hf = moe(tmp_path / "hf", arch, **shape)
    path = write_gguf(hf, tmp_path / "moe.gguf", uniform("f32"))
    assert_as_transformers(path, hf, prompt(30))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k_m"])
def test_quantized_experts_against_their_dequantized_weights(tmp_path, monkeypatch, fmt):
    """Each expert's rows of a block-format stack are its own: dequantized by weir's loader, the
    file gives transformers' logits on the `gguf` package's dequantization of it; on weir's
    kernels, whose products round the activations to 8 bits as llama.cpp's do (which can swap a
    token's experts where two are close), the prompt's greedy choices mostly agree."""
    from gpu import assemble
    from gpu.attention.select import get_backend
    from gpu.backend import TorchBackend
    from gpu.quant.gguf_write import q4_k_m, uniform, write_gguf

    hf = moe(tmp_path / "hf", hidden_size=256, intermediate_size=256)
    path = write_gguf(hf, tmp_path / "moe.gguf", q4_k_m if fmt == "q4_k_m" else uniform(fmt))
    ref = dequantized(path, hf, tmp_path / "ref")
    ids = prompt(40)
    ours = prompt_choices(path, ids, dtype="float32")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0, :-1].argmax(-1).tolist()
    agree = sum(a == b for a, b in zip(ours, theirs))
    assert agree >= 0.8 * len(ours), (agree, len(ours))
    torch_ops = lambda c, d, t: TorchBackend(get_backend("auto", d), fuse=False)  # noqa: E731
    monkeypatch.setattr(assemble, "choose_backend", torch_ops)
    assert_as_transformers(path, ref, ids)


@pytest.mark.parametrize(
    "fmt,arch", [("q8_0", "qwen3_moe"), ("bf16", "qwen3_moe"), ("q8_0", "qwen2_moe")]
)
def test_the_one_call_stack_runs_a_mixture_as_the_modules_do(tmp_path, fmt, arch):
    """With its experts in block (or 16-bit) formats, a mixture runs inside the compiled layer
    stack (gpu/cpu/csrc/moe.cpp): the same experts chosen and the same kernels as the module
    path, the routing's float operations its own (a softmax's exp, the weighted sum's fused
    multiply-adds), so the two differ by float32 rounding; the greedy tokens exactly, a batch of
    prompts too. The log-probs within 0.15: these formats' products take the activations in 8
    bits (bfloat16's mantissa, Q8_0's codes), and a float32 rounding that moves one activation
    across a rounding boundary moves that row's next products by about 1/256, which later
    layers carry on (0.087 seen on an AVX2 machine, where the module path and the stack had
    agreed to 1e-6 on AVX-512); a wrong expert, weight or scale moves them by far more."""
    from gpu.quant.gguf_write import uniform, write_gguf

    shape = {"norm_topk_prob": False} if arch == "qwen2_moe" else {}  # and its shared expert
    hf = moe(tmp_path / "hf", arch, hidden_size=128, intermediate_size=64, num_layers=3, **shape)
    path = write_gguf(hf, tmp_path / "moe.gguf", uniform(fmt))
    assert_stack_as_modules(path, atol=0.15, rtol=0)


def test_a_dense_layer_beside_a_wider_shared_expert_in_the_stack(tmp_path):
    """Qwen2-MoE with a dense layer (mlp_only_layers) whose MLP is narrower than the shared
    expert: the stack's scratch is as wide as the widest, each product its own width (the dense
    layer's had taken the scratch's width: zeros came out); in bfloat16 as the module path."""
    hf = moe(tmp_path / "hf", "qwen2_moe", num_layers=3, norm_topk_prob=False, dense_layers=(1,))
    from transformers import AutoConfig

    assert ModelSpec.from_hf_config(AutoConfig.from_pretrained(hf)).dense_layers == (1,)
    assert_stack_as_modules(hf, dtype="bfloat16", atol=1e-3, rtol=1e-3)


def assert_stack_as_modules(path, **config) -> None:
    """A batch of three prompts (six greedy tokens, three top log-probs each) in the one-call
    stack and on the module path: the same tokens, the log-probs close (`atol`/`rtol` when
    given, else float32's default)."""
    tol = {k: config.pop(k) for k in ("atol", "rtol") if k in config}
    prompts = [prompt(n)[k:] for k, n in enumerate((9, 17, 40))]
    results = []
    for forward in ("auto", "modules"):
        engine = EngineConfig(
            model=str(path), device="cpu", num_kv_blocks=64, cpu_forward=forward, **config
        )
        core = load(engine).core
        assert (core.runner.model.stack is not None) == (forward == "auto")
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
        for i, ids in enumerate(prompts):
            core.add(EngineRequest(f"r{i}", ids, params))
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        logprobs: dict[str, list[float]] = {f"r{i}": [] for i in range(len(prompts))}
        while core.has_work:
            for o in core.step():
                tokens[o.request_id] += o.new_token_ids
                logprobs[o.request_id] += [v for lp in o.logprobs or [] for v in lp.top_logprobs]
        results.append((tokens, logprobs))
    (stack_tokens, stack_lp), (module_tokens, module_lp) = results
    assert stack_tokens == module_tokens
    for key in stack_lp:
        torch.testing.assert_close(torch.tensor(stack_lp[key]), torch.tensor(module_lp[key]), **tol)


def test_an_early_mixtral_file_with_one_tensor_per_expert(tmp_path):
    """Mixtral files written before llama.cpp stacked experts (December 2023: blk.N.ffn_gate.E,
    ffn_up.E, ffn_down.E, one tensor each), which llama.cpp still reads: served as the stacked
    file is."""
    import gguf
    import numpy as np

    from gpu.quant.gguf_write import uniform, write_gguf

    hf = moe(tmp_path / "hf", "mixtral")
    stacked = write_gguf(hf, tmp_path / "stacked.gguf", uniform("q8_0"))
    reader = gguf.GGUFReader(stacked)
    w = gguf.GGUFWriter(str(tmp_path / "early.gguf"), "llama")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = {"sub_type": field.types[-1]} if field.types[0] == gguf.GGUFValueType.ARRAY else {}
        w.add_key_value(name, field.contents(), field.types[0], **sub)
    for t in reader.tensors:
        data = np.array(t.data)
        if t.name.endswith("_exps.weight"):  # [E, rows, bytes] -> E tensors [rows, bytes]
            stem = t.name.removesuffix("_exps.weight")
            for e in range(data.shape[0]):
                w.add_tensor(
                    f"{stem}.{e}.weight", data[e], raw_shape=data[e].shape, raw_dtype=t.tensor_type
                )
            continue
        shape = [int(d) for d in reversed(t.shape)]
        raw = shape if t.tensor_type in (0, 1) else data.shape
        w.add_tensor(t.name, data, raw_shape=raw, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert any(
        ".ffn_gate.3.weight" in t.name for t in gguf.GGUFReader(tmp_path / "early.gguf").tensors
    )
    ids = prompt(30)
    got = {}
    for name in ("stacked", "early"):
        config = EngineConfig(
            model=str(tmp_path / f"{name}.gguf"), device="cpu", dtype="float32", num_kv_blocks=64
        )
        core = load(config).core
        core.add(
            EngineRequest("r", ids, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        )
        out = []
        while core.has_work:
            for o in core.step():
                out += o.new_token_ids
        got[name] = (out, core.runner.last_logits.clone())
    assert got["early"][0] == got["stacked"][0]
    assert torch.equal(got["early"][1], got["stacked"][1])
