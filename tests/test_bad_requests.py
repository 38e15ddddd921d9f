"""Bad requests, table-driven: every malformed field is a 4xx naming it, and the server stays
healthy afterwards."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import api_server

USER = [{"role": "user", "content": "Tell me about the river café 🌊 and the stone bridge"}]


@pytest.fixture(scope="module")
def server(model_dir):
    s = api_server(model_dir)
    yield s
    s.stop()


def chat(client, **kw):
    kw.setdefault("model", "tiny")
    kw.setdefault("messages", USER)
    return client.chat.completions.create(**kw)


M = USER
BAD = [  # (route, body, status, param)
    ("chat", {}, 400, "messages"),
    ("chat", {"messages": []}, 400, "messages"),
    ("chat", {"messages": "hi"}, 400, "messages"),
    ("chat", {"messages": [{"content": "x"}]}, 400, "messages[0].role"),
    ("chat", {"messages": [{"role": "", "content": "x"}]}, 400, "messages[0].role"),
    ("chat", {"messages": [{"role": 5, "content": "x"}]}, 400, "messages[0].role"),
    ("chat", {"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
    (
        "chat",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages[0].content[0].type",
    ),
    (
        "chat",
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        400,
        "messages[0].content[0].text",
    ),
    ("chat", {"messages": M, "model": "gpt-9"}, 404, "model"),
    ("chat", {"messages": M, "max_tokens": 0}, 400, "max_tokens"),
    ("chat", {"messages": M, "max_tokens": -5}, 400, "max_tokens"),
    ("chat", {"messages": M, "max_tokens": 100000}, 400, "max_tokens"),
    ("chat", {"messages": M, "max_completion_tokens": "x"}, 400, "max_completion_tokens"),
    ("chat", {"messages": M, "temperature": 3}, 400, "temperature"),
    ("chat", {"messages": M, "temperature": "hot"}, 400, "temperature"),
    ("chat", {"messages": M, "top_p": 0}, 400, "top_p"),
    ("chat", {"messages": M, "top_p": 1.5}, 400, "top_p"),
    ("chat", {"messages": M, "top_k": -2}, 400, "top_k"),
    ("chat", {"messages": M, "min_p": 2}, 400, "min_p"),
    ("chat", {"messages": M, "presence_penalty": 5}, 400, "presence_penalty"),
    ("chat", {"messages": M, "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("chat", {"messages": M, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("chat", {"messages": M, "n": 0}, 400, "n"),
    ("chat", {"messages": M, "n": 1000}, 400, "n"),
    ("chat", {"messages": M, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ("chat", {"messages": M, "top_logprobs": 3}, 400, "top_logprobs"),
    ("chat", {"messages": M, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("chat", {"messages": M, "logit_bias": {"5": 1000}}, 400, "logit_bias"),
    ("chat", {"messages": M, "logit_bias": {str(i): 1 for i in range(400)}}, 400, "logit_bias"),
    ("chat", {"messages": M, "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ("chat", {"messages": M, "stop": 5}, 400, "stop"),
    ("chat", {"messages": M, "stop": [""]}, 400, "stop"),
    ("chat", {"messages": M, "stop": ["a"] * 20}, 400, "stop"),
    ("chat", {"messages": M, "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("chat", {"messages": M, "stop_token_ids": [10**8]}, 400, "stop_token_ids"),
    ("chat", {"messages": M, "min_tokens": 50, "max_tokens": 10}, 400, "min_tokens"),
    ("chat", {"messages": M, "stream": "yes"}, 400, "stream"),
    ("chat", {"messages": M, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("chat", {"messages": M, "seed": "x"}, 400, "seed"),
    ("chat", {"messages": M, "priority": 3}, 400, "priority"),
    ("chat", {"messages": M, "prompt_logprobs": 99}, 400, "prompt_logprobs"),
    ("chat", {"messages": [{"role": "user", "content": "word " * 600}]}, 400, "messages"),
    (
        "chat",
        {"messages": M, "continue_final_message": True, "add_generation_prompt": True},
        400,
        "continue_final_message",
    ),
    (
        "chat",
        {"messages": M, "chat_template_kwargs": {"messages": []}},
        400,
        "chat_template_kwargs",
    ),
    ("completions", {}, 400, "prompt"),
    ("completions", {"prompt": []}, 400, "prompt"),
    ("completions", {"prompt": [1, "a"]}, 400, "prompt"),
    ("completions", {"prompt": [10**9]}, 400, "prompt"),
    ("completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("completions", {"prompt": "hi", "echo": 3}, 400, "echo"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "word " * 600}, 400, "prompt"),  # the context, named as sent
    ("completions", {"prompt": "hi", "suffix": "x"}, 400, "suffix"),  # refused, not ignored
    ("completions", {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("completions", {"prompt": "hi", "best_of": "x"}, 400, "best_of"),
    ("tokenize", {}, 400, "prompt"),
    ("tokenize", {"prompt": "a", "messages": M}, 400, "prompt"),
    ("tokenize", {"prompt": 5}, 400, "prompt"),
    ("detokenize", {}, 400, "tokens"),
    ("detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("detokenize", {"tokens": ["a"]}, 400, "tokens"),
]
ROUTES = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "tokenize": "/tokenize",
    "detokenize": "/detokenize",
}


@pytest.mark.parametrize("route,body,status,param", BAD)
def test_bad_request_table(server, route, body, status, param):
    r = httpx.post(server.url + ROUTES[route], json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    # Nested problems name their path (messages[0].role); others the top-level field.
    got = err["param"] if "[" in param else (err["param"] or "").split("[")[0].split(".")[0]
    assert got == param, err


def test_null_where_openai_allows_it(server, client):
    """n, stream, logprobs and echo are nullable in OpenAI's spec (the SDK sends None as null):
    null is the default, not a 400."""
    nulls = {"n": None, "stream": None, "logprobs": None, "max_tokens": 2}
    r = httpx.post(server.url + ROUTES["chat"], json={"messages": M, **nulls})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
    r = httpx.post(server.url + ROUTES["completions"], json={"prompt": "hi", "echo": None, **nulls})
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None, r.text
    assert chat(client, n=None, stream=None, logprobs=None, max_tokens=2).choices


def test_healthy_after_the_bad_requests(server, client):
    assert httpx.get(server.url + "/health").status_code == 200
    assert chat(client, max_tokens=2).choices[0].message.content is not None
