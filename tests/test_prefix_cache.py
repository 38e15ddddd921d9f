"""Prefix caching end to end on a real tiny model: hits, identical greedy output with caching on
and off (and against transformers), eviction under pressure, parallel samples sharing a prompt."""

from __future__ import annotations

import random

import torch

from core.config import EngineConfig
from core.request import EngineRequest
from core.sampling import SamplingParams
from gpu.launch import load


def run(core, requests, check=True):
    """Add (id, prompt ids, params[, kwargs]) tuples; step to the end; tokens and outputs by id."""
    for rid, ids, params, *extra in requests:
        core.add(EngineRequest(rid, ids, params, **(extra[0] if extra else {})))
    tokens: dict[str, list[int]] = {rid: [] for rid, *_ in requests}
    finals = {}
    while core.has_work:
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out
        if check:
            core.kv.check_integrity()
    return tokens, finals


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def engine(path, caching=True, **kw):
    kw.setdefault("num_kv_blocks", 256)
    return load(
        EngineConfig(model=str(path), enable_prefix_caching=caching, check_integrity=True, **kw)
    )


def test_shared_prefix_hits_and_matches_no_caching_and_transformers(model_dir):
    from transformers import AutoModelForCausalLM

    path = model_dir("qwen3")
    on = engine(path, True)
    tok = on.tokenizer
    rng = random.Random(0)
    prefix = [rng.randrange(3, 1000) for _ in range(300)]
    prompts = [prefix + tok.encode(" first question"), prefix + tok.encode(" and a second one")]

    # One after the other, as a chat client resends its conversation.
    first, f1 = run(on.core, [("a", prompts[0], greedy(12))])
    second, f2 = run(on.core, [("b", prompts[1], greedy(12))])
    assert f1["a"].num_cached_tokens == 0
    assert f2["b"].num_cached_tokens >= 300 // 16 * 16
    assert (
        on.core.num_computed_prompt_tokens
        == len(prompts[0]) + len(prompts[1]) - f2["b"].num_cached_tokens
    )

    off = engine(path, False)
    plain, _ = run(off.core, [("a", prompts[0], greedy(12)), ("b", prompts[1], greedy(12))])
    assert first["a"] == plain["a"] and second["b"] == plain["b"]
    assert not off.core.kv.pool.cached

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for rid, ids in zip("ab", prompts):
        ref = hf.generate(
            torch.tensor([ids]),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(ids) :].tolist()
        assert plain[rid] == ref


def test_eviction_under_pressure_keeps_serving_correctly(model_dir):
    path = model_dir("qwen3")
    rng = random.Random(1)
    # Eight distinct 40-token "system prompts", each reused by several requests over time.
    systems = [[rng.randrange(3, 1000) for _ in range(40)] for _ in range(8)]
    rounds = []
    for r in range(4):
        batch = []
        for s in rng.sample(range(8), 5):
            user = [rng.randrange(3, 1000) for _ in range(rng.randint(1, 12))]
            batch.append((f"r{r}-s{s}", systems[s] + user, greedy(8)))
        rounds.append(batch)

    # 48 blocks of 4 tokens hold about 4 of the 8 prefixes: the cache must keep evicting.
    small = engine(path, True, num_kv_blocks=48, block_size=4, max_num_batched_tokens=64)
    roomy = engine(path, False, num_kv_blocks=512, block_size=4)
    for batch in rounds:
        got, _ = run(small.core, batch)
        want, _ = run(roomy.core, batch)
        assert got == want  # an evicted block still in use would corrupt the KV and the tokens
    kv = small.core.kv
    assert kv.pool.num_evictions > 0 and kv.num_hit_tokens > 0
    assert kv.num_free_blocks == kv.num_blocks  # everything finished: all free (some cached)
    assert len(kv.pool.cached) > 0


def test_parallel_samples_compute_the_prompt_once(model_dir):
    path = model_dir("qwen3")
    loaded = engine(path, True)
    core = loaded.core
    rng = random.Random(2)
    prompt = [rng.randrange(3, 1000) for _ in range(100)]
    params = SamplingParams(temperature=0.9, max_tokens=10, seed=7)
    reqs = [("s0", prompt, params)] + [
        (
            f"s{j}",
            prompt,
            SamplingParams(temperature=0.9, max_tokens=10, seed=7 + j),
            {"leader_id": "s0"},
        )
        for j in (1, 2)
    ]
    tokens, finals = run(core, reqs)
    bs = core.kv.block_size
    tail = len(prompt) - (len(prompt) - 1) // bs * bs  # what each further sample recomputes
    assert core.num_computed_prompt_tokens == len(prompt) + 2 * tail
    assert finals["s1"].num_cached_tokens == finals["s2"].num_cached_tokens == len(prompt) - tail
    assert len({tuple(t) for t in tokens.values()}) == 3  # seeds differ: samples differ

    again, _ = run(engine(path, True).core, reqs)
    assert again == tokens  # the same seeds give the same samples


def test_followers_run_when_the_leader_is_aborted(model_dir):
    """A further sample waits for the first one's prompt; if the first is aborted mid-prefill,
    the others must not wait forever."""
    loaded = engine(model_dir("qwen3"), True, max_num_batched_tokens=16)
    core = loaded.core
    prompt = list(range(20, 120))
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    core.add(EngineRequest("lead", prompt, p))
    core.add(EngineRequest("follow", prompt, p, leader_id="lead"))
    core.step()  # the leader's first 16-token chunk; the follower is held
    assert core.requests["follow"].num_computed_tokens == 0
    core.abort("lead")
    tokens, finals = run(core, [])
    assert finals["follow"].finish_reason == "length" and len(tokens["follow"]) == 4
    assert core.kv.num_free_blocks == core.kv.num_blocks


def test_prompt_logprobs_survive_preemption_without_duplicates(model_dir):
    path = model_dir("qwen3")
    prompts = [list(range(30 + i, 70 + i)) for i in range(6)]

    def collect(**kw):
        core = engine(path, True, **kw).core
        for i, ids in enumerate(prompts):
            core.add(
                EngineRequest(
                    str(i),
                    ids,
                    SamplingParams(
                        temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=1
                    ),
                )
            )
        seen: dict[str, list] = {}
        while core.has_work:
            for out in core.step():
                if out.prompt_logprobs is not None:
                    assert out.request_id not in seen  # sent once, with the first token
                    seen[out.request_id] = [
                        (e.token_id, e.logprob) if e else None for e in out.prompt_logprobs
                    ]
        return core, seen

    tight, got = collect(num_kv_blocks=24, block_size=4, max_num_batched_tokens=32)
    _, want = collect(num_kv_blocks=512)
    assert tight.scheduler.num_preemptions > 0
    for rid, ids in zip(map(str, range(6)), prompts):
        assert len(want[rid]) == len(ids) and want[rid][0] is None
        assert [e[0] for e in want[rid][1:]] == ids[1:]
    # the same entries, once each; values within float tolerance (chunks sum in another order)
    assert got.keys() == want.keys()
    for rid in want:
        assert got[rid][0] is None and [e[0] for e in got[rid][1:]] == prompts[int(rid)][1:]
        for g, w in zip(got[rid][1:], want[rid][1:]):
            assert abs(g[1] - w[1]) < 1e-4, (rid, g, w)
