"""truncate_prompt_tokens on a text: its last tokens kept, with the special tokens its tokenizer
puts around it (an encoder's pooling reads its [CLS] row: cut off, the vector would be another
token's). The server's pooling routes and the offline LLM share it."""

from __future__ import annotations

from typing import Any


def kept_tail(tokenizer: Any, text: str, keep: int) -> list[int]:
    """`text`'s tokens cut to the last `keep`, the special tokens the tokenizer puts around it
    (BERT's [CLS] and [SEP], a BOS) kept in their places, as vLLM's truncate_prompt_tokens cuts
    a text (its tokenizer truncating from the left); a text of fewer tokens whole."""
    ids = tokenizer.encode(text)
    if len(ids) <= keep:
        return ids
    content = tokenizer.encode(text, add_special_tokens=False)
    added = len(ids) - len(content)
    if 0 < added < keep:
        at = next((p for p in range(added + 1) if ids[p : p + len(content)] == content), None)
        if at is not None:
            tail = content[len(content) - (keep - added) :]
            return ids[:at] + tail + ids[at + len(content) :]
    return ids[-keep:]
