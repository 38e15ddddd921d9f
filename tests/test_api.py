"""The OpenAI API surface against a live server, with the official SDK: every sampling parameter,
log-probs, usage, tokenizer endpoints, request ids, the OpenAPI document and bad requests."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from core.engine import Hold
from tests.conftest import api_server

USER = [{"role": "user", "content": "Tell me about the river café 🌊 and the stone bridge"}]


@pytest.fixture(scope="module")
def server(model_dir):
    s = api_server(model_dir)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tok(server):
    return server.state.tokenizer


def chat(client, **kw):
    kw.setdefault("model", "tiny")
    kw.setdefault("messages", USER)
    return client.chat.completions.create(**kw)


def complete(client, **kw):
    kw.setdefault("model", "tiny")
    return client.completions.create(**kw)


# ---------------------------------------------------------------- sampling parameters
def test_top_k_1_equals_greedy(client):
    greedy = chat(client, temperature=0, max_tokens=16, extra_body={"ignore_eos": True})
    top1 = chat(
        client, temperature=1.0, max_tokens=16, seed=5, extra_body={"top_k": 1, "ignore_eos": True}
    )
    assert top1.choices[0].message.content == greedy.choices[0].message.content


def test_logit_bias_forces_its_token(client, tok):
    token = tok.encode(" river")[-1]
    r = complete(
        client,
        prompt="hello",
        max_tokens=5,
        temperature=1.0,
        logit_bias={str(token): 100},
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].text == tok.decode([token]) * 5
    banned = complete(client, prompt="hello", max_tokens=1, temperature=0)
    first = tok.encode(banned.choices[0].text)[0] if banned.choices[0].text else None
    if first is not None:
        again = complete(
            client, prompt="hello", max_tokens=1, temperature=0, logit_bias={str(first): -100}
        )
        assert again.choices[0].text != banned.choices[0].text


def test_min_tokens_suppresses_eos(client, tok):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    forced = dict(logit_bias={str(eos): 100})
    r = complete(client, prompt="hello", max_tokens=20, temperature=0, **forced)
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "stop"
    r = complete(
        client, prompt="hello", max_tokens=20, temperature=0, **forced, extra_body={"min_tokens": 6}
    )
    assert r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "stop"


def streamed_text(stream, chat_api=True):
    text, finish = "", None
    for c in stream:
        for ch in c.choices:
            text += (ch.delta.content or "") if chat_api else ch.text
            finish = ch.finish_reason or finish
    return text, finish


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_cut_streamed_and_not(client, include):
    base = chat(client, temperature=0, max_tokens=40, extra_body={"ignore_eos": True})
    full = base.choices[0].message.content
    stop = next(
        full[i : i + 3]
        for i in range(6, len(full) - 3)
        if "\ufffd" not in full[i : i + 3] and full[i : i + 3].strip()
    )
    cut = full.index(stop) + (len(stop) if include else 0)
    extra = {"ignore_eos": True, "include_stop_str_in_output": include}
    r = chat(
        client, temperature=0, max_tokens=40, stop=[stop, "never-appears-xyz"], extra_body=extra
    )
    assert r.choices[0].message.content == full[:cut]
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop  # vLLM's: which stop ended it
    text, finish = streamed_text(
        chat(client, temperature=0, max_tokens=40, stop=stop, stream=True, extra_body=extra)
    )
    assert text == full[:cut] and finish == "stop"
    rc = complete(
        client, prompt="the river", temperature=0, max_tokens=30, extra_body={"ignore_eos": True}
    )
    ctext = rc.choices[0].text
    s2 = next(
        ctext[i : i + 2]
        for i in range(3, len(ctext) - 2)
        if "\ufffd" not in ctext[i : i + 2] and ctext[i : i + 2].strip()
    )
    stream = complete(
        client,
        prompt="the river",
        temperature=0,
        max_tokens=30,
        stop=[s2],
        stream=True,
        extra_body=extra,
    )
    text, _ = streamed_text(stream, chat_api=False)
    assert text == ctext[: ctext.index(s2) + (len(s2) if include else 0)]
    one = complete(
        client, prompt="the river", temperature=0, max_tokens=30, stop=[s2], extra_body=extra
    )
    assert one.choices[0].model_extra["stop_reason"] == s2
    assert rc.choices[0].model_extra["stop_reason"] is None  # a length cut


def test_streaming_never_shows_half_a_stop_string(server):
    # A stop string that never matches must never be cut across chunks either: the text is held
    # back until it is known not to start the stop string, so no chunk ends with its prefix.
    body = {
        "model": "tiny",
        "messages": USER,
        "temperature": 0,
        "max_tokens": 30,
        "stream": True,
        "stop": ["zzzq"],
        "ignore_eos": True,
    }
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    texts = [e["choices"][0]["delta"].get("content") or "" for e in events]
    joined = "".join(texts)
    assert "zzzq" not in joined
    plain = httpx.post(
        server.url + "/v1/chat/completions", json={**body, "stream": False, "stop": None}
    ).json()
    assert joined == plain["choices"][0]["message"]["content"]


def test_same_seed_same_tokens_in_any_batch(client, server):
    kw = dict(temperature=1.0, max_tokens=24, seed=1234, extra_body={"ignore_eos": True})
    alone = chat(client, **kw).choices[0].message.content

    def other(i):
        return chat(
            client,
            temperature=1.0,
            max_tokens=24,
            seed=i,
            messages=[{"role": "user", "content": f"noise {i} " * (i + 1)}],
        ).id

    server.engine.hold(Hold(gather=6))  # the six start in one batch
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(other, i) for i in range(5)]
        busy = pool.submit(lambda: chat(client, **kw).choices[0].message.content).result()
        [f.result() for f in futures]
    assert busy == alone
    assert chat(client, **{**kw, "seed": 99}).choices[0].message.content != alone


def test_penalties_change_the_text(client):
    base = complete(
        client, prompt="the the the", temperature=0, max_tokens=30, extra_body={"ignore_eos": True}
    )
    for extra in (
        {"frequency_penalty": 2.0},
        {"presence_penalty": 2.0},
        {"extra_body": {"repetition_penalty": 2.0, "ignore_eos": True}},
    ):
        kw = dict(prompt="the the the", temperature=0, max_tokens=30)
        kw.setdefault("extra_body", {"ignore_eos": True})
        kw.update(extra)
        assert complete(client, **kw).choices[0].text != base.choices[0].text


# ---------------------------------------------------------------- logprobs
def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_chat_logprobs_shapes_and_values_match_transformers(client, server, tok):
    r = chat(
        client,
        temperature=0,
        max_tokens=8,
        logprobs=True,
        top_logprobs=5,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    for entry in content:
        assert math.isfinite(entry.logprob) and entry.logprob <= 0
        assert len(entry.top_logprobs) == 5
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs))
        assert entry.bytes is not None
    prompt = httpx.post(server.url + "/tokenize", json={"messages": USER}).json()["tokens"]
    hf = hf_model(server.state.config.model)
    out = hf.generate(
        torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0]
    with torch.no_grad():
        logits = hf(out[None, :-1]).logits[0, len(prompt) - 1 :]
    ref = logits.log_softmax(-1).gather(1, out[len(prompt) :, None]).squeeze(1)
    got = torch.tensor([e.logprob for e in content])
    torch.testing.assert_close(got, ref, atol=1e-3, rtol=0)
    no = chat(client, max_tokens=2)
    assert no.choices[0].logprobs is None


def test_completion_logprobs_echo_and_prompt_logprobs(client, server, tok):
    prompt = "the river flows"
    ids = tok.encode(prompt)
    r = complete(
        client,
        prompt=prompt,
        max_tokens=4,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(t) <= 3 for t in lp.top_logprobs) and lp.text_offset == sorted(lp.text_offset)
    assert "".join(lp.tokens) == r.choices[0].text
    echo = complete(
        client,
        prompt=prompt,
        max_tokens=4,
        temperature=0,
        logprobs=2,
        echo=True,
        extra_body={"ignore_eos": True},
    )
    elp = echo.choices[0].logprobs
    assert echo.choices[0].text == prompt + r.choices[0].text
    assert len(elp.tokens) == len(ids) + 4
    assert elp.token_logprobs[0] is None and elp.top_logprobs[0] is None
    assert elp.token_logprobs[len(ids) :] == pytest.approx(lp.token_logprobs, abs=1e-5)

    hf = hf_model(server.state.config.model)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    want = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert elp.token_logprobs[1 : len(ids)] == pytest.approx(want, abs=1e-3)
    raw = httpx.post(
        server.url + "/v1/completions",
        json={"model": "tiny", "prompt": ids, "max_tokens": 1, "prompt_logprobs": 2},
    ).json()
    plp = raw["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    assert plp[1][str(ids[1])]["logprob"] == pytest.approx(want[0], abs=1e-3)


def test_streamed_logprobs_and_usage_counts(client):
    stream = chat(
        client,
        temperature=0,
        max_tokens=10,
        logprobs=True,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1]
    assert chunks[-1].choices == []
    tokens = sum(len(ch.logprobs.content) for c in chunks for ch in c.choices if ch.logprobs)
    assert tokens == chunks[-1].usage.completion_tokens == 10
    plain = list(chat(client, temperature=0, max_tokens=3, stream=True))
    assert all(c.usage is None for c in plain)


def test_continuous_usage_stats(client):
    chunks = list(
        chat(
            client,
            temperature=0,
            max_tokens=6,
            stream=True,
            extra_body={"ignore_eos": True},
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 6
    assert all(c.usage is not None for c in chunks)
    # every chunk carries the prompt's tokens, the role chunk too (it had 0), and with n=2 each
    # choice's own completion tokens (as vLLM reports them)
    prompt = chunks[-1].usage.prompt_tokens
    two = list(
        chat(
            client, temperature=1.0, max_tokens=5, n=2, stream=True,
            extra_body={"ignore_eos": True},
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )  # fmt: skip
    assert all(c.usage.prompt_tokens == prompt for c in two)
    for i in range(2):
        mine = [c.usage.completion_tokens for c in two if c.choices and c.choices[0].index == i]
        assert mine[0] == 0 and mine == sorted(mine) and mine[-1] == 5
    assert two[-1].usage.completion_tokens == 10
