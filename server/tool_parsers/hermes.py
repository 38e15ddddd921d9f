"""Hermes-style calls (Qwen2.5, Qwen3, Hermes, and most templates that say `<tool_call>`):
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, text around them."""

from __future__ import annotations

from typing import Any

from server.markers import held
from server.tool_parsers.base import Parsed, ToolParser, call_from, partial_json, whole_call
from server.tool_parsers.grammar import call_schema, lark_json, text_or_calls


class HermesParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)
    open, close = "<tool_call>", "</tool_call>"
    key = "arguments"  # the arguments' member in the call object a grammar writes
    before_close = "\n"  # what an enforced call writes between its JSON and `close`

    def parse(self, text: str, final: bool = False) -> Parsed:
        """Text around the calls is content, but for whitespace alone after a call (what
        separates calls, and ends the text, held until other text follows). A call cut short
        (no closing tag), or one closed on JSON that does not parse whole (a raw newline in a
        string, a dropped quote), is a call only if its JSON is whole, as vLLM's parser reads
        it: else its text is content (never a call with arguments it did not write)."""
        out = Parsed()
        content: list[str] = []
        pos = 0
        while True:
            start = text.find(self.open, pos)
            if start < 0:
                tail = text[pos:]
                keep = len(tail) if final else len(tail) - held(tail, self.open)
                if out.calls and not tail[:keep].strip():
                    keep = 0  # after a call: a separator, or text still to come
                content.append(tail[:keep])
                break
            if not out.calls or text[pos:start].strip():
                content.append(text[pos:start])
            body_at = start + len(self.open)
            end = text.find(self.close, body_at)
            body = text[body_at : end if end >= 0 else len(text)]
            done = end >= 0
            if done or final:  # its JSON must be whole: else its text is content, as vLLM's
                call = whole_call(body)
            else:
                call = call_from(partial_json(body), False)
            if call is None and (done or final):
                # Not a call after all (broken markup): its text is content, as written.
                stop = end + len(self.close) if done else len(text)
                content.append(text[start:stop])
                pos = stop
                if done:
                    continue
                break
            if call is not None:
                out.calls.append(call)
            if not done:
                break
            pos = end + len(self.close)
        out.content = "".join(content)
        return out

    def call_grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        more = ' ("\\n" call)*' if parallel else ""
        opened, closed = self.lit(self.open + "\n"), self.lit(self.before_close + self.close)
        obj = lark_json(call_schema(tools, self.key))
        return f"start: call{more}\ncall: {opened} obj {closed}\nobj: {obj}"

    def auto_grammar(self, tools: list[dict[str, Any]], parallel: bool, answer: bool) -> str:
        closed = self.lit(self.before_close + self.close)
        more = f" ({self.lit(chr(10) + self.open + chr(10))} obj {closed})*" if parallel else ""
        return (
            text_or_calls(self.open, answer, self.special)
            + f'after: "\\n" obj {closed}{more}\n'
            + f"obj: {lark_json(call_schema(tools, self.key))}"
        )
