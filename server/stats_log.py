"""The periodic stats line vLLM operators read in the log (throughput, queue, KV cache, prefix
cache hits), written every --stats-interval seconds while the engine has work;
--disable-log-stats turns it off. Fed by the same per-step StepStats as /metrics."""

from __future__ import annotations

import logging

import trio

from core.stats import StepStats

log = logging.getLogger("weir.stats")


class StatsLog:
    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.preemptions = 0
        self.spec = StepStats()  # speculative decoding's counts in the interval
        self.last = StepStats()

    def observe(self, s: StepStats) -> None:
        self.prompt_tokens += s.prompt_tokens
        self.generation_tokens += s.generation_tokens
        self.prefix_queries += s.prefix_queries
        self.prefix_hits += s.prefix_hits
        self.preemptions += s.preemptions
        if s.spec_drafts:
            spec = self.spec
            spec.spec_drafts += s.spec_drafts
            spec.spec_draft_tokens += s.spec_draft_tokens
            spec.spec_accepted_tokens += s.spec_accepted_tokens
            per = spec.spec_accepted_per_pos
            per.extend([0] * (len(s.spec_accepted_per_pos) - len(per)))
            for i, v in enumerate(s.spec_accepted_per_pos):
                per[i] += v
        self.last = s

    def line(self, elapsed: float) -> str | None:
        """The line for the interval just ended and reset the counts; None if nothing happened
        and nothing is queued (an idle server stays quiet)."""
        s = self.last
        busy = self.prompt_tokens or self.generation_tokens or s.num_running or s.num_waiting
        if not busy:
            return None
        hit = 100.0 * self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
        text = (
            f"Avg prompt throughput: {self.prompt_tokens / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {self.generation_tokens / elapsed:.1f} tokens/s, "
            f"Running: {s.num_running} reqs, Waiting: {s.num_waiting} reqs, "
            f"KV cache usage: {100.0 * s.kv_usage:.1f}%, Prefix cache hit rate: {hit:.1f}%"
        )
        if self.preemptions:
            text += f", Preemptions: {self.preemptions}"
        spec = self.spec
        if spec.spec_drafts:
            # as vLLM words it: each verified proposal yields its accepted tokens and one more
            drafts, drafted = spec.spec_drafts, spec.spec_draft_tokens
            per_pos = ", ".join(f"{v / drafts:.3f}" for v in spec.spec_accepted_per_pos)
            text += (
                f"; SpecDecoding metrics: Mean acceptance length: "
                f"{1 + spec.spec_accepted_tokens / drafts:.2f}, Accepted throughput: "
                f"{spec.spec_accepted_tokens / elapsed:.2f} tokens/s, Drafted throughput: "
                f"{drafted / elapsed:.2f} tokens/s, Accepted: {spec.spec_accepted_tokens} "
                f"tokens, Drafted: {drafted} tokens, Per-position acceptance rate: {per_pos}, "
                f"Avg Draft acceptance rate: {100 * spec.spec_accepted_tokens / drafted:.1f}%"
            )
            self.spec = StepStats()
        self.prompt_tokens = self.generation_tokens = 0
        self.prefix_queries = self.prefix_hits = self.preemptions = 0
        return text

    async def run(self, interval: float) -> None:
        """Log a line every `interval` seconds (a task of the app's lifespan nursery)."""
        last = trio.current_time()
        while True:
            await trio.sleep(interval)
            now = trio.current_time()
            text = self.line(now - last)
            last = now
            if text is not None:
                log.info("%s", text)
