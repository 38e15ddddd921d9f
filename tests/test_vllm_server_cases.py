"""Behaviours vLLM's own server tests check that a client of weir meets too: log-prob counts of
-1 ("as many as allowed"), and chat's `echo` with a continued final message."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import LiveServer, tiny_config

USER = [{"role": "user", "content": "Tell me about the river and the stone bridge"}]


@pytest.fixture(scope="module")
def server(model_dir):
    s = LiveServer(tiny_config(model_dir, num_kv_blocks=128, max_logprobs=30)).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def everything(model_dir):
    """--max-logprobs -1: a request may ask for the whole vocabulary."""
    s = LiveServer(tiny_config(model_dir, num_kv_blocks=64, max_logprobs=-1)).start()
    yield s
    s.stop()


# ---------------------------------------------------------------- log-probs -1
def test_minus_one_is_the_servers_limit(client):
    """--max-logprobs 30: -1 asks for 30, in every field that takes a count."""
    chat = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=3, logprobs=True, top_logprobs=-1
    )
    assert [len(e.top_logprobs) for e in chat.choices[0].logprobs.content] == [30] * 3
    comp = client.completions.create(
        model="tiny",
        prompt="the river",
        max_tokens=3,
        logprobs=-1,
        extra_body={"prompt_logprobs": -1},
    )
    # the sampled token first, then 30 alternatives (30 or 31 entries)
    assert all(30 <= len(top) <= 31 for top in comp.choices[0].logprobs.top_logprobs)
    prompt = comp.choices[0].model_extra["prompt_logprobs"]
    assert prompt[0] is None and all(30 <= len(p) <= 31 for p in prompt[1:])
    # echo: the prompt tokens carry log-probs as well
    echoed = client.completions.create(
        model="tiny", prompt="the river", max_tokens=2, logprobs=-1, echo=True
    )
    lp = echoed.choices[0].logprobs
    assert lp.top_logprobs[0] is None and all(30 <= len(t) <= 31 for t in lp.top_logprobs[1:])


def test_minus_one_is_the_whole_vocabulary_without_a_limit(everything):
    vocab = everything.state.vocab_size
    r = httpx.post(
        everything.url + "/v1/chat/completions",
        json={"messages": USER, "max_tokens": 2, "logprobs": True, "top_logprobs": -1},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [len(e["top_logprobs"]) for e in content] == [vocab, vocab]
    r = httpx.post(
        everything.url + "/v1/completions",
        json={"prompt": "the river", "max_tokens": 1, "prompt_logprobs": -1},
        timeout=60,
    )
    prompt = r.json()["choices"][0]["prompt_logprobs"]
    assert all(vocab <= len(p) <= vocab + 1 for p in prompt[1:])


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": -2},
         "top_logprobs"),
        ("/v1/completions", {"prompt": "hi", "logprobs": -2}, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": -2}, "prompt_logprobs"),
    ],
)  # fmt: skip
def test_below_minus_one_is_a_400(server, path, body, param):
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ---------------------------------------------------------------- chat echo
CONTINUE = USER + [{"role": "assistant", "content": "The bridge is"}]


def test_echo_with_a_continued_final_message(client):
    kw = dict(
        model="tiny",
        messages=CONTINUE,
        max_tokens=6,
        temperature=0,
        extra_body={"echo": True, "continue_final_message": True, "add_generation_prompt": False},
    )
    plain = client.chat.completions.create(
        **{**kw, "extra_body": {**kw["extra_body"], "echo": False}}
    )
    whole = client.chat.completions.create(**kw)
    continuation = plain.choices[0].message.content
    assert whole.choices[0].message.content == "The bridge is" + continuation
    assert whole.usage.completion_tokens == plain.usage.completion_tokens  # echo is not output
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    # The echo comes first, whole, before any generated text.
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert texts[0] == "The bridge is"


def test_echo_without_generation_prompt_echoes_the_last_message(client):
    """vLLM: the reply's role is the last message's own without a generation prompt, so that
    message is echoed whatever its role; with one, only an assistant message would be."""
    r = client.chat.completions.create(
        model="tiny",
        messages=USER,
        max_tokens=3,
        extra_body={"echo": True, "add_generation_prompt": False},
    )
    assert r.choices[0].message.content.startswith(USER[0]["content"])
    r = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=3, temperature=0, extra_body={"echo": True}
    )
    plain = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=3, temperature=0
    )
    assert r.choices[0].message.content == plain.choices[0].message.content
