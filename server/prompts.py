"""A request's prompt field (a string, a list of strings, a list of token ids or a list of
token-id lists, as the OpenAI API takes them for completions and embeddings) -> token lists."""

from __future__ import annotations

from typing import Any

from core.truncation import cut_ids, cut_text
from server.errors import APIError
from server.state import ServerState


def _is_ids(x: Any) -> bool:
    return (
        isinstance(x, list)
        and bool(x)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
    )


def token_lists(
    st: ServerState,
    value: str | list[Any],
    field: str,
    keep: int | None = None,
    side: str = "right",
) -> list[list[int]]:
    """`keep`: each input cut to `keep` tokens, its first (`side` "right") or its last ("left"),
    a text's special tokens kept (core/truncation.py); None: whole."""

    def encode(text: str) -> list[int]:
        if keep is None:
            return st.tokenizer.encode(text)
        return cut_text(st.tokenizer, text, keep, side)

    def listed(ids: list[int]) -> list[int]:
        return list(ids) if keep is None else cut_ids(ids, keep, side)

    if isinstance(value, str):
        return [encode(value)]
    if not value:
        raise APIError(400, f"{field} must not be empty", field, "invalid_value")
    if all(isinstance(p, str) for p in value):
        return [encode(p) for p in value]
    if _is_ids(value):
        return [listed(value)]
    if all(_is_ids(p) for p in value):
        return [listed(p) for p in value]
    raise APIError(
        400,
        f"{field} must be a string, a list of strings, a list of token ids or a "
        "list of token-id lists",
        field,
        "invalid_value",
    )
