"""IBM Granite 3.x calls (vLLM's `granite`): a JSON list of `{"name", "arguments"}` objects after
`<|tool_call|>` (Granite 3.0 and later write it, a special token of their tokenizers) or the
string `<tool_call>` (as vLLM also reads Granite 3.1's), or a reply that is the list itself.
Text before the marker is the reply's content. Granite's chat templates write
`<|tool_call|>`, which is how `auto` knows them."""

from __future__ import annotations

from typing import Any

from server.markers import held
from server.tool_parsers.base import Parsed, ToolParser, listed_calls, whole_listed_calls
from server.tool_parsers.grammar import listed_auto_grammar, listed_grammar

MARK = "<|tool_call|>"
STRING = "<tool_call>"


class GraniteParser(ToolParser):
    name = "granite"
    markers = (MARK,)

    def parse(self, text: str, final: bool = False) -> Parsed:
        at, rest = _calls_at(text)
        if at < 0:
            if not final and not text.strip():
                return Parsed()  # the list or a marker may still open the reply
            keep = len(text) if final else len(text) - max(held(text, MARK), held(text, STRING))
            return Parsed(content=text[:keep])
        if final:  # every item a whole call, else all of it is content (as vLLM's parser)
            calls = whole_listed_calls(rest.strip())
            if not calls or None in calls:
                return Parsed(content=text)
            return Parsed(content=text[:at], calls=calls)
        if not rest.strip() or STRING.startswith(rest.lstrip()):
            return Parsed(content=text[:at])  # the string marker may still follow the token
        return Parsed(content=text[:at], calls=listed_calls(rest.lstrip(), final))

    def call_grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        return listed_grammar(MARK, tools, parallel, self.special)

    def auto_grammar(self, tools: list[dict[str, Any]], parallel: bool, answer: bool) -> str:
        return listed_auto_grammar(MARK, tools, parallel, answer, self.special)


def _calls_at(text: str) -> tuple[int, str]:
    """Where the calls' markup begins in `text` (-1: nowhere yet) and what follows its markers:
    the first `<|tool_call|>` or `<tool_call>` (the string after the token skipped too), or the
    reply's opening `[`."""
    marks = [(i, m) for m in (MARK, STRING) if (i := text.find(m)) >= 0]
    if marks:
        at, mark = min(marks)
        rest = text[at + len(mark) :]
        if mark == MARK and rest.lstrip().startswith(STRING):
            rest = rest.lstrip()[len(STRING) :]
        return at, rest
    if text.lstrip().startswith("["):
        return 0, text.lstrip()
    return -1, ""
