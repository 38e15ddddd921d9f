"""A tensor-parallel worker: one rank's process, holding its share of the model and its KV cache.

Each node starts one per local rank (gpu/dist/node.py) as `python -m gpu.dist.worker CMD_FD
REPLY_FD` and speaks to it over two pipes of msgspec msgpack frames:

    to the worker      WorkerInit (config, rank, rendezvous), then, from the engine's executor
                       (gpu/dist/executor.py), one RunStep per engine step (a GrammarMask after
                       it, to rank 0, when the step samples under a grammar), StopWorker
    from the worker    WorkerReady once its shard is loaded and its KV cache allocated (the ranks
                       agree on the block count first: the smallest any rank has room for), then
                       rank 0 alone: one SampledTokens per RunStep; any rank: RankFailed

Ranks on other nodes than the engine's have no pipe from it: rank 0 relays each RunStep and
StopWorker to them through a gloo group (`Relay`), the frame's bytes broadcast as they came.

A RunStep carries the engine's SchedulerOutput as it is (core/runner_step.py): the same step
protocol the engine's own runner consumes, so each rank's ModelRunner keeps its copy of the
requests exactly as a single-process runner does.
"""

from __future__ import annotations

import logging
import signal
import sys
import traceback
from multiprocessing.connection import Connection

from pathlib import Path

import msgspec
import torch
import torch.distributed as dist

from core import child, engine_loop
from core.child import watch_parent
from core.config import EngineConfig
from core.request import StepResult
from core.runner_step import SchedulerOutput
from gpu.dist import parallel
from gpu.st_dense import projection
from gpu.assemble import (
    build_runner,
    fit_model_len,
    load_shard,
    resolve_device,
    served_positions,
    set_threads,
)
from gpu.loader import load_config, resolve_dtype

log = logging.getLogger("weir.worker")


# ---- messages ----
class WorkerInit(msgspec.Struct, tag="init", gc=False):
    config: EngineConfig  # its tensor_parallel_size and nnodes give the layout
    rank: int
    init_method: str
    model_path: str
    eos_token_ids: list[int]  # banned before a request's min_tokens (rank 0 samples)
    log_level: int = logging.INFO


class RunStep(msgspec.Struct, tag="step", gc=False):
    output: SchedulerOutput
    masked: bool = False  # a GrammarMask frame follows for rank 0


class GrammarMask(msgspec.Struct, tag="mask", gc=False):
    rows: list[int]
    words: int
    bitmask: bytes  # [len(rows), words] int32, native order


class StopWorker(msgspec.Struct, tag="stop", gc=False):
    pass


class WorkerReady(msgspec.Struct, tag="ready", gc=False):
    num_blocks: int  # the KV blocks every rank keeps
    max_model_len: int
    device: str


class SampledTokens(msgspec.Struct, tag="sampled", gc=False):
    result: StepResult


class RankFailed(msgspec.Struct, tag="failed", gc=False):
    message: str


ToWorker = WorkerInit | RunStep | GrammarMask | StopWorker
FromWorker = WorkerReady | SampledTokens | RankFailed


# ---- the worker ----
class Relay:
    """Frames from rank 0 to the ranks on other nodes: a length, then the bytes, broadcast over
    a gloo group (a CPU transport even where the model's collectives use NCCL)."""

    def __init__(self, group) -> None:
        self.group = group
        self._size = torch.zeros(1, dtype=torch.int64)

    def send(self, frame: bytes) -> None:
        self._size[0] = len(frame)
        dist.broadcast(self._size, 0, group=self.group)
        dist.broadcast(torch.frombuffer(bytearray(frame), dtype=torch.uint8), 0, group=self.group)

    def recv(self) -> bytes:
        dist.broadcast(self._size, 0, group=self.group)
        buf = torch.empty(int(self._size[0]), dtype=torch.uint8)
        dist.broadcast(buf, 0, group=self.group)
        return buf.numpy().tobytes()


def node_ranks(config: EngineConfig, node: int) -> range:
    """The ranks node `node` runs: an equal share each, node 0 holding rank 0."""
    per = config.tensor_parallel_size // config.nnodes
    return range(node * per, (node + 1) * per)


def run_rank(commands: Connection, replies: Connection) -> None:
    decode = msgspec.msgpack.Decoder(ToWorker).decode
    encode = msgspec.msgpack.Encoder().encode
    init = decode(commands.recv_bytes())
    assert isinstance(init, WorkerInit)
    config, rank, world = init.config, init.rank, init.config.tensor_parallel_size
    logging.basicConfig(
        level=init.log_level, format=f"%(asctime)s %(levelname)s weir.rank{rank}: %(message)s"
    )
    try:
        device = resolve_device(config.device)
        if device.type == "cuda":
            device = torch.device("cuda", rank % len(node_ranks(config, 0)))
        torch.manual_seed(config.seed)
        tp = parallel.init(rank, world, init.init_method, device)
        remote = [r for r in range(world) if r not in node_ranks(config, 0)]
        # Every rank takes part in creating a group, members or not.
        relay = Relay(dist.new_group([0, *remote], backend="gloo")) if remote else None
        path = Path(init.model_path)
        hf_config = load_config(path, config.hf_overrides, config.tokenizer)
        set_threads(config, hf_config, device, len(node_ranks(config, 0)))
        dtype = resolve_dtype(config.dtype, hf_config, device)
        model, num_blocks = load_shard(config, path, hf_config, dtype, device, tp)
        # One block layout for all: the fewest blocks any rank has room for.
        fewest = torch.tensor([num_blocks], device=device)
        dist.all_reduce(fewest, op=dist.ReduceOp.MIN)
        num_blocks = int(fewest.item())
        positions = served_positions(path, model.spec.max_position_embeddings)
        max_model_len = fit_model_len(config, positions, num_blocks, rank)
        eos = set(init.eos_token_ids)
        runner = build_runner(config, model, num_blocks, max_model_len, dtype, device, eos)
        runner.samples = rank == 0
        if rank == 0:  # (the rank that pools)
            runner.projector = projection(path, model, device)
        replies.send_bytes(encode(WorkerReady(num_blocks, max_model_len, str(device))))
        from_relay = relay is not None and rank in remote

        def take(block: bool) -> RunStep | StopWorker | None:
            if not block and not from_relay and not commands.poll():
                return None
            frame = relay.recv() if from_relay else commands.recv_bytes()
            if rank == 0 and relay is not None:
                relay.send(frame)  # a RunStep or StopWorker: nothing else reaches rank 0 here
            return decode(frame)

        def handle(msg: RunStep | StopWorker) -> bool:
            """A rank has no step of its own: each command is a step to run (or the end)."""
            if isinstance(msg, StopWorker):
                return False
            masks = None
            if msg.masked and rank == 0:
                masks = lambda: _read_mask(commands, decode, device)  # noqa: E731
            result = runner.execute(msg.output, masks=masks)
            if rank == 0:
                replies.send_bytes(encode(SampledTokens(result)))
            return True

        engine_loop.serve(take, handle)
    except (EOFError, BrokenPipeError):
        pass  # the engine is gone
    except BaseException as e:  # noqa: BLE001 - the driver fails the engine with this message
        log.error("rank %d failed\n%s", rank, traceback.format_exc())
        try:
            replies.send_bytes(encode(RankFailed(f"rank {rank}: {type(e).__name__}: {e}")))
        except OSError:
            pass
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _read_mask(commands: Connection, decode, device: torch.device):
    msg = decode(commands.recv_bytes())
    assert isinstance(msg, GrammarMask)
    rows = torch.tensor(msg.rows, dtype=torch.int64)
    mask = torch.frombuffer(bytearray(msg.bitmask), dtype=torch.int32).view(len(msg.rows), -1)
    return rows.to(device), mask.to(device)


def main() -> None:
    # Ctrl-C and systemd's SIGTERM reach every process of the service: the server drains first
    # and the engine stops the workers, as it does itself (core/engine_process.py).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    watch_parent()
    run_rank(*child.pipes(sys.argv))


if __name__ == "__main__":
    main()
