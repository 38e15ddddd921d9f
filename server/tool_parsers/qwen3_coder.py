"""Qwen3-Coder's XML calls:
`<tool_call><function=NAME><parameter=KEY>value</parameter>...</function></tool_call>`.
Values are raw text, typed by the tool's parameter schema (a string stays a string; other
types are read as JSON; `null` is None where the schema allows null); each parameter is
reported once its closing tag arrives.

Enforced calls (tool_choice required or named, and strict tools under auto) are written in this
markup as Qwen3-Coder's chat template writes them: a line for the function, then each parameter
in its schema's order (the required ones always, the others optional), its value on lines of its
own: any text for a parameter that takes a string (one of the literals for an enum of strings),
else JSON that validates against its schema."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from core.structured import Constraint, close_objects, json_options
from server.markers import held
from server.tool_parsers.base import Call, Parsed, ToolParser
from server.tool_parsers.grammar import rebase_refs, resolve_ref, text_or_calls

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION = re.compile(r"<function=([^>\n]+)>")
PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def _text(schema: Any) -> bool:
    """Whether a parameter's schema allows a string (a string type, in a type list or in
    anyOf/oneOf, or an enum of strings): its value is then kept as the text written."""
    if not isinstance(schema, dict):
        return schema is True  # the schema `true` takes anything
    kind = schema.get("type")
    if kind == "string" or (isinstance(kind, list) and "string" in kind):
        return True
    if any(isinstance(v, str) for v in schema.get("enum") or []):
        return True
    return any(_text(s) for s in (schema.get("anyOf") or []) + (schema.get("oneOf") or []))


def _null(schema: Any) -> bool:
    """Whether a parameter's schema allows null (a null type, in a type list or anyOf/oneOf)."""
    if not isinstance(schema, dict):
        return schema is True
    kind = schema.get("type")
    if kind == "null" or (isinstance(kind, list) and "null" in kind):
        return True
    return any(_null(s) for s in (schema.get("anyOf") or []) + (schema.get("oneOf") or []))


END = "\n</parameter>\n"  # a value's end, as the template writes it
ANY_TEXT = r"/(?s:.*)\n<\/parameter>\n/"  # a lazy lexeme: any text, then END


def _function_rules(i: int, tool: dict[str, Any]) -> list[str]:
    """Lark rules `f{i}` for one call of `tool` in this markup, from `<function=...>` to
    `</function>`: its parameters in their schema's order, each value a lexeme of text or an
    embedded JSON schema (the tool's parameters under its `$defs`, their references re-rooted)."""
    fn = tool["function"]
    params = close_objects(fn.get("parameters") or {"type": "object"})
    body = resolve_ref(params, params)  # a Pydantic model's recursive root is a reference
    props = body.get("properties") if isinstance(body, dict) else None
    rules, items = [], []
    if not isinstance(props, dict) or not props:  # any parameters, any text each
        rules.append(f'f{i}_p: "<parameter=" /[^>\\n]+/ ">\\n" f{i}_v')
        rules.append(f"f{i}_v[lazy]: {ANY_TEXT}")
        items.append(f"f{i}_p*")
        props = {}
    required = set(body.get("required") or []) if isinstance(body, dict) else set()
    whole = rebase_refs(params, "#/$defs/weir_tool")
    defs = {"x-guidance": json_options(Constraint("json")), "$defs": {"weir_tool": whole}}
    for j, (key, schema) in enumerate(props.items()):
        rule = f"f{i}_{j}"
        head = json.dumps(f"<parameter={key}>\n")
        enum = schema.get("enum") if isinstance(schema, dict) else None
        if _text(schema) and enum and all(isinstance(v, str) for v in enum):
            rules.append(f"{rule}: {head} ({' | '.join(json.dumps(v + END) for v in enum)})")
        elif _text(schema):
            rules.append(f"{rule}: {head} {rule}_v")
            rules.append(f"{rule}_v[lazy]: {ANY_TEXT}")
        else:
            doc = {**defs, **rebase_refs(schema, "#/$defs/weir_tool")}
            rules.append(f"{rule}: {head} {rule}_j {json.dumps(END)}")
            rules.append(f"{rule}_j: %json {json.dumps(doc)}")
        items.append(rule if key in required else f"{rule}?")
    line = json.dumps(f"<function={fn['name']}>\n")
    rules.insert(0, f"f{i}: {line} {' '.join(items)} {json.dumps('</function>' + chr(10))}")
    return rules


def _calls(tools: list[dict[str, Any]]) -> str:
    """Rule `fn`: one function line and its parameters, for any of `tools`."""
    rules = [f"fn: {' | '.join(f'f{i}' for i in range(len(tools)))}"]
    for i, tool in enumerate(tools):
        rules += _function_rules(i, tool)
    return "\n".join(rules) + "\n"


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is no JSON value")


class Qwen3CoderParser(ToolParser):
    name = "qwen3_coder"
    markers = ("<function=", "<parameter=")

    def __init__(
        self, tools: list[dict[str, Any]] | None = None, special: Mapping[str, int] | None = None
    ) -> None:
        super().__init__(tools, special)
        self.text_params: dict[str, set[str]] = {}  # function -> parameters that take text
        self.null_params: dict[str, set[str]] = {}  # and those that take null
        for tool in tools or []:
            fn = tool.get("function") or {}
            props = (fn.get("parameters") or {}).get("properties") or {}
            if isinstance(props, dict):
                self.text_params[fn.get("name", "")] = {k for k, v in props.items() if _text(v)}
                self.null_params[fn.get("name", "")] = {k for k, v in props.items() if _null(v)}

    def _value(self, function: str, key: str, raw: str) -> Any:
        """One newline either side is the markup's (as vLLM strips them), the rest the value's:
        kept as text where the schema allows a string, else read as JSON (a value that is no
        JSON, or no finite number, stays text)."""
        raw = raw[1:] if raw.startswith("\n") else raw
        raw = raw[:-1] if raw.endswith("\n") else raw
        if raw == "null" and key in self.null_params.get(function, ()):
            return None
        if key in self.text_params.get(function, ()):
            return raw
        try:
            value = json.loads(raw, parse_constant=_no_constant)
        except (ValueError, RecursionError):
            return raw
        return raw if isinstance(value, float) and not math.isfinite(value) else value

    def parse(self, text: str, final: bool = False) -> Parsed:
        out = Parsed()
        content: list[str] = []
        pos = 0
        while True:
            start = text.find(OPEN, pos)
            if start < 0:
                tail = text[pos:]
                content.append(tail if final else tail[: len(tail) - held(tail, OPEN)])
                break
            content.append(text[pos:start])
            end = text.find(CLOSE, start)
            done = end >= 0
            block = text[start : end if done else len(text)]
            head = FUNCTION.search(block)
            if head is None:
                if done or final:  # not a call: the text as written
                    stop = end + len(CLOSE) if done else len(text)
                    content.append(text[start:stop])
                    pos = stop
                    if done:
                        continue
                break
            if final and not done:  # cut short: its text, not a call it did not finish
                content.append(text[start:])
                break
            name = head.group(1).strip()
            args = {
                m.group(1).strip(): self._value(name, m.group(1).strip(), m.group(2))
                for m in PARAMETER.finditer(block, head.end())
            }
            out.calls.append(Call(name, args, done))
            if not done:
                break
            pos = end + len(CLOSE)
        out.content = "".join(content)
        return out

    def call_grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        more = ' ("\\n" call)*' if parallel else ""
        call = f"call: {self.lit(OPEN + chr(10))} fn {self.lit(CLOSE)}\n"
        return f"start: call{more}\n" + call + _calls(tools)

    def auto_grammar(self, tools: list[dict[str, Any]], parallel: bool, answer: bool) -> str:
        closed = self.lit(CLOSE)
        more = f" ({self.lit(chr(10) + OPEN + chr(10))} fn {closed})*" if parallel else ""
        after = f'after: "\\n" fn {closed}{more}\n'
        return text_or_calls(OPEN, answer, self.special) + after + _calls(tools)
