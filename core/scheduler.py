"""Scheduler: one rule, each request's computed tokens catch up with its known tokens.

Every step has a token budget (`max_num_batched_tokens`) and a cap on running requests
(`max_num_seqs`). Running requests are served first, then waiting ones in arrival order. A prompt
longer than what is left of the budget is chunked across steps. When the pool runs out of blocks the
newest running request is preempted: its blocks are freed and it is recomputed later; a step that
preempted admits nothing new.
"""

from __future__ import annotations

from collections import deque

import msgspec

from core.kv_cache_manager import KVCacheManager
from core.request import Request, Status


class ScheduledSeq(msgspec.Struct, gc=False):
    """One request's share of a step: which tokens to compute, where they go, whether to sample."""

    request: Request
    start: int  # position of the first new token
    num_new_tokens: int
    block_table: list[int]
    sample: bool  # the chunk reaches the end of the known tokens: its last row gives logits

    @property
    def token_ids(self) -> list[int]:
        return self.request.all_token_ids[self.start : self.start + self.num_new_tokens]


class SchedulerOutput(msgspec.Struct, gc=False):
    seqs: list[ScheduledSeq]
    preempted: list[str]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)


class Scheduler:
    def __init__(
        self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        request.status = Status.WAITING
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Take a finished or aborted request out of the queues and free its blocks."""
        if request.status is Status.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = Status.FINISHED

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = Status.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _schedule_one(self, request: Request, num_new: int) -> ScheduledSeq:
        table = self.kv.allocate(request, num_new)
        start = request.num_computed_tokens
        return ScheduledSeq(
            request=request,
            start=start,
            num_new_tokens=num_new,
            block_table=table,
            sample=start + num_new == request.num_tokens,
        )

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        preempted: list[str] = []

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            while not self.kv.can_allocate(request, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            if request.status is not Status.RUNNING:
                break  # it preempted itself: everything after it is gone too
            seqs.append(self._schedule_one(request, num_new))
            budget -= num_new
            i += 1

        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                request = self.waiting[0]
                num_new = min(request.num_tokens - request.num_computed_tokens, budget)
                if not self.kv.can_allocate(request, num_new):
                    break
                self.waiting.popleft()
                request.status = Status.RUNNING
                self.running.append(request)
                seqs.append(self._schedule_one(request, num_new))
                budget -= num_new

        return SchedulerOutput(seqs=seqs, preempted=preempted)

    def commit(self, out: SchedulerOutput) -> None:
        """After the forward pass: the scheduled tokens now have KV in the cache."""
        for s in out.seqs:
            s.request.num_computed_tokens += s.num_new_tokens
