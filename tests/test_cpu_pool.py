"""weir's CPU thread pool (gpu/cpu/csrc/pool.cpp): every task runs exactly once, whoever claims
it and however long it is held."""

from __future__ import annotations

import pytest

from gpu.cpu import build as cpu_build


@pytest.fixture(scope="module")
def ops():
    return cpu_build.load()  # as the other CPU kernel tests: a build failure fails here


def run(ops, tasks: int, threads: int, hold: bool = False, worker_us: int = 0):
    """(runs per task, 1 + the index of the thread that ran each task)."""
    runs, by = ops.pool_selftest(tasks, threads, hold, worker_us)
    return runs.tolist(), by.tolist()


def test_every_task_runs_once(ops):
    for tasks in (1, 2, 7, 64):
        runs, by = run(ops, tasks, 2)
        assert runs == [1] * tasks, runs
        assert all(b in (1, 2) for b in by), by


def test_a_task_held_past_the_callers_spin(ops):
    """A worker holds its task for 3 ms (as when the OS takes its core mid-task): the caller runs
    the rest, outwaits its spin, sleeps, and is woken when that task ends; nothing is lost and
    the next loop runs normally. The caller's first task waits for a worker to start one, so
    the held task happens every round, however the threads are scheduled."""
    for _ in range(20):
        runs, by = run(ops, 16, 2, hold=True, worker_us=3000)
        assert runs == [1] * 16, runs
        assert 2 in by and set(by) <= {1, 2}, by
        assert run(ops, 8, 2)[0] == [1] * 8
