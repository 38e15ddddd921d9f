"""Host time of the runner's step preparation (input ids, positions, slots, block tables and the
attention metadata) for decode steps of many sequences at long contexts, on the CPU, with no
model: the part of a GPU decode step's host work that grows with batch x context.

    python -m benchmarks.prepare [--shapes 64x200,256x600,256x1000,256x4000]

Run it at two commits (a worktree with PYTHONPATH set to it) and compare, alternating.
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

from gpu.runner import ModelRunner


def step(num_seqs: int, context: int, block_size: int = 16) -> SimpleNamespace:
    """One decode step: every sequence `context` tokens long, each with its own blocks."""
    blocks = -(-context // block_size)
    seqs = []
    for i in range(num_seqs):
        request = SimpleNamespace(request_id=str(i), all_token_ids=list(range(context)))
        seqs.append(
            SimpleNamespace(
                num_new_tokens=1,
                start=context - 1,
                block_table=list(range(i * blocks, (i + 1) * blocks)),
                request=request,
                token_ids=None,
                sample=True,
            )
        )
    return SimpleNamespace(seqs=seqs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="64x200,256x600,256x1000,256x4000")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    runner = ModelRunner.__new__(ModelRunner)  # prepare() needs no model
    runner.block_size, runner.device = 16, torch.device("cpu")
    try:
        from gpu.block_tables import BlockTables

        runner.block_tables = BlockTables()
    except ImportError:  # a commit before the grown-in-place tables
        pass
    for shape in args.shapes.split(","):
        n, ctx = map(int, shape.split("x"))
        out = step(n, ctx)
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            runner.prepare(out)
            times.append(time.perf_counter() - t)
        print(f"{n} sequences x {ctx} tokens: prepare {statistics.median(times) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
