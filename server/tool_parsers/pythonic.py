"""Pythonic calls (Llama 3.2 and 4, some fine-tunes): the reply is a Python list of calls,
`[get_weather(city="Oslo", days=3), get_time()]`. A reply that does not open with `[` is
plain content; a call is reported once its closing parenthesis arrives (its arguments are
Python literals, which have no useful partial form)."""

from __future__ import annotations

import ast
import math
from typing import Any

from server.tool_parsers.base import Call, Parsed, ToolParser


def _after_list(body: str) -> str:
    """The text after the reply's closing `]` (body starts with its `[`)."""
    items, closed = _items(body[1:])
    consumed = sum(len(i) + 1 for i in items)  # each item and its `,` or the closing `]`
    return body[1 + consumed :] if closed else ""


def _items(body: str) -> tuple[list[str], bool]:
    """The complete top-level items of a list body (after its `[`), and whether it closed."""
    items, depth, start, quote, esc = [], 0, 0, "", False
    for i, ch in enumerate(body):
        if quote:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == quote:
                quote = ""
            continue
        if ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")}" or (ch == "]" and depth > 0):
            depth -= 1
        elif ch in ",]" and depth == 0:
            items.append(body[start:i])
            start = i + 1
            if ch == "]":
                return items, True
    return items, False


_NOT_JSON = object()


def _json(value: Any) -> Any:
    """A Python literal as JSON holds it (tuples and sets as lists), or _NOT_JSON (bytes,
    complex numbers, Ellipsis, non-string keys)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else _NOT_JSON
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_json(v) for v in value]
        return _NOT_JSON if any(v is _NOT_JSON for v in items) else items
    if isinstance(value, dict):
        out = {k: _json(v) for k, v in value.items()}
        ok = all(isinstance(k, str) for k in out) and _NOT_JSON not in out.values()
        return out if ok else _NOT_JSON
    return _NOT_JSON


def _call(item: str) -> Call | None:
    """One call of plain keyword arguments, `name(key=literal, ...)`, as vLLM reads them: a
    plain function name, no positional or ** arguments, literals JSON can hold."""
    try:
        node = ast.parse(item.strip(), mode="eval").body
    except (SyntaxError, RecursionError, ValueError):
        return None
    if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, ast.Name):
        return None
    if any(kw.arg is None for kw in node.keywords):
        return None
    try:
        args = {kw.arg: _json(ast.literal_eval(kw.value)) for kw in node.keywords}
    except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError):
        return None
    if _NOT_JSON in args.values():
        return None
    return Call(node.func.id, args, True)


class PythonicParser(ToolParser):
    name = "pythonic"
    markers = ("[func_name1(", "pythonic")

    def parse(self, text: str, final: bool = False) -> Parsed:
        body = text.lstrip()
        if not body:
            return Parsed(content=text if final else "")
        if not body.startswith("["):
            return Parsed(content=text)
        items, closed = _items(body[1:])
        calls = []
        for item in items:
            call = _call(item)
            if call is None:
                break  # not a call: what follows is not read as calls either
            calls.append(call)
        if final:  # the whole reply a closed list of calls, else all of it is content (vLLM's)
            whole = closed and calls and len(calls) == len(items)
            if not whole or _after_list(body).strip():
                return Parsed(content=text)
        return Parsed(calls=calls)
