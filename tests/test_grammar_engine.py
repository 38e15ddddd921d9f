"""Structured outputs inside the engine: the bitmask in tensors against the matcher, the grammar
winning over bans, compiles off the step and cached, constraints in the engine process."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from core.config import EngineConfig
from core.request import EngineRequest
from core.sampling import SamplingParams
from core.runner_step import GrammarBatch
from core.structured import Constraint, Grammars
from gpu import grammar_mask
from gpu.backend import TorchBackend
from gpu.launch import load
from gpu.sampler import Sampler, SamplingMetadata
from tests.conftest import LiveServer, tiny_config
from tests.test_structured import USER, constraint_fields, texts_of, valid


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
