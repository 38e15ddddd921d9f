"""Speculative decoding: proposals of several tokens a step for a request, verified in one forward.

`--speculative-config` takes vLLM's JSON. Two methods are served: `ngram` (prompt lookup: the
request's last n tokens, n from `prompt_lookup_max` down to `prompt_lookup_min`, are looked up
earlier in its own tokens, prompt and output, and the tokens that followed their latest
occurrence are proposed, up to `num_speculative_tokens`), and `draft_model` (a small model with
the same tokenizer, `model`, proposes greedily: gpu/draft.py; the engine reserves the positions
and the runner's draft model fills them). The target model then computes every
proposed position in one row of the step (gpu/runner.py), and the sampler keeps the proposals
its own distribution agrees with (gpu/sampler.py `verify`: greedy rows the argmax's run,
sampled rows by rejection sampling, so the output distribution is the model's own).

Speculation steps aside where it would not pay: for a step whose batch has more running
requests than `disable_by_batch_size` (vLLM's name), and for a request whose proposals keep
failing (after `MIN_DRAFTED` proposed tokens, an acceptance rate under `MIN_ACCEPTANCE`).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

METHODS = ("ngram", "draft_model")
MIN_DRAFTED = 32  # proposed tokens before a request's acceptance rate is judged
MIN_ACCEPTANCE = 0.1  # below it a request stops proposing


class SpeculativeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # Running requests above which a step goes without speculation (verification would cost
    # more than it saves once the batch fills the machine); None: `auto_batch_limit`.
    disable_by_batch_size: int | None = None
    model: str | None = None  # the draft model (method draft_model)

    @classmethod
    def parse(cls, text: str | dict[str, Any]) -> SpeculativeConfig:
        """From --speculative-config's JSON (or a dict); a ValueError names what is wrong."""
        where = "--speculative-config"
        try:
            raw = json.loads(text) if isinstance(text, str) else dict(text)
            if isinstance(raw, dict) and "method" not in raw and raw.get("model"):
                raw = {**raw, "method": "draft_model"}  # as vLLM reads a draft model's path
            config = msgspec.convert(raw, cls)
        except (json.JSONDecodeError, msgspec.ValidationError, TypeError) as e:
            raise ValueError(f"{where}: {e}") from None
        if config.method not in METHODS:
            raise ValueError(
                f"{where}: method {config.method!r} is not served: weir speculates with "
                "'ngram' (prompt lookup) and 'draft_model' (a smaller model of the same "
                "vocabulary, \"model\": its path); eagle, medusa, mlp_speculator and the MTP "
                "heads need trained proposal weights it does not load"
            )
        if config.method == "draft_model" and not config.model:
            raise ValueError(f"{where}: method 'draft_model' needs \"model\": the draft's path")
        if not 1 <= config.num_speculative_tokens <= 16:
            raise ValueError(f"{where}: num_speculative_tokens must be between 1 and 16")
        high = config.prompt_lookup_max or config.prompt_lookup_min or 4
        low = config.prompt_lookup_min or 1
        if not 1 <= low <= high <= 32:
            raise ValueError(
                f"{where}: need 1 <= prompt_lookup_min <= prompt_lookup_max <= 32, got "
                f"{low} and {high}"
            )
        config.prompt_lookup_max, config.prompt_lookup_min = high, low
        if config.disable_by_batch_size is not None and config.disable_by_batch_size < 1:
            raise ValueError(f"{where}: disable_by_batch_size must be positive")
        return config


# Rows a step verifies nearly for free, by device. On a CPU a decode step of the 1B model took
# 1.08x its one-row time at 2 rows, 1.13x at 3, 1.33-1.39x at 4-5 and 2.1x at 8 (weir's bf16
# kernels, 2-core EPYC: docs/benchmarks.md), and at 64 streams verifying 4 proposals each, none
# kept, cost 13% of the throughput. On a GPU a decode step reads its weights for up to some
# hundred rows: 64 is a guess until measured there.
FREE_ROWS = {"cpu": 4, "cuda": 64}


def auto_batch_limit(k: int, device: str) -> int:
    """disable_by_batch_size when the config leaves it out: the running requests whose k + 1
    verification rows each still fit the device's nearly free rows (at least 1)."""
    return max(1, FREE_ROWS.get(device, FREE_ROWS["cuda"]) // (k + 1))


class NgramIndex:
    """Where each n-gram of a request's tokens last occurred with a token after it, kept as the
    tokens grow (each new token updates one entry per n): a lookup per step is one dict get per
    n, whatever the length of the context."""

    __slots__ = ("low", "high", "seen", "size")

    def __init__(self, low: int, high: int) -> None:
        self.low, self.high = low, high
        self.seen: list[dict[tuple[int, ...], int]] = [{} for _ in range(high + 1)]
        self.size = 0  # tokens indexed

    def update(self, tokens: list[int]) -> None:
        """Index n-grams ending before the last token (those have a token after them)."""
        for end in range(max(self.size, 1), len(tokens)):
            # the n-grams ending at `end` (exclusive) are followed by tokens[end]
            for n in range(self.low, min(self.high, end) + 1):
                self.seen[n][tuple(tokens[end - n : end])] = end
        self.size = max(self.size, len(tokens))

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens: what followed the latest earlier occurrence of the longest suffix."""
        self.update(tokens)
        for n in range(min(self.high, len(tokens) - 1), self.low - 1, -1):
            end = self.seen[n].get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end : end + k]
        return []


def grammar_cut(matcher, proposal: list[int]) -> list[int]:
    """The proposal up to the first token the grammar refuses, or up to where it is complete
    (the model's own token comes after that: end of sequence)."""
    ahead = matcher.deep_copy()
    kept = []
    for token in proposal:
        if ahead.is_stopped() or not ahead.consume_token(token):
            break
        kept.append(token)
    return kept


class Speculator:
    """Proposals for a step's running requests (the engine's side of speculation)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len

    def wants(self, request) -> bool:
        """Whether a request speculates at all: not with penalties or bad words (their counts
        and bans move with every accepted token), pooling or beams (each step ranks every
        beam's next token); with a grammar only from n-gram proposals (cut where the grammar
        refuses them, before the step: a draft model's are made too late)."""
        params = request.sampling_params
        return (
            request.pooling is None
            and not params.needs_penalties
            and not params.bad_words
            and not params.beam_width
            and not request.spec_off
            and (params.structured is None or self.config.method == "ngram")
        )

    def propose(self, requests: list) -> None:
        """Set each decoding request's `spec_token_ids` for this step (empty: none). With a
        draft model they are placeholders (-1) the runner's draft model fills (gpu/draft.py)."""
        by_batch = self.config.disable_by_batch_size
        quiet = by_batch is not None and len(requests) > by_batch
        for r in requests:
            r.spec_token_ids = []
            if quiet or r.num_pending or r.num_computed_tokens != r.num_tokens - 1:
                continue  # prefilling, or its last token is not known yet
            if not self.wants(r):
                continue
            # room: max_tokens counts the token the verification always yields
            room = min(
                self.k,
                r.max_tokens - r.num_output_tokens - 1,
                self.max_model_len - r.num_tokens - 1,
            )
            if room <= 0:
                continue
            if self.config.method == "draft_model":
                r.spec_token_ids = [-1] * room
                continue
            if r.spec_index is None:
                c = self.config
                r.spec_index = NgramIndex(c.prompt_lookup_min, c.prompt_lookup_max)
            proposal = r.spec_index.propose(r.all_token_ids, room)
            if proposal and r.grammar is not None:
                proposal = grammar_cut(r.grammar, proposal)
            r.spec_token_ids = proposal

    def judge(self, request, proposed: int, accepted: int) -> None:
        """A verified proposal: a request whose proposals keep failing stops proposing."""
        request.spec_drafted += proposed
        request.spec_accepted += accepted
        if (
            request.spec_drafted >= MIN_DRAFTED
            and request.spec_accepted < MIN_ACCEPTANCE * request.spec_drafted
        ):
            request.spec_off = True
            request.spec_index = None
