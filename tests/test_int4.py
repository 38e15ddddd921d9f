"""AWQ and GPTQ int4 checkpoints (gpu/quant/int4.py): repacked into GGUF's Q4_0 / Q4_1 blocks
and served by the block kernels.

The checkpoints are written here in each method's own layout (AutoAWQ's "gemm" packing, AutoGPTQ's
v1 with its zeros stored minus one, GPTQModel's v2), from integers and scales drawn here, so the
reference is the checkpoint's own meaning w = s (q - z), computed in float32 by this file:
- the repacked blocks, dequantized by the `gguf` package, are that: exactly for Q4_0
  (symmetric), within f16's rounding of s z for Q4_1 (its m = -s z is an f16, as in AWQ's own
  kernels);
- tiny Llama and Qwen3 checkpoints served by weir against transformers on those weights:
  teacher-forced top-1 agreement of at least 80% and a mean gap under 0.1 nats, as for GGUF's
  block formats (tests/test_gguf.py says why not greedy equality: int8 activations);
- what is not served is refused at start-up naming it.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from core.config import CheckpointError, EngineConfig
from gpu.launch import load
from gpu.quant.int4 import PARTS, Int4Scheme, repack
from gpu.tiny_model import build_tiny_model
from tests.test_gguf import run

TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun today."
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHAPE = dict(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, num_layers=2)


def pack_rows(v: np.ndarray) -> np.ndarray:
    """[..., 8c] 4-bit values -> int32 [..., c], value 8j + p in bits 4p (GPTQ's order)."""
    v = v.astype(np.uint32).reshape(*v.shape[:-1], -1, 8)
    return (v << (4 * np.arange(8, dtype=np.uint32))).sum(-1, dtype=np.uint32).view(np.int32)


def pack_awq(v: np.ndarray) -> np.ndarray:
    """AWQ's order: nibble p of each int32 holds value 8j + (0, 2, 4, 6, 1, 3, 5, 7)[p]."""
    v = v.reshape(*v.shape[:-1], -1, 8)[..., [0, 2, 4, 6, 1, 3, 5, 7]]
    return pack_rows(v.reshape(*v.shape[:-2], -1))


def int4_layer(w: torch.Tensor, group: int, sym: bool):
    """Round-to-nearest 4-bit of w [n, k] per group of inputs: q, z [n, groups], s f16."""
    n, k = w.shape
    g = w.reshape(n, k // group, group).double()
    if sym:
        s = g.abs().amax(-1) / 7.5
        z = torch.full_like(s, 8)
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        s = (hi - lo) / 15
        z = torch.round(-lo / s).clamp(0, 15)
    s = s.half().double()
    q = torch.round(g / s[..., None] + z[..., None]).clamp(0, 15)
    return q.reshape(n, k).to(torch.uint8).numpy(), z.to(torch.uint8).numpy(), s.half().numpy()


def checkpoint_tensors(method: str, q, z, s, version: str = "gptq") -> dict[str, torch.Tensor]:
    """One layer's tensors in `method`'s layout (q [n, k], z and s [n, groups])."""
    n, k = q.shape
    groups = s.shape[1]
    if method == "awq":
        return {
            "qweight": torch.from_numpy(pack_awq(q.T.copy())),  # [k, n / 8]
            "qzeros": torch.from_numpy(pack_awq(z.T.copy())),  # [groups, n / 8]
            "scales": torch.from_numpy(s.T.copy()),
        }
    stored = z.astype(np.int16) - (1 if version == "gptq" else 0)
    return {
        "qweight": torch.from_numpy(pack_rows(q).T.copy()),  # [k / 8, n]
        "qzeros": torch.from_numpy(pack_rows((stored & 0xF).T.copy())),  # [groups, n / 8]
        "scales": torch.from_numpy(s.T.copy()),
        "g_idx": torch.arange(k, dtype=torch.int32) // (k // groups),
    }


def meaning(q, z, s) -> torch.Tensor:
    group = q.shape[1] // s.shape[1]
    zz = np.repeat(z, group, axis=1).astype(np.float32)
    ss = np.repeat(s.astype(np.float32), group, axis=1)
    return torch.from_numpy(ss * (q.astype(np.float32) - zz))


SCHEMES = {
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
             "version": "gemm"}, False),
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
              "sym": True}, True),
    "gptq_v2 asym": ({"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": False,
                      "sym": False, "checkpoint_format": "gptq_v2"}, False),
}  # fmt: skip


@pytest.mark.parametrize("key", list(SCHEMES))
def test_repacked_blocks_are_the_checkpoints_weights(key):
    import gguf

    qc, sym = SCHEMES[key]
    scheme = Int4Scheme.from_config(qc, "test")
    w = torch.randn(48, 256) * 0.05
    group = 256 if qc["group_size"] == -1 else qc["group_size"]
    q, z, s = int4_layer(w, group, sym)
    parts = checkpoint_tensors(qc["quant_method"], q, z, s, qc.get("checkpoint_format", "gptq"))
    block = repack(scheme, "layer.weight", **{p: parts.get(p) for p in PARTS})
    assert block.fmt.name == ("q4_0" if sym else "q4_1") and block.shape == (48, 256)
    got = gguf.quants.dequantize(block.rows, gguf.GGMLQuantizationType(block.fmt.ggml_type))
    want = meaning(q, z, s).numpy()
    if sym:
        assert np.array_equal(got, want)
    else:  # m = -s z in f16: within half an f16 step of s z
        sz = np.repeat(s.astype(np.float32) * z, group, axis=1)
        assert (np.abs(got - want) <= np.abs(sz) * 2.0**-11 + 1e-7).all()
    assert np.abs(want - w.numpy()).max() < 0.05  # and the test's quantizer is a quantizer


def test_gptq_8_bit_becomes_q8_0_exactly():
    """GPTQ's 8-bit layout (four inputs an int32, v1's zeros stored minus one) as Q8_0: the
    integers and scales unchanged; asymmetric zeros are refused."""
    import gguf

    qc = {"quant_method": "gptq", "bits": 8, "group_size": 128, "desc_act": False, "sym": True}
    scheme = Int4Scheme.from_config(qc, "test")
    w = torch.randn(48, 256) * 0.05
    g = w.reshape(48, 2, 128).double()
    s = (g.abs().amax(-1) / 127.5).half()
    q = (torch.round(g / s.double()[..., None]) + 128).clamp(0, 255).reshape(48, 256)
    q, s = q.to(torch.uint8).numpy(), s.numpy()

    def pack4(v):  # [..., 4c] 8-bit values -> int32 [..., c], value 4j + p in bits 8p
        v = v.astype(np.uint32).reshape(*v.shape[:-1], -1, 4)
        return (v << (8 * np.arange(4, dtype=np.uint32))).sum(-1, dtype=np.uint32).view(np.int32)

    zeros = np.full((2, 48), 127, dtype=np.uint8)  # z - 1
    parts = {
        "qweight": torch.from_numpy(pack4(q).T.copy()),  # [k / 4, n]
        "qzeros": torch.from_numpy(pack4(zeros)),  # [groups, n / 4]
        "scales": torch.from_numpy(s.T.copy()),
    }
    block = repack(scheme, "layer.weight", **parts)
    assert block.fmt.name == "q8_0" and block.shape == (48, 256)
    got = gguf.quants.dequantize(block.rows, gguf.GGMLQuantizationType(block.fmt.ggml_type))
    want = np.repeat(s.astype(np.float32), 128, axis=1) * (q.astype(np.float32) - 128)
    assert np.array_equal(got, want)
    zeros[1, 5] = 100
    parts["qzeros"] = torch.from_numpy(pack4(zeros))
    with pytest.raises(CheckpointError, match="8-bit GPTQ zeros other than 128"):
        repack(scheme, "layer.weight", **parts)
    with pytest.raises(CheckpointError, match="asymmetric 8-bit GPTQ is not served"):
        Int4Scheme.from_config({**qc, "sym": False}, "test")


def write_int4_checkpoint(hf_dir, out, method, qc, sym):
    """`hf_dir`'s model with every linear layer as `method` holds it (the rest in float16, as
    quantizers leave it); returns the float32 state dict the checkpoint means."""
    out.mkdir()
    for f in hf_dir.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    config = json.loads((hf_dir / "config.json").read_text())
    config["quantization_config"] = qc
    config["torch_dtype"] = "float16"
    (out / "config.json").write_text(json.dumps(config))
    state = load_file(hf_dir / "model.safetensors")
    tensors, meant = {}, {}
    for name, w in state.items():
        prefix = name.removesuffix(".weight")
        if name.endswith(".weight") and prefix.rsplit(".", 1)[-1] in LINEARS:
            k = w.shape[1]
            group = k if qc["group_size"] == -1 else qc["group_size"]
            q, z, s = int4_layer(w, group, sym)
            parts = checkpoint_tensors(method, q, z, s, qc.get("checkpoint_format", "gptq"))
            tensors.update({f"{prefix}.{p}": t for p, t in parts.items()})
            meant[name] = meaning(q, z, s)
        else:
            tensors[name] = w.half()
            meant[name] = w.half().float()
    save_file(tensors, out / "model.safetensors")
    return meant


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("int4")
    out = {}
    for arch, key in (("llama", "awq"), ("qwen3", "gptq"), ("llama", "gptq_v2 asym")):
        hf = root / arch
        if not hf.exists():
            build_tiny_model(hf, arch, tie_word_embeddings=False, **SHAPE)
        qc, sym = SCHEMES[key]
        path = root / f"{arch}-{key.replace(' ', '-')}"
        out[arch, key] = (path, hf, write_int4_checkpoint(hf, path, qc["quant_method"], qc, sym))
    return out


def load_dir(path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # weir's CPU kernels (on a GPU machine "auto" would be CUDA)
        return load(EngineConfig(model=str(path), num_kv_blocks=64, **{"device": "cpu", **kw}))


@pytest.mark.parametrize(
    "arch,key", [("llama", "awq"), ("qwen3", "gptq"), ("llama", "gptq_v2 asym")]
)
def test_served_against_transformers(models, arch, key):
    """(Two ranks: tests/test_compressed_tensors.py's, the same cut of a layer's blocks.)"""
    from transformers import AutoModelForCausalLM

    path, hf, meant = models[arch, key]
    loaded = load_dir(path)
    try:
        ours = served(loaded, key)
    finally:
        loaded.core.close()
    ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    ref.load_state_dict(meant)
    ids = loaded.tokenizer.encode(TEXT, add_special_tokens=False)
    with torch.no_grad():
        logprobs = torch.log_softmax(ref.eval()(torch.tensor([ids])).logits[0].double(), -1)
    agree = int((ours == logprobs.argmax(-1)).sum())
    assert agree >= 0.8 * len(ours), (agree, len(ours))
    gaps = logprobs.max(-1).values - logprobs[torch.arange(len(ours)), ours]
    assert float(gaps.mean()) < 0.1, gaps


def served(loaded, key) -> torch.Tensor:
    """The prompt's teacher-forced top-1 tokens and the first generated one."""
    held = loaded.weight_bytes
    fmt = "q4_0" if SCHEMES[key][1] else "q4_1"
    assert set(held) == {fmt, "f16", "f32"} and held["f32"] < 4 * 256 * 8  # f32: norms only
    ids = loaded.tokenizer.encode(TEXT, add_special_tokens=False)
    tokens, plp = run(loaded, ids, n=1, prompt_logprobs=1)
    return torch.tensor([plp[i].top_ids[0] for i in range(1, len(ids))] + tokens[:1])


@pytest.mark.parametrize(
    "change,message",
    [
        ({"bits": 8}, "bits=8 is not served"),
        ({"group_size": 48}, "group_size 48 is not served"),
        ({"version": "gemv"}, "AWQ version 'gemv' is not served"),
        ({"quant_method": "bitsandbytes"}, "quantized with 'bitsandbytes' are not served"),
        ({"quant_method": "gptq", "desc_act": True}, "desc_act=true"),
    ],
)
def test_what_is_not_served_is_refused_naming_it(models, tmp_path, change, message):
    path, _, _ = models["llama", "awq"]
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in path.iterdir():
        (bad / f.name).symlink_to(f)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(change)
    (bad / "config.json").unlink()
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        load_dir(bad)


def test_flags_and_broken_layers(models, tmp_path):
    path, _, _ = models["llama", "awq"]
    with pytest.raises(CheckpointError, match="--quantization gptq: .* has no gptq"):
        load_dir(path, quantization="gptq")
    with pytest.raises(CheckpointError, match=r"--quantization q4_k: .*already quantized \(awq\)"):
        load_dir(path, quantization="q4_k")
    assert load_dir(path, quantization="awq").weight_bytes["q4_1"] > 0
    bad = without(path, tmp_path / "broken", "model.layers.1.mlp.up_proj.scales")
    with pytest.raises(CheckpointError, match=r"model.layers.1.mlp.up_proj: incomplete awq layer"):
        load_dir(bad)


def without(path, out, name):
    """A copy of checkpoint `path` (its other files linked) whose weights lack tensor `name`."""
    out.mkdir()
    for f in path.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).symlink_to(f)
    tensors = load_file(path / "model.safetensors")
    del tensors[name]
    save_file(tensors, out / "model.safetensors")
    return out
