"""weir's CPU thread pool (gpu/kernels/cpu_pool.cpp): every task runs exactly once, whoever
claims it and however long it is held."""

from __future__ import annotations

import ctypes

import pytest

from gpu.kernels import cpu_build


@pytest.fixture(scope="module")
def lib():
    return cpu_build.load()  # as the other CPU kernel tests: a build failure fails here


def run(lib, tasks: int, threads: int, caller_us: int, worker_us: int) -> list[int]:
    ran = (ctypes.c_int32 * tasks)()
    lib.weir_pool_selftest(tasks, threads, caller_us, worker_us, ran)
    return list(ran)


def test_every_task_runs_once(lib):
    for tasks in (1, 2, 7, 64):
        ran = run(lib, tasks, 2, 0, 0)
        assert all(r in (1, 2) for r in ran), ran


def test_a_task_held_past_the_callers_spin(lib):
    """A worker holds its task for 3 ms (as when the OS takes its core mid-task): the caller runs
    the rest, outwaits its spin, sleeps, and is woken when that task ends; nothing is lost and
    the next loop runs normally."""
    held = 0
    for _ in range(20):
        ran = run(lib, 16, 2, 50, 3000)
        assert all(r in (1, 2) for r in ran), ran
        held += ran.count(2)
        assert run(lib, 8, 2, 0, 0).count(0) == 0
    assert held > 0, "no task ever ran on the worker: the wait was not exercised"
