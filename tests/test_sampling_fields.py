"""vLLM's sampling fields beyond OpenAI's, over HTTP on the tiny model: each is honoured (the
output obeys it) or refused naming the field, never accepted and ignored."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import LiveServer, tiny_config


@pytest.fixture(scope="module")
def server(model_dir):
    s = LiveServer(tiny_config(model_dir)).start()
    yield s
    s.stop()


def post(server, route: str, **body) -> httpx.Response:
    body.setdefault("model", "tiny")
    if route == "chat/completions":
        body.setdefault("messages", [{"role": "user", "content": "Tell me about the river"}])
    else:
        body.setdefault("prompt", "The river")
    return httpx.post(f"{server.url}/v1/{route}", json=body, timeout=120)


def token_ids(reply: dict, route: str) -> list[int]:
    """The sampled ids, from log-probs written as token_id:N."""
    lp = reply["choices"][0]["logprobs"]
    tokens = [c["token"] for c in lp["content"]] if route == "chat/completions" else lp["tokens"]
    return [int(t.removeprefix("token_id:")) for t in tokens]


@pytest.mark.parametrize("route", ["chat/completions", "completions"])
@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_allowed_token_ids_are_all_that_is_sampled(server, route, temperature):
    allowed = [300, 301, 302, 555]
    logprobs = {"logprobs": True} if route == "chat/completions" else {"logprobs": 0}
    r = post(
        server,
        route,
        allowed_token_ids=allowed,
        temperature=temperature,
        seed=4,
        max_tokens=12,
        ignore_eos=True,
        return_tokens_as_token_ids=True,
        **logprobs,
    )
    assert r.status_code == 200, r.text
    ids = token_ids(r.json(), route)
    assert len(ids) == 12 and set(ids) <= set(allowed)


@pytest.mark.parametrize(
    "value, message", [([], "must not be empty"), ([5, 10**7], "outside the vocabulary")]
)
def test_bad_allowed_token_ids_are_refused_by_name(server, value, message):
    r = post(server, "completions", allowed_token_ids=value)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "allowed_token_ids" and message in err["message"]


def test_allowed_tokens_that_min_tokens_bans_are_refused(server, model_dir):
    """Allowed tokens that all end the output (EOS, stop_token_ids) under min_tokens leave
    nothing to sample: a 400 naming the field (it had emitted token 0 until min_tokens), while
    one more allowed token is sampled until then, and ignore_eos lifts EOS's ban."""
    import json

    eos = json.loads((model_dir("qwen3") / "generation_config.json").read_text())["eos_token_id"]
    eos = eos[0] if isinstance(eos, list) else eos
    for extra in (
        {"allowed_token_ids": [eos]},
        {"allowed_token_ids": [300], "stop_token_ids": [300]},
    ):
        r = post(server, "completions", min_tokens=2, max_tokens=4, **extra)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "allowed_token_ids" and "min_tokens=2" in err["message"]
    r = post(
        server, "completions", allowed_token_ids=[eos, 300], min_tokens=3, max_tokens=6,
        logprobs=0, return_tokens_as_token_ids=True,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    ids = token_ids(r.json(), "completions")
    assert ids[:3] == [300, 300, 300] and set(ids) <= {eos, 300}
    r = post(server, "completions", allowed_token_ids=[eos], min_tokens=2, ignore_eos=True)
    assert r.status_code == 200, r.text


def test_truncate_prompt_tokens_keeps_that_many(server):
    ids = list(range(40, 70))
    for side, kept in ((None, ids[-7:]), ("left", ids[-7:]), ("right", ids[:7])):
        extra = {"truncation_side": side} if side else {}
        r = post(
            server, "completions", prompt=ids, truncate_prompt_tokens=7, echo=True, max_tokens=1,
            logprobs=0, return_tokens_as_token_ids=True, **extra,
        )  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 7
        assert token_ids(r.json(), "completions")[:7] == kept
    # shorter than the count: as it is
    r = post(server, "completions", prompt=ids, truncate_prompt_tokens=100, max_tokens=1)
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    # -1: as much as the context holds, one token left for the output
    r = post(server, "completions", prompt=[7] * 600, truncate_prompt_tokens=-1, max_tokens=1)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 511
    r = post(server, "chat/completions", truncate_prompt_tokens=4, max_tokens=2)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 4


@pytest.mark.parametrize("value", [0, 513, -2])
def test_bad_truncate_prompt_tokens_are_refused_by_name(server, value):
    r = post(server, "completions", truncate_prompt_tokens=value)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "truncate_prompt_tokens"


def contains(ids: list[int], seq: list[int]) -> bool:
    return any(ids[i : i + len(seq)] == seq for i in range(len(ids) - len(seq) + 1))


@pytest.mark.parametrize("route", ["chat/completions", "completions"])
def test_bad_words_are_never_generated(server, route):
    from core.sampling import bad_words_ids

    tok = server.state.tokenizer

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    logprobs = {"logprobs": True} if route == "chat/completions" else {"logprobs": 0}
    common = dict(
        temperature=0, max_tokens=24, ignore_eos=True, return_tokens_as_token_ids=True, **logprobs
    )
    ids = token_ids(post(server, route, **common).json(), route)
    # words the greedy reply writes: one of a single token, one of two (banned after the first)
    words = []
    for n in (1, 2):
        for k in range(len(ids) - n + 1):
            word = tok.decode(ids[k : k + n])
            if (
                word.strip()
                and "\ufffd" not in word
                and ids[k : k + n] in bad_words_ids(encode, [word])
            ):
                words.append(word)
                break
    assert len(words) == 2
    banned = bad_words_ids(encode, words)
    r = post(server, route, bad_words=words, **common)
    assert r.status_code == 200, r.text
    got = token_ids(r.json(), route)
    assert len(got) == 24 and got != ids
    assert not any(contains(got, seq) for seq in banned)


@pytest.mark.parametrize("value", [[""], ["  "], ["w"] * 129])
def test_bad_bad_words_are_refused_by_name(server, value):
    r = post(server, "completions", bad_words=value)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "bad_words"
