"""Pythonic calls (Llama 3.2 and 4, some fine-tunes): the reply is a Python list of calls,
`[get_weather(city="Oslo", days=3), get_time()]`. A reply that does not open with `[` is
plain content; a call is reported once its closing parenthesis arrives (its arguments are
Python literals, which have no useful partial form)."""

from __future__ import annotations

import ast

from server.tool_parsers.base import Call, Parsed, ToolParser


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


def _call(item: str) -> Call | None:
    try:
        node = ast.parse(item.strip(), mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call) or node.args:
        return None
    name = ast.unparse(node.func)
    try:
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
    except (ValueError, SyntaxError, TypeError):
        return None
    return Call(name, args, True)


class PythonicParser(ToolParser):
    name = "pythonic"
    markers = ("[func_name1(", "pythonic")

    def parse(self, text: str, final: bool = False) -> Parsed:
        body = text.lstrip()
        if not body:
            return Parsed(content=text if final else "")
        if not body.startswith("["):
            return Parsed(content=text)
        items, _ = _items(body[1:])
        calls = []
        for item in items:
            call = _call(item)
            if call is None:
                break  # not a call: what follows is not read as calls either
            calls.append(call)
        if final and not calls:
            return Parsed(content=text)
        return Parsed(calls=calls)
