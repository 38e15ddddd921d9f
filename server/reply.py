"""One chat choice's reply shaped from the model's text: reasoning split off first (a reasoning
parser), then tool calls parsed from the rest (a tool-call parser), the remainder as content.
The same parsers give the whole reply and, as differences between successive parses, the
streamed deltas, so the two cannot disagree."""

from __future__ import annotations

from server.protocol import Delta, ResponseMessage
from server.reasoning import ReasoningStream, ThinkParser
from server.tool_parsers import ToolParser, ToolStream, tool_calls


def finish_reason(reason: str | None, has_calls: bool, named: bool = False) -> str | None:
    """ "tool_calls" for a reply that ended with calls; "stop" as it is for a call the request
    named (tool_choice naming a function), as OpenAI answers it and vLLM (since its #25054)."""
    return "tool_calls" if has_calls and reason == "stop" and not named else reason


class Reply:
    def __init__(
        self,
        thinker: type[ThinkParser] | None,
        prompt_text: str,
        tools: ToolParser | None,
        named: bool = False,
    ) -> None:
        """`named`: tool_choice named the function (finish_reason)."""
        self.thinker = thinker(prompt_text) if thinker else None
        self.tools = tools
        self.named = named
        self.reasoning = ReasoningStream(self.thinker) if self.thinker else None
        self.calls = ToolStream(tools) if tools else None

    @property
    def plain(self) -> bool:
        return self.thinker is None and self.tools is None

    def whole(self, text: str, reason: str | None) -> tuple[ResponseMessage, str | None]:
        if self.plain:
            return ResponseMessage("assistant", text), reason
        think: str | None = None
        if self.thinker is not None:
            think, text = self.thinker.split(text, final=True)
        message = ResponseMessage("assistant", text or None)
        if self.thinker is not None:
            message.reasoning = message.reasoning_content = think
        if self.tools is not None:
            parsed = self.tools.parse(text, final=True)
            message.content = parsed.content or None
            message.tool_calls = tool_calls(parsed)
            return message, finish_reason(reason, bool(parsed.calls), self.named)
        return message, reason

    def delta(self, new_text: str, final: bool) -> Delta:
        """What is new in this choice; fields left None when nothing is."""
        if self.plain:
            return Delta(content=new_text or None)
        think, text = "", new_text
        if self.reasoning is not None:
            think, text = self.reasoning.feed(new_text, final)
        delta = Delta(reasoning=think or None, reasoning_content=think or None)
        if self.calls is not None:
            text, calls = self.calls.feed(text, final)
            delta.tool_calls = calls or None
        delta.content = text or None
        return delta

    def reasoning_text(self, text: str | None = None) -> str:
        """The part of the output that was reasoning, its markers included (the whole text
        streamed so far when `text` is None)."""
        if self.thinker is None:
            return ""
        text = self.reasoning.text if text is None else text
        if hasattr(self.thinker, "reasoning_length"):  # harmony: the content is no suffix
            return text[: self.thinker.reasoning_length(text)]
        think, content = self.thinker.split(text, final=True)
        return "" if think is None else text[: len(text) - len(content)]

    def finish(self, reason: str | None) -> str | None:
        """After the final delta: "tool_calls" where the final parse has calls (a call cut
        short and dropped there is no reason, though its start was streamed); a named call's
        "stop" (finish_reason)."""
        return finish_reason(reason, bool(self.calls and self.calls.parsed.calls), self.named)
