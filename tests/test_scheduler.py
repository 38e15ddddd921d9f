"""Scheduler and EngineCore with a fake model: budgets, chunked prefill, preemption, stops,
aborts."""

from __future__ import annotations

import hashlib

import pytest

from core.engine_core import EngineCore
from core.request import EngineRequest, StepResult
from core.sampling import InvalidParam, SamplingParams
from core.runner_step import SchedulerOutput

VOCAB = 1000


class FakeRunner:
    """Next token = a hash of every token so far: a recompute after preemption must see the same
    history to produce the same tokens. It knows the requests only from the step protocol (its
    own copy of tokens and block tables, as gpu/runner_state.py keeps them), so a token or block
    the protocol loses changes the tokens or fails an assertion. Records every step."""

    vocab_size = VOCAB
    num_labels = 0  # a causal LM

    def __init__(self) -> None:
        self.steps: list[list[tuple[str, int, int, bool]]] = []
        self.tokens: dict[str, list[int]] = {}
        self.tables: dict[str, list[int]] = {}

    def execute(self, out: SchedulerOutput, grammar=None) -> list[int]:
        for rid in out.finished:
            del self.tokens[rid], self.tables[rid]
        for new in out.new:
            assert new.request_id not in self.tokens
            self.tokens[new.request_id] = list(new.prompt_token_ids)
            self.tables[new.request_id] = []
        for rid in out.preempted + out.resumed:
            self.tables[rid] = []
        self.steps.append(
            [(s.request_id, s.start, s.num_new_tokens, s.sample) for s in out.scheduled]
        )
        ids = []
        for s in out.scheduled:
            self.tokens[s.request_id] += s.new_token_ids
            self.tables[s.request_id] += s.new_block_ids
            table = self.tables[s.request_id]
            # Every new token's KV must go to a slot the block table covers, in distinct blocks.
            assert len(table) * 4 >= s.start + s.num_new_tokens and len(set(table)) == len(table)
            # The runner holds every token up to those it computes now.
            assert len(self.tokens[s.request_id]) >= s.start + s.num_new_tokens
            if s.sample:
                history = self.tokens[s.request_id][: s.start + s.num_new_tokens]
                digest = hashlib.sha256(repr(history).encode()).digest()
                ids.append(int.from_bytes(digest[:4], "little") % (VOCAB - 10) + 10)
        return StepResult(ids, [None] * len(ids))


def make_core(num_blocks=64, budget=64, max_seqs=8, max_model_len=512, eos=()):
    runner = FakeRunner()
    core = EngineCore(
        runner,
        None,
        num_blocks=num_blocks,
        block_size=4,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        eos_token_ids=set(eos),
        check_integrity=True,
    )
    return core, runner


def run(core: EngineCore, max_steps: int = 10_000):
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    for _ in range(max_steps):
        if not core.has_work:
            break
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        core.kv.check_integrity()
    assert not core.has_work
    return tokens, reasons


def add(core, rid, n, max_tokens=8, salt=None, **kw):
    salt = rid if salt is None else salt
    prompt = [
        int(hashlib.md5(f"{salt}/{i}".encode()).hexdigest(), 16) % (VOCAB - 10) + 10
        for i in range(n)
    ]
    core.add(EngineRequest(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, **kw)))


def test_budget_and_seq_cap_are_respected():
    core, runner = make_core(budget=20, max_seqs=3)
    for i in range(6):
        add(core, f"r{i}", 7)
    tokens, reasons = run(core)
    assert all(len(tokens[f"r{i}"]) == 8 for i in range(6))
    assert set(reasons.values()) == {"length"}
    for step in runner.steps:
        assert sum(n for _, _, n, _ in step) <= 20
        assert len(step) <= 3
    assert core.kv.num_free_blocks == core.kv.num_blocks


def test_long_prompt_is_chunked_and_decodes_go_first():
    core, runner = make_core(budget=16)
    add(core, "short", 3, max_tokens=20)
    core.step()  # "short" is now decoding
    add(core, "long", 50, max_tokens=2)
    core.step()
    # The decode was scheduled first, then as much of the long prompt as the budget allowed.
    assert runner.steps[-1] == [("short", 3, 1, True), ("long", 0, 15, False)]
    tokens, _ = run(core)
    chunks = [(s, n) for step in runner.steps for rid, s, n, _ in step if rid == "long"]
    assert chunks[:4] == [(0, 15), (15, 15), (30, 15), (45, 5)]
    assert core.num_partial_prefills >= 3
    assert len(tokens["long"]) == 2


def test_preemption_frees_newest_and_recomputes_same_tokens():
    roomy, _ = make_core(num_blocks=200, budget=64)
    for i in range(4):
        add(roomy, f"r{i}", 10, max_tokens=30)
    expected, _ = run(roomy)

    # 4 requests growing to 40 tokens need 40 blocks of 4; give them 24.
    tight, runner = make_core(num_blocks=24, budget=64)
    for i in range(4):
        add(tight, f"r{i}", 10, max_tokens=30)
    got, reasons = run(tight)
    assert tight.scheduler.num_preemptions > 0
    assert got == expected
    assert set(reasons.values()) == {"length"}
    assert tight.kv.num_free_blocks == 24


def test_no_admission_in_a_step_that_preempted():
    core, runner = make_core(num_blocks=12, budget=64, max_seqs=8)
    add(core, "a", 8, max_tokens=20)
    add(core, "b", 8, max_tokens=20)
    for _ in range(3):
        core.step()
    add(core, "c", 2, max_tokens=2)
    preempted_steps = 0
    while core.has_work:
        out = core.scheduler.schedule()
        if out.preempted:
            preempted_steps += 1
            admitted = [
                s.request.request_id
                for s in out.seqs
                if s.start == 0 and s.request.num_output_tokens == 0
            ]
            # "c" never starts in a step that preempted someone.
            assert "c" not in admitted
        if out.seqs:
            sampled = core.runner.execute(out.output)
            core.scheduler.commit(out)
            it = iter(sampled.token_ids)
            for s in out.seqs:
                if s.sample:
                    r = s.request
                    r.append_output(next(it))
                    if r.num_output_tokens >= r.max_tokens:
                        core.scheduler.remove(r)
                        del core.requests[r.request_id]
        core.kv.check_integrity()
    assert preempted_steps > 0


def test_stops_on_eos_stop_token_and_max_model_len():
    core, runner = make_core()
    add(core, "probe", 5, max_tokens=6, salt="p")
    probe, _ = run(core)
    third = probe["probe"][2]

    core, _ = make_core(eos={third})
    add(core, "eos", 5, max_tokens=6, salt="p")
    add(core, "ignore", 5, max_tokens=6, salt="p", ignore_eos=True)
    tokens, reasons = run(core)
    assert tokens["eos"] == probe["probe"][:3] and reasons["eos"] == "stop"
    assert tokens["ignore"] == probe["probe"] and reasons["ignore"] == "length"

    core, _ = make_core()
    add(core, "stopid", 5, max_tokens=6, salt="p", stop_token_ids=[third])
    tokens, reasons = run(core)
    assert tokens["stopid"] == probe["probe"][:3] and reasons["stopid"] == "stop"

    core, _ = make_core(max_model_len=8)
    add(core, "ctx", 5, max_tokens=None)
    tokens, reasons = run(core)
    assert len(tokens["ctx"]) == 3 and reasons["ctx"] == "length"


def test_abort_frees_blocks_wherever_the_request_is():
    core, _ = make_core(budget=8, max_seqs=1)
    add(core, "running", 20, max_tokens=50)
    add(core, "waiting", 4)
    core.step()
    assert core.kv.num_free_blocks < core.kv.num_blocks
    out = core.abort("running")
    assert out.finished and out.finish_reason == "abort"
    assert core.abort("waiting").finish_reason == "abort"
    assert core.abort("unknown") is None
    assert not core.has_work
    core.kv.check_integrity()
    assert core.kv.num_free_blocks == core.kv.num_blocks


def test_check_rejects_what_cannot_be_served():
    core, _ = make_core(max_model_len=16)
    with pytest.raises(InvalidParam) as e:
        core.check(EngineRequest("x", [], SamplingParams()))
    assert e.value.param == "prompt"
    with pytest.raises(InvalidParam):
        core.check(EngineRequest("x", [VOCAB + 5], SamplingParams()))
    with pytest.raises(InvalidParam) as e:
        core.check(EngineRequest("x", [11] * 16, SamplingParams()))
    assert "16" in e.value.message
    with pytest.raises(InvalidParam) as e:
        core.check(EngineRequest("x", [11] * 10, SamplingParams(max_tokens=7)))
    assert e.value.param == "max_tokens" and "17" in e.value.message
    assert core.check(EngineRequest("x", [11] * 10, SamplingParams(max_tokens=None))) == 6


def make_priority_core(**kw):
    runner = FakeRunner()
    core = EngineCore(
        runner,
        None,
        block_size=4,
        max_model_len=512,
        check_integrity=True,
        scheduling_policy="priority",
        **kw,
    )
    return core, runner


def test_priority_orders_the_waiting_queue():
    core, runner = make_priority_core(num_blocks=64, max_num_seqs=1, max_num_batched_tokens=64)
    for rid, prio in [("low", 10), ("mid", 5), ("high", 0), ("mid2", 5)]:
        core.add(
            EngineRequest(
                rid, [11, 12, 13], SamplingParams(max_tokens=2, temperature=0), priority=prio
            )
        )
    run(core)
    order = []
    for step in runner.steps:
        for rid, *_ in step:
            if rid not in order:
                order.append(rid)
    assert order == ["high", "mid", "mid2", "low"]


def test_priority_preempts_the_lowest_priority_running_request():
    core, runner = make_priority_core(num_blocks=12, max_num_seqs=4, max_num_batched_tokens=64)
    # The older request has the lower priority (larger value): under FCFS the newer one would go.
    core.add(
        EngineRequest("old-low", [11] * 8, SamplingParams(max_tokens=20, temperature=0), priority=9)
    )
    core.add(
        EngineRequest(
            "new-high", [12] * 8, SamplingParams(max_tokens=20, temperature=0), priority=1
        )
    )
    victims = []
    while core.has_work:
        out = core.scheduler.schedule()
        victims += out.preempted
        if out.seqs:
            sampled = iter(core.runner.execute(out.output).token_ids)
            core.scheduler.commit(out)
            for s in out.seqs:
                if s.sample:
                    r = s.request
                    r.append_output(next(sampled))
                    if r.num_output_tokens >= r.max_tokens:
                        core.scheduler.remove(r)
                        del core.requests[r.request_id]
        core.kv.check_integrity()
    assert victims and set(victims) == {"old-low"}
