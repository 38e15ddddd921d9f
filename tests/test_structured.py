"""Structured outputs: every constraint kind enforced on a random model (the hardest client: it
tries everything), streamed and not, with n > 1, beside unconstrained requests, under preemption;
the mask in tensors; the grammar winning over other processors; compiles off the engine step;
and a 400 for every constraint that cannot be enforced."""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
import torch

from core.config import EngineConfig
from core.engine import Hold
from core.request import EngineRequest
from core.sampling import SamplingParams
from core.runner_step import GrammarBatch
from core.structured import Constraint, Grammars
from gpu import grammar_mask
from gpu.backend import TorchBackend
from gpu.launch import load
from gpu.sampler import Sampler, SamplingMetadata
from tests.conftest import LiveServer, tiny_config

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
    s = LiveServer(tiny_config(model_dir, num_kv_blocks=14, max_num_batched_tokens=64)).start()
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


def test_serving_goes_on_after_bad_constraints(server):
    r = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "x", "max_tokens": 4, "response_format": {"type": "text"}},
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None
    assert httpx.get(server.url + "/health").status_code == 200


# ---------------------------------------------------------------- engine and tensors
@pytest.fixture(scope="module")
def grammars(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir("qwen3"))
    return tok, Grammars(tok.backend_tokenizer.to_str(), len(tok) + 37, [tok.eos_token_id])


def test_mask_in_tensors_matches_the_matcher(grammars):
    """The int32 bitmask, expanded in torch, allows exactly the tokens the matcher accepts; ids
    past the tokenizer (padded lm_head rows) are never allowed."""
    tok, g = grammars
    matcher = g.start(Constraint("regex", r"ab?c")).result()
    # row 1 of a step's two sampled rows is constrained
    batch = GrammarBatch([1], g.words, lambda pointer: g.fill([(matcher, 0)], pointer, 1))
    rows, mask = grammar_mask.build(batch, torch.device("cpu"))
    assert rows.tolist() == [1] and mask.shape == (1, g.words)
    allowed = grammar_mask.allowed(mask, g.vocab_size)[0]
    ids = allowed.nonzero().flatten().tolist()
    assert ids and all(i < len(tok) for i in ids)
    for i in ids:
        probe = matcher.deep_copy()
        assert probe.consume_token(i), tok.decode([i])
    # The compiled CPU kernel (float32, in place) and the torch ops (any other dtype or device)
    # mask the same tokens.
    from gpu.attention.select import get_backend
    from gpu.cpu.backend import CpuBackend

    backend = CpuBackend(get_backend("auto", torch.device("cpu")))
    for dtype in (torch.float32, torch.float64):
        logits = torch.zeros(2, g.vocab_size, dtype=dtype)
        out = backend.apply_token_bitmask(logits, rows, mask)
        assert (out[0] == 0).all() and torch.isinf(out[1][~allowed]).all()
        assert (out[1][allowed] == 0).all()


def test_sampler_grammar_wins_when_a_ban_leaves_nothing():
    vocab = 64
    mask = torch.zeros(1, 2, dtype=torch.int32)
    mask[0, 0] = 1 << 5  # only token 5 allowed
    m = SamplingMetadata(
        temperature=torch.tensor([1.0, 1.0]),
        top_k=torch.zeros(2, dtype=torch.int64),
        top_p=torch.ones(2),
        min_p=torch.zeros(2),
        all_greedy=False,
        ban=(torch.tensor([1]), torch.tensor([5])),
        grammar=(torch.tensor([1]), mask),
    )
    out = Sampler(0, torch.device("cpu"), TorchBackend(None, fuse=False))(torch.randn(2, vocab), m)
    assert out.token_ids[1].item() == 5


def test_a_slow_compile_does_not_hold_the_batch(model_dir, monkeypatch):
    """A request whose grammar is compiling waits (deferred) while others keep stepping."""
    core = load(EngineConfig(model=str(model_dir("qwen3")), num_kv_blocks=64)).core
    release = threading.Event()
    original = Grammars._compile

    def slow(self, c):
        release.wait(30)
        return original(self, c)

    monkeypatch.setattr(Grammars, "_compile", slow)
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=4, structured=Constraint("json_object"))
    core.add(EngineRequest("slow", [5, 6, 7], constrained))
    core.add(EngineRequest("plain", [5, 6, 7], p))
    finished = set()
    for _ in range(6):
        finished |= {o.request_id for o in core.step() if o.finished}
        stats = core.take_stats()
        assert (stats.num_waiting, stats.num_deferred) == (1, 1)  # the slow one, deferred
    assert "plain" in finished and "slow" not in finished
    assert core.requests["slow"].num_computed_tokens == 0
    release.set()
    while core.has_work:
        finished |= {o.request_id for o in core.step() if o.finished}
    assert "slow" in finished


def test_compiled_grammars_are_cached_and_each_request_has_its_own_matcher(grammars):
    _, g = grammars
    c = Constraint("choice", json.dumps(["alpha", "beta"]))
    a, b = g.start(c).result(), g.start(c).result()
    assert a is not b and len(g._cache) >= 1
    tok_ids = [i for i in range(g.vocab_size) if a.deep_copy().consume_token(i)]
    assert a.consume_token(tok_ids[0]) and not b.is_error()
    assert b.try_consume_tokens([tok_ids[0]]) == 1  # b is still at the start


def test_constraints_in_the_engine_process(model_dir):
    """The product default: matchers live in the engine process, compiled there."""
    s = LiveServer(tiny_config(model_dir, num_kv_blocks=64), engine_process=True).start()
    try:
        tok = s.state.tokenizer
        for kind in ("json", "choice", "lark"):
            for stream in (False, True):
                body = {"messages": USER, "max_tokens": 150, "temperature": 1.0, "seed": 3}
                body |= {"n": 2, "stream": stream, **constraint_fields(kind, tok)}
                for text, finish in texts_of(s, "/v1/chat/completions", body):
                    assert finish == "stop" and valid(kind, text), (kind, text)
    finally:
        s.stop()
