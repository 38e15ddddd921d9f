"""Token usage of one HTTP request, as the OpenAI API reports it: prompt tokens once per prompt,
completion tokens per choice, and with a reasoning parser the tokens that wrote the reasoning."""

from __future__ import annotations

from collections.abc import Callable

from core.request import RequestOutput
from server.protocol import CompletionTokensDetails, PromptTokensDetails, Usage


class UsageCounter:
    """Prompt tokens count once per prompt (not per sample); completion tokens add up."""

    def __init__(self, n: int, choices: int) -> None:
        self.n = n
        self.prompt = self.cached = 0
        self.prompt_seen: set[int] = set()
        self.completion = [0] * choices
        self.reasoning: list[int] | None = None  # per choice, when a reasoning parser counts
        self.ids: list[list[int]] | None = None  # per choice, its output tokens (the same)

    def count_reasoning(self) -> None:
        self.reasoning = [0] * len(self.completion)
        self.ids = [[] for _ in self.completion]

    def update(self, index: int, out: RequestOutput) -> None:
        self.completion[index] = out.num_output_tokens
        if self.ids is not None:
            self.ids[index] += out.new_token_ids
        prompt = index // self.n
        if prompt not in self.prompt_seen:
            self.prompt_seen.add(prompt)
            self.prompt += out.num_prompt_tokens
            self.cached += out.num_cached_tokens

    def tokens_writing(self, index: int, chars: int, decode: Callable[[list[int]], str]) -> int:
        """How many of choice `index`'s output tokens wrote its text's first `chars` characters:
        the fewest whose text (`decode`) is that long (outputs can arrive merged, so their own
        boundaries do not say; a few decodes, once a request). Never more than its tokens."""
        ids = self.ids[index] if self.ids is not None else []
        if chars <= 0 or not ids:
            return 0
        lo, hi = 1, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(decode(ids[:mid])) >= chars:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def of_choice(self, index: int, prompt_tokens: int) -> Usage:
        """One choice's usage so far (continuous_usage_stats, as vLLM reports it per choice):
        its prompt's tokens (known before any output) and its own completion tokens."""
        done = self.completion[index]
        return Usage(prompt_tokens, done, prompt_tokens + done)

    def usage(self) -> Usage:
        done = sum(self.completion)
        usage = Usage(
            self.prompt, done, self.prompt + done, PromptTokensDetails(cached_tokens=self.cached)
        )
        if self.reasoning is not None:
            usage.completion_tokens_details = CompletionTokensDetails(sum(self.reasoning))
        return usage
