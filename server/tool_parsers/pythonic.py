"""Pythonic calls (Llama 3.2 and 4, some fine-tunes): the reply is a Python list of calls,
`[get_weather(city="Oslo", days=3), get_time()]`. A reply that does not open with `[` is
plain content; a call is reported once its closing parenthesis arrives (its arguments are
Python literals, which have no useful partial form; JSON's `true`, `false` and `null` are read
as Python's True, False and None).

Enforced calls (tool_choice required or named, and strict tools under auto) are written as such
a list: each call's keyword arguments in its schema's order (the required ones always, the
others optional), each value JSON that validates against the parameter's schema."""

from __future__ import annotations

import ast
import json
import math
from typing import Any

from core.structured import Constraint, close_objects, json_options
from server.tool_parsers.base import Call, Parsed, ToolParser
from server.tool_parsers.grammar import rebase_refs, resolve_ref


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


_JSON_NAMES = {"true": True, "false": False, "null": None}


def _python(node: ast.AST) -> ast.AST:
    """A literal's tree with JSON's names (true, false, null) as Python's constants."""

    class Names(ast.NodeTransformer):
        def visit_Name(self, name: ast.Name) -> ast.AST:
            if name.id in _JSON_NAMES:
                return ast.copy_location(ast.Constant(_JSON_NAMES[name.id]), name)
            return name

    return Names().visit(node)


def _arguments(i: int, tool: dict[str, Any]) -> list[str]:
    """Lark rules `f{i}` for one call of `tool`, `name(key=value, ...)`: its parameters in their
    schema's order, ", " between those written, each value an embedded JSON schema (the tool's
    parameters under its `$defs`, their references re-rooted)."""
    fn = tool["function"]
    params = close_objects(fn.get("parameters") or {"type": "object"})
    body = resolve_ref(params, params)
    props = body.get("properties") if isinstance(body, dict) else None
    head = json.dumps(fn["name"] + "(")
    if not isinstance(props, dict) or not props:  # any keyword arguments of any JSON
        loose = {"x-guidance": json_options(Constraint("json"))}
        return [
            f'f{i}: {head} (f{i}_kw (", " f{i}_kw)*)? ")"',
            f'f{i}_kw: /[A-Za-z_][A-Za-z0-9_]*/ "=" f{i}_v',
            f"f{i}_v: %json {json.dumps(loose)}",
        ]
    required = set(body.get("required") or [])
    whole = rebase_refs(params, "#/$defs/weir_tool")
    defs = {"x-guidance": json_options(Constraint("json")), "$defs": {"weir_tool": whole}}
    keys = list(props)
    rules = []
    for j, key in enumerate(keys):
        doc = {**defs, **rebase_refs(props[key], "#/$defs/weir_tool")}
        rules.append(f"f{i}_{j}: {json.dumps(key + '=')} f{i}_{j}_v")
        rules.append(f"f{i}_{j}_v: %json {json.dumps(doc)}")
    # a_j: the parameters from j on, the first of them written; t_j: ", " and a_j, optional
    # where none from j on is required
    for j in range(len(keys)):
        left = any(k in required for k in keys[j + 1 :])
        tail = f'(", " f{i}_a{j + 1})' if j + 1 < len(keys) else ""
        if tail and not left:
            tail += "?"
        options = [f"f{i}_{j} {tail}".strip()]
        if keys[j] not in required and j + 1 < len(keys):
            options.append(f"f{i}_a{j + 1}")
        rules.append(f"f{i}_a{j}: {' | '.join(options)}")
    first = "" if required else "?"
    rules.insert(0, f'f{i}: {head} f{i}_a0{first} ")"')
    return rules


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
        args = {kw.arg: _json(ast.literal_eval(_python(kw.value))) for kw in node.keywords}
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

    def call_grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        more = ' (", " call)*' if parallel else ""
        rules = [
            f'start: "[" call{more} "]"',
            f"call: {' | '.join(f'f{i}' for i in range(len(tools)))}",
        ]
        for i, tool in enumerate(tools):
            rules += _arguments(i, tool)
        return "\n".join(rules) + "\n"

    def auto_grammar(self, tools: list[dict[str, Any]], parallel: bool, answer: bool) -> str:
        """Text whose first character (past blanks) is not `[`, or the list of calls."""
        calls = self.call_grammar(tools, parallel).replace("start:", "calls:", 1)
        if answer:
            return "start: @answer | calls\n" + calls
        return "start: TEXT | calls\nTEXT: /(?s:\\s*[^\\[\\s].*)?/\n" + calls
