"""--kv-cache-dtype: a 16-bit KV cache under a float32 model (twice the tokens in the same memory,
attention reading half the bytes), through the engine, the compiled CPU forward and the server,
and the combinations that are refused."""

from __future__ import annotations

import httpx
import msgspec
import pytest
import torch

from core.config import EngineConfig
from core.request import EngineRequest
from core.sampling import SamplingParams
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


@pytest.mark.parametrize("kv", ["bfloat16", "float16"])
def test_a_16_bit_cache_holds_twice_the_tokens_and_decodes_close(kv, model_dir):
    path = str(model_dir("llama"))
    base = EngineConfig(model=path, dtype="float32", device="cpu", kv_cache_memory=1 << 22)
    full = load(base)
    half = load(msgspec.structs.replace(base, kv_cache_dtype=kv))
    assert half.core.kv.num_blocks == 2 * full.core.kv.num_blocks
    k, v = half.core.runner.kv_caches[0]
    assert k.dtype == v.dtype == getattr(torch, kv)
    assert half.kv_dtype == kv and full.kv_dtype == "float32"
    assert half.core.runner.model.stack is not None  # the compiled path takes it
    want, want_steps = run_greedy(full)
    got, got_steps = run_greedy(half)
    assert len(got) == len(PROMPTS) and all(len(t) == 16 for t in got.values())
    # Step by step, while every request's tokens so far agree, the logits differ by no more
    # than K/V rounded to 16 bits makes them.
    compared, differ = 0, 0
    for (ids_a, a), (ids_b, b) in zip(want_steps, got_steps):
        assert ids_a == ids_b
        # bfloat16 keeps 8 bits of mantissa, float16 11: seen 0.3-0.7% and 0.03-0.05% of the
        # logits' range on these models
        bound = (0.02 if kv == "bfloat16" else 0.003) * float(a.max() - a.min())
        assert float((a - b).abs().max()) <= bound
        differ += not torch.equal(a, b)
        compared += 1
        if any(want[r][:compared] != got[r][:compared] for r in want):
            break
    assert compared >= 4 and differ > 0  # compared over several steps; the cache is 16-bit


def test_refused_combinations_say_what_is_offered(model_dir):
    path = str(model_dir("llama"))
    with pytest.raises(ValueError, match="under a bfloat16 model"):
        load(EngineConfig(model=path, dtype="bfloat16", device="cpu", kv_cache_dtype="float16"))
    with pytest.raises(ValueError, match="under a bfloat16 model"):
        load(EngineConfig(model=path, dtype="bfloat16", device="cpu", kv_cache_dtype="float32"))
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8 is not offered"):
        EngineConfig(kv_cache_dtype="fp8").validate()


def test_the_flag_and_its_aliases():
    def parse(*flags):
        return config_from_args(build_parser().parse_args(["serve", *flags])).kv_cache_dtype

    assert parse() == "auto"
    assert parse("--kv-cache-dtype", "bfloat16") == "bfloat16"
    assert parse("--kv-cache-dtype", "half") == "float16"
    assert parse("--kv-cache-dtype", "auto") == "auto"


def test_served_with_a_16_bit_cache(model_dir):
    server = LiveServer(
        EngineConfig(
            model=str(model_dir("qwen3")),
            dtype="float32",
            served_model_name=["m"],
            kv_cache_dtype="bfloat16",
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
        assert metric(text, "vllm:cache_config_info", cache_dtype="bfloat16") == 1
    finally:
        server.stop()
