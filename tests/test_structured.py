"""Structured outputs: every constraint kind enforced on a random model (the hardest client: it
tries everything), streamed and not, with n > 1, beside unconstrained requests, under preemption;
the mask in tensors; the grammar winning over other processors; compiles off the engine step;
and a 400 for every constraint that cannot be enforced."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest

from core.engine import Hold
from core.structured import Constraint
from tests.conftest import GrammarProbe, LiveServer, tiny_config

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "member"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}-\d{2,4}"
CHOICES = ["yes", "no", "it depends"]
GBNF = 'root ::= "(" [0-9]{1,3} ("+" [0-9]{1,3})* ")"'
LARK = 'start: "[" NUM ("," NUM)* "]"\nNUM: /[0-9]{1,3}/'
USER = [{"role": "user", "content": "Describe the river in structured form."}]


@pytest.fixture(scope="module")
def server(model_dir):
    s = LiveServer(tiny_config(model_dir)).start()
    yield s
    s.stop()


def close_bias(tok) -> dict[str, float]:
    """A random model writes string characters forever; favouring the tokens that close strings,
    objects and groups ends its outputs (the grammar still decides what is allowed)."""
    ids = [tok.convert_tokens_to_ids(c) for c in ('"', "}", "]", ")")]
    return {str(i): 6.0 for i in ids if i is not None and i != tok.unk_token_id}


def no_whitespace_bias(tok) -> dict[str, float]:
    """Flexible JSON whitespace lets a random model emit it forever: push it down (a bias, not
    a ban, and the grammar still decides)."""
    vocab = tok.get_vocab()
    return {
        str(i): -100.0
        for t, i in vocab.items()
        if tok.decode([i]).strip() == "" and tok.decode([i])
    }


def valid(kind: str, text: str) -> bool:
    try:
        if kind == "json":
            jsonschema.validate(json.loads(text), SCHEMA)
            return True
        if kind == "json_object":
            return isinstance(json.loads(text), dict)
    except (ValueError, jsonschema.ValidationError):
        return False
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    if kind == "gbnf":
        return re.fullmatch(r"\(\d{1,3}(\+\d{1,3})*\)", text) is not None
    if kind == "lark":
        return re.fullmatch(r"\[\d{1,3}(,\d{1,3})*\]", text) is not None
    raise AssertionError(kind)


def constraint_fields(kind: str, tok) -> dict:
    """The request fields for a kind, in each of the spellings clients use."""
    bias = close_bias(tok)
    if kind == "json":  # OpenAI's response_format, flexible whitespace pushed down
        return {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
            },
            "logit_bias": bias | no_whitespace_bias(tok),
        }
    if kind == "json_object":  # vLLM's structured_outputs, compact
        return {
            "structured_outputs": {"json_object": True, "disable_any_whitespace": True},
            "logit_bias": bias,
        }
    if kind == "regex":  # vLLM's older top-level name
        return {"guided_regex": REGEX}
    if kind == "choice":
        return {"structured_outputs": {"choice": CHOICES}}
    if kind == "gbnf":
        return {"guided_grammar": GBNF, "logit_bias": bias}
    return {"structured_outputs": {"grammar": LARK}, "logit_bias": bias}


def texts_of(server, path: str, body: dict) -> list[tuple[str, str]]:
    """(text, finish_reason) per choice, streamed or not."""
    if not body.get("stream"):
        r = httpx.post(server.url + path, json=body, timeout=120)
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        key = "message" if "messages" in body else None
        return [
            (c["message"]["content"] if key else c["text"], c["finish_reason"]) for c in choices
        ]
    parts: dict[int, list[str]] = {}
    finish: dict[int, str] = {}
    with httpx.stream("POST", server.url + path, json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for c in event["choices"]:
                piece = c["delta"].get("content") if "delta" in c else c["text"]
                parts.setdefault(c["index"], []).append(piece or "")
                if c["finish_reason"]:
                    finish[c["index"]] = c["finish_reason"]
    return [("".join(parts[i]), finish[i]) for i in sorted(parts)]


KINDS = ["json", "json_object", "regex", "choice", "gbnf", "lark"]


def test_every_kind_holds_for_sampled_outputs_beside_unconstrained_requests(server):
    """7 requests x n=3 per kind and mode (21 samples at temperature 1, each its own seed),
    chat and completions, all at once with greedy unconstrained requests whose tokens must not
    change."""
    tok = server.state.tokenizer
    greedy = {"prompt": "the river", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    alone = texts_of(server, "/v1/completions", greedy)
    jobs = []
    for kind in KINDS:
        for stream in (False, True):
            for i in range(7):
                chat = i % 2 == 0
                body = {
                    "max_tokens": 200,
                    "temperature": 1.0,
                    "seed": 1000 * KINDS.index(kind) + 10 * i + stream,
                    "n": 3,
                    "stream": stream,
                    **constraint_fields(kind, tok),
                }
                body |= {"messages": USER} if chat else {"prompt": "Data:"}
                path = "/v1/chat/completions" if chat else "/v1/completions"
                jobs.append((kind, path, body))
    with ThreadPoolExecutor(16) as pool:
        plain = [pool.submit(texts_of, server, "/v1/completions", greedy) for _ in range(4)]
        results = [(kind, pool.submit(texts_of, server, p, b)) for kind, p, b in jobs]
        counts: dict[str, int] = {}
        for kind, future in results:
            for text, finish in future.result():
                assert finish == "stop" and valid(kind, text), (kind, finish, text)
                counts[kind] = counts.get(kind, 0) + 1
        assert all(f.result() == alone for f in plain)
    assert counts == {kind: 42 for kind in KINDS}
    assert server.engine.core.kv.num_free_blocks == server.engine.core.kv.num_blocks


def test_constraints_hold_under_preemption(model_dir):
    """A pool too small for the batch: requests are preempted and recomputed, their matchers
    keep their place (the generated tokens stay), every output still parses."""
    config = tiny_config(model_dir, num_kv_blocks=14, max_num_batched_tokens=64, max_model_len=224)
    s = LiveServer(config).start()
    try:
        tok = s.state.tokenizer
        body = {
            "messages": [{"role": "user", "content": "word " * 30}],
            "max_tokens": 150,
            "temperature": 1.0,
            **constraint_fields("json", tok),
        }
        s.engine.hold(Hold(gather=8))  # the first eight start together: the pool must preempt
        with ThreadPoolExecutor(8) as pool:
            futures = [
                pool.submit(texts_of, s, "/v1/chat/completions", body | {"seed": i})
                for i in range(16)
            ]
            for f in futures:
                for text, finish in f.result():
                    assert finish == "stop" and valid("json", text), text
        metrics = httpx.get(s.url + "/metrics").text
        preempted = [
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("weir:num_preemptions_total")
        ]
        assert preempted and preempted[0] > 0, "the pool did not force a preemption"
    finally:
        s.stop()


def test_whitespace_flexible_json_that_finishes_parses(server):
    """Default JSON whitespace, no help from a bias: whatever finishes with stop parses."""
    bodies = [
        {"prompt": "x", "max_tokens": 120, "temperature": 1.0, "seed": i, "guided_json": SCHEMA}
        for i in range(10)
    ]
    done = 0
    for body in bodies:
        for text, finish in texts_of(server, "/v1/completions", body):
            if finish == "stop":
                jsonschema.validate(json.loads(text), SCHEMA)
                done += 1
            else:
                assert finish == "length"
    assert done >= 1


def test_grammar_wins_over_bans_and_stop_tokens(server):
    """min_tokens bans the stop token the grammar requires: the grammar wins, the request ends
    on that token with finish_reason stop instead of sampling from nothing."""
    tok = server.state.tokenizer
    b = tok.convert_tokens_to_ids("b")
    body = {
        "prompt": "x",
        "max_tokens": 5,
        "temperature": 1.0,
        "guided_regex": "b",
        "stop_token_ids": [b],
        "min_tokens": 3,
        "include_stop_str_in_output": True,
    }
    r = httpx.post(server.url + "/v1/completions", json=body).json()
    assert r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == 1


def test_max_tokens_still_cuts_a_constraint(server):
    body = {"prompt": "x", "max_tokens": 3, "temperature": 1.0, "seed": 1, "guided_json": SCHEMA}
    ((text, finish),) = texts_of(server, "/v1/completions", body)
    assert finish == "length" and text.startswith("{")


# ---------------------------------------------------------------- bad input
BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "structural_tag"}}, "response_format"),
    ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_grammar": "start: foo"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    # compiles, but matches no text at all (was a 500 "The engine failed" after one token)
    ({"guided_regex": r"[^\s\S]"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "start: /[^\\s\\S]/"}}, "structured_outputs"),
    ({"guided_json": False}, "guided_json"),
]  # fmt: skip


@pytest.mark.parametrize("fields,param", BAD)
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_constraint_that_cannot_be_enforced_is_a_400(server, fields, param, route):
    body = {"max_tokens": 4, **fields}
    body |= {"messages": USER} if route == "chat" else {"prompt": "x"}
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    r = httpx.post(server.url + path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param), err


def test_the_schema_true_means_any_json_value(server, model_dir):
    """JSON Schema's `true` (what `{}` means) was refused as "Expecting object schema"."""
    probe = GrammarProbe(model_dir)
    for c in (Constraint("json", "true"), Constraint("json", "true", think="optional")):
        assert probe.accepts(c, '[1, {"a": null}]') and probe.accepts(c, '"x"')
        assert not probe.accepts(c, "x")
    schema = {"type": "json_schema", "json_schema": {"name": "any", "schema": True}}
    for fields in ({"guided_json": True}, {"response_format": schema}):
        body = {"prompt": "x", "max_tokens": 4, **fields}
        r = httpx.post(server.url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "guided_json": False})
    assert "allows no value" in r.json()["error"]["message"]


def test_a_grammar_that_dead_ends_is_the_requests_400(server):
    """A rule that matches nothing, reached only after a first token (no check finds it
    before): the request ends with a 400 of its own, not a 500 "The engine failed"."""
    body = {"prompt": "x", "max_tokens": 5, "guided_grammar": 'start: "a" b\nb: /[^\\s\\S]/'}
    r = httpx.post(server.url + "/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert "allows nothing after" in r.json()["error"]["message"], r.text
    assert httpx.get(server.url + "/health").status_code == 200


def test_serving_goes_on_after_bad_constraints(server):
    r = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "x", "max_tokens": 4, "response_format": {"type": "text"}},
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None
    assert httpx.get(server.url + "/health").status_code == 200
