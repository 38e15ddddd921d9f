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

import torch

from gpu.runner import ModelRunner


def step(num_seqs: int, context: int, block_size: int = 16):
    """One decode step: every sequence `context` tokens long, each with its own blocks, and the
    runner's copy of them (gpu/runner_state.py) made once, as a running engine has it."""
    from core.runner_step import NewRequest, ScheduledRequest, SchedulerOutput
    from core.sampling import SamplingParams
    from gpu.runner_state import RunnerRequests

    blocks = -(-context // block_size)
    state = RunnerRequests()
    new = [NewRequest(str(i), list(range(context)), SamplingParams()) for i in range(num_seqs)]
    first = [
        ScheduledRequest(str(i), context - 1, 1, True, [], list(range(i * b, (i + 1) * b)))
        for i, b in ((i, blocks) for i in range(num_seqs))
    ]
    state.update(SchedulerOutput([], new, [], [], first))
    entries = [ScheduledRequest(str(i), context - 1, 1, True, [], []) for i in range(num_seqs)]
    return state, SchedulerOutput([], [], [], [], entries)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="64x200,256x600,256x1000,256x4000")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    runner = ModelRunner.__new__(ModelRunner)  # prepare() needs no model
    runner.block_size, runner.device = 16, torch.device("cpu")
    for shape in args.shapes.split(","):
        n, ctx = map(int, shape.split("x"))
        runner.state, out = step(n, ctx)
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            runner.prepare(out, runner.state.update(out))
            times.append(time.perf_counter() - t)
        print(f"{n} sequences x {ctx} tokens: prepare {statistics.median(times) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
