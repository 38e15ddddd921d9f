"""Engine statistics: gathered on the engine thread in plain fields (no locks), handed to the
Trio thread once per step as a StepStats, where the metrics layer publishes them."""

from __future__ import annotations

import msgspec


class FinishedStats(msgspec.Struct, array_like=True, gc=False):
    finish_reason: str
    e2e: float
    queue: float
    prefill: float
    decode: float
    prompt_tokens: int
    generation_tokens: int
    inference: float = 0.0  # first scheduled to last token: prefill + decode
    max_tokens: int = 0  # the request's max_tokens, resolved against the context
    num_preemptions: int = 0
    lora_name: str | None = None  # its LoRA adapter's name, or None (the base model)


class StepStats(msgspec.Struct, gc=False):
    num_running: int = 0
    num_waiting: int = 0
    # Of those, waiting on something other than room in the batch or the cache (a further
    # sample of a prompt holds until the first sample's prompt is cached): vLLM's "deferred".
    num_deferred: int = 0
    kv_usage: float = 0.0
    num_free_blocks: int = 0
    num_adds_seen: int = 0  # requests the engine has taken off its queue, ever
    # Increments since the previous StepStats.
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    iteration_tokens: list[int] = []
    ttft: list[float] = []
    itl: list[float] = []
    finished: list[FinishedStats] = []
    # Speculative decoding (vLLM's spec_decode_* counters): verified proposals, their tokens,
    # the tokens kept, and per position of a proposal how many were kept there.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []
    # With --enable-lora: the adapters of the running requests and of the waiting ones (names)
    lora_running: list[str] | None = None
    lora_waiting: list[str] = []


def finished_stats(request, reason: str, now: float) -> FinishedStats:
    """The timings and counts of a request (core/request.py Request) that ends now."""
    arrival = request.arrival_time
    scheduled = request.first_scheduled_time or now
    first = request.first_token_time or now
    last = request.last_token_time or now
    return FinishedStats(
        reason,
        now - arrival,
        scheduled - arrival,
        first - scheduled,
        last - first,
        request.num_prompt_tokens,
        request.num_output_tokens,
        last - scheduled,
        request.max_tokens,
        request.num_preemptions,
        request.lora.name if request.lora is not None else None,
    )
