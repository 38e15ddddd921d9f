"""gpt-oss's replies in OpenAI's harmony format (vLLM's `openai_gptoss`): a sequence of messages,
each a header (its channel, perhaps a recipient) and a body,

    <|channel|>analysis<|message|>reasoning...<|end|>
    <|start|>assistant<|channel|>final<|message|>the answer

the analysis channel's bodies are the reasoning; the final channel's, and commentary without a
recipient (a preamble), the content; a commentary message to a function (`to=functions.NAME`,
perhaps with `<|constrain|>json`) is a tool call, passed on to the `openai` tool-call parser
(server/tool_parsers/openai.py) in one plain form, `<|channel|>commentary to=functions.NAME
<|message|>ARGUMENTS<|call|>`. The markers are special tokens: the reply is decoded with them
(`special_tokens`), and none reaches the content. A reply with no harmony markup at all (a
structured output held to its grammar from the first token) is content as it is.

`split` is prefix-stable like every reasoning parser's: a message adds to the reasoning or the
rest only once its header is whole, and its body only grows."""

from __future__ import annotations

import re

from server.markers import held
from server.reasoning.think import ThinkParser

CHANNEL, MESSAGE, START = "<|channel|>", "<|message|>", "<|start|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
CALL_HEADER = "<|channel|>commentary to=functions."
_RECIPIENT = re.compile(r"to=(\S+?)(?=<\||\s|$)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


class HarmonyParser(ThinkParser):
    special_tokens = True  # the reply is decoded with its special tokens: the markup is them
    assume_reasoning = False

    def __init__(self, prompt_text: str = "") -> None:
        # A constraint holds from the first token (nothing opens a reasoning block for it).
        self.in_reasoning = False
        self.thinking_off = True

    def split(self, text: str, final: bool = False) -> tuple[str | None, str]:
        reasoning, rest, _ = self._read(text, final)
        return reasoning, rest

    def reasoning_length(self, text: str) -> int:
        """Characters of `text` up to the end of its last analysis message (with its marker):
        what wrote the reasoning."""
        return self._read(text, True)[2]

    def _read(self, text: str, final: bool) -> tuple[str | None, str, int]:
        if not text.startswith((CHANNEL, START, " to=", "to=")):
            opening = any(m.startswith(text) for m in (CHANNEL, START, " to=", "to=")) and text
            if opening and not final:
                return "", "", 0
            return None, text, 0
        reasoning: list[str] = []
        rest: list[str] = []
        pos = reasoned = 0
        while pos < len(text):
            if text.startswith(START, pos):
                pos += len(START)
            body_at = text.find(MESSAGE, pos)
            if body_at < 0:
                break  # the header is not whole yet
            header = text[pos:body_at]
            body_at += len(MESSAGE)
            found = [(i, m) for m in ENDS if (i := text.find(m, body_at)) >= 0]
            end, marker = min(found) if found else (len(text), "")
            body = text[body_at:end]
            if not marker and not final:
                body = body[: len(body) - max(held(body, m) for m in ENDS)]
            channel = _CHANNEL.search(header)
            recipient = _RECIPIENT.search(header)
            kind = channel.group(1) if channel else ""
            to = recipient.group(1) if recipient else ""
            if kind == "analysis":
                reasoning.append(body)
                reasoned = end + len(marker)
            elif to.startswith("functions."):
                closed = "<|call|>" if marker or final else ""
                rest.append(f"{CALL_HEADER}{to[len('functions.') :]}{MESSAGE}{body}{closed}")
            else:  # final, a preamble, or a message to a tool that is not a function: content
                rest.append(body)
            if not marker:
                break
            pos = end + len(marker)
        return ("".join(reasoning) if reasoning else None), "".join(rest), reasoned
