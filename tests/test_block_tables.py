"""The runner's step block tables: per-request copies that grow in place, equal to the tables."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from gpu.attention.backend import AttentionMetadata
from gpu.block_tables import BlockTables, StepTables


def seq(rid: str, table: list[int]):
    return SimpleNamespace(request=SimpleNamespace(request_id=rid), block_table=table)


def test_gather_equals_the_padded_tables_through_growth_preemption_and_absence():
    """Random steps over requests whose tables grow, are replaced (preempted and re-admitted:
    a new list with other ids, possibly as long as before) or are left out of a step: every step
    the flat buffer is the tables padded with 0, as built from lists."""
    rng = random.Random(0)
    tables = {str(i): [rng.randrange(1000)] for i in range(12)}
    cache = BlockTables()
    for _ in range(300):
        for rid in tables:
            r = rng.random()
            if r < 0.3:
                tables[rid].append(rng.randrange(1000))  # the same list grows
            elif r < 0.35:  # preempted and re-admitted: a new list of new ids
                tables[rid] = [rng.randrange(1000) for _ in range(rng.randint(1, 40))]
        scheduled = [rid for rid in tables if rng.random() < 0.7] or ["0"]
        rng.shuffle(scheduled)
        got = cache.gather([seq(rid, tables[rid]) for rid in scheduled])
        want = StepTables.from_lists([tables[rid] for rid in scheduled])
        assert (got.num_rows, got.width) == (want.num_rows, want.width)
        assert got.flat == want.flat


def test_metadata_from_step_tables_matches_lists():
    lists = [[3, 4, 5], [7], [9, 10]]
    as_lists = AttentionMetadata.build(
        [1, 2, 3], lists, [1, 1, 1], [40, 10, 20], lambda d, t: torch.tensor(d, dtype=t)
    )
    cache = BlockTables()
    step = cache.gather([seq(str(i), t) for i, t in enumerate(lists)])
    as_step = AttentionMetadata.build(
        [1, 2, 3], step, [1, 1, 1], [40, 10, 20], lambda d, t: torch.tensor(d, dtype=t)
    )
    assert as_step.block_tables.tolist() == [[3, 4, 5], [7, 0, 0], [9, 10, 0]]
    for field in ("block_tables", "query_start_loc", "seq_lens", "decode_seq_ids"):
        assert torch.equal(getattr(as_lists, field), getattr(as_step, field))
