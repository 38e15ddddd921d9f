"""SamplingParams: how one request is sampled and when it stops."""

from __future__ import annotations

import msgspec

from core.structured import Constraint

MAX_LOGIT_BIAS = 300
MAX_STOP_STRINGS = 16
MAX_BAD_WORDS = 128  # vLLM's VLLM_MAX_NUM_BAD_WORDS


class SamplingParams(msgspec.Struct, omit_defaults=True, gc=False):
    """Per-request sampling settings, validated once by `validate()` before the engine sees them.

    `max_tokens=None` means "up to the model's context length"; the engine resolves it at add time.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = []
    include_stop_str_in_output: bool = False
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    seed: int | None = None
    logit_bias: dict[int, float] = {}
    # Only these tokens may be sampled (vLLM's allowed_token_ids); None: any.
    allowed_token_ids: list[int] | None = None
    # Words never generated (vLLM's bad_words): the engine tokenizes them into
    # bad_words_token_ids (bad_words_ids), whose last token is banned after the others.
    bad_words: list[str] = []
    bad_words_token_ids: list[list[int]] = []
    logprobs: int | None = None  # top alternatives per generated token (0: just the chosen one)
    prompt_logprobs: int | None = None  # the same for every prompt token
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured: Constraint | None = None  # the output must match this (core/structured.py)
    # Beam search (core/beam.py) over this many beams, returning as many sequences, best first
    # (0: off); hypotheses are scored by cumulative log-prob / length ** length_penalty, and
    # early_stopping is transformers': True, False or "never".
    beam_width: int = 0
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def validate(self) -> None:
        """Raise InvalidParam naming the field for values no sampler could honour."""
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidParam("temperature", "temperature must be between 0 and 100")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidParam("top_p", "top_p must be in (0, 1]")
        if self.top_k < -1:
            raise InvalidParam("top_k", "top_k must be -1 (disabled), 0 (disabled) or positive")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidParam("min_p", "min_p must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidParam(name, f"{name} must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise InvalidParam("repetition_penalty", "repetition_penalty must be in (0, 2]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidParam("max_tokens", "max_tokens must be at least 1")
        if self.min_tokens < 0:
            raise InvalidParam("min_tokens", "min_tokens must not be negative")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParam(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            )
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidParam("stop", f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in self.stop):
            raise InvalidParam("stop", "stop strings must not be empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidParam("stop_token_ids", "token ids must not be negative")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidParam("logit_bias", f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens")
        for token, bias in self.logit_bias.items():
            if token < 0:
                raise InvalidParam("logit_bias", f"token id {token} is negative")
            if not -100.0 <= bias <= 100.0:
                raise InvalidParam(
                    "logit_bias", f"bias {bias} for token {token} is outside [-100, 100]"
                )
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise InvalidParam("allowed_token_ids", "allowed_token_ids must not be empty")
            if any(t < 0 for t in self.allowed_token_ids):
                raise InvalidParam("allowed_token_ids", "token ids must not be negative")
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise InvalidParam("bad_words", f"at most {MAX_BAD_WORDS} bad words")
        if any(not w.strip() for w in self.bad_words):
            raise InvalidParam("bad_words", "bad words must not be empty or only whitespace")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            # The upper bound is the server's --max-logprobs (core.request_check.check_request).
            if v is not None and v < 0:
                raise InvalidParam(name, f"{name} must not be negative")
        if self.beam_width:
            self._validate_beams()

    def _validate_beams(self) -> None:
        """Beam search ranks the model's own log-probabilities: what would change the
        distribution or draw from it cannot be honoured, and is refused naming the field."""
        if self.beam_width < 0:
            raise InvalidParam("n", "the beam width must be positive")
        if self.early_stopping not in (True, False, "never"):
            raise InvalidParam("early_stopping", 'early_stopping must be true, false or "never"')
        if not -1e6 < self.length_penalty < 1e6:
            raise InvalidParam("length_penalty", "length_penalty must be a finite number")
        refused = {
            "temperature": not self.greedy,
            "top_p": self.top_p < 1.0,
            "top_k": self.top_k > 0,
            "min_p": self.min_p > 0.0,
            "presence_penalty": self.presence_penalty != 0.0,
            "frequency_penalty": self.frequency_penalty != 0.0,
            "repetition_penalty": self.repetition_penalty != 1.0,
            "logit_bias": bool(self.logit_bias),
            "allowed_token_ids": self.allowed_token_ids is not None,
            "bad_words": bool(self.bad_words),
            "response_format": self.structured is not None,
            "prompt_logprobs": self.prompt_logprobs is not None,
        }
        for name, bad in refused.items():
            if bad:
                raise InvalidParam(
                    name,
                    f"{name} cannot be used with beam search (use_beam_search), which ranks "
                    "the model's own log-probabilities",
                )


def bad_words_ids(encode, words: list[str]) -> list[list[int]]:
    """vLLM's tokenization of bad_words (`encode`: text to ids, no special tokens): each word as
    it is (less leading spaces), and with one leading space where that is another first token
    of the same length (a word inside the text)."""
    out: list[list[int]] = []
    for word in words:
        bare = encode(word.lstrip())
        if bare:
            out.append(bare)
        spaced = encode(" " + word.lstrip())
        if spaced and (not bare or (spaced[0] != bare[0] and len(spaced) == len(bare))):
            out.append(spaced)
    return out


def banned_by_bad_words(words_ids: list[list[int]], output: list[int]) -> list[int]:
    """The tokens that would complete a bad word after `output` (a word's last token, where
    the output ends with the rest of it)."""
    banned = []
    for ids in words_ids:
        n = len(ids) - 1
        if n <= len(output) and (n == 0 or output[-n:] == ids[:-1]):
            banned.append(ids[-1])
    return banned


class InvalidParam(ValueError):
    """A request value the engine cannot accept; `param` names the offending field."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message
