"""truncate_prompt_tokens on a pooling input, as vLLM's pooling runner cuts one: its first tokens
kept (truncation_side "right", the default: as sentence-transformers cuts at max_seq_length) or
its last ("left"), a text's special tokens kept in their places around what is kept (an
encoder's pooling reads its [CLS] row: cut off, the vector would be another token's). The
server's pooling routes and the offline LLM share it."""

from __future__ import annotations

from typing import Any

SIDES = ("left", "right")


def cut_ids(ids: list[int], keep: int, side: str = "right") -> list[int]:
    """Token ids as given, cut to `keep`: the first (side "right") or the last ("left")."""
    return list(ids[:keep]) if side == "right" else list(ids[-keep:])


def cut_text(tokenizer: Any, text: str, keep: int, side: str = "right") -> list[int]:
    """`text`'s tokens cut to `keep`, the special tokens the tokenizer puts around it (BERT's
    [CLS] and [SEP], a BOS) kept in their places; a text of fewer tokens whole."""
    ids = tokenizer.encode(text)
    if len(ids) <= keep:
        return ids
    content = tokenizer.encode(text, add_special_tokens=False)
    added = len(ids) - len(content)
    if 0 < added < keep:
        at = next((p for p in range(added + 1) if ids[p : p + len(content)] == content), None)
        if at is not None:
            kept = cut_ids(content, keep - added, side)
            return ids[:at] + kept + ids[at + len(content) :]
    return cut_ids(ids, keep, side)
