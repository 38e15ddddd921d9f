"""Phi-4-mini's calls (vLLM's `phi4_mini_json`): text, then the word `functools` and a JSON list of
`{"name", "arguments"}` objects. Its chat template lists the tools between `<|tool|>` and
`<|/tool|>`, which is how `auto` knows it."""

from __future__ import annotations

from typing import Any

from server.markers import held
from server.tool_parsers.base import (
    Parsed,
    ToolParser,
    call_schema,
    lark_json,
    lift_defs,
    listed_calls,
    text_or_calls,
    whole_listed_calls,
)

MARK = "functools"


class Phi4MiniJsonParser(ToolParser):
    name = "phi4_mini_json"
    markers = ("<|tool|>", MARK + "[")

    def parse(self, text: str, final: bool = False) -> Parsed:
        at = text.find(MARK + "[")
        if at < 0:
            # `functools` alone, or a beginning of it, may still open calls: held back
            if not final and text.endswith(MARK):
                return Parsed(content=text[: -len(MARK)])
            keep = len(text) if final else len(text) - held(text, MARK)
            return Parsed(content=text[:keep])
        rest = text[at + len(MARK) :]
        if final:  # every item a whole call, else all of it is content (as vLLM's parser)
            calls = whole_listed_calls(rest.strip())
            if not calls or None in calls:
                return Parsed(content=text)
            return Parsed(content=text[:at], calls=calls)
        return Parsed(content=text[:at], calls=listed_calls(rest, final))

    def call_grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        bound = {} if parallel else {"maxItems": 1}
        calls = lift_defs(
            call_schema(tools), lambda one: {"type": "array", "items": one, "minItems": 1, **bound}
        )
        return f'start: "{MARK}" calls\ncalls: {lark_json(calls)}'

    def auto_grammar(self, tools: list[dict[str, Any]], parallel: bool, answer: bool) -> str:
        """Text, then the word and the list of calls (as call_grammar's)."""
        return text_or_calls(MARK, answer) + self.call_grammar(tools, parallel).replace(
            f'start: "{MARK}" calls', "after: calls", 1
        )
