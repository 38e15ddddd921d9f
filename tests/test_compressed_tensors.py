"""compressed-tensors checkpoints (gpu/quant/compressed.py): llm-compressor's W4A16, W8A16, W8A8
and FP8 layers served as Q4_0 / Q4_1 / Q8_0 blocks and FP8 weights.

The checkpoints are written by the `compressed-tensors` package itself (its presets, its
compressors' `compress`), from scales drawn here, and its own `decompress` is the reference:
- each layer weir makes holds exactly the package's dequantized weight (Q4_1's m = -s z within
  f16's rounding of s z);
- tiny Llama and Qwen3 checkpoints served by weir against transformers on those dequantized
  weights: teacher-forced top-1 agreement of at least 80% and a mean gap under 0.1 nats, as for
  the int4 and GGUF block formats (tests/test_gguf.py says why not greedy equality);
- what is not served is refused at start-up naming it.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

from core.config import CheckpointError, EngineConfig
from gpu.launch import load
from gpu.quant.compressed import CompressedScheme
from gpu.tiny_model import build_tiny_model
from tests.test_gguf import run
from tests.test_int4 import without

TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun today."
# the products a checkpoint quantizes (Mixtral's experts: w1, w2, w3; routers stay in float)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1",
           "w2", "w3")  # fmt: skip
SHAPE = dict(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, num_layers=2)
# preset -> (storage format, the block format weir serves it as)
PRESETS = {
    "W4A16": ("pack-quantized", "q4_0"),
    "W4A16_ASYM": ("pack-quantized", "q4_1"),
    "W8A16": ("pack-quantized", "q8_0"),
    "W8A8": ("int-quantized", "q8_0"),
    "FP8_DYNAMIC": ("float-quantized", "fp8"),
    "FP8": ("float-quantized", "fp8"),
}


def scheme_of(preset: str):
    return preset_name_to_scheme(preset, ["Linear"])


def config_of(preset: str, scheme, **extra) -> dict:
    qc = QuantizationConfig(
        config_groups={"group_0": scheme},
        format=PRESETS[preset][0],
        quantization_status="compressed",
        ignore=["lm_head"],
    ).model_dump(mode="json")
    qc.update(extra)
    return qc


def compress(w: torch.Tensor, preset: str, scheme) -> tuple[dict, torch.Tensor]:
    """One layer as the package stores it, from min-max scales in bfloat16 (llm-compressor's
    observers write them in the model's dtype), and the package's own dequantized weight
    (float32 scales, so the reference adds no rounding of its own)."""
    a = scheme.weights
    n, k = w.shape
    group = a.group_size if a.strategy == "group" else k
    g = w.float().reshape(n, k // group, group)
    state = {"weight": w}
    if a.type == "float":
        if a.strategy == "tensor":
            state["weight_scale"] = (w.float().abs().amax() / 448).reshape(1)
        else:
            state["weight_scale"] = w.float().abs().amax(1, keepdim=True) / 448
    elif a.symmetric:
        state["weight_scale"] = g.abs().amax(-1) / (2 ** (a.num_bits - 1) - 0.5)
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        s = ((hi - lo) / (2**a.num_bits - 1)).to(torch.bfloat16)
        half = 2 ** (a.num_bits - 1)
        zp = (torch.round(-lo / s.float()) - half).clamp(-half, half - 1)
        state["weight_scale"], state["weight_zero_point"] = s, zp.to(torch.int8)
    state["weight_scale"] = state["weight_scale"].to(torch.bfloat16)
    if preset == "FP8":  # static activations: a per-tensor input scale
        state["input_scale"] = torch.tensor([0.02], dtype=torch.float32)
    compressor = BaseCompressor.load_from_registry(PRESETS[preset][0])
    stored = compressor.compress(state, scheme)
    wide = {**stored, "weight_scale": stored["weight_scale"].float()}
    return stored, compressor.decompress(wide, scheme)["weight"].float()


@pytest.mark.parametrize("preset", list(PRESETS))
def test_each_layer_is_the_packages_dequantized_weight(preset):
    import gguf

    scheme = scheme_of(preset)
    weir = CompressedScheme.from_config(config_of(preset, scheme), "test")
    w = (torch.randn(96, 256) * 0.05).to(torch.bfloat16)
    stored, want = compress(w, preset, scheme)
    made = weir.make("model.layers.0.mlp.up_proj.weight", dict(stored))
    fmt = PRESETS[preset][1]
    if fmt == "fp8":
        assert torch.equal(made.dequantize(torch.float32), want)
        assert (made.input_scale is not None) == (preset == "FP8")
        return
    assert made.fmt.name == fmt and made.shape == (96, 256)
    got = gguf.quants.dequantize(made.rows, gguf.GGMLQuantizationType(made.fmt.ggml_type))
    if fmt == "q4_1":  # m = -s z as an f16: within 2^-11 of s z, z at most 15
        s = np.repeat(stored["weight_scale"].float().numpy(), 128, axis=1)
        assert (np.abs(got - want.numpy()) <= 15 * s * 2.0**-11 + 1e-7).all()
    else:
        assert np.array_equal(got, want.numpy())
    assert float((want - w.float()).abs().max()) < 0.05  # and the scales quantize


def write_checkpoint(hf_dir, out, preset, scheme, qc=None, pick=None):
    """`hf_dir`'s model (bfloat16) with every linear layer but lm_head stored by the package
    (or as `pick(layer)` says: (preset, scheme), or None for float); returns the float32 state
    dict the checkpoint means."""
    pick = pick or (lambda layer: (preset, scheme))
    out.mkdir()
    for f in hf_dir.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    config = json.loads((hf_dir / "config.json").read_text())
    config["quantization_config"] = qc or config_of(preset, scheme)
    config["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config))
    tensors, meant = {}, {}
    for name, w in load_file(hf_dir / "model.safetensors").items():
        w = w.to(torch.bfloat16)
        prefix = name.removesuffix(".weight")
        how = pick(prefix) if prefix.rsplit(".", 1)[-1] in LINEARS else None
        if name.endswith(".weight") and how is not None:
            stored, meant[name] = compress(w, *how)
            tensors.update({f"{prefix}.{p}": t for p, t in stored.items()})
        else:
            tensors[name], meant[name] = w, w.float()
    save_file(tensors, out / "model.safetensors")
    return meant


SERVED = [
    ("llama", "W4A16"),
    ("qwen3", "W4A16_ASYM"),
    ("llama", "W8A8"),
    ("qwen3", "FP8_DYNAMIC"),
    ("qwen3_moe", "W4A16"),  # experts one module each, as llm-compressor writes them
    ("mixtral", "W8A16"),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("compressed")
    out = {}
    for arch, preset in SERVED:
        hf = root / arch
        if not hf.exists():
            build_tiny_model(hf, arch, tie_word_embeddings=False, **SHAPE)
        path = root / f"{arch}-{preset}"
        out[arch, preset] = (path, hf, write_checkpoint(hf, path, preset, scheme_of(preset)))
    return out


def load_dir(path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # weir's CPU kernels (on a GPU machine "auto" would be CUDA)
        return load(EngineConfig(model=str(path), num_kv_blocks=64, **{"device": "cpu", **kw}))


@pytest.mark.parametrize("arch,preset", SERVED)
def test_served_against_transformers(models, arch, preset):
    path, hf, meant = models[arch, preset]
    loaded = load_dir(path)
    fmt = PRESETS[preset][1]
    if fmt == "fp8":  # FP8 products need a GPU with FP8 arithmetic: dequantized on CPU
        assert "fp8" not in loaded.weight_bytes and loaded.weight_bytes["bf16"] > 0
    else:
        assert loaded.weight_bytes[fmt] > 0 and set(loaded.weight_bytes) <= {fmt, "bf16", "f32"}
    agrees_with_transformers(loaded, hf, meant)


def agrees_with_transformers(loaded, hf, meant):
    """The checkpoint served against transformers on the weights it means (a folder of them:
    transformers stacks a mixture's per-expert tensors as it loads them)."""
    import shutil
    import tempfile

    from transformers import AutoModelForCausalLM

    ids = loaded.tokenizer.encode(TEXT, add_special_tokens=False)
    tokens, plp = run(loaded, ids, n=1, prompt_logprobs=1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = shutil.copytree(hf, f"{tmp}/ref", ignore=shutil.ignore_patterns("*.safetensors"))
        save_file({k: v.contiguous() for k, v in meant.items()}, f"{folder}/model.safetensors")
        ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        logprobs = torch.log_softmax(ref.eval()(torch.tensor([ids])).logits[0].double(), -1)
    ours = torch.tensor([plp[i].top_ids[0] for i in range(1, len(ids))] + tokens[:1])
    agree = int((ours == logprobs.argmax(-1)).sum())
    assert agree >= 0.8 * len(ours), (agree, len(ours))
    gaps = logprobs.max(-1).values - logprobs[torch.arange(len(ours)), ours]
    assert float(gaps.mean()) < 0.1, gaps


def test_int8_activations_are_said_once(models, caplog):
    """W8A8's int8 activations are not reproduced: one warning at start-up says so."""
    path, _, _ = models["llama", "W8A8"]
    with caplog.at_level("WARNING", logger="weir.launch"):
        load_dir(path)
    assert caplog.text.count("the checkpoint means int8 activations") == 1
    caplog.clear()
    with caplog.at_level("WARNING", logger="weir.launch"):
        load_dir(models["llama", "W4A16"][0])
    assert "int8 activations" not in caplog.text


@pytest.mark.parametrize("arch,preset", [("llama", "W4A16"), ("qwen3", "FP8_DYNAMIC")])
def test_on_two_ranks(models, arch, preset):
    """--tensor-parallel-size 2: each layer made whole, then cut to each rank's share as a GGUF
    tensor is (Q4_0 by whole rows and blocks; FP8 rows with their scales, columns with every
    row's), held to the one-rank bar."""
    path, hf, meant = models[arch, preset]
    loaded = load_dir(path, tensor_parallel_size=2)
    try:
        assert len(loaded.core.runner.workers) == 2
        agrees_with_transformers(loaded, hf, meant)
    finally:
        loaded.core.close()


def test_groups_by_target_and_ignored_layers(models, tmp_path):
    """Two config groups chosen by their "re:" targets (8-bit attention, 4-bit MLP), and the
    layers `ignore` names left in bfloat16."""
    _, hf, _ = models["llama", "W4A16"]
    attn = preset_name_to_scheme("W8A16", ["re:.*self_attn.*"])
    mlp = preset_name_to_scheme("W4A16", ["re:.*mlp.*"])
    qc = QuantizationConfig(
        config_groups={"attention": attn, "mlp": mlp},
        format="pack-quantized",
        quantization_status="compressed",
        ignore=["lm_head", "re:.*down_proj"],
    ).model_dump(mode="json")

    def pick(layer):
        if layer.endswith("down_proj"):
            return None
        return ("W8A16", attn) if "self_attn" in layer else ("W4A16", mlp)

    path = tmp_path / "mixed"
    meant = write_checkpoint(hf, path, None, None, qc, pick)
    loaded = load_dir(path)
    held = loaded.weight_bytes
    floats = ("embed_tokens", "lm_head", "down_proj")
    bf16 = sum(2 * w.numel() for name, w in meant.items() if any(f in name for f in floats))
    assert held["q8_0"] > 0 and held["q4_0"] > 0 and held["bf16"] == bf16
    agrees_with_transformers(loaded, hf, meant)


def changed(path, tmp_path, change) -> object:
    """`path` with its quantization_config changed by `change(qc)`."""
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in path.iterdir():
        if f.name != "config.json":
            (bad / f.name).symlink_to(f)
    config = json.loads((path / "config.json").read_text())
    change(config["quantization_config"])
    (bad / "config.json").write_text(json.dumps(config))
    return bad


def group0(**weights):
    return lambda qc: qc["config_groups"]["group_0"]["weights"].update(weights)


@pytest.mark.parametrize(
    "change,message",
    [
        (group0(num_bits=3), "3-bit integer weights in 'pack-quantized' are not served"),
        (group0(group_size=48), "group_size 48 is not served"),
        (group0(actorder="group"), r"actorder 'group'\) is not served"),
        (group0(actorder="dynamic"), r"actorder 'dynamic'\) is not served"),
        (group0(strategy="block"), "strategy 'block' is not served"),
        (group0(type="float"), "float weights of 4 bits by group in 'pack-quantized'"),
        (lambda qc: qc.update(kv_cache_scheme={"num_bits": 8, "type": "int"}), "kv_cache_scheme"),
        (lambda qc: qc.update(sparsity_config={"format": "sparse-24-bitmask"}), "sparsity_config"),
        (lambda qc: qc.update(quantization_status="frozen"), "status 'frozen' are not served"),
        (
            lambda qc: qc["config_groups"]["group_0"].update(targets=["re:.*mlp.*"]),
            r"self_attn\.\w_proj: quantized in the checkpoint, but no compressed-tensors",
        ),
        (lambda qc: qc.update(format="marlin-24"), "in 'marlin-24' are not served"),
    ],
)
def test_what_is_not_served_is_refused_naming_it(models, tmp_path, change, message):
    path, _, _ = models["llama", "W4A16"]
    with pytest.raises(CheckpointError, match=message):
        load_dir(changed(path, tmp_path, change))


def test_flags_and_broken_layers(models, tmp_path):
    path, hf, _ = models["llama", "W4A16"]
    with pytest.raises(CheckpointError, match="--quantization compressed-tensors: .* has no"):
        load_dir(hf, quantization="compressed-tensors")
    with pytest.raises(CheckpointError, match=r"--quantization q8_0: .*already quantized"):
        load_dir(path, quantization="q8_0")
    assert load_dir(path, quantization="compressed-tensors").weight_bytes["q4_0"] > 0
    bad = without(path, tmp_path / "broken", "model.layers.1.mlp.up_proj.weight_scale")
    with pytest.raises(
        CheckpointError, match=r"model.layers.1.mlp.up_proj: incomplete compressed-tensors layer"
    ):
        load_dir(bad)
