"""GGUF files served directly (gpu/gguf_file.py): tiny Llama, Qwen2 and Qwen3 models written with
the `gguf` package's writer (gpu/quant/gguf_write.py), loaded by weir and compared with
transformers running the same weights, dequantized by the `gguf` package.

What is asserted, per format:
- F32 files: greedy output equal to transformers for 12 tokens (names, Q/K row order, metadata,
  tokenizer all right).
- Block and 16-bit formats: teacher-forced top-1 agreement of at least 80% over a 37-token
  text (and the first generated token), and the tokens weir picks on average within 0.1 nats of
  transformers' best there (one flipped near-tie may cost 1.3 nats: transformers makes the same
  pick when its activations are rounded to int8 as weir's are). Not greedy equality: weir
  takes the activations of a block format as int8 per 32 (bf16 for BF16 weights), as llama.cpp
  does, and these random tiny models have
  near-ties (top logits 0.01-0.1 apart) that such rounding flips (transformers itself, given
  int8 activations, agrees with its float self on 33-36 of 37 positions).
- The compiled stack and the module path give the same tokens; weights stay in their formats.
"""

from __future__ import annotations

import json
import warnings

import gguf
import numpy as np
import pytest
import torch

from core.config import CheckpointError, EngineConfig
from core.request import EngineRequest
from core.sampling import SamplingParams
from gpu.gguf_names import hf_name, llama_unpermute_index
from gpu.launch import load
from gpu.quant.formats import BY_GGML_TYPE
from gpu.quant.gguf_random import write_random_gguf
from gpu.quant.gguf_write import q4_k_m, uniform, write_gguf
from gpu.tiny_model import build_tiny_model

TEXT = (
    "the river flows over the stone and the server streams tokens to every client while the "
    "cache holds blocks of keys"
)
SHAPE = dict(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, num_layers=2)
FILES = {
    ("llama", "f32"): uniform("f32"),
    ("qwen2", "f32"): uniform("f32"),
    ("qwen3", "f32"): uniform("f32"),
    ("llama", "q8_0"): uniform("q8_0"),
    ("llama", "q4_k_m"): q4_k_m,
    ("qwen3", "bf16"): uniform("bf16"),
    ("qwen3", "q4_k_m"): q4_k_m,
    ("qwen3", "q5_k"): uniform("q5_k"),
    ("llama", "q3_k"): uniform("q3_k"),
    ("qwen2", "q2_k"): uniform("q2_k"),
    ("qwen3", "iq4_xs"): uniform("iq4_xs"),
    ("llama", "iq3_xxs"): uniform("iq3_xxs"),
    ("qwen2", "iq3_s"): uniform("iq3_s"),
    ("qwen3", "iq2_xs"): uniform("iq2_xs"),
    ("llama", "iq2_s"): uniform("iq2_s"),
    ("qwen2", "q4_0"): uniform("q4_0"),
    ("qwen2", "q4_k_m"): q4_k_m,  # Q/K/V in two formats, with biases
}


def write_files(root, files: dict) -> tuple[dict, dict]:
    """The Hugging Face models of the archs `files` names, and each (arch, format) written as
    a GGUF file by its rule."""
    hf = {
        arch: build_tiny_model(
            root / arch,
            arch,
            tie_word_embeddings=arch != "llama",
            pretokenizer="llama-bpe" if arch == "llama" else "qwen2",  # as the real ones split
            **SHAPE,
        )
        for arch in sorted({arch for arch, _ in files})
    }
    paths = {
        key: write_gguf(hf[key[0]], root / f"{key[0]}-{key[1]}.gguf", fmt)
        for key, fmt in files.items()
    }
    return hf, paths


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_files(tmp_path_factory.mktemp("gguf"), FILES)


def hf_from_gguf(path, hf_dir):
    """transformers' model of `hf_dir`'s shape holding the GGUF file's weights, dequantized by
    the gguf package (Llama's Q/K rows put back in Hugging Face's order)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    state = model.state_dict()
    cfg = model.config
    for t in gguf.GGUFReader(path).tensors:
        name = hf_name(t.name)
        w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
        w = w.reshape(state[name].shape)
        if cfg.model_type == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            w = w[torch.from_numpy(llama_unpermute_index(w.shape[0], heads))]
        state[name].copy_(w)
    return model.eval()


def run(loaded, ids, n=12, prompt_logprobs=None):
    core = loaded.core
    params = SamplingParams(
        temperature=0, max_tokens=n, ignore_eos=True, prompt_logprobs=prompt_logprobs
    )
    core.add(EngineRequest("r", ids, params))
    tokens, plp = [], None
    while core.has_work:
        for o in core.step():
            tokens += o.new_token_ids
            plp = o.prompt_logprobs or plp
    return tokens, plp


def load_file(path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # weir's CPU kernels (on a GPU machine "auto" would be CUDA)
        return load(EngineConfig(model=str(path), num_kv_blocks=64, **{"device": "cpu", **kw}))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_f32_file_is_transformers_exactly(files, arch):
    hf, paths = files
    loaded = load_file(paths[arch, "f32"])
    ids = loaded.tokenizer.encode(TEXT, add_special_tokens=False)[:20]
    got, _ = run(loaded, ids)
    ref = hf_from_gguf(paths[arch, "f32"], hf[arch])
    want = ref.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert got == want[0, len(ids) :].tolist()


@pytest.mark.parametrize(
    "arch,fmt",
    [("llama", "q8_0"), ("llama", "q4_k_m"), ("qwen3", "bf16"), ("qwen3", "q4_k_m"),
     ("qwen3", "q5_k"), ("qwen2", "q4_0"), ("qwen2", "q4_k_m"), ("llama", "q3_k"),
     ("qwen2", "q2_k"), ("qwen3", "iq4_xs"), ("llama", "iq3_xxs"), ("qwen2", "iq3_s"),
     ("qwen3", "iq2_xs"), ("llama", "iq2_s")],
)  # fmt: skip
def test_block_formats_against_transformers(files, arch, fmt):
    hf, paths = files
    close_to_transformers(paths[arch, fmt], hf[arch])


def close_to_transformers(path, hf_dir, **kw):
    """The module docstring's bar, and (loaded as it is by default) the compiled stack equal to
    the module path."""
    loaded = load_file(path, **kw)
    ids = loaded.tokenizer.encode(TEXT, add_special_tokens=False)
    tokens, plp = run(loaded, ids, n=1, prompt_logprobs=1)
    ref = hf_from_gguf(path, hf_dir)
    with torch.no_grad():
        logprobs = torch.log_softmax(ref(torch.tensor([ids])).logits[0].double(), -1)
    ours = [plp[i].top_ids[0] for i in range(1, len(ids))] + tokens[:1]
    theirs = logprobs.argmax(-1).tolist()
    agree = sum(a == b for a, b in zip(ours, theirs))
    assert agree >= 0.8 * len(ours), (agree, len(ours))
    gaps = logprobs.max(-1).values - logprobs[torch.arange(len(ours)), torch.tensor(ours)]
    assert float(gaps.mean()) < 0.1, gaps
    if kw:
        loaded.core.close()  # (tensor-parallel workers)
        return
    # the compiled stack and the module path: the same kernels in the same order
    modules = load_file(path, cpu_forward="modules")
    assert loaded.core.runner.model.stack is not None and modules.core.runner.model.stack is None
    assert run(load_file(path), ids)[0] == run(modules, ids)[0]


@pytest.mark.parametrize(
    "rule,formats",
    [(q4_k_m, {"q5_0", "q8_0"}), (uniform("q5_k"), {"q5_1"}), (uniform("q4_1"), {"q4_1"})],
)
def test_rows_that_are_not_whole_super_blocks(tmp_path, rule, formats):
    """A hidden size that is no multiple of 256 (Qwen2.5-0.5B's 896): llama-quantize writes
    those products as Q5_0 in a Q4_K_M file, Q5_1 in a Q5_K_M one, Q8_0 for Q6_K's; weir serves
    them (and Q4_1) against transformers."""
    hf_dir = build_tiny_model(
        tmp_path / "m", "qwen2", hidden_size=384, intermediate_size=512, num_heads=6,
        num_kv_heads=2, num_layers=2, pretokenizer="qwen2",
    )  # fmt: skip
    path = write_gguf(hf_dir, tmp_path / "m.gguf", rule)
    written = {BY_GGML_TYPE[int(t.tensor_type)].name for t in gguf.GGUFReader(path).tensors}
    assert formats <= written, written
    close_to_transformers(path, hf_dir)


def test_a_random_file_written_in_blocks(files, tmp_path):
    """The benchmark's 8B-shaped file is written this way (random blocks, no float weights):
    at the tiny shape, served as its blocks say, the gguf package being the judge."""
    hf, _ = files
    config = json.loads((hf["llama"] / "config.json").read_text())
    path = write_random_gguf(tmp_path / "random.gguf", config, hf["llama"], q4_k_m)
    assert {t.tensor_type.name for t in gguf.GGUFReader(path).tensors} == {"Q4_K", "Q6_K", "F32"}
    loaded = load_file(path)
    ids = loaded.tokenizer.encode(TEXT, add_special_tokens=False)
    tokens, plp = run(loaded, ids, n=1, prompt_logprobs=1)
    ref = hf_from_gguf(path, hf["llama"])
    with torch.no_grad():
        logprobs = torch.log_softmax(ref(torch.tensor([ids])).logits[0].double(), -1)
    ours = torch.tensor([plp[i].top_ids[0] for i in range(1, len(ids))] + tokens[:1])
    gaps = logprobs.max(-1).values - logprobs[torch.arange(len(ours)), ours]
    assert float(gaps.mean()) < 0.1, gaps
    spread = logprobs.max(-1).values - logprobs.median(-1).values
    assert float(spread.min()) > 1.0, spread  # the weights decide: not a flat distribution


def test_weights_stay_in_their_formats(files):
    _, paths = files
    path = paths["llama", "q4_k_m"]
    loaded = load_file(path)
    reader = gguf.GGUFReader(path)
    by_type: dict[str, int] = {}
    for t in reader.tensors:
        key = t.tensor_type.name.lower()
        by_type[key] = by_type.get(key, 0) + int(t.n_bytes)
    held = loaded.weight_bytes
    assert set(held) == set(by_type) == {"q4_k", "q6_k", "f32"}
    for fmt in ("q4_k", "q6_k"):  # repacked: k-quants' 6-bit scales unpacked, at most +3%
        assert by_type[fmt] <= held[fmt] <= 1.03 * by_type[fmt]
    assert held["f32"] == by_type["f32"]  # the norms; no float copy of any matrix


def test_tokenizer_and_template_come_from_the_file(files, tmp_path):
    hf, paths = files
    from transformers import AutoTokenizer

    loaded = load_file(paths["llama", "q8_0"])
    theirs = AutoTokenizer.from_pretrained(hf["llama"])
    assert loaded.tokenizer.encode(TEXT) == theirs.encode(TEXT, add_special_tokens=False)
    assert loaded.tokenizer.chat_template == theirs.chat_template
    assert loaded.tokenizer.eos_token == "<|im_end|>"
    # the server loads the same tokenizer from the folder the engine saved it in
    saved = AutoTokenizer.from_pretrained(loaded.tokenizer_path)
    assert saved.encode(TEXT) == loaded.tokenizer.encode(TEXT)
    # --tokenizer: a Hugging Face folder instead
    other = load_file(paths["llama", "q8_0"], tokenizer=str(hf["llama"]))
    assert other.tokenizer_path == str(hf["llama"])


def test_quantizing_at_load_equals_the_same_gguf(files, tmp_path):
    """--quantization q4_k on the safetensors checkpoint holds the same bytes as a Q4_K GGUF
    written by the same quantizer, so it gives the same tokens."""
    hf, _ = files
    gguf_path = write_gguf(hf["qwen3"], tmp_path / "q.gguf", uniform("q4_k"))
    # (a quantized GGUF's KV cache is 16-bit, as llama.cpp's is)
    online = load(
        EngineConfig(
            model=str(hf["qwen3"]),
            quantization="q4_k",
            num_kv_blocks=64,
            kv_cache_dtype="bfloat16",
            device="cpu",
        )
    )
    assert set(online.weight_bytes) == {"q4_k", "f32"}
    ids = online.tokenizer.encode(TEXT)[:16]
    assert run(online, ids)[0] == run(load_file(gguf_path), ids)[0]


# ---- bad input: a start-up error naming what is wrong (exit code 2 from `weir serve`) ----
def rewrite(src, dst, *, arch=None, tensor_type=None):
    """A copy of GGUF `src` with another architecture name, or its first matrix re-typed."""
    reader = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), arch or reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, value, vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(name, value, vtype)
    retyped = False
    for t in reader.tensors:
        data, qtype = np.array(t.data), t.tensor_type
        if tensor_type is not None and not retyped and len(t.shape) == 2:
            qtype, retyped = tensor_type, True
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            data = np.zeros((int(t.shape[1]), int(t.shape[0]) // block * size), dtype=np.uint8)
        shape = [int(d) for d in reversed(t.shape)]
        w.add_tensor(
            t.name, data, raw_shape=shape if qtype in (0, 1, 30) else data.shape, raw_dtype=qtype
        )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_bad_files_are_named_start_up_errors(files, tmp_path):
    hf, paths = files
    src = paths["llama", "q8_0"]
    data = src.read_bytes()
    cases = []
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) * 2 // 3])
    cases.append((truncated, "runs past the end|not a readable GGUF"))
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    cases.append((garbage, "not a readable GGUF"))
    cases.append(
        (rewrite(src, tmp_path / "arch.gguf", arch="gpt2"), "architecture 'gpt2' is not served")
    )
    iq1 = rewrite(src, tmp_path / "iq1.gguf", tensor_type=gguf.GGMLQuantizationType.IQ1_S)
    cases.append((iq1, r"tensor \S+ has type IQ1_S"))
    for path, message in cases:
        with pytest.raises(CheckpointError, match=message):
            load_file(path)
    # a tokenizer with more tokens than the model has rows
    big = tmp_path / "big"
    build_tiny_model(big, "qwen3", vocab_size=2048, **SHAPE)
    with pytest.raises(
        CheckpointError, match=r"\d+ tokens but the model.s vocabulary has 1024 rows"
    ):
        load_file(src, tokenizer=str(big))
    with pytest.raises(CheckpointError, match="already quantized"):
        load_file(src, quantization="q4_k")
    with pytest.raises(CheckpointError, match="not a .gguf file"):
        load(EngineConfig(model=str(hf["llama"]), quantization="gguf", num_kv_blocks=16))


def test_weir_serve_exits_2_on_a_bad_file(tmp_path):
    import subprocess
    import sys

    from tests.conftest import free_port

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    proc = subprocess.run(
        [sys.executable, "-m", "server", "serve", str(bad), "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "bad.gguf: not a readable GGUF file" in proc.stderr


def test_a_gguf_file_served_over_http(files):
    """`weir serve model.gguf`: the engine in its own process, the server's tokenizer the one
    the engine saved from the file; chat through the template from the file; /metrics says what
    the weights and the KV cache hold."""
    import httpx

    from tests.conftest import LiveServer

    _, paths = files
    config = EngineConfig(
        model=str(paths["qwen3", "q4_k_m"]), served_model_name=["q"], num_kv_blocks=64, device="cpu"
    )
    server = LiveServer(config, engine_process=True).start()
    try:
        body = {
            "model": "q",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 5,
            "temperature": 0,
        }
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["usage"]["completion_tokens"] == 5
        # the prompt went through the file's ChatML template: 3 marker tokens and the text
        assert out["usage"]["prompt_tokens"] >= 5
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        for fmt in ("q4_k", "q6_k", "f32"):
            assert f'weir:model_weights_bytes{{format="{fmt}",model_name="q"}}' in metrics
        assert 'weir:kv_cache_bytes{dtype="bfloat16",model_name="q"}' in metrics
    finally:
        server.stop()
