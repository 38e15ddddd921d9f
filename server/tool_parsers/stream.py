"""Tool calls out: the whole-text result as OpenAI `tool_calls`, and a stream's deltas as the
difference between successive whole-text parses."""

from __future__ import annotations

import uuid

from server.protocol import DeltaFunction, DeltaToolCall, FunctionCall, ToolCallOut
from server.tool_parsers.base import Parsed, ToolParser, dumps, stable_prefix


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_calls(parsed: Parsed) -> list[ToolCallOut]:
    return [ToolCallOut(call_id(), FunctionCall(c.name, dumps(c.arguments))) for c in parsed.calls]


class ToolStream:
    """One choice's stream: each call gets the text that is new; returns the content delta and
    the tool-call deltas (a call's first delta has its index, id, type and name; its arguments
    follow in pieces that concatenate to the non-streamed JSON)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent_content = 0
        self.ids: list[str] = []
        self.sent_args: list[str] = []
        self.parsed = Parsed()

    def feed(self, new_text: str, final: bool = False) -> tuple[str, list[DeltaToolCall]]:
        self.text += new_text
        parsed = self.parsed = self.parser.parse(self.text, final)
        content = parsed.content[self.sent_content :]
        self.sent_content = len(parsed.content)
        deltas = []
        for i, call in enumerate(parsed.calls):
            first = i >= len(self.ids)
            if first:
                self.ids.append(call_id())
                self.sent_args.append("")
            done = call.complete or final
            if call.arguments is None:  # not begun
                args = ""
            else:
                args = dumps(call.arguments) if done else stable_prefix(call.arguments)
            piece = args[len(self.sent_args[i]) :] if args.startswith(self.sent_args[i]) else ""
            self.sent_args[i] += piece
            if first:
                fn = DeltaFunction(name=call.name, arguments=piece)
                deltas.append(DeltaToolCall(i, fn, id=self.ids[i], type="function"))
            elif piece:
                deltas.append(DeltaToolCall(i, DeltaFunction(arguments=piece)))
        return content, deltas
