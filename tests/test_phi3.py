"""Phi-3 (Phi3ForCausalLM): Llama with fused qkv_proj / gate_up_proj tensors in its checkpoint
(gpu/fused_weights.py), a sliding window, and LongRoPE's short and long factors (gpu/models/
rope.py `fit_context`), against transformers on the same random weights."""

from __future__ import annotations

import pytest
import torch

from core.config import CheckpointError, EngineConfig
from core.request import EngineRequest
from core.sampling import SamplingParams
from gpu.fused_weights import fused_parts, split_fused
from gpu.launch import load
from gpu.models.partial_rope import head_order
from gpu.models.spec import ModelSpec
from gpu.tiny_model import build_tiny_model

HEAD_DIM = 16  # the tiny model's 64 / 4 heads: LongRoPE takes 8 factors of each kind
LONGROPE = {
    "rope_type": "longrope",
    "original_max_position_embeddings": 64,
    "short_factor": [1.0, 1.1, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0],
    "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 12.0, 16.0],
}


def first_logits(path, ids, **config) -> tuple[torch.Tensor, list[int]]:
    """weir's logits after the prompt, and its greedy continuation of 6 tokens (with one step
    at a time: asynchronous scheduling, the default on a GPU, launches the next step before the
    last one's tokens are seen, and the runner's logits are then the next step's)."""
    config = {"device": "cpu", "async_scheduling": False} | config
    core = load(EngineConfig(model=str(path), dtype="float32", **config)).core
    core.add(EngineRequest("r", ids, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)))
    logits, out = None, []
    while core.has_work:
        for o in core.step():
            out += o.new_token_ids
        if logits is None and out:  # the step that ended the prompt
            logits = core.runner.last_logits[0].float().cpu()
    return logits, out


def transformers_run(path, ids, **options) -> tuple[torch.Tensor, list[int]]:
    """transformers' logits after the prompt and six greedy tokens; `options` for from_pretrained
    (attn_implementation="eager": the attention that soft-caps Gemma 2's scores)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **options).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, -1]
        out = hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=None)
    return logits, out[0, len(ids) :].tolist()


def prompt(n: int) -> list[int]:
    return [(37 * i + 11) % 900 + 20 for i in range(n)]


def assert_as_transformers(path, hf, ids, **config) -> None:
    """weir serving `path` gives transformers' logits after the prompt and its greedy tokens on
    the checkpoint `hf` (the same weights)."""
    got, tokens = first_logits(path, ids, num_kv_blocks=64, **config)
    want, hf_tokens = transformers_run(hf, ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert tokens == hf_tokens


def backend_config(backend: str, monkeypatch) -> dict:
    """The engine configuration of a test's backend: "stack" (the one-call CPU stack, where the
    model fits it), "modules" (layer by layer) or "cuda-backend" (use_cuda_backend)."""
    if backend == "cuda-backend":
        return use_cuda_backend(monkeypatch)
    return {"stack": {}, "modules": {"cpu_forward": "modules"}}[backend]


def use_cuda_backend(monkeypatch) -> dict:
    """Models load on the CUDA backend's kernels: compiled, on the GPU, where there is one;
    else in Triton's interpreter on CPU tensors. Returns the configuration's device for it."""
    from gpu import assemble
    from gpu.attention.select import get_backend
    from gpu.cuda.backend import CudaBackend

    monkeypatch.setattr(
        assemble, "choose_backend", lambda c, d, t, **kw: CudaBackend(get_backend("triton", d))
    )
    return {"device": "cuda" if torch.cuda.is_available() else "cpu"}


@pytest.mark.parametrize("window", [None, 8])
def test_phi3_matches_transformers(tmp_path, window):
    """The fused tensors cut into Q/K/V and gate/up; with a window of 8 over a 30-token prompt
    only the last 8 positions are attended to, as transformers does."""
    path = build_tiny_model(tmp_path / "phi3", "phi3", sliding_window=window)
    ids = prompt(30)
    assert_as_transformers(path, path, ids)


def test_longrope_short_factors_within_the_pretrained_length(tmp_path):
    """Served at the pretrained length or less, every sequence rotates with the short factors,
    as transformers rotates a sequence that short."""
    path = build_tiny_model(
        tmp_path / "phi3", "phi3", max_position_embeddings=256, rope_scaling=LONGROPE
    )
    ids = prompt(40)
    assert_as_transformers(path, path, ids, max_model_len=64)


def test_longrope_long_factors_past_it(tmp_path):
    """Served past the pretrained length, the long factors (and the attention factor): a prompt
    of 80 tokens gives transformers' logits, which rotates a sequence past 64 with them."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    path = build_tiny_model(
        tmp_path / "phi3", "phi3", max_position_embeddings=256, rope_scaling=LONGROPE
    )
    ids = prompt(80)
    got, _ = first_logits(path, ids, num_kv_blocks=64)
    want, _ = transformers_run(path, ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    config = AutoConfig.from_pretrained(path)
    rope = load(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64)).core.runner
    long_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](config, None, 65)
    short_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](config, None)
    assert torch.equal(rope.model.rope.inv_freq.cpu(), long_freq.float())
    assert not torch.equal(long_freq, short_freq)


@pytest.mark.parametrize("rope", ["window", "longrope", "gguf"])
def test_a_partial_rotation_matches_transformers(tmp_path, rope):
    """Phi-4-mini's partial_rotary_factor (here half of each 16-element head rotated): each Q and
    K head reordered at load (gpu/models/partial_rope.py) so that weir's full-head rotation
    rotates those elements and passes the rest; with a window, with LongRoPE's long factors
    (and their attention factor on the rotated elements only), and from a GGUF file."""
    from gpu.quant.gguf_write import uniform, write_gguf

    partial = {"rope_type": "default", "partial_rotary_factor": 0.5}
    if rope == "longrope":
        scaling = {**LONGROPE, "partial_rotary_factor": 0.5}
        scaling["short_factor"], scaling["long_factor"] = [1.0, 1.5, 2.0, 3.0], [1.0, 3.0, 6, 9]
        hf = build_tiny_model(
            tmp_path / "hf", "phi3", max_position_embeddings=256, rope_scaling=scaling
        )
        ids = prompt(80)
    else:
        hf = build_tiny_model(tmp_path / "hf", "phi3", sliding_window=8, rope_scaling=partial)
        ids = prompt(30)
    path = write_gguf(hf, tmp_path / "p.gguf", uniform("f32")) if rope == "gguf" else hf
    assert_as_transformers(path, hf, ids)


def test_a_rotation_of_an_odd_number_of_elements_is_refused():
    from transformers import Phi3Config

    config = Phi3Config(
        hidden_size=64,
        num_attention_heads=4,
        num_hidden_layers=1,
        intermediate_size=128,
        vocab_size=100,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e4,
            "partial_rotary_factor": 0.1875,
        },
    )
    config.architectures = ["Phi3ForCausalLM"]
    with pytest.raises(CheckpointError, match="partial_rotary_factor 0.1875: 3 rotated elements"):
        ModelSpec.from_hf_config(config)
    assert head_order(16, 8).tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]


def test_fused_tensors_are_cut_by_the_models_sizes(tmp_path):
    path = build_tiny_model(tmp_path / "phi3", "phi3")
    from transformers import AutoConfig

    spec = ModelSpec.from_hf_config(AutoConfig.from_pretrained(path))
    assert fused_parts("model.layers.0.self_attn.q_proj.weight") is None
    name = "model.layers.3.self_attn.qkv_proj.weight"
    qkv = torch.arange(128 * 64, dtype=torch.float32).reshape(128, 64)  # 64 + 32 + 32 rows
    parts = split_fused(name, qkv, spec)
    assert [(n, tuple(t.shape)) for n, t in parts] == [
        ("model.layers.3.self_attn.q_proj.weight", (64, 64)),
        ("model.layers.3.self_attn.k_proj.weight", (32, 64)),
        ("model.layers.3.self_attn.v_proj.weight", (32, 64)),
    ]
    assert torch.equal(torch.cat([t for _, t in parts]), qkv)
    gate_up = split_fused("model.layers.0.mlp.gate_up_proj.weight", torch.zeros(256, 64), spec)
    assert [n for n, _ in gate_up] == ["model.layers.0.mlp.gate_proj.weight",
                                       "model.layers.0.mlp.up_proj.weight"]  # fmt: skip
    with pytest.raises(CheckpointError, match="has 100 rows, the model expects 128"):
        split_fused(name, torch.zeros(100, 64), spec)


@pytest.mark.parametrize("rope", ["window", "longrope"])
def test_a_phi3_gguf_file_serves_as_its_checkpoint(tmp_path, rope):
    """Phi-3 as llama.cpp's converter writes it (attn_qkv, ffn_up of gate and up, the sliding
    window and LongRoPE's factors as keys and tensors; written here by weir's writer, whose
    names and keys were checked against that converter's file of the same model): the same
    logits as transformers on the checkpoint, with the file's own tokenizer."""
    from gpu.quant.gguf_write import uniform, write_gguf

    if rope == "window":
        hf = build_tiny_model(tmp_path / "hf", "phi3", sliding_window=8)
        ids = prompt(30)
    else:
        hf = build_tiny_model(
            tmp_path / "hf", "phi3", max_position_embeddings=256, rope_scaling=LONGROPE
        )
        ids = prompt(80)  # past the pretrained 64: the long factors
    path = write_gguf(hf, tmp_path / "phi3.gguf", uniform("f32"))
    assert_as_transformers(path, hf, ids)


def test_a_quantized_fused_tensor_is_cut_by_whole_rows_of_blocks(tmp_path):
    from gpu.gguf_file import GgufCheckpoint
    from gpu.quant.gguf_write import uniform, write_gguf

    hf = build_tiny_model(tmp_path / "hf", "phi3")
    ckpt = GgufCheckpoint(write_gguf(hf, tmp_path / "q8.gguf", uniform("q8_0")))
    spec = ModelSpec.from_hf_config(ckpt.config())
    weights = dict(ckpt.weights())
    for fused, sizes in (("self_attn.qkv_proj", [64, 32, 32]), ("mlp.gate_up_proj", [128, 128])):
        whole = weights[f"model.layers.1.{fused}.weight"]
        parts = split_fused(f"model.layers.1.{fused}.weight", whole, spec)
        assert [p.shape[0] for _, p in parts] == sizes
        assert torch.equal(torch.cat([p.dequantize() for _, p in parts]), whole.dequantize())


@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_phi3_on_the_cuda_backend(tmp_path, monkeypatch, partial):
    """The CUDA backend's kernels (Triton's interpreter here: the fused rotation and K/V write,
    the attention kernels with the window) on Phi-3, whole and partly rotated heads."""
    scaling = {"rope_type": "default", "partial_rotary_factor": partial}
    hf = build_tiny_model(tmp_path / "hf", "phi3", sliding_window=8, rope_scaling=scaling)
    assert_as_transformers(hf, hf, prompt(30), **use_cuda_backend(monkeypatch))


def test_adapters_on_the_fused_layers(tmp_path):
    """PEFT adapters of Phi-3's own modules (qkv_proj and gate_up_proj: one A for the parts,
    B stacked by rows; and all-linear) beside the base in one batch: PEFT's tokens and top
    log-probs. An adapter of a fused layer and a part of it too is refused by name."""
    import json

    from safetensors.torch import load_file, save_file

    from core.lora import LoraError, read_adapter
    from gpu.lora import base_of
    from tests.lora_adapters import TOP, assert_matches_peft, engine, make_adapter, peft_greedy
    from tests.lora_adapters import refs_of, run

    hf = build_tiny_model(tmp_path / "hf", "phi3", sliding_window=8)
    fused = (8, 16, ["qkv_proj", "gate_up_proj"], False)
    adapters = {
        "fused": make_adapter(hf, tmp_path / "fused", "", seed=1, spec=fused),
        "all": make_adapter(hf, tmp_path / "all", "", seed=2, spec=(4, 8, "all-linear", True)),
    }
    prompts = [prompt(n)[k:] for k, n in enumerate((9, 23))]
    loaded = engine(hf, num_kv_blocks=64, device="cpu")
    refs = refs_of(loaded, adapters)
    names = [None, "fused", "all"]
    jobs = [(f"{n}-{i}", ids, refs.get(n)) for n in names for i, ids in enumerate(prompts)]
    got, logprobs = run(loaded.core, jobs, max_tokens=6, logprobs=TOP)
    want = {n: peft_greedy(hf, adapters.get(n), prompts, 6, logits=True) for n in names}
    assert_matches_peft(got, logprobs, want, names, len(prompts))
    assert got["fused-1"] != got["None-1"] and got["all-1"] != got["None-1"]  # they matter
    # qkv_proj and q_proj of one layer: which would apply is unclear, so neither is served
    both = tmp_path / "both"
    both.mkdir()
    config = json.loads((adapters["fused"] / "adapter_config.json").read_text())
    config["target_modules"] += ["q_proj"]
    (both / "adapter_config.json").write_text(json.dumps(config))
    tensors = load_file(adapters["fused"] / "adapter_model.safetensors")
    at = "base_model.model.model.layers.0.self_attn."
    tensors[at + "q_proj.lora_A.weight"] = tensors[at + "qkv_proj.lora_A.weight"].clone()
    tensors[at + "q_proj.lora_B.weight"] = tensors[at + "qkv_proj.lora_B.weight"][:64].clone()
    save_file(tensors, both / "adapter_model.safetensors")
    spec = loaded.core.runner.model.spec
    with pytest.raises(LoraError, match="layer 0 has qkv_proj and q_proj"):
        read_adapter("both", both, base_of(spec), 16)
