"""Asynchronous scheduling (core/engine_core.py step): step N+1 is scheduled and launched before
step N's results are taken in, its rows for requests whose sample is pending reading that sample
on the device. On a CPU the forward runs when launched, but the same code path runs, so every
output must equal synchronous scheduling's, token for token and log-prob for log-prob: stops of
every kind, max_tokens, aborts, preemption, chunked prefill, prefix caching, n > 1, seeded
sampling, log-probs, and the batches that take the previous step in first (grammars, penalties).
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from core.config import EngineConfig
from core.request import EngineRequest
from core.runner_step import NewRequest, ScheduledRequest, SchedulerOutput
from core.sampling import SamplingParams, bad_words_ids
from core.structured import Constraint
from gpu.launch import load
from gpu.runner_state import RunnerRequests


# On a GPU machine the CUDA path itself: pending samples read on the device, results waited for
# by event (there, other batch shapes may round the products differently).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def engine(model_dir, async_scheduling: bool, **kw):
    config = dict(
        model=str(model_dir("qwen3")),
        device=DEVICE,
        num_kv_blocks=64,
        block_size=4,
        max_num_batched_tokens=48,
        max_num_seqs=8,
        check_integrity=True,
        async_scheduling=async_scheduling,
    )
    config.update(kw)
    return load(EngineConfig(**config)).core


def drive(core, requests, abort_at: dict[int, str] | None = None, max_steps: int = 2000):
    """Add the requests, step to the end; per request its (tokens, text, finish reason,
    log-probs, prompt log-probs), and the runner's `pending` entries seen."""
    for r in requests:
        core.add(r)
    got: dict[str, list] = {r.request_id: [[], "", None, [], None] for r in requests}
    pending_rows = 0
    submit = core.runner.submit

    def watching(out, grammar=None):
        nonlocal pending_rows
        pending_rows += sum(s.pending for s in out.scheduled)
        return submit(out, grammar)

    core.runner.submit = watching
    steps = 0
    while core.has_work:
        steps += 1
        assert steps < max_steps
        outputs = []
        if abort_at and steps in abort_at:
            rid = abort_at[steps]
            if core.async_scheduling:  # the point: a step with its row is running
                assert rid in [s.request.request_id for s in core._inflight[0].seqs]
            outputs.append(core.abort(rid))
        for out in outputs + core.step():
            entry = got[out.request_id]
            entry[0] += out.new_token_ids
            entry[1] += out.new_text
            entry[3] += [(lp.token_id, lp.logprob, lp.top_ids) for lp in out.logprobs]
            if out.prompt_logprobs is not None:
                entry[4] = [(p.token_id, p.logprob) if p else None for p in out.prompt_logprobs]
            if out.finished:
                assert entry[2] is None, f"{out.request_id} finished twice"
                entry[2] = out.finish_reason
    core.runner.submit = submit
    assert core.kv.num_free_blocks == core.kv.num_blocks  # every block back in the pool
    return got, pending_rows


def same(got: dict, want: dict) -> None:
    """Tokens, text, finish reasons and log-probs' token ids exactly; the log-probs' values to
    float32 rounding (a batch of other rows can move the LM head's sums by an ulp)."""
    assert got.keys() == want.keys()
    for rid, (tokens, text, reason, lps, plps) in want.items():
        g_tokens, g_text, g_reason, g_lps, g_plps = got[rid]
        assert (g_tokens, g_text, g_reason) == (tokens, text, reason), rid
        assert [(t, top) for t, _, top in g_lps] == [(t, top) for t, _, top in lps], rid
        assert [v for _, v, _ in g_lps] == pytest.approx([v for _, v, _ in lps], rel=1e-5)
        assert (g_plps is None) == (plps is None), rid
        if plps is not None:
            assert [p and p[0] for p in g_plps] == [p and p[0] for p in plps], rid
            values = [p[1] for p in plps if p]
            assert [p[1] for p in g_plps if p] == pytest.approx(values, rel=1e-5), rid


def prompt(i: int, n: int) -> list[int]:
    return [(i * 7919 + j * 104729) % 900 + 10 for j in range(n)]


def workload(sync_result=None) -> list[EngineRequest]:
    """Mixed requests; stops (strings and token ids) are taken from a first synchronous run's
    outputs, so that they really end requests in the middle of the batch."""
    greedy = dict(temperature=0)
    reqs = [
        EngineRequest("long", prompt(1, 90), SamplingParams(max_tokens=12, **greedy)),  # chunked
        EngineRequest(
            "short", prompt(2, 3), SamplingParams(max_tokens=20, ignore_eos=True, **greedy)
        ),
        EngineRequest("one", prompt(3, 9), SamplingParams(max_tokens=1, **greedy)),
        EngineRequest(
            "lp",
            prompt(4, 11),
            SamplingParams(max_tokens=9, logprobs=2, prompt_logprobs=1, **greedy),
        ),
        EngineRequest(
            "seeded", prompt(5, 13), SamplingParams(max_tokens=15, temperature=0.9, seed=7)
        ),
        EngineRequest("min", prompt(6, 6), SamplingParams(max_tokens=10, min_tokens=6, **greedy)),
        # n > 1: two samples of one prompt, the second waiting for the first's cached prompt
        EngineRequest("n0", prompt(7, 21), SamplingParams(max_tokens=8, temperature=0.8, seed=1)),
        EngineRequest(
            "n1",
            prompt(7, 21),
            SamplingParams(max_tokens=8, temperature=0.8, seed=2),
            leader_id="n0",
        ),
        # shares a cached prefix with "long"
        EngineRequest(
            "prefix", prompt(1, 90)[:40] + [5, 6], SamplingParams(max_tokens=6, **greedy)
        ),
    ]
    if sync_result is not None:
        tokens, text = sync_result["short"][0], sync_result["seeded"][1]
        reqs.append(
            EngineRequest(
                "stop-id",
                prompt(2, 3),
                SamplingParams(
                    max_tokens=20, ignore_eos=True, stop_token_ids=[tokens[5]], **greedy
                ),
            )
        )
        reqs.append(
            EngineRequest(
                "stop-str",
                prompt(5, 13),
                SamplingParams(max_tokens=15, temperature=0.9, seed=7, stop=[text[4:7]]),
            )
        )
    return reqs


@pytest.mark.parametrize("blocks", [64, 32])  # 32: preemption
def test_outputs_equal_synchronous_scheduling(model_dir, blocks):
    first, _ = drive(engine(model_dir, False, num_kv_blocks=blocks), workload())
    sync, sync_pending = drive(engine(model_dir, False, num_kv_blocks=blocks), workload(first))
    core = engine(model_dir, True, num_kv_blocks=blocks)
    got, pending = drive(core, workload(first))
    assert sync_pending == 0 and pending > 20  # the pipeline ran: rows read pending samples
    same(got, sync)
    assert sync["stop-id"][2] == "stop" and len(sync["stop-id"][0]) == 6
    assert sync["stop-str"][2] == "stop" and len(sync["stop-str"][0]) < 15
    if blocks == 32:
        assert core.scheduler.num_preemptions > 0


def test_an_abort_while_its_step_runs(model_dir):
    """Aborted with a step in flight: nothing of it comes after the abort, the others are as
    without the abort, and its blocks are freed."""
    reqs = lambda: [  # noqa: E731
        EngineRequest(f"r{i}", prompt(i, 5 + i), SamplingParams(max_tokens=12, temperature=0))
        for i in range(4)
    ]
    sync, _ = drive(engine(model_dir, False), reqs())
    core = engine(model_dir, True)
    got, _ = drive(core, reqs(), abort_at={5: "r2"})
    assert got["r2"][2] == "abort" and got["r2"][0] == sync["r2"][0][: len(got["r2"][0])]
    assert len(got["r2"][0]) < 12
    same({k: got[k] for k in ("r0", "r1", "r3")}, {k: sync[k] for k in ("r0", "r1", "r3")})


def test_grammars_and_penalties_take_the_previous_step_in_first(model_dir):
    """A batch with a constrained or penalized request needs its tokens on the host: no row
    reads a pending sample while one is live, and outputs equal synchronous scheduling's."""
    schema = Constraint("json", '{"type": "object", "properties": {"a": {"type": "integer"}}}')
    reqs = lambda: [  # noqa: E731
        EngineRequest("plain", prompt(1, 8), SamplingParams(max_tokens=10, temperature=0)),
        EngineRequest(
            "json", prompt(2, 8), SamplingParams(max_tokens=20, temperature=0, structured=schema)
        ),
        EngineRequest(
            "pen", prompt(3, 8), SamplingParams(max_tokens=10, repetition_penalty=1.3, seed=3)
        ),
        # bad words of two tokens: banned by the token before, which must be known
        EngineRequest(
            "bad", prompt(4, 8), SamplingParams(max_tokens=10, temperature=0, bad_words=words)
        ),
    ]
    sync_core = engine(model_dir, False)
    plain = SamplingParams(max_tokens=10, temperature=0)
    ids = drive(sync_core, [EngineRequest("p", prompt(4, 8), plain)])[0]["p"][0]
    tok = sync_core.tokenizer

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    pairs = [tok.decode(ids[i : i + 2]) for i in range(len(ids) - 1)]
    words = [
        w for w, i in zip(pairs, range(len(ids))) if ids[i : i + 2] in bad_words_ids(encode, [w])
    ]
    assert words
    sync, _ = drive(sync_core, reqs())
    assert sync["bad"][0] != ids
    core = engine(model_dir, True)
    got, pending = drive(core, reqs())
    assert pending == 0
    same(got, sync)
    alone = drive(core, reqs()[3:])
    assert alone == ({"bad": sync["bad"]}, 0)
    assert core._num_need_known == 0  # every such request counted out when it ended


def test_the_runner_fills_a_pending_token_from_its_last_step():
    """gpu/runner_state.py: a pending entry adds a placeholder, which the request's next entry
    replaces with the real id the engine has seen since."""
    state = RunnerRequests()
    params = SamplingParams(temperature=0)
    out = SchedulerOutput([], [NewRequest("a", [1, 2, 3], params)], [], [], [])
    out.scheduled = [ScheduledRequest("a", 0, 3, True, [], [0])]
    (r,) = state.update(out)
    assert r.token_ids == [1, 2, 3]
    # step 2: its first sample (not yet seen by the engine) is the next input
    state.update(SchedulerOutput([], [], [], [], [ScheduledRequest("a", 3, 1, True, [], [], True)]))
    assert r.token_ids == [1, 2, 3, -1] and r.num_output_tokens == 1
    # step 3: the engine has seen it (9); the second sample is pending
    state.update(
        SchedulerOutput([], [], [], [], [ScheduledRequest("a", 4, 1, True, [9], [], True)])
    )
    assert r.token_ids == [1, 2, 3, 9, -1]
    # resumed after a preemption: every id known, nothing pending
    state.update(SchedulerOutput([], [], [], ["a"], [ScheduledRequest("a", 0, 5, True, [4], [1])]))
    assert r.token_ids == [1, 2, 3, 9, 4] and list(r.table) == [1]


def test_the_flag_is_refused_with_tensor_parallelism():
    with pytest.raises(ValueError, match="--async-scheduling"):
        EngineConfig(async_scheduling=True, tensor_parallel_size=2).validate()


def test_the_offline_api_and_a_server_with_async_scheduling(model_dir):
    """The engine loop drains the step still in flight when the work runs out (LLM.generate
    returns every token), and a server started with --async-scheduling serves streams."""
    from tests.conftest import LiveServer, tiny_config
    from weir import LLM

    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    prompts = ["hello there", "the river", [11, 12, 13]]
    outs = {}
    for flag in (False, True):
        llm = LLM(str(model_dir("qwen3")), num_kv_blocks=64, async_scheduling=flag)
        outs[flag] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs[True] == outs[False] and all(len(t) == 7 for t in outs[True])
    server = LiveServer(tiny_config(model_dir, async_scheduling=True, device="cpu")).start()
    try:
        body = {
            "model": "tiny",
            "prompt": [11, 12, 13],
            "max_tokens": 7,
            "temperature": 0,
            "ignore_eos": True,
        }
        r = httpx.post(server.url + "/v1/completions", json=body)
        assert r.json()["choices"][0]["text"] == llm.tokenizer.decode(outs[True][2])
        with httpx.stream(
            "POST", server.url + "/v1/completions", json={**body, "stream": True}
        ) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
        assert text == llm.tokenizer.decode(outs[True][2])
    finally:
        server.stop()
