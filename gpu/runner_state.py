"""The model runner's own copy of its requests, kept from the step protocol (core/runner_step.py).

Each request the runner has been shown (or a beam forked from one): its token ids (the prompt,
then the outputs as each step brings them), its sampling and pooling parameters, its block
table, and what the runner keeps for it between steps (a seeded generator, a pooling sum). The
same code serves the engine's own runner and every tensor-parallel rank: what a rank knows is
what the protocol said, nothing read from the engine's objects.

A step needs every scheduled request's whole table, padded to the longest: 256 sequences at 4k
tokens are 64k ids. Each table is an `array('i')` that takes only its new blocks, and a step
concatenates those arrays with memory copies (building it from Python lists each step cost 5-6
ms of host time: on a GPU, a third of a decode step).
"""

from __future__ import annotations

from array import array

from core.pooling import PoolingParams
from core.runner_step import Fork, NewRequest, SchedulerOutput
from core.sampling import SamplingParams
from gpu.block_tables import StepTables


class RunnerRequest:
    __slots__ = (
        "request_id",
        "token_ids",
        "num_prompt_tokens",
        "sampling_params",
        "pooling",
        "table",
        "generator",
        "pool_state",
        "num_known",
        "lora",
        "allowed",
    )

    def __init__(self, new: NewRequest) -> None:
        self.request_id = new.request_id
        self.token_ids: list[int] = list(new.prompt_token_ids)
        self.num_prompt_tokens = len(new.prompt_token_ids)
        self.sampling_params: SamplingParams = new.sampling_params
        self.pooling: PoolingParams | None = new.pooling
        self.table = array("i")
        self.generator = None  # the request's own, made from its seed on first use
        self.pool_state = None  # a running sum or the CLS row, across a prompt's chunks
        # Tokens whose ids the runner has been given; past them, at most one placeholder (-1)
        # for a sample of its own the engine has not seen yet (a `pending` entry).
        self.num_known = len(self.token_ids)
        self.lora = new.lora  # its adapter (core/lora.py LoraRef), or None: the base model
        self.allowed = None  # its allowed_token_ids on the device, made on first use

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


class RunnerRequests:
    def __init__(self) -> None:
        self.requests: dict[str, RunnerRequest] = {}
        self._zeros = array("i")

    def __len__(self) -> int:
        return len(self.requests)

    def update(self, out: SchedulerOutput) -> list[RunnerRequest]:
        """Apply a step; the scheduled requests, in row order."""
        requests = self.requests
        if out.forks:
            self._fork(out.forks)
        for rid in out.finished:
            requests.pop(rid, None)
        for new in out.new:
            requests[new.request_id] = RunnerRequest(new)
        for rid in out.preempted:
            requests[rid].table = array("i")  # its blocks are free again
        for rid in out.resumed:
            requests[rid].table = array("i")
        scheduled = []
        for s in out.scheduled:
            r = requests[s.request_id]
            if len(r.token_ids) > r.num_known:  # a placeholder: its id comes now, or stays -1
                del r.token_ids[r.num_known :]
            if s.new_token_ids:
                r.token_ids += s.new_token_ids
                r.num_known = len(r.token_ids)
            if s.pending:
                r.token_ids.append(-1)
            if s.new_block_ids:
                r.table.extend(s.new_block_ids)
            scheduled.append(r)
        return scheduled

    def _fork(self, forks: list[Fork]) -> None:
        """Beams continuing other beams: each dst a copy of its src as it was before any of
        these forks (a beam may continue in its own sequence and be copied into others)."""
        requests = self.requests
        before = {f.src: requests[f.src] for f in forks}
        for f in forks:
            src = before[f.src]
            r = RunnerRequest.__new__(RunnerRequest)
            r.request_id = f.dst
            r.token_ids = src.token_ids[: f.num_tokens]
            r.num_prompt_tokens = src.num_prompt_tokens
            r.sampling_params = src.sampling_params
            r.pooling = src.pooling
            r.table = src.table[: f.num_blocks]
            r.generator = None
            r.pool_state = None
            r.num_known = f.num_tokens
            r.lora = src.lora
            r.allowed = None
            requests[f.dst] = r

    def tables(self, scheduled: list[RunnerRequest]) -> StepTables:
        """The scheduled requests' tables, padded with block 0 to the longest."""
        width = max(len(r.table) for r in scheduled)
        if len(self._zeros) < width:
            self._zeros = array("i", bytes(4 * width))
        zeros = self._zeros
        flat = array("i")
        for r in scheduled:
            flat += r.table
            n = len(r.table)
            if n < width:
                flat += zeros[: width - n]
        return StepTables(flat, len(scheduled), width)
