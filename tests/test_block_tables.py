"""The runner's own copy of its requests (gpu/runner_state.py), kept from the step protocol: its
block tables grow from each step's new block ids, start over when a request is resumed after a
preemption, and a step's flat buffer equals the tables padded with block 0."""

from __future__ import annotations

import random

import torch

from core.runner_step import NewRequest, ScheduledRequest, SchedulerOutput
from core.sampling import SamplingParams
from gpu.attention.backend import AttentionMetadata
from gpu.block_tables import StepTables
from gpu.runner_state import RunnerRequests


def test_tables_through_growth_preemption_resumption_and_absence():
    """Random steps over requests whose tables grow, are freed and retaken (preempted, then
    resumed with a whole new table) or are left out of a step: every step the runner's flat
    buffer is the engine's tables padded with 0, and its tokens are the engine's."""
    rng = random.Random(0)
    tables = {str(i): [rng.randrange(1000)] for i in range(12)}
    tokens = {rid: [rng.randrange(50) for _ in range(5)] for rid in tables}
    sent_tables = {rid: 0 for rid in tables}  # what the runner holds, as the scheduler counts
    sent_tokens = {rid: 5 for rid in tables}
    state = RunnerRequests()
    new = [NewRequest(rid, list(tokens[rid]), SamplingParams()) for rid in tables]
    first = True
    for _ in range(300):
        preempted, resumed = [], []
        for rid in tables:
            r = rng.random()
            if r < 0.3:
                tables[rid].append(rng.randrange(1000))
                tokens[rid].append(rng.randrange(50))
            elif r < 0.35:  # preempted and later resumed: a new table of new ids
                preempted.append(rid)
                tables[rid] = [rng.randrange(1000) for _ in range(rng.randint(1, 40))]
                sent_tables[rid] = 0
                resumed.append(rid)
        scheduled = [rid for rid in tables if rng.random() < 0.7] or ["0"]
        rng.shuffle(scheduled)
        entries = []
        for rid in scheduled:
            entries.append(
                ScheduledRequest(
                    rid,
                    0,
                    1,
                    True,
                    tokens[rid][sent_tokens[rid] :],
                    tables[rid][sent_tables[rid] :],
                )
            )
            sent_tables[rid], sent_tokens[rid] = len(tables[rid]), len(tokens[rid])
        out = SchedulerOutput(
            [], new if first else [], preempted if not first else [], resumed, entries
        )
        first = False
        got_requests = state.update(out)
        got = state.tables(got_requests)
        want = StepTables.from_lists([tables[rid] for rid in scheduled])
        assert (got.num_rows, got.width) == (want.num_rows, want.width)
        assert got.flat == want.flat
        assert all(r.token_ids == tokens[r.request_id] for r in got_requests)
    state.update(SchedulerOutput(list(tables), [], [], [], []))
    assert len(state) == 0  # finished: forgotten


def test_metadata_from_step_tables_matches_lists():
    lists = [[3, 4, 5], [7], [9, 10]]
    as_lists = AttentionMetadata.build(
        [1, 2, 3], lists, [1, 1, 1], [40, 10, 20], lambda d, t: torch.tensor(d, dtype=t)
    )
    step = StepTables.from_lists(lists)
    as_step = AttentionMetadata.build(
        [1, 2, 3], step, [1, 1, 1], [40, 10, 20], lambda d, t: torch.tensor(d, dtype=t)
    )
    assert as_step.block_tables.tolist() == [[3, 4, 5], [7, 0, 0], [9, 10, 0]]
    for field in ("block_tables", "query_start_loc", "seq_lens", "decode_seq_ids"):
        assert torch.equal(getattr(as_lists, field), getattr(as_step, field))
