"""gpt-oss's calls (vLLM's `openai` parser), as the harmony reasoning parser passes them on
(server/reasoning/harmony.py): `<|channel|>commentary to=functions.NAME<|message|>{...}<|call|>`,
one call a message, content around them. A call's arguments are its message's JSON: shown as
they grow, whole once the message ends (its `<|call|>`, or the end of the reply)."""

from __future__ import annotations

import json
from typing import Any

from server.markers import held
from server.reasoning.harmony import CALL_HEADER, MESSAGE
from server.tool_parsers.base import Call, Parsed, ToolParser, partial_json, whole_json
from server.tool_parsers.grammar import args_schema, lark_json

CLOSE = "<|call|>"


class OpenAIParser(ToolParser):
    name = "openai"
    markers = ("<|channel|>",)

    def parse(self, text: str, final: bool = False) -> Parsed:
        out = Parsed()
        content: list[str] = []
        pos = 0
        while True:
            start = text.find(CALL_HEADER, pos)
            if start < 0:
                tail = text[pos:]
                content.append(tail if final else tail[: len(tail) - held(tail, CALL_HEADER)])
                break
            content.append(text[pos:start])
            name_at = start + len(CALL_HEADER)
            body_at = text.find(MESSAGE, name_at)
            if body_at < 0:
                break  # the name is not whole yet
            name = text[name_at:body_at].strip()
            body_at += len(MESSAGE)
            end = text.find(CLOSE, body_at)
            done = end >= 0 or final
            body = text[body_at : end if end >= 0 else len(text)]
            if done:
                args = whole_json(body) if body.strip() else {}
                if args is None:  # not JSON after all: its text is content, as written
                    content.append(body)
                else:
                    out.calls.append(Call(name, args, complete=True))
            else:
                args = partial_json(body)
                out.calls.append(Call(name, args if isinstance(args, dict) else {}))
            if end < 0:
                break
            pos = end + len(CLOSE)
        out.content = "".join(content)
        return out

    def call_grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        """One call (harmony ends the reply at a call's `<|call|>`: one a reply, whatever
        `parallel` says), its markers the tokenizer's special tokens, its arguments those of
        the function it names (closed and whitespace-bounded as every parser's: args_schema)."""
        calls = " | ".join(f"call{i}" for i in range(len(tools)))
        lines = [f"start: {calls}"]
        for i, tool in enumerate(tools):
            fn = tool["function"]
            name = json.dumps(f"commentary to=functions.{fn['name']}")
            lines.append(f"call{i}: <|channel|> {name} <|message|> args{i} <|call|>")
            lines.append(f"args{i}: {lark_json(args_schema(tool))}")
        return "\n".join(lines)

    def auto_grammar(self, tools: list[dict[str, Any]], parallel: bool, answer: bool) -> str:
        """A harmony reply whose call, if it makes one, is held to the tools: messages on the
        analysis channel (or commentary preambles), then a final message (its text, or with
        `answer` the nested grammar @answer) or one call as `call_grammar` writes it."""
        body = "@answer" if answer else "TEXT?"
        return (
            "start: msg* (final | call)\n"
            'msg: <|channel|> ("analysis" | "commentary") <|message|> TEXT? <|end|> '
            '<|start|> "assistant"\n'
            f'final: <|channel|> "final" <|message|> {body} <|return|>?\n'
            "TEXT: /(?s:.+)/\n" + self.call_grammar(tools, parallel).replace("start:", "call:", 1)
        )
