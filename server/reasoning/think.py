"""The think-marker form most reasoning models share: `<think>reasoning</think>answer`."""

from __future__ import annotations

from server.markers import held


class ThinkParser:
    start = "<think>"
    end = "</think>"
    # Whether the output starts inside the reasoning when the prompt does not say so itself.
    assume_reasoning = False

    def __init__(self, prompt_text: str = "") -> None:
        # A template that opens the think block in the prompt (DeepSeek-R1's, Qwen3 thinking
        # models') leaves the output starting inside it; one that closed it (Qwen3 with
        # enable_thinking false writes an empty block) leaves no reasoning to find.
        opened, closed = prompt_text.rfind(self.start), prompt_text.rfind(self.end)
        self.in_reasoning = opened > closed or (self.assume_reasoning and opened == closed == -1)
        # The template ended the prompt with a closed (empty) block: thinking is off.
        self.thinking_off = prompt_text.rstrip().endswith(self.end)

    def split(self, text: str, final: bool = False) -> tuple[str | None, str]:
        """(reasoning, content): reasoning None when the output has none. Text that may still
        turn out to be part of a marker is held back until `final`."""
        if self.in_reasoning:
            body = text
            if body.startswith(self.start):  # the model wrote the opening marker anyway
                body = body[len(self.start) :]
            elif not final and self.start.startswith(body) and body:
                return "", ""
        elif text.startswith(self.start):
            body = text[len(self.start) :]
        elif not final and self.start.startswith(text):
            return "", ""  # the output may be opening a think block
        else:
            return None, text
        i = body.find(self.end)
        if i >= 0:
            return body[:i], body[i + len(self.end) :]
        if final:
            return body, ""
        return body[: len(body) - held(body, self.end)], ""


class ReasoningStream:
    """One choice's streamed reasoning and content: each call gets the whole text so far and
    returns what is new since the last call."""

    def __init__(self, parser: ThinkParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent_reasoning = 0
        self.sent_content = 0

    def feed(self, new_text: str, final: bool = False) -> tuple[str, str]:
        self.text += new_text
        reasoning, content = self.parser.split(self.text, final)
        reasoning = reasoning or ""
        delta_r = reasoning[self.sent_reasoning :]
        delta_c = content[self.sent_content :]
        self.sent_reasoning, self.sent_content = len(reasoning), len(content)
        return delta_r, delta_c
