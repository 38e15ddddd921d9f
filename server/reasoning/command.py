"""Cohere's Command R7B and Command A (`command`, as their tool parser): the tool plan or thinking
between `<|START_THINKING|>` and `<|END_THINKING|>`, then the answer between
`<|START_RESPONSE|>` and `<|END_RESPONSE|>` (or `<|START_ACTION|>` calls:
server/tool_parsers/command.py). All are special tokens of its tokenizer, so the reply is
decoded with them kept (`special_tokens`) and the answer's markers are taken out of the content
too."""

from __future__ import annotations

from server.markers import without
from server.reasoning.think import ThinkParser

RESPONSE = ("<|START_RESPONSE|>", "<|END_RESPONSE|>")


class CommandReasoningParser(ThinkParser):
    start = "<|START_THINKING|>"
    end = "<|END_THINKING|>"
    special_tokens = True

    def split(self, text: str, final: bool = False) -> tuple[str | None, str]:
        reasoning, content = super().split(text, final)
        return reasoning, without(content, RESPONSE, final)
