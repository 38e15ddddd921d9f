"""SamplingParams: how one request is sampled and when it stops."""

from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, omit_defaults=True, gc=False):
    """Per-request sampling settings, validated once by `validate()` before the engine sees them.

    `max_tokens=None` means "up to the model's context length"; the engine resolves it at add time.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    max_tokens: int | None = 16
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self) -> None:
        """Raise ValueError(param, message) style errors for values no sampler could honour."""
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidParam("temperature", "temperature must be between 0 and 100")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidParam("top_p", "top_p must be in (0, 1]")
        if self.top_k < -1:
            raise InvalidParam("top_k", "top_k must be -1 (disabled), 0 (disabled) or positive")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidParam("max_tokens", "max_tokens must be at least 1")


class InvalidParam(ValueError):
    """A request value the engine cannot accept; `param` names the offending field."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message
