"""Node: the tensor-parallel workers of this machine, started, watched and stopped together.

The engine's executor (gpu/dist/executor.py) holds the node that runs rank 0. With `--nnodes K` each
other machine runs `weir serve MODEL ... --node-rank R --headless`: a node of its own ranks and no
server (`run_headless`), whose workers meet the others at `--distributed-init-method` and take
their steps from rank 0 over the relay (gpu/dist/worker.py `Relay`).
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import subprocess
import time
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import msgspec

from core.child import Child
from core.config import EngineConfig
from gpu import openmp
from gpu.dist.worker import (
    FromWorker,
    RankFailed,
    StopWorker,
    WorkerInit,
    WorkerReady,
    node_ranks,
)

log = logging.getLogger("weir.node")



class WorkerDied(RuntimeError):
    pass


class WorkerFailed(WorkerDied):
    """A worker reported an exception (its message says which rank and what)."""


def local_init_method() -> str:
    """A free TCP port on this machine for the ranks to meet at."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


class Worker:
    """One rank's process (`python -m gpu.dist.worker`, core/child.py) and its two pipes."""

    def __init__(self, rank: int, config: EngineConfig) -> None:
        env = dict(os.environ)
        openmp.prepare(config, env)
        self.rank = rank
        started = Child("gpu.dist.worker", env)
        self.proc, self.commands, self.replies = started.proc, started.commands, started.replies


class Node:
    def __init__(self, workers: list[Worker]) -> None:
        self.workers = workers
        self._encode = msgspec.msgpack.Encoder().encode
        self.decode = msgspec.msgpack.Decoder(FromWorker).decode
        self._closed = False
        atexit.register(self.stop)

    @classmethod
    def start(
        cls, config: EngineConfig, path: Path, eos: set[int], node_rank: int, init_method: str
    ) -> tuple[Node, list[WorkerReady]]:
        """Start this node's ranks and wait until every one has loaded its shard and allocated
        its KV cache (which takes the other nodes too: the ranks agree on the block count)."""
        node = cls([])
        # Workers run from the repository root: a path the user gave relative to their own
        # working directory is made absolute here, once, before any worker sees it.
        where = str(Path(path).expanduser().resolve())
        try:
            for rank in node_ranks(config, node_rank):
                node.workers.append(Worker(rank, config))
            level = logging.getLogger().getEffectiveLevel()
            for w in node.workers:
                init = WorkerInit(config, w.rank, init_method, where, sorted(eos), level)
                w.commands.send_bytes(node._encode(init))
            readies = [node.expect(w, WorkerReady) for w in node.workers]
        except BaseException:
            node.stop(kill=True)
            raise
        return node, readies

    def send(self, frame: bytes, workers: list[Worker] | None = None) -> None:
        for w in self.workers if workers is None else workers:
            w.commands.send_bytes(frame)

    def expect(self, w: Worker, kind: type) -> Any:
        """The next reply of worker `w`, which must be a `kind` (a failure or an exit raises)."""
        msg = self.receive(w)
        if not isinstance(msg, kind):
            raise WorkerDied(f"rank {w.rank} sent {type(msg).__name__}, expected {kind.__name__}")
        return msg

    def receive(self, w: Worker) -> Any:
        try:
            msg = self.decode(w.replies.recv_bytes())
        except (EOFError, OSError):
            raise WorkerDied(
                self.exited(5) or f"tensor-parallel rank {w.rank} closed its pipe"
            ) from None
        if isinstance(msg, RankFailed):
            raise WorkerFailed(msg.message)
        return msg

    def ready(self) -> list[Worker]:
        """Block until some worker has something to say (or has exited): those workers."""
        by_conn = {w.replies: w for w in self.workers}
        return [by_conn[c] for c in wait(list(by_conn))]

    def exited(self, wait: float = 1.0, signalled: bool = False) -> str | None:
        """'rank N exited (...)' for a worker that has exited (`signalled`: one killed by a
        signal), waiting up to `wait` for one."""
        deadline = time.monotonic() + wait
        while True:
            gone = [(w.proc.poll(), w.rank) for w in self.workers if w.proc.poll() is not None]
            if signalled:
                gone = [g for g in gone if g[0] < 0]
            if gone:
                # One killed by a signal caused the others' failures, not the other way round.
                code, rank = min(gone, key=lambda g: (g[0] >= 0, g[1]))
                how = f"killed by signal {-code}" if code < 0 else f"code {code}"
                return f"tensor-parallel rank {rank} exited ({how})"
            if time.monotonic() > deadline:
                return None
            time.sleep(0.01)

    def stop(self, kill: bool = False) -> None:
        """Stop every worker (StopWorker, then a kill for any that does not leave in 10 s); with
        `kill`, at once: a worker may be blocked in a collective a dead peer never joins."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.stop)
        for w in self.workers:
            if not kill:
                try:
                    w.commands.send_bytes(self._encode(StopWorker()))
                except OSError:
                    pass
            w.commands.close()
        for w in self.workers:
            try:
                w.proc.wait(timeout=0 if kill else 10)
            except subprocess.TimeoutExpired:
                if not kill:
                    log.warning("tensor-parallel rank %d did not stop in 10 s: killing it", w.rank)
                w.proc.kill()
                w.proc.wait()
            w.replies.close()


def run_headless(config: EngineConfig) -> int:
    """`--headless`: run this node's ranks until rank 0 stops them (or one fails); no server.
    Exit status 0 when every worker stopped cleanly."""
    from gpu.assemble import model_path
    from gpu.loader import eos_token_ids, load_config

    config.validate()
    if config.nnodes < 2 or config.node_rank == 0:
        raise ValueError("--headless runs the ranks of another node: give --nnodes and --node-rank")
    path, _ = model_path(config)
    hf_config = load_config(path, config.hf_overrides, config.tokenizer)
    eos = eos_token_ids(path, hf_config)  # rank 0 samples: these are not used here
    node, readies = Node.start(config, path, eos, config.node_rank, config.distributed_init_method)
    log.info(
        "node %d of %d: ranks %s on %s, %d KV blocks",
        config.node_rank,
        config.nnodes,
        ", ".join(str(w.rank) for w in node.workers),
        ", ".join(r.device for r in readies),
        readies[0].num_blocks,
    )
    watching = {w.replies: w for w in node.workers}
    failed = False
    try:
        while watching and not failed:
            for conn in wait(list(watching)):
                w = watching[conn]
                try:
                    msg = node.decode(conn.recv_bytes())
                except (EOFError, OSError):
                    del watching[conn]
                    if w.proc.wait() != 0:  # stopped by rank 0's StopWorker: 0
                        log.error("tensor-parallel rank %d exited (%d)", w.rank, w.proc.returncode)
                        failed = True
                    continue
                if isinstance(msg, RankFailed):  # a worker speaks here only to fail
                    log.error("%s", msg.message)
                    failed = True
    finally:
        node.stop(kill=failed)
    return 1 if failed else 0
