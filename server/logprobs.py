"""Engine log-probs -> the OpenAI shapes: chat `logprobs.content`, completions' parallel lists,
and vLLM's `prompt_logprobs`."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from core.request import Logprob
from core.structured import byte_level_alphabet
from server.protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TokenLogprob,
    TopLogprob,
)


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """The inverse of byte-level BPE's byte -> printable character table (GPT-2's)."""
    return {c: b for b, c in byte_level_alphabet().items()}


class TokenText:
    """A token's text and its exact bytes (a byte-level token may be part of a character)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            raw = self.tokenizer.convert_ids_to_tokens(token_id)
            table = _byte_decoder()
            if (
                isinstance(raw, str)
                and raw
                and all(c in table for c in raw)
                and token_id not in self.tokenizer.all_special_ids
            ):
                data = [table[c] for c in raw]
            else:
                data = list(text.encode("utf-8"))
            hit = self._cache[token_id] = (text, data)
        return hit


# JSON has no -inf (a token logit_bias banned has that log-prob): vLLM's floor instead.
LOGPROB_FLOOR = -9999.0


def _lp(value: float) -> float:
    return value if value > LOGPROB_FLOOR else LOGPROB_FLOOR


def token_name(token_id: int, text: str, as_ids: bool) -> str:
    """A log-prob entry's token: its text, or "token_id:N" (--return-tokens-as-token-ids), which
    a client can map back even when the token is only part of a UTF-8 character."""
    return f"token_id:{token_id}" if as_ids else text


def chat_logprobs(entries: list[Logprob], text_of: TokenText, as_ids: bool = False) -> ChatLogprobs:
    content = []
    for e in entries:
        token, data = text_of(e.token_id)
        top = []
        for tid, lp in zip(e.top_ids, e.top_logprobs):
            t, b = text_of(tid)
            top.append(TopLogprob(token_name(tid, t, as_ids), _lp(lp), b))
        content.append(
            TokenLogprob(token_name(e.token_id, token, as_ids), _lp(e.logprob), data, top)
        )
    return ChatLogprobs(content)


class CompletionLogprobsBuilder:
    """Accumulates completions-style log-probs across streamed deltas; offsets keep counting
    (in characters of the text, also when tokens are written as token ids).

    Each position's `top_logprobs` holds the chosen token first, then the top alternatives, as
    vLLM does: `logprobs: N` gives N or N + 1 entries, and `logprobs: 0` the chosen one alone.
    The keys are token texts, and two tokens can share one (pieces of a character both read
    "\ufffd"): the later one is then keyed "token_id:N" rather than lost, as vLLM loses it."""

    def __init__(self, text_of: TokenText, as_ids: bool = False, offset: int = 0) -> None:
        self.text_of = text_of
        self.as_ids = as_ids
        self.offset = offset

    def build(self, entries: list[Logprob | None], token_ids: list[int]) -> CompletionLogprobs:
        out = CompletionLogprobs([], [], [], [])
        name = self.name
        for tid, e in zip(token_ids, entries):
            text = self.text_of(tid)[0]
            out.tokens.append(name(tid))
            out.text_offset.append(self.offset)
            self.offset += len(text)
            if e is None:  # the first prompt token has no log-prob
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(_lp(e.logprob))
            top: dict[str, float] = {}
            seen = set()
            for t, lp in zip([tid, *e.top_ids], [e.logprob, *e.top_logprobs]):
                if t in seen:
                    continue
                seen.add(t)
                key = name(t)
                if key in top:  # two tokens with one text (e.g. halves of a character): by id
                    key = f"token_id:{t}"
                top[key] = _lp(lp)
            out.top_logprobs.append(top)
        return out

    def name(self, token_id: int) -> str:
        return token_name(token_id, self.text_of(token_id)[0], self.as_ids)


def prompt_logprobs(entries: list[Logprob | None], text_of: TokenText) -> PromptLogprobs:
    out: PromptLogprobs = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        d = {str(e.token_id): PromptLogprob(_lp(e.logprob), text_of(e.token_id)[0])}
        for tid, lp in zip(e.top_ids, e.top_logprobs):
            d.setdefault(str(tid), PromptLogprob(_lp(lp), text_of(tid)[0]))
        out.append(d)
    return out
