"""Qwen3-Coder's XML calls:
`<tool_call><function=NAME><parameter=KEY>value</parameter>...</function></tool_call>`.
Values are raw text, typed by the tool's parameter schema (a string stays a string; other
types are read as JSON); each parameter is reported once its closing tag arrives."""

from __future__ import annotations

import json
import re
from typing import Any

from server.markers import held
from server.tool_parsers.base import Call, Parsed, ToolParser

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION = re.compile(r"<function=([^>\n]+)>")
PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


class Qwen3CoderParser(ToolParser):
    name = "qwen3_coder"
    markers = ("<function=", "<parameter=")

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.types: dict[str, dict[str, Any]] = {}
        for tool in tools or []:
            fn = tool.get("function") or {}
            props = (fn.get("parameters") or {}).get("properties") or {}
            self.types[fn.get("name", "")] = {k: v.get("type") for k, v in props.items()}

    def _value(self, function: str, key: str, raw: str) -> Any:
        raw = raw.strip("\n")
        if self.types.get(function, {}).get(key) == "string":
            return raw
        try:
            return json.loads(raw)
        except ValueError:
            return raw

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
