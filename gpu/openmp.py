"""OpenMP's wait policy for a process that runs the engine, set before torch loads libgomp.

On CPU weir's kernels run a step's heavy work on their own pool (gpu/cpu/csrc/pool.cpp); torch's
OpenMP team runs only the few small torch ops left around it, and by default its threads spin for
a while after each, taking the core the pool's workers need next (figures: docs/benchmarks.md).
PASSIVE has them sleep instead. libgomp reads the variable once, when torch loads it, so each
process that runs the engine calls `prepare` before it imports torch (the engine process, the
server's own when the engine runs on its thread, a tensor-parallel worker, `LLM`). An explicit
setting wins; oneDNN's products (--cpu-matmul onednn) run on OpenMP's own threads and keep its
default. Nothing here imports torch.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("weir.openmp")

SET_HERE = False  # this process's OMP_WAIT_POLICY is weir's doing (benchmarks take it out again
# for the peers they start)


def wait_policy(cpu_matmul: str) -> str | None:
    """The policy weir sets for these products, or None (OpenMP's default)."""
    return None if cpu_matmul == "onednn" else "PASSIVE"


def prepare(config, env: dict[str, str] | None = None) -> None:
    """Set OMP_WAIT_POLICY in `env` (this process's environment when None) for `config`'s
    products, unless it is set already; in this process, only while torch is not loaded yet."""
    policy = wait_policy(config.cpu_matmul)
    target = os.environ if env is None else env
    if policy is None or "OMP_WAIT_POLICY" in target:
        return
    if env is None and "torch" in sys.modules:
        log.debug("torch is loaded already: OpenMP keeps its wait policy")
        return
    target["OMP_WAIT_POLICY"] = policy
    if env is None:
        global SET_HERE
        SET_HERE = True
