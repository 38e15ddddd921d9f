"""Executor: the engine's model runner under tensor parallelism, driving one worker per rank.

The scheduler, block pool, detokenizer and grammar matchers stay single, in the engine process;
the model lives in the workers (gpu/dist/worker.py), each with its share of the weights and of every
layer's KV heads, joined by torch.distributed (NCCL on CUDA, gloo on CPU). Each engine step is
one RunStep frame written to every worker of this node (gpu/dist/node.py; the same bytes: the
step protocol's SchedulerOutput as the engine made it; rank 0 relays it to other nodes' ranks),
then, when constrained requests sample, their grammar bitmask to rank 0 while the forward runs;
rank 0 answers with the sampled ids. A worker that dies or fails ends the engine like a dead
engine process: `execute` raises, every worker is stopped, and the server fails every request.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import msgspec
import torch

from core.config import EngineConfig
from core.request import StepResult
from core.runner_step import GrammarBatch, SchedulerOutput
from gpu import grammar_mask
from gpu.dist import parallel
from gpu.models.spec import ModelSpec
from gpu.dist.node import Node, WorkerDied, WorkerFailed, local_init_method
from gpu.dist.worker import GrammarMask, RunStep, SampledTokens, node_ranks

log = logging.getLogger("weir.executor")


class Executor:
    """The ModelRunner interface (vocab_size, eos_token_ids, execute, close) over the workers."""

    def __init__(self, spec: ModelSpec, node: Node) -> None:
        self.vocab_size = spec.vocab_size
        self.num_labels = spec.num_labels  # a sequence classifier's (0: a causal LM)
        self.pooling_only = False  # (encoders are not served under tensor parallelism)
        self.per_token = False
        self.eos_token_ids: set[int] = set()
        self.node = node
        self.num_blocks = 0
        self.max_model_len = 0
        self.device_names = ""
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
    def execute(self, out: SchedulerOutput, grammar: GrammarBatch | None = None) -> StepResult:
        try:
            # rank 0 relays it to other nodes' ranks
            self.node.send(self._encode(RunStep(out, masked=grammar is not None)))
            if grammar is not None:  # filled while the workers run the forward
                rows, mask = grammar_mask.build(grammar, torch.device("cpu"))
                msg = GrammarMask(rows.tolist(), mask.shape[1], mask.numpy().tobytes())
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
        if w is not self.workers[0] or not isinstance(msg, SampledTokens):
            raise WorkerDied(f"rank {w.rank} sent {type(msg).__name__} during a step")
        return msg.result

    # ---- the end ----
    def close(self, kill: bool = False) -> None:
        """Stop every worker; with `kill`, at once (see Node.stop)."""
        self.node.stop(kill)
