"""A tensor-parallel worker: one rank's process, holding its share of the model and its KV cache.

Each node starts one per local rank (gpu/dist/node.py) as `python -m gpu.dist.worker CMD_FD REPLY_FD` and
speaks to it over two pipes of msgspec msgpack frames:

    to the worker      Init (config, rank, world size, rendezvous), then, from the engine's
                       executor (gpu/dist/executor.py), one Step per engine step (Mask after it, to
                       rank 0, when the step samples under a grammar), Stop
    from the worker    Ready once its shard is loaded and its KV cache allocated (the ranks agree
                       on the block count first: the smallest any rank has room for), then rank 0
                       alone: one Sampled per Step; any rank: Failed

Ranks on other nodes than the engine's have no pipe from it: rank 0 relays each Step and Stop to
them through a gloo group (`Relay`), the frame's bytes broadcast as they came.

Each worker mirrors the requests it has been shown (prompt, sampling parameters, tokens so far,
block table), so a step's message carries only what changed: requests that finished, requests
seen for the first time, and per scheduled request its new block ids and the tokens sampled since
it was last scheduled. The mirror feeds the same ModelRunner that runs an unsharded model.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

from pathlib import Path

import msgspec
import torch
import torch.distributed as dist

from core.config import EngineConfig
from core.request import EngineRequest, Request, StepResult
from core.scheduler import ScheduledSeq, SchedulerOutput
from gpu.dist import parallel
from gpu.assemble import build_runner, fit_model_len, load_shard, resolve_device, set_threads
from gpu.loader import load_config, resolve_dtype

log = logging.getLogger("weir.worker")


# ---- messages ----
class Init(msgspec.Struct, tag="init", gc=False):
    config: EngineConfig  # its tensor_parallel_size and nnodes give the layout
    rank: int
    init_method: str
    model_path: str
    eos_token_ids: list[int]  # banned before a request's min_tokens (rank 0 samples)
    log_level: int = logging.INFO


class SeqStep(msgspec.Struct, array_like=True, gc=False):
    """One scheduled request: ScheduledSeq less what the worker already knows."""

    request_id: str
    start: int
    num_new_tokens: int
    sample: bool
    table_from: int  # keep this many of the block table's entries, then append new_blocks
    new_blocks: list[int]
    new_outputs: list[int]  # tokens sampled since the request was last scheduled


class Step(msgspec.Struct, tag="step", gc=False):
    finished: list[str]  # requests to forget (finished or aborted)
    new: list[EngineRequest]  # requests scheduled for the first time
    seqs: list[SeqStep]
    masked: bool = False  # a Mask frame follows for rank 0


class Mask(msgspec.Struct, tag="mask", gc=False):
    rows: list[int]
    words: int
    bitmask: bytes  # [len(rows), words] int32, native order


class Stop(msgspec.Struct, tag="stop", gc=False):
    pass


class Ready(msgspec.Struct, tag="ready", gc=False):
    num_blocks: int  # the KV blocks every rank keeps
    max_model_len: int
    device: str


class Sampled(msgspec.Struct, tag="sampled", gc=False):
    result: StepResult


class Failed(msgspec.Struct, tag="failed", gc=False):
    message: str


ToWorker = Init | Step | Mask | Stop
FromWorker = Ready | Sampled | Failed


# ---- the worker ----
class Mirror:
    """The requests as this rank knows them, rebuilt into SchedulerOutputs for the runner."""

    def __init__(self) -> None:
        self.requests: dict[str, Request] = {}
        self.tables: dict[str, list[int]] = {}

    def apply(self, step: Step) -> SchedulerOutput:
        for rid in step.finished:
            self.requests.pop(rid, None)
            self.tables.pop(rid, None)
        for req in step.new:
            self.requests[req.request_id] = Request(req, 0)
            self.tables[req.request_id] = []
        seqs = []
        for s in step.seqs:
            request = self.requests[s.request_id]
            for token in s.new_outputs:
                request.append_output(token)
            table = self.tables[s.request_id]
            del table[s.table_from :]
            table += s.new_blocks
            seqs.append(ScheduledSeq(request, s.start, s.num_new_tokens, table, s.sample))
        return SchedulerOutput(seqs, [])


def _watch_parent(parent: int) -> None:
    """Leave when the engine process is gone, even from inside a collective that will never
    complete (a worker blocked there would not see its pipe close)."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(1)


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


def serve(commands: Connection, replies: Connection) -> None:
    decode = msgspec.msgpack.Decoder(ToWorker).decode
    encode = msgspec.msgpack.Encoder().encode
    init = decode(commands.recv_bytes())
    assert isinstance(init, Init)
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
        hf_config = load_config(path)
        set_threads(config, hf_config, device, len(node_ranks(config, 0)))
        dtype = resolve_dtype(config.dtype, hf_config, device)
        model, num_blocks = load_shard(config, path, hf_config, dtype, device, tp)
        # One block layout for all: the fewest blocks any rank has room for.
        fewest = torch.tensor([num_blocks], device=device)
        dist.all_reduce(fewest, op=dist.ReduceOp.MIN)
        num_blocks = int(fewest.item())
        max_model_len = fit_model_len(config, model.spec.max_position_embeddings, num_blocks, rank)
        eos = set(init.eos_token_ids)
        runner = build_runner(config, model, num_blocks, max_model_len, dtype, device, eos)
        runner.samples = rank == 0
        replies.send_bytes(encode(Ready(num_blocks, max_model_len, str(device))))
        mirror = Mirror()
        from_relay = relay is not None and rank in remote
        while True:
            frame = relay.recv() if from_relay else commands.recv_bytes()
            msg = decode(frame)
            if rank == 0 and relay is not None:
                relay.send(frame)  # a Step or Stop: rank 0's pipe carries nothing else here
            if isinstance(msg, Stop):
                break
            out = mirror.apply(msg)
            masks = None
            if msg.masked and rank == 0:
                masks = lambda: _read_mask(commands, decode, device)  # noqa: E731
            result = runner.execute(out, masks)
            if rank == 0:
                replies.send_bytes(encode(Sampled(result)))
    except (EOFError, BrokenPipeError):
        pass  # the engine is gone
    except BaseException as e:  # noqa: BLE001 - the driver fails the engine with this message
        log.error("rank %d failed\n%s", rank, traceback.format_exc())
        try:
            replies.send_bytes(encode(Failed(f"rank {rank}: {type(e).__name__}: {e}")))
        except OSError:
            pass
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _read_mask(commands: Connection, decode, device: torch.device):
    msg = decode(commands.recv_bytes())
    assert isinstance(msg, Mask)
    rows = torch.tensor(msg.rows, dtype=torch.int64)
    mask = torch.frombuffer(bytearray(msg.bitmask), dtype=torch.int32).view(len(msg.rows), -1)
    return rows.to(device), mask.to(device)


def main() -> None:
    # Ctrl-C and systemd's SIGTERM reach every process of the service: the server drains first
    # and the engine stops the workers, as it does itself (core/engine_process.py).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    cmd_fd, reply_fd = int(sys.argv[1]), int(sys.argv[2])
    serve(Connection(cmd_fd, writable=False), Connection(reply_fd, readable=False))


if __name__ == "__main__":
    main()
