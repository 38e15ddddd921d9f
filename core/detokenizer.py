"""Incremental detokenization on `tokenizers.decoders.DecodeStream`: O(1) work per new token."""

from __future__ import annotations

from collections import deque

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# Prompt tokens fed to the stream as context, so the first generated token decodes as it would
# inside the full text (leading spaces, byte fallback) without paying for the whole prompt.
PRIME_TOKENS = 8


class Detokenizer:
    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = self._clean_context(prompt_token_ids[-PRIME_TOKENS:])
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        # Tokens the stream is holding back (an incomplete UTF-8 sequence), and a little context
        # before them: enough to decode them by hand if the request ends mid-character.
        self._pending: list[int] = []
        self._recent: deque[int] = deque(context[-4:], maxlen=4)

    def _clean_context(self, ids: list[int]) -> list[int]:
        """Drop context that does not decode cleanly: a cut through a multi-byte character at
        its start, or a prompt that itself ends mid-character (its bytes are not ours to finish)."""
        ids = list(ids)
        while ids and self._tokenizer.decode(ids, skip_special_tokens=self._skip).startswith(
            "\ufffd"
        ):
            ids.pop(0)
        if ids and self._tokenizer.decode(ids, skip_special_tokens=self._skip).endswith("\ufffd"):
            return []
        return ids

    def step(self, token_id: int) -> str:
        text = self._stream.step(self._tokenizer, token_id)
        if text is None:
            self._pending.append(token_id)
            return ""
        self._recent.extend(self._pending)
        self._recent.append(token_id)
        self._pending.clear()
        return text

    def flush(self) -> str:
        """Text still held back at the end of a request, decoded as `tokenizer.decode` would."""
        if not self._pending:
            return ""
        context = list(self._recent)
        base = self._tokenizer.decode(context, skip_special_tokens=self._skip)
        full = self._tokenizer.decode(context + self._pending, skip_special_tokens=self._skip)
        self._pending.clear()
        return full[len(base) :] if full.startswith(base) else full
