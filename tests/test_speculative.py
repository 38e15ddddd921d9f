"""Speculative decoding (core/speculative.py, gpu/sampler.py verify): n-gram proposals verified
in one forward. Greedy outputs are the same tokens as without speculation, with stops of every
kind inside an accepted run, max_tokens and min_tokens, log-probs, chunked prefill, preemption
and prefix caching; sampled outputs keep the model's distribution (a chi-square bound on the
rejection sampler) and seeded ones repeat; it steps aside by batch size and by acceptance."""

from __future__ import annotations

import json

import pytest
import torch

from core.config import EngineConfig
from core.request import EngineRequest
from core.sampling import SamplingParams
from core.speculative import NgramIndex, SpeculativeConfig, Speculator, auto_batch_limit
from gpu.launch import load
from gpu.sampler import Sampler, SamplingMetadata
from tests.test_async_scheduling import drive, same

# Every step may speculate here (left out, the limit is the device's: auto_batch_limit).
NGRAM = json.dumps(
    {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 3,
        "disable_by_batch_size": 64,
    }
)


def test_the_config_is_vllms_and_refuses_what_it_cannot_serve():
    c = SpeculativeConfig.parse(NGRAM)
    assert (c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == (4, 3, 1)
    for text, named in (
        ('{"method": "eagle", "num_speculative_tokens": 2}', "'eagle' is not served"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "the draft's path"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "between 1 and 16"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "typo": 1}', "typo"),
        ('{"method": "ngram"', "--speculative-config"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, '
            '"prompt_lookup_max": 2}',
            "prompt_lookup_min",
        ),  # fmt: skip
    ):
        with pytest.raises(ValueError, match=named):
            SpeculativeConfig.parse(text)
    with pytest.raises(ValueError, match="synchronous scheduling"):
        EngineConfig(speculative_config=NGRAM, async_scheduling=True).validate()
    # a draft model's path alone means draft_model, as vLLM reads it
    draft = SpeculativeConfig.parse('{"model": "/a/draft", "num_speculative_tokens": 3}')
    assert (draft.method, draft.model) == ("draft_model", "/a/draft")


def test_ngram_lookup_takes_the_latest_longest_match():
    index = NgramIndex(1, 3)
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    # the suffix 1 2 3 last occurred before 7 8: its continuation, not the earlier 9's
    assert index.propose(tokens, 3) == [7, 8, 1]
    assert index.propose(tokens + [5], 2) == []  # no earlier 3 5 / 5: nothing
    assert index.propose(tokens + [5, 1, 2], 4) == [3, 5, 1, 2]  # grown incrementally
    assert NgramIndex(2, 2).propose([4, 4], 3) == []  # a suffix never matches itself


def test_the_rejection_sampler_keeps_the_models_distribution():
    """A proposal verified by sampling: the first token out is distributed as the model's
    softmax whatever is proposed (8 tokens, 20,000 draws a proposal, chi-square at 1e-4)."""
    vocab, n = 8, 20_000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2]]).repeat(n, 1)
    want = torch.softmax(logits[0], dim=-1)
    sampler = Sampler(seed=0, device=torch.device("cpu"), backend=_Argmax())
    m = SamplingMetadata(
        all_greedy=False,
        temperature=torch.ones(n),
        top_k=torch.zeros(n, dtype=torch.int64),
        top_p=torch.ones(n),
        min_p=torch.zeros(n),
    )
    for proposal in (0, 3, 7):  # likely, unlikely, and in between
        drafts = torch.full((n,), proposal)
        out, accepted = sampler.verify(logits, m, drafts)
        assert torch.equal(out.token_ids[accepted], drafts[accepted])
        counts = torch.bincount(out.token_ids, minlength=vocab).double()
        chi2 = ((counts - n * want) ** 2 / (n * want)).sum().item()
        assert chi2 < 31.3, (proposal, chi2)  # 7 degrees of freedom, p = 1e-4
        assert abs(accepted.double().mean().item() - want[proposal].item()) < 0.02


class _Argmax:
    def argmax(self, logits):
        return logits.argmax(dim=-1)


def engine(model_dir, spec: str | None, **kw):
    config = dict(
        model=str(model_dir("qwen3")),
        device="cpu",
        num_kv_blocks=64,
        block_size=4,
        max_num_batched_tokens=48,
        max_num_seqs=8,
        check_integrity=True,
        speculative_config=spec,
    )
    config.update(kw)
    return load(EngineConfig(**config)).core


def prompt(i: int, n: int, period: int = 5) -> list[int]:
    """Prompts that repeat themselves, so the n-gram lookup finds something to propose."""
    return [(i * 37 + j % period * 11) % 900 + 10 for j in range(n)]


def workload(first=None) -> list[EngineRequest]:
    g = dict(temperature=0)
    reqs = [
        EngineRequest("long", prompt(1, 90), SamplingParams(max_tokens=14, **g)),  # chunked
        EngineRequest("r2", prompt(2, 12), SamplingParams(max_tokens=20, ignore_eos=True, **g)),
        EngineRequest(
            "lp", prompt(3, 10), SamplingParams(max_tokens=12, logprobs=2, ignore_eos=True, **g)
        ),
        EngineRequest("min", prompt(4, 8), SamplingParams(max_tokens=10, min_tokens=7, **g)),
        EngineRequest("one", prompt(5, 6), SamplingParams(max_tokens=1, **g)),
        EngineRequest("prefix", prompt(1, 90)[:40] + [7, 8], SamplingParams(max_tokens=9, **g)),
        # n > 1: the second sample waits for the first's prompt in the cache
        EngineRequest("n0", prompt(6, 17), SamplingParams(max_tokens=11, ignore_eos=True, **g)),
        EngineRequest(
            "n1",
            prompt(6, 17),
            SamplingParams(max_tokens=11, ignore_eos=True, **g),
            leader_id="n0",
        ),
    ]
    if first is not None:  # stops taken from a first run, so that they land inside runs
        tokens, text = first["r2"][0], first["lp"][1]
        reqs.append(
            EngineRequest(
                "stop-id",
                prompt(2, 12),
                SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=[tokens[6]], **g),
            )
        )
        reqs.append(
            EngineRequest(
                "stop-str",
                prompt(3, 10),
                SamplingParams(max_tokens=12, ignore_eos=True, stop=[text[5:8]], **g),
            )
        )
    return reqs


def oracle(reference: dict[str, list[int]], monkeypatch):
    """Proposals from the reference run's own continuation (every third one with a wrong
    second token): long accepted runs, partial ones and rejections, whatever the model."""

    def propose(self, requests):
        for r in requests:
            r.spec_token_ids = []
            if r.num_pending or r.num_computed_tokens != r.num_tokens - 1 or not self.wants(r):
                continue
            room = min(self.k, r.max_tokens - r.num_output_tokens - 1)
            if room <= 0:
                continue
            at = r.num_output_tokens
            proposal = list(reference[r.request_id][at : at + room])
            if at % 3 == 0 and len(proposal) > 1:
                proposal[1] = proposal[1] % 900 + 11
            r.spec_token_ids = proposal

    monkeypatch.setattr(Speculator, "propose", propose)


@pytest.mark.parametrize("proposer", ["ngram", "oracle"])
@pytest.mark.parametrize("blocks", [64, 32])  # 32: preemption
def test_greedy_outputs_are_the_same_tokens(model_dir, monkeypatch, proposer, blocks):
    first, _ = drive(engine(model_dir, None, num_kv_blocks=blocks), workload())
    want, _ = drive(engine(model_dir, None, num_kv_blocks=blocks), workload(first))
    if proposer == "oracle":
        oracle({k: v[0] for k, v in want.items()}, monkeypatch)
    core = engine(model_dir, NGRAM, num_kv_blocks=blocks)
    counts = {"drafts": 0, "accepted": 0}
    take = core.take_stats

    def counting():
        s = take()
        counts["drafts"] += s.spec_drafts
        counts["accepted"] += s.spec_accepted_tokens
        return s

    core.take_stats = counting
    steps = []
    step = core.step
    core.step = lambda: (steps.append(1), step(), counting())[1]
    got, _ = drive(core, workload(first))
    same(got, want)
    assert want["stop-id"][2] == "stop" and len(want["stop-id"][0]) == 7
    assert want["stop-str"][2] == "stop" and want["min"][0][:7] == got["min"][0][:7]
    assert counts["drafts"] > 5
    if proposer == "oracle":  # runs of several tokens a step, stops inside them
        assert counts["accepted"] > 40
        base_steps = sum(len(v[0]) for v in want.values())
        assert len(steps) < base_steps
    if blocks == 32:
        assert core.scheduler.num_preemptions > 0


def test_seeded_sampling_repeats_and_steps_aside(model_dir):
    """Seeded sampled requests give the same tokens run after run; a request whose proposals
    keep failing stops proposing; a batch above disable_by_batch_size proposes nothing."""
    reqs = lambda: [  # noqa: E731
        EngineRequest(
            f"s{i}",
            prompt(i, 15),
            SamplingParams(max_tokens=30, temperature=0.8, seed=i, ignore_eos=True),
        )
        for i in range(3)
    ]
    runs = [drive(engine(model_dir, NGRAM), reqs())[0] for _ in range(2)]
    same(runs[0], runs[1])
    core = engine(model_dir, NGRAM)
    for r in reqs():
        core.add(r)
    for _ in range(3):
        core.step()
    request = core.requests["s0"]
    core.speculator.judge(request, 40, 1)
    assert request.spec_off and request.spec_index is None
    core.step()
    assert request.spec_token_ids == []
    quiet = json.dumps({**json.loads(NGRAM), "disable_by_batch_size": 2})
    core = engine(model_dir, quiet)
    assert core.speculator.config.disable_by_batch_size == 2
    auto = {k: v for k, v in json.loads(NGRAM).items() if k != "disable_by_batch_size"}
    limit = engine(model_dir, json.dumps(auto)).speculator.config.disable_by_batch_size
    assert limit == auto_batch_limit(4, "cpu") == 1  # 4 nearly free rows on a CPU: one stream
    for r in reqs():
        core.add(r)
    for _ in range(4):
        core.step()
        assert all(not r.spec_token_ids for r in core.scheduler.running)


def test_a_server_counts_its_drafts(model_dir):
    """--speculative-config served: /metrics counts drafts and accepted tokens with vLLM's
    names, per position too."""
    import httpx

    from tests.conftest import LiveServer, tiny_config

    server = LiveServer(tiny_config(model_dir, device="cpu", speculative_config=NGRAM)).start()
    try:
        body = {"model": "tiny", "prompt": prompt(1, 40), "max_tokens": 24, "temperature": 0}
        r = httpx.post(server.url + "/v1/completions", json={**body, "ignore_eos": True})
        assert r.status_code == 200
        text = httpx.get(server.url + "/metrics").text
        drafts = [
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("weir:spec_decode_num_drafts_total")
        ]
        assert drafts and drafts[0] > 0
        assert "weir:spec_decode_num_accepted_tokens_per_pos_total" in text
    finally:
        server.stop()


def test_structured_outputs_verify_proposals_under_their_grammar(model_dir, monkeypatch):
    """A constrained request speculates from n-gram proposals cut where its grammar refuses
    them; each verified position is masked by the grammar as it will be there. Outputs are the
    same tokens as without speculation, and long runs are kept."""
    from core.speculative import grammar_cut
    from core.structured import Constraint

    schema = '{"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}'
    reqs = lambda: [  # noqa: E731
        EngineRequest(
            "json",
            prompt(1, 9),
            SamplingParams(max_tokens=40, temperature=0, structured=Constraint("json", schema)),
        ),
        EngineRequest(
            "regex",
            prompt(2, 9),
            SamplingParams(
                max_tokens=30, temperature=0, structured=Constraint("regex", "(ab|cd|x){4,30}")
            ),
        ),
        EngineRequest("plain", prompt(3, 9), SamplingParams(max_tokens=20, temperature=0)),
    ]
    want, _ = drive(engine(model_dir, None), reqs())
    reference = {k: v[0] for k, v in want.items()}

    def propose(self, requests):
        for r in requests:
            r.spec_token_ids = []
            if r.num_computed_tokens != r.num_tokens - 1 or not self.wants(r):
                continue
            room = min(self.k, r.max_tokens - r.num_output_tokens - 1)
            at = r.num_output_tokens
            proposal = list(reference[r.request_id][at : at + max(room, 0)])
            if at % 2 and len(proposal) > 2:  # now and then a token the grammar may refuse
                proposal[2] = 11
            if proposal and r.grammar is not None:
                proposal = grammar_cut(r.grammar, proposal)
            r.spec_token_ids = proposal

    monkeypatch.setattr(Speculator, "propose", propose)
    core = engine(model_dir, NGRAM)
    accepted = []
    step = core.step

    def stepping():
        out = step()
        accepted.append(core.take_stats().spec_accepted_tokens)
        return out

    core.step = stepping
    got, _ = drive(core, reqs())
    same(got, want)
    assert sum(accepted) > 20
    assert json.loads(got["json"][1]) is not None and got["json"][2] == "stop"


def test_tensor_parallel_ranks_verify_proposals(model_dir):
    """Two ranks (CPU workers): every rank computes the proposals' rows, rank 0 verifies; the
    same tokens as one rank without speculation."""
    from weir import LLM

    prompts = [prompt(1, 13), prompt(2, 8, period=3)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    base = LLM(str(model_dir("qwen3")), num_kv_blocks=64, device="cpu")
    want = [o.outputs[0].token_ids for o in base.generate(prompts, params, use_tqdm=False)]
    tp = LLM(
        str(model_dir("qwen3")),
        num_kv_blocks=64,
        device="cpu",
        tensor_parallel_size=2,
        speculative_config=NGRAM,
    )
    try:
        drafts = []
        take = tp.engine.take_stats

        def counting():
            s = take()
            drafts.append(s.spec_drafts)
            return s

        tp.engine.take_stats = counting
        got = [o.outputs[0].token_ids for o in tp.generate(prompts, params, use_tqdm=False)]
    finally:
        tp.engine.close()
    assert got == want and sum(drafts) > 0
