"""Engine log-probs -> the OpenAI shapes: chat `logprobs.content`, completions' parallel lists,
and vLLM's `prompt_logprobs`."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from core.request import Logprob
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
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


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


def chat_logprobs(entries: list[Logprob], text_of: TokenText) -> ChatLogprobs:
    content = []
    for e in entries:
        token, data = text_of(e.token_id)
        top = []
        for tid, lp in zip(e.top_ids, e.top_logprobs):
            t, b = text_of(tid)
            top.append(TopLogprob(t, lp, b))
        content.append(TokenLogprob(token, e.logprob, data, top))
    return ChatLogprobs(content)


class CompletionLogprobsBuilder:
    """Accumulates completions-style log-probs across streamed deltas; offsets keep counting."""

    def __init__(self, text_of: TokenText, offset: int = 0) -> None:
        self.text_of = text_of
        self.offset = offset

    def build(self, entries: list[Logprob | None], token_ids: list[int]) -> CompletionLogprobs:
        out = CompletionLogprobs([], [], [], [])
        for tid, e in zip(token_ids, entries):
            token, _ = self.text_of(tid)
            out.tokens.append(token)
            out.text_offset.append(self.offset)
            self.offset += len(token)
            if e is None:  # the first prompt token has no log-prob
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(e.logprob)
            top = {}
            for t, lp in zip(e.top_ids, e.top_logprobs):
                top.setdefault(self.text_of(t)[0], lp)
            out.top_logprobs.append(top)
        return out


def prompt_logprobs(entries: list[Logprob | None], text_of: TokenText) -> PromptLogprobs:
    out: PromptLogprobs = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        d = {str(e.token_id): PromptLogprob(e.logprob, text_of(e.token_id)[0])}
        for tid, lp in zip(e.top_ids, e.top_logprobs):
            d.setdefault(str(tid), PromptLogprob(lp, text_of(tid)[0]))
        out.append(d)
    return out
