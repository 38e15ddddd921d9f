"""Scheduler: one rule, each request's computed tokens catch up with its known tokens.

Every step has a token budget (`max_num_batched_tokens`) and a cap on running requests
(`max_num_seqs`). Running requests are served first, then waiting ones in policy order (arrival,
or priority then arrival). A waiting request starts after the longest run of its blocks already in
the prefix cache. A prompt longer than what is left of the budget is chunked across steps (an
encoder's never is: `whole_prompts`). When the pool runs out of blocks the newest (or
lowest-priority) running request is preempted: its blocks are freed and it is recomputed later;
a step that preempted admits nothing new.

A beam search (core/beam.py) holds its width in running sequences from admission on; its beams
are admitted together, preempted together and removed together.
"""

from __future__ import annotations

import bisect


from core.kv_cache_manager import KVCacheManager
from core.request import Request, Status
from core.runner_step import Fork, SchedulerOutput
from core.scheduled import ScheduledSeq, ScheduledStep, runner_output


POLICIES = ("fcfs", "priority")


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str = "fcfs",
        max_loras: int = 0,
        whole_prompts: bool = False,
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {POLICIES}, not {policy!r}")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        # An encoder's: a prompt is never chunked; it starts in a step with room for all of it.
        self.whole_prompts = whole_prompts
        # Distinct LoRA adapters among the running requests at most (0: adapters off); a
        # waiting request for another adapter waits (`num_waiting_lora`) until one's requests end.
        self.max_loras = max_loras
        self.waiting: list[Request] = []  # kept sorted by _key
        # Waiting requests that _held may hold back (a grammar compiling, a leader to wait for):
        # the only ones num_deferred has to look at, so the per-step gauge stays O(1) in the
        # length of the queue.
        self._may_defer: set[Request] = set()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # Requests the runner holds that have finished since the last step: it forgets them.
        self._forget: list[str] = []
        # Beam searches with beams running (each holds `width` seats), and the beams forked
        # since the runner last heard (core/runner_step.py Fork).
        self.groups: set = set()
        # Beam searches that can never be admitted: at the head of the queue with nothing running
        # (no blocks will be freed) and still too big (their beams' shared prefix evicted while
        # they were preempted). The engine fails them (take_stuck) instead of waiting forever.
        self.stuck: list = []
        self._forks: list[Fork] = []

    def _key(self, request: Request) -> tuple[int, ...]:
        if self.policy == "priority":
            return (request.priority, request.seq_no)
        return (request.seq_no,)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        request.status = Status.WAITING
        bisect.insort(self.waiting, request, key=self._key)
        if request.grammar_future is not None or request.leader is not None:
            self._may_defer.add(request)

    def remove(self, request: Request) -> None:
        """Take a finished or aborted request out of the queues and free its blocks."""
        if request.status is Status.RUNNING:
            self.running.remove(request)
        elif request.status in (Status.WAITING, Status.PREEMPTED):
            self.waiting.remove(request)
            self._may_defer.discard(request)
        self.kv.free(request)
        request.status = Status.FINISHED
        if request.shown:
            self._forget.append(request.request_id)
        if request.group is not None:
            self.groups.discard(request.group)
            if self._forks:
                self._forks = [f for f in self._forks if f.dst != request.request_id]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = Status.PREEMPTED
        request.runner_blocks = 0  # the runner's table starts over when it is resumed
        if request.group is not None:  # its beams run again from the start: rows too
            self.groups.discard(request.group)
            request.beam.candidates = None
            request.forked = False
        request.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(
            self.waiting, request, key=self._key
        )  # back in its place, ahead of later ones

    def _held(self, request: Request) -> bool:
        """A request whose grammar is still compiling waits (without holding the batch); a
        further sample of a prompt waits until the first one's prompt is in the cache."""
        if request.grammar_future is not None:
            return True
        leader = request.leader
        if leader is None or not self.kv.enable_caching:
            return False
        if (
            leader.status in (Status.FINISHED, Status.PREEMPTED)
            or leader.num_computed_tokens >= leader.num_prompt_tokens
        ):
            request.leader = None
            return False
        return True

    @property
    def num_deferred(self) -> int:
        """Waiting requests held back by _held rather than by a lack of room."""
        caching = self.kv.enable_caching
        return sum(
            1
            for r in self._may_defer
            if r.grammar_future is not None
            or (
                caching
                and r.leader is not None
                and r.leader.status not in (Status.FINISHED, Status.PREEMPTED)
                and r.leader.num_computed_tokens < r.leader.num_prompt_tokens
            )
        )

    def running_loras(self) -> dict[int, str]:
        """The adapters of the running requests: content key -> name."""
        return {r.lora.key: r.lora.name for r in self.running if r.lora is not None}

    @property
    def num_waiting_lora(self) -> int:
        """Waiting requests held back because every adapter slot is another adapter's."""
        if not self.max_loras:
            return 0
        loras = self.running_loras()
        if len(loras) < self.max_loras:
            return 0
        return sum(1 for r in self.waiting if r.lora is not None and r.lora.key not in loras)

    def _seq(self, request: Request, num_new: int, table: list[int]) -> ScheduledSeq:
        start = request.num_computed_tokens
        known = request.num_scheduled_tokens
        return ScheduledSeq(
            request=request,
            start=start,
            num_new_tokens=num_new,
            block_table=table,
            sample=start + num_new >= known and request.pooling is None,
            num_draft=max(0, start + num_new - known),
        )

    def schedule(self) -> ScheduledStep:
        budget = self.max_num_batched_tokens
        scheduled: dict[str, ScheduledSeq] = {}
        preempted: list[str] = []
        bs = self.kv.block_size
        tables = self.kv.block_tables

        for request in list(self.running):
            if budget <= 0:
                break
            if request.status is not Status.RUNNING:
                continue  # preempted earlier in this step
            computed = request.num_computed_tokens
            known = len(request.all_token_ids) + request.num_pending
            total = known + len(request.spec_token_ids)
            num_new = min(total - computed, budget)
            if num_new <= 0:
                continue
            if request.num_pending and (
                request.num_output_tokens + request.num_pending >= request.max_tokens
            ):
                continue  # its pending sample is its last: nothing will follow it
            table = tables.get(request.request_id)
            if table is not None and computed + num_new <= len(table) * bs and not request.forked:
                # The common decode step: the new tokens fit in blocks the request already
                # holds, so there is nothing to allocate (and nothing to preempt for).
                scheduled[request.request_id] = ScheduledSeq(
                    request,
                    computed,
                    num_new,
                    table,
                    computed + num_new >= known and request.pooling is None,
                    max(0, computed + num_new - known),
                )
                budget -= num_new
                continue
            while not self.kv.can_allocate(request, num_new):
                victim = max(self.running, key=self._key)
                # A beam search's beams go together.
                for v in victim.group.live if victim.group is not None else (victim,):
                    self._preempt(v)
                    preempted.append(v.request_id)
                    undone = scheduled.pop(v.request_id, None)
                    if undone is not None:
                        budget += undone.num_new_tokens
                if request.status is not Status.RUNNING:
                    break
            if request.status is not Status.RUNNING:
                continue
            request.forked = False
            table = self.kv.allocate(request, num_new)
            scheduled[request.request_id] = self._seq(request, num_new, table)
            budget -= num_new

        if not preempted:
            loras = {r.lora.key for r in self.running if r.lora is not None}
            # Seats taken: the running sequences, and those beam searches hold beyond their
            # running beams.
            seats = len(self.running) + sum(g.width - len(g.live) for g in self.groups)
            i = 0
            while i < len(self.waiting) and budget > 0 and seats < self.max_num_seqs:
                request = self.waiting[i]
                if self._held(request) or request.num_pending:
                    i += 1
                    continue
                lora = request.lora
                if lora is not None and lora.key not in loras and len(loras) >= self.max_loras:
                    i += 1  # every slot is another adapter's: it waits, never fails
                    continue
                if request.group is not None:
                    admitted = self._admit_beams(request.group, budget, seats, scheduled)
                    if admitted is None:
                        if not self.running and not scheduled and request.group not in self.stuck:
                            self.stuck.append(request.group)
                        break
                    budget -= admitted
                    seats += request.group.width
                    if lora is not None:
                        loras.add(lora.key)
                    continue
                hits = self.kv.find_cached(request)
                cached = len(hits) * self.kv.block_size
                num_new = min(request.num_tokens - cached, budget)
                if self.whole_prompts and num_new < request.num_tokens - cached:
                    break  # it waits, first in line, for a step with room for all of it
                if not self.kv.can_allocate(request, num_new, hits):
                    break
                del self.waiting[i]
                self._may_defer.discard(request)
                table = self.kv.allocate(request, num_new, hits)
                request.num_computed_tokens = cached
                self.kv.count_lookup(request.num_tokens, cached)
                if request.num_preemptions == 0:
                    request.num_cached_tokens = cached
                request.status = Status.RUNNING
                self.running.append(request)
                seats += 1
                if lora is not None:
                    loras.add(lora.key)
                scheduled[request.request_id] = self._seq(request, num_new, table)
                budget -= num_new

        seqs = list(scheduled.values())
        return ScheduledStep(seqs, preempted, self._runner_output(seqs, preempted))

    def _admit_beams(
        self, group, budget: int, seats: int, scheduled: dict[str, ScheduledSeq]
    ) -> int | None:
        """Admit a beam search's waiting beams together (each from its cached prefix, as the
        budget allows: one left without tokens this step is scheduled with the running ones
        next step), if its width fits the seats and all their blocks fit; the tokens
        scheduled, or None when it does not fit."""
        if seats + group.width > self.max_num_seqs:
            return None
        kv = self.kv
        plans = []
        need = 0
        idle: set[int] = set()
        left = budget
        for request in group.live:
            hits = kv.find_cached(request)
            cached = len(hits) * kv.block_size
            num_new = min(request.num_tokens - cached, left)
            left -= num_new
            need += kv.blocks_needed(request, num_new, len(hits))
            idle.update(b.block_id for b in hits if b.ref_cnt == 0)
            plans.append((request, hits, cached, num_new))
        if need + len(idle) > kv.num_free_blocks:
            return None
        # Every beam's cached blocks are taken first: new blocks for one must not evict
        # another's hits from the free list.
        for request, hits, cached, num_new in plans:
            kv.allocate(request, 0, hits)
            request.num_computed_tokens = cached
        for request, hits, cached, num_new in plans:
            self.waiting.remove(request)
            table = kv.allocate(request, num_new)
            kv.count_lookup(request.num_tokens, cached)
            if request.num_preemptions == 0:
                request.num_cached_tokens = cached
            request.status = Status.RUNNING
            self.running.append(request)
            if num_new:
                scheduled[request.request_id] = self._seq(request, num_new, table)
        self.groups.add(group)
        return budget - left

    def fork(self, dst: Request, src: Request) -> None:
        """A beam search's `dst` becomes a copy of its beam `src` (about to take a token of its
        own): same tokens, every block shared; the runner copies src's as they are now."""
        dst.all_token_ids = list(src.all_token_ids)
        dst.output_token_ids = list(src.output_token_ids)
        dst.num_computed_tokens = src.num_computed_tokens
        dst.block_hashes = list(src.block_hashes)
        self.kv.fork(dst, src)
        dst.forked = True
        dst.shown = True
        # The runner takes src's tokens and its full blocks; a partial last block comes with
        # dst's next entry (after its copy, if dst writes into a copy of it).
        dst.runner_tokens = len(src.all_token_ids)
        dst.runner_blocks = src.num_computed_tokens // self.kv.block_size
        self._forks.append(
            Fork(dst.request_id, src.request_id, dst.runner_tokens, dst.runner_blocks)
        )
        if dst.status is not Status.RUNNING:
            dst.status = Status.RUNNING
            self.running.append(dst)

    def share_last_block(self, request: Request) -> None:
        """A beam whose partial last block another beam now shares: whichever of them writes
        into it first takes a copy, so the runner's table must take it again."""
        bs = self.kv.block_size
        if request.num_computed_tokens % bs:
            request.forked = True
            full = request.num_computed_tokens // bs
            if request.runner_blocks > full:
                request.runner_blocks = full
                self._forks.append(
                    Fork(request.request_id, request.request_id, request.runner_tokens, full)
                )

    def park(self, request: Request) -> None:
        """A beam search's sequence that no beam continues: out of the batch, blocks freed,
        kept (unscheduled) for a later fork."""
        if request.status is Status.RUNNING:
            self.running.remove(request)
        self.kv.free(request)
        request.status = Status.FINISHED
        request.forked = False

    def _runner_output(self, seqs: list[ScheduledSeq], preempted: list[str]) -> SchedulerOutput:
        """The step for the model runner: what changed since it last saw each request. A step
        that schedules nothing does not reach the runner: what it would forget waits."""
        copies = self.kv.take_copies() if self.kv.copies else []
        if not seqs:
            return SchedulerOutput([], [], [], [], [])
        finished, self._forget = self._forget, []
        forks, self._forks = self._forks, []
        # Every preempted request was running, so the runner has seen it.
        return runner_output(seqs, finished, list(preempted), forks, copies)

    def commit(self, out: ScheduledStep) -> None:
        """Once the step is launched: its tokens count as computed (their KV is written before
        any later step reads it: steps run in order), and each sampled request has a pending
        token until the engine sees it. Full blocks go into the prefix cache once all their
        tokens are known (`cache_known` registers the ones ending in a pending token)."""
        bs = self.kv.block_size
        for s in out.seqs:
            request = s.request
            before = request.num_computed_tokens
            request.num_computed_tokens = after = before + s.num_new_tokens
            if s.sample and request.group is None:  # a beam's row decides its next token later
                request.num_pending += 1
            if after // bs > before // bs:  # a block filled up: register it in the prefix cache
                self.kv.cache_computed(request)

    def cache_known(self, request: Request) -> None:
        """A pending token became known: a block it completed can be registered now."""
        self.kv.cache_computed(request)
