"""Beam search served: `use_beam_search` in completions and chat over HTTP, and the requests
that are refused naming their field."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def beam_server(model_dir):
    from tests.conftest import LiveServer, tiny_config

    server = LiveServer(tiny_config(model_dir, dtype="float32", max_beam_width=8)).start()
    yield server
    server.stop()


def test_beam_search_over_http(beam_server):
    """use_beam_search in completions and chat, streamed or not: n choices best first (scores
    from the returned log-probs), the same either way, usage counting every choice; a stream
    sends the finished beams at the end."""
    import json

    import httpx

    url = beam_server.url
    body = {
        "model": "tiny",
        "prompt": "the model is a server",
        "max_tokens": 6,
        "n": 3,
        "use_beam_search": True,
        "length_penalty": 1.0,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    got = r.json()
    choices = got["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    scores = [sum(c["logprobs"]["token_logprobs"]) / len(c["logprobs"]["tokens"]) for c in choices]
    assert scores == sorted(scores, reverse=True)
    assert len({tuple(c["logprobs"]["tokens"]) for c in choices}) == 3
    assert got["usage"]["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in choices)
    with httpx.stream("POST", url + "/v1/completions", json=body | {"stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    streamed = {e["choices"][0]["index"]: e["choices"][0] for e in events}
    assert [streamed[i]["text"] for i in range(3)] == [c["text"] for c in choices]
    assert all(e["choices"][0]["finish_reason"] for e in events)  # the beams, once done

    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 5,
        "n": 2,
        "use_beam_search": True,
        "early_stopping": "never",
    }
    r = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 200, r.text
    texts = [c["message"]["content"] for c in r.json()["choices"]]
    assert len(texts) == 2
    with httpx.stream("POST", url + "/v1/chat/completions", json=chat | {"stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    content = ["", ""]
    for e in events:
        c = e["choices"][0]
        content[c["index"]] += c["delta"].get("content") or ""
    assert content == texts


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"temperature": 0.8}, "temperature"),
        ({"top_p": 0.5}, "top_p"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"early_stopping": "soon"}, "early_stopping"),
        ({"n": 9}, "n"),
    ],
)
def test_beam_search_bad_requests(beam_server, extra, field):
    import httpx

    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "n": 2, "use_beam_search": True}
    r = httpx.post(beam_server.url + "/v1/completions", json=body | extra, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
