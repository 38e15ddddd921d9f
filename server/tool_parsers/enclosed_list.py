"""Calls as a JSON list between two markers, text before them: Command R7B's
`<|START_ACTION|>[...]<|END_ACTION|>` (server/tool_parsers/command.py) and Hunyuan's
`<tool_calls>[...]</tool_calls>` (server/tool_parsers/hunyuan.py). A subclass names its markers,
the markup it takes out of the content, its items' member names (for the enforced grammar) and
how an item reads as a call."""

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


class EnclosedListParser(ToolParser):
    start = end = ""
    markup: tuple[str, ...] = ()  # never content (other markup the reply is read with)
    keys: dict[str, str] = {}  # call_schema's member names of an item

    def item_call(self, item: Any, complete: bool) -> Call | None:
        """One listed object as a Call (None without a whole name)."""
        return call_from(item, complete)

    def parse(self, text: str, final: bool = False) -> Parsed:
        at = text.find(self.start)
        if at < 0:
            return Parsed(content=without(text, self.markup, final, hold=(self.start,)))
        content = without(text[:at], self.markup, True)
        rest = text[at + len(self.start) :]
        end = rest.find(self.end)
        body = rest if end < 0 else rest[:end]
        if final:  # a whole list of whole calls, nothing after it, or all of it is content
            value = whole_json(body.strip())
            items = value if isinstance(value, list) else [None]
            calls = [self.item_call(item, True) for item in items]
            trailing = rest[end + len(self.end) :] if end >= 0 else ""
            if not calls or None in calls or without(trailing, self.markup, True).strip():
                return Parsed(content=without(text, self.markup, True))
            return Parsed(content=content, calls=calls)
        value = partial_json(body)
        calls = []
        closed = end >= 0 or closed_json(body)
        for j, item in enumerate(value if isinstance(value, list) else []):
            call = self.item_call(item, closed or j < len(value) - 1)
            if call is not None:
                calls.append(call)
        return Parsed(content=content, calls=calls)

    def call_grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        start, end = literal(self.start, self.special), literal(self.end, self.special)
        return f"start: {start} calls {end}\n" + calls_rule(tools, parallel, **self.keys)

    def auto_grammar(self, tools: list[dict[str, Any]], parallel: bool, answer: bool) -> str:
        top = text_or_calls(self.start, answer, self.special)
        after = f"after: calls {literal(self.end, self.special)}\n"
        return top + after + calls_rule(tools, parallel, **self.keys)
