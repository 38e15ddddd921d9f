"""Llama 3.x JSON calls: the reply is the call itself, `{"name": ..., "parameters": {...}}`,
optionally after `<|python_tag|>`, several separated by `;`. A reply that does not open with a
call is plain content (decided on its first character, so streaming never has to take it back)."""

from __future__ import annotations

from typing import Any

from server.tool_parsers.base import Parsed, ToolParser, call_from, partial_json, whole_call

from server.tool_parsers.grammar import call_schema, lark_json

TAG = "<|python_tag|>"


def _split_top(text: str) -> list[str]:
    """The top-level `;`-separated pieces of a sequence of JSON objects (outside strings)."""
    pieces, depth, start, in_str, esc = [], 0, 0, False, False
    for i, ch in enumerate(text):
        if in_str:
            esc = not esc and ch == "\\"
            if ch == '"' and not esc:
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == ";" and depth == 0:
            pieces.append(text[start:i])
            start = i + 1
    pieces.append(text[start:])
    return pieces


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = (TAG, '"parameters"')

    def parse(self, text: str, final: bool = False) -> Parsed:
        body = text.lstrip()
        if body.startswith(TAG):
            body = body[len(TAG) :]
        elif not final and TAG.startswith(body):
            return Parsed()  # may still be the tag: hold it back
        if not body.lstrip().startswith("{"):
            if not final and not body.strip():
                return Parsed()
            return Parsed(content=text)
        out = Parsed()
        pieces = _split_top(body)
        if final:  # every piece a whole call, else the text is content (as vLLM's parser)
            calls = [whole_call(piece) for piece in pieces if piece.strip()]
            if not calls or None in calls:
                return Parsed(content=text)
            return Parsed(calls=calls)
        for j, piece in enumerate(pieces):
            last = j == len(pieces) - 1
            call = whole_call(piece) if not last else call_from(partial_json(piece), False)
            if call is None:
                break  # not a whole call: nothing after it is read as calls
            out.calls.append(call)
        return out

    def call_grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        more = ' ("; " obj)*' if parallel else ""
        return f"start: obj{more}\nobj: {lark_json(call_schema(tools, 'parameters'))}"

    def auto_grammar(self, tools: list[dict[str, Any]], parallel: bool, answer: bool) -> str:
        """The reply is calls when it opens with an object (parse's rule): text is any text
        whose first character, past whitespace, is not "{" (the python tag, a special token,
        is never text), or with `answer` the nested grammar @answer."""
        text = "@answer" if answer else "TEXT"
        rules = "" if answer else "TEXT: /(?s:\\s*([^\\s{].*)?)/\n"
        return f"start: {text} | calls\n{rules}" + self.call_grammar(tools, parallel).replace(
            "start: obj", "calls: obj", 1
        )
