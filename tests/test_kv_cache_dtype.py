"""--kv-cache-dtype: a 16-bit KV cache under a float32 model (twice the tokens in the same memory,
attention reading half the bytes) and an FP8 one (E4M3 or E5M2) under any model (half a 16-bit
one's), through the engine, the compiled CPU forward, the Triton kernels and the server, the
rounding of the compiled K/V writes, and the combinations that are refused."""

from __future__ import annotations

import httpx
import msgspec
import pytest
import torch

from core.config import EngineConfig
from core.request import EngineRequest
from core.sampling import SamplingParams
from gpu.cpu import build as cpu_build
from gpu.kv_cache import KV_DTYPES, cache_dtype
from gpu.launch import load
from server.cli import build_parser, config_from_args
from tests.conftest import LiveServer
from tests.test_ops import metric

PROMPTS = ["hello there", "the model is a server " * 4, "café naïve 你好 😀", "token " * 30]


def run_greedy(loaded, max_tokens=16):
    """{request id: tokens}, and each step's logits [rows, vocab] with the rows' request ids."""
    core = loaded.core
    for i, text in enumerate(PROMPTS):
        ids = loaded.tokenizer.encode(text)
        p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        core.add(EngineRequest(str(i), ids, p))
    tokens: dict[str, list[int]] = {}
    steps = []
    while core.has_work:
        outs = core.step()
        for o in outs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        steps.append(([o.request_id for o in outs], core.runner.last_logits.clone()))
    return tokens, steps


# (model dtype, cache dtype, blocks in the same memory as the model's own cache's, the logits'
# bound as a share of their range, steps compared at least): bfloat16 keeps 8 bits of mantissa,
# float16 11, FP8 E4M3 4 and E5M2 3; seen 0.2-0.8%, 0.03-0.05%, 3-4% and 6-10% of the range on
# these models, where FP8 changes a greedy token within two steps (random weights: logits close
# together)
CASES = [
    ("float32", "bfloat16", 2, 0.02, 4),
    ("float32", "float16", 2, 0.003, 4),
    ("float32", "fp8_e5m2", 4, 0.15, 1),
    ("bfloat16", "fp8_e5m2", 2, 0.15, 1),
    ("float32", "fp8_e4m3", 4, 0.15, 1),
    ("bfloat16", "fp8", 2, 0.15, 1),
]


@pytest.mark.parametrize("dtype,kv,more,bound,steps", CASES)
def test_a_narrower_cache_holds_more_tokens_and_decodes_close(
    dtype, kv, more, bound, steps, model_dir
):
    path = str(model_dir("llama"))
    base = EngineConfig(model=path, dtype=dtype, device="cpu", kv_cache_memory=1 << 22)
    full = load(base)
    half = load(msgspec.structs.replace(base, kv_cache_dtype=kv))
    assert half.core.kv.num_blocks == more * full.core.kv.num_blocks
    k, v = half.core.runner.kv_caches[0]
    assert k.dtype == v.dtype == KV_DTYPES[kv]
    assert half.kv_dtype == kv and full.kv_dtype == dtype
    if dtype == "float32":
        assert half.core.runner.model.stack is not None  # the compiled path takes it
    want, want_steps = run_greedy(full)
    got, got_steps = run_greedy(half)
    assert len(got) == len(PROMPTS) and all(len(t) == 16 for t in got.values())
    # Step by step, while every request's tokens so far agree, the logits differ by no more
    # than K/V rounded to the cache's dtype makes them.
    compared, differ = 0, 0
    for (ids_a, a), (ids_b, b) in zip(want_steps, got_steps):
        assert ids_a == ids_b
        assert float((a - b).abs().max()) <= bound * float(a.max() - a.min())
        differ += not torch.equal(a, b)
        compared += 1
        if any(want[r][:compared] != got[r][:compared] for r in want):
            break
    assert compared >= steps and differ > 0  # compared over steps; the cache is narrower


def test_refused_combinations_say_what_is_offered(model_dir):
    path = str(model_dir("llama"))
    with pytest.raises(ValueError, match="under a bfloat16 model"):
        load(EngineConfig(model=path, dtype="bfloat16", device="cpu", kv_cache_dtype="float16"))
    with pytest.raises(ValueError, match="under a bfloat16 model"):
        load(EngineConfig(model=path, dtype="bfloat16", device="cpu", kv_cache_dtype="float32"))
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8_inc is not offered.*fp8_e5m2"):
        EngineConfig(kv_cache_dtype="fp8_inc").validate()
    for name in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        EngineConfig(kv_cache_dtype=name).validate()
    assert cache_dtype("fp8_e5m2", torch.float16, torch.device("cpu")) == torch.float8_e5m2
    assert cache_dtype("fp8", torch.float16, torch.device("cpu")) == torch.float8_e4m3fn


def test_fp8_on_a_gpu_needs_its_conversions(monkeypatch):
    """An Ampere GPU (8.0) has no FP8 conversions: refused naming the capability; Hopper's
    (9.0) and Ada's (8.9) cache FP8."""
    for capability in ((8, 0), (8, 9), (9, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d, c=capability: c)
        if capability < (8, 9):
            with pytest.raises(ValueError, match=r"capability 8.9 or later.*\(8, 0\)"):
                cache_dtype("fp8_e5m2", torch.bfloat16, torch.device("cuda"))
        else:
            got = cache_dtype("fp8", torch.bfloat16, torch.device("cuda"))
            assert got == torch.float8_e4m3fn


@pytest.mark.parametrize(
    "arch,backend,kv", [("llama", "triton", "fp8_e5m2"), ("qwen3", "cuda", "fp8")]
)
def test_the_triton_kernels_serve_an_fp8_cache_as_the_reference_does(
    arch, backend, kv, model_dir, monkeypatch
):
    """The Triton attention kernels (and the CUDA backend's fused rotation and K/V write, with
    Qwen3's head norms) over an FP8 cache: the same cache bit for bit as torch's reference
    attention writes, so the same tokens and the logits within float32's sums (Triton's
    interpreter on CPU)."""
    from tests.test_phi3 import use_cuda_backend

    path = str(model_dir(arch))
    base = EngineConfig(
        model=path, dtype="float32", device="cpu", kv_cache_dtype=kv, attention_backend="torch"
    )
    want, want_steps = run_greedy(load(base), max_tokens=6)
    config = msgspec.structs.replace(base, attention_backend="triton")
    if backend == "cuda":
        config = msgspec.structs.replace(config, **use_cuda_backend(monkeypatch))
    loaded = load(config)
    k, _ = loaded.core.runner.kv_caches[0]
    assert k.dtype == KV_DTYPES[kv]
    got, got_steps = run_greedy(loaded, max_tokens=6)
    assert got == want
    for (ids_a, a), (ids_b, b) in zip(want_steps, got_steps):
        assert ids_a == ids_b
        torch.testing.assert_close(b, a, atol=1e-4 * float(a.max() - a.min()), rtol=1e-4)


def test_the_flag_and_its_aliases():
    def parse(*flags):
        return config_from_args(build_parser().parse_args(["serve", *flags])).kv_cache_dtype

    assert parse() == "auto"
    assert parse("--kv-cache-dtype", "bfloat16") == "bfloat16"
    assert parse("--kv-cache-dtype", "half") == "float16"
    assert parse("--kv-cache-dtype", "auto") == "auto"
    assert parse("--kv-cache-dtype", "fp8_e5m2") == "fp8_e5m2"
    assert parse("--kv-cache-dtype", "fp8") == "fp8"


def test_the_compiled_k_v_writes_round_as_torch_does():
    """The compiled forward writes K/V into a narrower cache itself (forward.cpp): every float32
    bit pattern drawn, and the edges (FP8's largest finite values, the ties past them, what
    E4M3 saturates, subnormals, signed zeros), rounds to torch's .to() bits (NaN to a NaN),
    E4M3 saturated to +-448 first as the module path writes it."""
    g = torch.Generator().manual_seed(0)
    drawn = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=g).to(torch.int32)
    edges = torch.tensor(
        [57344.0, 61439.99, 61440.0, 65535.0, 65536.0, 1e9, float("inf"), 2.0**-14, 2.0**-15]
        + [2.0**-16, 2.0**-17, 3 * 2.0**-18, 1.125, 1.375, 1.3125, 0.0, 65520.0, 65519.0]
        + [448.0, 447.9, 449.0, 464.0, 465.0, 480.0, 2.0**-6, 2.0**-9, 2.0**-10, 3 * 2.0**-11]
    )
    x = torch.cat([drawn.view(torch.float32), edges, -edges, torch.randn(1 << 16) * 1e-4])
    ops = cpu_build.load()
    for dtype in (torch.bfloat16, torch.float16, torch.float8_e5m2, torch.float8_e4m3fn):
        top = 448.0 if dtype == torch.float8_e4m3fn else float("inf")
        got, want = ops.round_to_cache(x, dtype), x.clamp(-top, top).to(dtype)
        nan = got.float().isnan()
        assert torch.equal(nan, want.float().isnan()) and nan.any()
        bits = torch.uint8 if dtype.itemsize == 1 else torch.int16
        assert torch.equal(got.view(bits)[~nan], want.view(bits)[~nan]), dtype


@pytest.mark.parametrize("kv", ["bfloat16", "fp8"])
def test_served_with_a_narrower_cache(kv, model_dir):
    server = LiveServer(
        EngineConfig(
            model=str(model_dir("qwen3")),
            dtype="float32",
            served_model_name=["m"],
            kv_cache_dtype=kv,
            num_kv_blocks=64,
        ),
        metrics_prefix="vllm",
    ).start()
    try:
        r = httpx.post(
            server.url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
        text = httpx.get(server.url + "/metrics").text
        assert metric(text, "vllm:cache_config_info", cache_dtype=kv) == 1
    finally:
        server.stop()


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_fp8_caches_under_beams_preemption_and_the_prefix_cache(kv, model_dir):
    """What else touches the cache's bytes: a beam's copy of a shared partial block (torch
    indexing on FP8 tensors), preemption and recompute on a tight pool, prefix-cache hits (the
    same prompt twice). The compiled forward and the module path write and read the same bytes,
    so their beams and tokens are the same."""
    from tests.test_beam_search import POOLS, PROMPTS as BEAM_PROMPTS, SEARCHES, beam_params

    path = str(model_dir("llama"))
    config = EngineConfig(
        model=path, dtype="float32", device="cpu", kv_cache_dtype=kv, **POOLS["tight"]
    )
    runs = []
    for forward in ("fused", "modules"):
        loaded = load(msgspec.structs.replace(config, cpu_forward=forward))
        core = loaded.core
        copies = []
        copy_blocks = core.runner._copy_blocks
        core.runner._copy_blocks = lambda pairs: (copies.extend(pairs), copy_blocks(pairs))
        for p, text in enumerate(BEAM_PROMPTS + BEAM_PROMPTS[:1]):
            ids = loaded.tokenizer.encode(text)
            for s, search in enumerate(SEARCHES):
                core.add(EngineRequest(f"{p}-beams-{s}", ids, beam_params(*search)))
            greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
            core.add(EngineRequest(f"{p}-greedy", ids, greedy))
        got: dict[str, list] = {}
        while core.has_work:
            for out in core.step():
                if out.beams:
                    got[out.request_id] = [b.token_ids for b in out.beams]
                else:
                    got.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert copies and core.scheduler.num_preemptions > 0
        assert core.kv.num_hit_tokens > 0  # the repeated prompt's blocks were found
        assert core.runner.kv_caches[0][0].dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        runs.append(got)
    assert runs[0] == runs[1] and len(runs[0]) == (len(SEARCHES) + 1) * (len(BEAM_PROMPTS) + 1)
