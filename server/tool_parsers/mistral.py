"""Mistral calls: text, then `[TOOL_CALLS]` and a JSON list of `{"name", "arguments"}` objects
(the v3 tokenizers), or `[TOOL_CALLS]name[ARGS]{...}` per call (v11 and later). Both are read;
an enforced call is written in the form the tokenizer says (v11's has [ARGS] as a special
token), its markers as the special tokens they are."""

from __future__ import annotations

import json
import re
from typing import Any

from server.markers import held
from server.tool_parsers.base import (
    Call,
    Parsed,
    ToolParser,
    listed_calls,
    partial_json,
    whole_json,
    whole_listed_calls,
)
from server.tool_parsers.grammar import (
    args_schema,
    lark_json,
    listed_auto_grammar,
    listed_grammar,
    text_or_calls,
)

MARK = "[TOOL_CALLS]"
ARGS = "[ARGS]"


class MistralParser(ToolParser):
    name = "mistral"
    markers = (MARK,)

    def parse(self, text: str, final: bool = False) -> Parsed:
        at = text.find(MARK)
        if at < 0:
            keep = len(text) if final else len(text) - held(text, MARK)
            return Parsed(content=text[:keep])
        if final:
            return self._whole(text, at)
        out = Parsed(content=text[:at])
        rest = text[at + len(MARK) :]
        if rest.lstrip().startswith("[") or (not final and not rest.strip()):
            out.calls = listed_calls(rest, final)
            return out
        # name[ARGS]{json}, repeated with further [TOOL_CALLS] markers.
        parts = rest.split(MARK)
        for j, part in enumerate(parts):
            name, sep, args = part.partition(ARGS)
            if not sep:
                break  # the name is still being written
            name = name.strip()
            if not re.fullmatch(r"[\w.\-]+", name):
                continue
            value = partial_json(args)
            done = final or j < len(parts) - 1
            out.calls.append(Call(name, value if isinstance(value, dict) else None, done))
        return out

    def _whole(self, text: str, at: int) -> Parsed:
        """The finished text: its calls only if every one is whole (a JSON list of calls, or
        each name[ARGS]{...}); else all of it is content, as vLLM's parser gives it."""
        rest = text[at + len(MARK) :].strip()
        calls: list[Call | None] = []
        if rest.startswith("["):
            calls = whole_listed_calls(rest)
        else:
            for part in rest.split(MARK):
                name, sep, args = part.partition(ARGS)
                value = whole_json(args) if sep else None
                ok = re.fullmatch(r"[\w.\-]+", name.strip()) and isinstance(value, dict)
                calls.append(Call(name.strip(), value, True) if ok else None)
        if not calls or None in calls:
            return Parsed(content=text)
        return Parsed(content=text[:at], calls=calls)

    def call_grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        if ARGS not in self.special:
            return listed_grammar(MARK, tools, parallel, self.special)
        more = f" ({self.lit(MARK)} call)*" if parallel else ""
        return f"start: {self.lit(MARK)} call{more}\n" + self._named_calls(tools)

    def auto_grammar(self, tools: list[dict[str, Any]], parallel: bool, answer: bool) -> str:
        if ARGS not in self.special:
            return listed_auto_grammar(MARK, tools, parallel, answer, self.special)
        more = f" ({self.lit(MARK)} call)*" if parallel else ""
        top = text_or_calls(MARK, answer, self.special)
        return top + f"after: call{more}\n" + self._named_calls(tools)

    def _named_calls(self, tools: list[dict[str, Any]]) -> str:
        """v11 and later (their tokenizers hold [ARGS] as a special token): each call is the
        function's name, [ARGS], then its arguments' JSON, typed by that function's schema."""
        names = " | ".join(f"call{i}" for i in range(len(tools)))
        lines = [f"call: {names}"]
        for i, tool in enumerate(tools):
            name = json.dumps(tool["function"]["name"])
            lines.append(f"call{i}: {name} {self.lit(ARGS)} args{i}")
            lines.append(f"args{i}: {lark_json(args_schema(tool))}")
        return "\n".join(lines)
