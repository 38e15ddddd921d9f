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
        self.last = StepStats()

    def observe(self, s: StepStats) -> None:
        self.prompt_tokens += s.prompt_tokens
        self.generation_tokens += s.generation_tokens
        self.prefix_queries += s.prefix_queries
        self.prefix_hits += s.prefix_hits
        self.preemptions += s.preemptions
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
