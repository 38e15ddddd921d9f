"""Executor: the engine's model runner under tensor parallelism, driving one worker per rank.

The scheduler, block pool, detokenizer and grammar matchers stay single, in the engine process;
the model lives in the workers (gpu/worker.py), each with its share of the weights and of every
layer's KV heads, joined by torch.distributed (NCCL on CUDA, gloo on CPU). Each engine step is one
Step frame written to every worker (the same bytes: what changed since the last step), then, when
constrained requests sample, their grammar bitmask to rank 0 while the forward runs; rank 0
answers with the sampled ids. A worker that dies or fails ends the engine like a dead engine
process: `execute` raises, every worker is stopped, and the server fails every request.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import msgspec
import torch

from core.config import EngineConfig
from core.request import EngineRequest, Request, Status, StepResult
from core.scheduler import SchedulerOutput
from gpu import grammar_mask, parallel
from gpu.models.spec import ModelSpec
from gpu.worker import (
    Allocate,
    FromWorker,
    Failed,
    Hello,
    Init,
    Mask,
    Ready,
    Sampled,
    SeqStep,
    Step,
    Stop,
)

log = logging.getLogger("weir.executor")

_ROOT = Path(__file__).resolve().parent.parent  # where `gpu` and `core` import from


class WorkerDied(RuntimeError):
    pass


class _Worker:
    def __init__(
        self, rank: int, proc: subprocess.Popen, commands: Connection, replies: Connection
    ):
        self.rank = rank
        self.proc = proc
        self.commands = commands
        self.replies = replies


class _Shown:
    """What the workers know of one request: how many of its outputs and block ids."""

    __slots__ = ("request", "outputs", "blocks", "preemptions")

    def __init__(self, request: Request) -> None:
        self.request = request
        self.outputs = 0  # the workers build it from its prompt
        self.blocks = 0
        self.preemptions = request.num_preemptions


def local_init_method() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


class Executor:
    """The ModelRunner interface (vocab_size, eos_token_ids, grammars, execute, close) over the
    workers."""

    def __init__(self, spec: ModelSpec, workers: list[_Worker]) -> None:
        self.vocab_size = spec.vocab_size
        self.eos_token_ids: set[int] = set()
        self.grammars = None  # core.structured.Grammars, set by the engine when first needed
        self.workers = workers
        self.num_blocks = 0
        self.max_model_len = 0
        self.device_names = ""
        self._shown: dict[str, _Shown] = {}
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(FromWorker).decode
        self._closed = False

    # ---- start-up ----
    @classmethod
    def launch(
        cls, config: EngineConfig, path: Path, hf_config: Any, device: torch.device, eos: set[int]
    ) -> Executor:
        """Start the workers, wait until each has loaded its shard, size the KV cache to the
        smallest rank's room, and wait until every cache is allocated."""
        from gpu.launch import fit_model_len

        world = config.tensor_parallel_size
        spec = ModelSpec.from_hf_config(hf_config)
        parallel.check(spec, world)
        if device.type == "cuda" and torch.cuda.device_count() < world:
            raise ValueError(
                f"--tensor-parallel-size {world} needs {world} GPUs; "
                f"{torch.cuda.device_count()} are visible"
            )
        init_method = config.distributed_init_method or local_init_method()
        executor = cls(spec, [])
        executor.eos_token_ids = eos
        atexit.register(executor.close)
        try:
            for rank in range(world):
                executor.workers.append(_spawn(rank))
            level = logging.getLogger().getEffectiveLevel()
            for w in executor.workers:
                init = Init(config, w.rank, world, init_method, str(path), sorted(eos), level)
                w.commands.send_bytes(executor._encode(init))
            hellos = [executor._expect(w, Hello) for w in executor.workers]
            num_blocks = min(h.num_blocks for h in hellos)
            max_model_len = fit_model_len(config, spec.max_position_embeddings, num_blocks)
            for w in executor.workers:
                w.commands.send_bytes(executor._encode(Allocate(num_blocks, max_model_len)))
            for w in executor.workers:
                executor._expect(w, Ready)
        except BaseException:
            executor.close(kill=True)
            raise
        executor.num_blocks, executor.max_model_len = num_blocks, max_model_len
        executor.device_names = ", ".join(h.device for h in hellos)
        return executor

    def _expect(self, w: _Worker, kind: type) -> Any:
        """The next reply of worker `w`, which must be a `kind` (a failure or an exit raises)."""
        msg = self._receive(w)
        if not isinstance(msg, kind):
            raise WorkerDied(f"rank {w.rank} sent {type(msg).__name__}, expected {kind.__name__}")
        return msg

    def _receive(self, w: _Worker) -> Any:
        try:
            msg = self._decode(w.replies.recv_bytes())
        except (EOFError, OSError):
            raise WorkerDied(
                self._exited(5) or f"tensor-parallel rank {w.rank} closed its pipe"
            ) from None
        if isinstance(msg, Failed):
            raise WorkerDied(msg.message)
        return msg

    # ---- each step ----
    def _step_message(self, out: SchedulerOutput) -> Step:
        shown = self._shown
        finished = [rid for rid, s in shown.items() if s.request.status is Status.FINISHED]
        for rid in finished:
            del shown[rid]
        new = []
        seqs = []
        for seq in out.seqs:
            request = seq.request
            s = shown.get(request.request_id)
            if s is None or s.request is not request:
                if s is not None:  # a new request under a finished one's id, in one step
                    finished.append(request.request_id)
                s = shown[request.request_id] = _Shown(request)
                new.append(_engine_request(request))
            if s.preemptions != request.num_preemptions:  # its blocks were freed and retaken
                s.preemptions, s.blocks = request.num_preemptions, 0
            table = seq.block_table
            outputs = request.output_token_ids[s.outputs :]
            seqs.append(
                SeqStep(
                    request.request_id,
                    seq.start,
                    seq.num_new_tokens,
                    seq.sample,
                    s.blocks,
                    table[s.blocks :],
                    outputs,
                )
            )
            s.blocks = len(table)
            s.outputs = request.num_output_tokens
        return Step(finished, new, seqs)

    def execute(self, out: SchedulerOutput) -> StepResult:
        step = self._step_message(out)
        requests = [s.request for s in out.seqs if s.sample]
        constrained = self.grammars is not None and any(r.grammar is not None for r in requests)
        step.masked = constrained
        try:
            frame = self._encode(step)
            for w in self.workers:
                w.commands.send_bytes(frame)
            if constrained:  # filled while the workers run the forward
                rows, mask = grammar_mask.build(requests, self.grammars, torch.device("cpu"))
                msg = Mask(rows.tolist(), mask.shape[1], mask.numpy().tobytes())
                self.workers[0].commands.send_bytes(self._encode(msg))
            return self._wait_result()
        except (WorkerDied, OSError) as e:
            # A rank whose peer died fails in its collective too: name the one that exited.
            message = self._exited() or str(e)
            self.close(kill=True)
            raise WorkerDied(message) from None

    def _exited(self, wait: float = 1.0) -> str | None:
        """ "rank N exited (...)" for the first worker that has exited, waiting up to `wait`."""
        deadline = time.monotonic() + wait
        while True:
            gone = [(w.proc.poll(), w.rank) for w in self.workers if w.proc.poll() is not None]
            if gone:
                # One killed by a signal caused the others' failures, not the other way round.
                code, rank = min(gone, key=lambda g: (g[0] >= 0, g[1]))
                how = f"killed by signal {-code}" if code < 0 else f"code {code}"
                return f"tensor-parallel rank {rank} exited ({how})"
            if time.monotonic() > deadline:
                return None
            time.sleep(0.01)

    def _wait_result(self) -> StepResult:
        """Rank 0's answer; any other rank speaking (it failed) or closing its pipe (it died)
        ends the step instead."""
        conns = {w.replies: w for w in self.workers}
        first = self.workers[0]
        while True:
            for conn in wait(list(conns)):
                w = conns[conn]
                msg = self._receive(w)  # raises on a failure or an exit
                if w is first and isinstance(msg, Sampled):
                    return msg.result
                raise WorkerDied(f"rank {w.rank} sent {type(msg).__name__} during a step")

    # ---- the end ----
    def close(self, kill: bool = False) -> None:
        """Stop every worker (Stop, then a kill for any that does not leave in 10 s); with
        `kill`, at once: a worker may be blocked in a collective a dead peer never joins."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for w in self.workers:
            if not kill:
                try:
                    w.commands.send_bytes(self._encode(Stop()))
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


def _engine_request(request: Request) -> EngineRequest:
    return EngineRequest(
        request.request_id,
        request.prompt_token_ids,
        request.sampling_params,
        pooling=request.pooling,
    )


def _spawn(rank: int) -> _Worker:
    """One worker process (`python -m gpu.worker`), with a pipe each way."""
    cmd_read, cmd_write = os.pipe()
    reply_read, reply_write = os.pipe()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpu.worker", str(cmd_read), str(reply_write)],
        pass_fds=(cmd_read, reply_write),
        env=env,
        cwd=_ROOT,
    )
    os.close(cmd_read)  # the child's ends: closing ours makes its death an end of file here
    os.close(reply_write)
    return _Worker(
        rank, proc, Connection(cmd_write, readable=False), Connection(reply_read, writable=False)
    )
