"""Executor: the engine's model runner under tensor parallelism, driving one worker per rank.

The scheduler, block pool, detokenizer and grammar matchers stay single, in the engine process;
the model lives in the workers (gpu/dist/worker.py), each with its share of the weights and of every
layer's KV heads, joined by torch.distributed (NCCL on CUDA, gloo on CPU). Each engine step is
one Step frame written to every worker of this node (gpu/dist/node.py; the same bytes: what changed
since the last step; rank 0 relays it to other nodes' ranks), then, when constrained requests
sample, their grammar bitmask to rank 0 while the forward runs; rank 0 answers with the sampled
ids. A worker that dies or fails ends the engine like a dead engine process: `execute` raises,
every worker is stopped, and the server fails every request.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import msgspec
import torch

from core.config import EngineConfig
from core.request import EngineRequest, Request, Status, StepResult
from core.scheduler import SchedulerOutput
from gpu import grammar_mask
from gpu.dist import parallel
from gpu.models.spec import ModelSpec
from gpu.dist.node import Node, WorkerDied, WorkerFailed, local_init_method
from gpu.dist.worker import Mask, Sampled, SeqStep, Step, node_ranks

log = logging.getLogger("weir.executor")


class _Shown:
    """What the workers know of one request: how many of its outputs and block ids."""

    __slots__ = ("request", "outputs", "blocks", "preemptions")

    def __init__(self, request: Request) -> None:
        self.request = request
        self.outputs = 0  # the workers build it from its prompt
        self.blocks = 0
        self.preemptions = request.num_preemptions


class Executor:
    """The ModelRunner interface (vocab_size, eos_token_ids, grammars, execute, close) over the
    workers."""

    def __init__(self, spec: ModelSpec, node: Node) -> None:
        self.vocab_size = spec.vocab_size
        self.eos_token_ids: set[int] = set()
        self.grammars = None  # core.structured.Grammars, set by the engine when first needed
        self.node = node
        self.num_blocks = 0
        self.max_model_len = 0
        self.device_names = ""
        self._shown: dict[str, _Shown] = {}
        self._encode = msgspec.msgpack.Encoder().encode

    @property
    def workers(self):
        return self.node.workers

    # ---- start-up ----
    @classmethod
    def launch(
        cls, config: EngineConfig, path: Path, hf_config: Any, device: torch.device, eos: set[int]
    ) -> Executor:
        """Start this node's workers (rank 0's) and wait until every rank, on every node, has
        loaded its shard and allocated its KV cache."""
        world = config.tensor_parallel_size
        spec = ModelSpec.from_hf_config(hf_config)
        parallel.check(spec, world)
        local = len(node_ranks(config, 0))
        if device.type == "cuda" and torch.cuda.device_count() < local:
            raise ValueError(
                f"--tensor-parallel-size {world} needs {local} GPUs on this machine; "
                f"{torch.cuda.device_count()} are visible"
            )
        init_method = config.distributed_init_method or local_init_method()
        node, readies = Node.start(config, path, eos, 0, init_method)
        executor = cls(spec, node)
        executor.eos_token_ids = eos
        executor.num_blocks = readies[0].num_blocks
        executor.max_model_len = readies[0].max_model_len
        executor.device_names = ", ".join(r.device for r in readies)
        if config.nnodes > 1:
            executor.device_names += f" (and {world - local} ranks on {config.nnodes - 1} nodes)"
        return executor

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
            self.node.send(self._encode(step))  # rank 0 relays it to other nodes' ranks
            if constrained:  # filled while the workers run the forward
                rows, mask = grammar_mask.build(requests, self.grammars, torch.device("cpu"))
                msg = Mask(rows.tolist(), mask.shape[1], mask.numpy().tobytes())
                self.node.send(self._encode(msg), self.workers[:1])
            return self._wait_result()
        except (WorkerDied, OSError) as e:
            # A rank whose peer was killed fails in its collective too: name the one killed;
            # else what a rank reported; else which one exited.
            if isinstance(e, WorkerFailed):
                message = self.node.exited(0.2, signalled=True) or str(e)
            else:
                message = self.node.exited() or str(e)
            self.close(kill=True)
            raise WorkerDied(message) from None

    def _wait_result(self) -> StepResult:
        """Rank 0's answer; any other rank speaking (it failed) or closing its pipe (it died)
        ends the step instead."""
        w = self.node.ready()[0]
        msg = self.node.receive(w)  # raises on a failure or an exit
        if w is not self.workers[0] or not isinstance(msg, Sampled):
            raise WorkerDied(f"rank {w.rank} sent {type(msg).__name__} during a step")
        return msg.result

    # ---- the end ----
    def close(self, kill: bool = False) -> None:
        """Stop every worker; with `kill`, at once (see Node.stop)."""
        self.node.stop(kill)


def _engine_request(request: Request) -> EngineRequest:
    return EngineRequest(
        request.request_id,
        request.prompt_token_ids,
        request.sampling_params,
        pooling=request.pooling,
    )
