"""Cohere's Command R7B and Command A calls (vLLM's `command`; llama.cpp's "Command R7B" format):
after its tool plan, `<|START_ACTION|>` and a JSON list of `{"tool_call_id", "tool_name",
"parameters"}` objects, then `<|END_ACTION|>`. The markers are special tokens of its tokenizer,
so the reply is read with special tokens kept: the answer's own `<|START_RESPONSE|>` /
`<|END_RESPONSE|>` (and the tool plan's thinking markers, where no reasoning parser took them)
are taken out of the content. Its chat template writes `<|START_ACTION|>`, which is how `auto`
knows it."""

from __future__ import annotations

from typing import Any

from server.markers import without
from server.tool_parsers.base import (
    Call,
    Parsed,
    ToolParser,
    call_from,
    closed_json,
    partial_json,
    whole_json,
)
from server.tool_parsers.grammar import calls_rule, literal, text_or_calls

START, END = "<|START_ACTION|>", "<|END_ACTION|>"
# the answer's and the tool plan's markup: never content
MARKUP = ("<|START_RESPONSE|>", "<|END_RESPONSE|>", "<|START_THINKING|>", "<|END_THINKING|>")
KEYS = {"key": "parameters", "name_key": "tool_name", "id_key": "tool_call_id"}


class CommandParser(ToolParser):
    name = "command"
    markers = (START,)

    def parse(self, text: str, final: bool = False) -> Parsed:
        at = text.find(START)
        if at < 0:
            return Parsed(content=without(text, MARKUP, final, hold=(START,)))
        content = without(text[:at], MARKUP, True)
        rest = text[at + len(START) :]
        end = rest.find(END)
        body = rest if end < 0 else rest[:end]
        if final:  # a whole list of whole calls, nothing after it, or all of it is content
            value = whole_json(body.strip())
            items = value if isinstance(value, list) else [None]
            calls = [_call(item, True) for item in items]
            trailing = rest[end + len(END) :] if end >= 0 else ""
            if not calls or None in calls or without(trailing, MARKUP, True).strip():
                return Parsed(content=without(text, MARKUP, True))
            return Parsed(content=content, calls=calls)
        value = partial_json(body)
        calls = []
        closed = end >= 0 or closed_json(body)
        for j, item in enumerate(value if isinstance(value, list) else []):
            done = closed or j < len(value) - 1
            call = _call(item, done)
            if call is not None:
                calls.append(call)
        return Parsed(content=content, calls=calls)

    def call_grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        start, end = literal(START, self.special), literal(END, self.special)
        return f"start: {start} calls {end}\n" + calls_rule(tools, parallel, **KEYS)

    def auto_grammar(self, tools: list[dict[str, Any]], parallel: bool, answer: bool) -> str:
        top = text_or_calls(START, answer, self.special)
        after = f"after: calls {literal(END, self.special)}\n"
        return top + after + calls_rule(tools, parallel, **KEYS)


def _call(item: Any, complete: bool) -> Call | None:
    """One listed object as a Call: its tool_name and parameters (None without a whole name)."""
    if not isinstance(item, dict) or "tool_name" not in item:
        return None
    obj = {"name": item["tool_name"]}
    if "parameters" in item:
        obj["arguments"] = item["parameters"]
    return call_from(obj, complete)
