"""A request's prompt field (a string, a list of strings, a list of token ids or a list of
token-id lists, as the OpenAI API takes them for completions and embeddings) -> token lists."""

from __future__ import annotations

from typing import Any

from server.errors import APIError
from server.state import ServerState


def _is_ids(x: Any) -> bool:
    return (
        isinstance(x, list)
        and bool(x)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
    )


def token_lists(st: ServerState, value: str | list[Any], field: str) -> list[list[int]]:
    def encode(text: str) -> list[int]:
        return st.tokenizer.encode(text)

    if isinstance(value, str):
        return [encode(value)]
    if not value:
        raise APIError(400, f"{field} must not be empty", field, "invalid_value")
    if all(isinstance(p, str) for p in value):
        return [encode(p) for p in value]
    if _is_ids(value):
        return [list(value)]
    if all(_is_ids(p) for p in value):
        return [list(p) for p in value]
    raise APIError(
        400,
        f"{field} must be a string, a list of strings, a list of token ids or a "
        "list of token-id lists",
        field,
        "invalid_value",
    )
