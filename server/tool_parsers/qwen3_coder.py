"""Qwen3-Coder's XML calls:
`<tool_call><function=NAME><parameter=KEY>value</parameter>...</function></tool_call>`.
Values are raw text, typed by the tool's parameter schema (a string stays a string; other
types are read as JSON); each parameter is reported once its closing tag arrives."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from server.markers import held
from server.tool_parsers.base import Call, Parsed, ToolParser

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


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is no JSON value")


class Qwen3CoderParser(ToolParser):
    name = "qwen3_coder"
    markers = ("<function=", "<parameter=")

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.text_params: dict[str, set[str]] = {}  # function -> parameters that take text
        for tool in tools or []:
            fn = tool.get("function") or {}
            props = (fn.get("parameters") or {}).get("properties") or {}
            if isinstance(props, dict):
                self.text_params[fn.get("name", "")] = {k for k, v in props.items() if _text(v)}

    def _value(self, function: str, key: str, raw: str) -> Any:
        """One newline either side is the markup's (as vLLM strips them), the rest the value's:
        kept as text where the schema allows a string, else read as JSON (a value that is no
        JSON, or no finite number, stays text)."""
        raw = raw[1:] if raw.startswith("\n") else raw
        raw = raw[:-1] if raw.endswith("\n") else raw
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
