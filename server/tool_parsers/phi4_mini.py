"""Phi-4-mini's calls (vLLM's `phi4_mini_json`): text, then the word `functools` and a JSON list of
`{"name", "arguments"}` objects. Its chat template lists the tools between `<|tool|>` and
`<|/tool|>`, which is how `auto` knows it."""

from __future__ import annotations

from typing import Any

from server.markers import held
from server.tool_parsers.base import Parsed, ToolParser, listed_calls, whole_listed_calls
from server.tool_parsers.grammar import listed_auto_grammar, listed_grammar

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
        return listed_grammar(MARK, tools, parallel, self.special)

    def auto_grammar(self, tools: list[dict[str, Any]], parallel: bool, answer: bool) -> str:
        return listed_auto_grammar(MARK, tools, parallel, answer, self.special)
