"""A response's output items built from the reply's deltas (server/reply.py), with the stream
events that announce them: reasoning -> a `reasoning` item, text -> a `message` item with one
`output_text` part, each tool call -> a `function_call` item. A new kind of output closes the
item before it; the same deltas build the stored output and the events, so they agree."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from server.protocol import Delta
from server.responses.items import new_id

Emit = Callable[..., None]  # emit(event type, **fields)


class OutputBuilder:
    def __init__(self, emit: Emit) -> None:
        self.emit = emit
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.text = ""  # the open item's text or arguments so far
        self.logprobs: list[dict[str, Any]] = []  # the open message's token log-probs
        # log-probs of tokens whose text has not shown yet (part of a multi-byte character):
        # given with the text they write
        self.pending: list[dict[str, Any]] = []
        self.call_index: int | None = None

    @property
    def index(self) -> int:
        return len(self.items) - 1

    def _start(self, item: dict[str, Any]) -> None:
        self.close()
        self.items.append(item)
        self.open, self.text, self.logprobs = item, "", []
        self.emit("response.output_item.added", output_index=self.index, item=dict(item))

    def _part(self, part: dict[str, Any]) -> None:
        self.emit(
            "response.content_part.added",
            item_id=self.open["id"],
            output_index=self.index,
            content_index=0,
            part=part,
        )

    def feed(self, delta: Delta, logprobs: list[dict[str, Any]] | None = None) -> None:
        """`logprobs`: those of this step's tokens, given with its text (output_text only)."""
        logprobs, self.pending = self.pending + (logprobs or []), []
        if not (delta.reasoning or delta.content or delta.tool_calls):
            self.pending = logprobs
            return
        if delta.reasoning:
            if self.open is None or self.open["type"] != "reasoning":
                self._start(
                    {
                        "type": "reasoning",
                        "id": new_id("rs"),
                        "summary": [],
                        "content": [],
                        "status": "in_progress",
                    }
                )
                self._part({"type": "reasoning_text", "text": ""})
            self._delta("response.reasoning_text.delta", delta.reasoning, content_index=0)
        if delta.content:
            if self.open is None or self.open["type"] != "message":
                self._start(
                    {
                        "type": "message",
                        "id": new_id("msg"),
                        "role": "assistant",
                        "status": "in_progress",
                        "content": [],
                    }
                )
                self._part({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            self.logprobs += logprobs
            self._delta(
                "response.output_text.delta", delta.content, content_index=0, logprobs=logprobs
            )
        for call in delta.tool_calls or []:
            if call.index != self.call_index:
                self.call_index = call.index
                self._start(
                    {
                        "type": "function_call",
                        "id": new_id("fc"),
                        "call_id": call.id or new_id("call"),
                        "name": call.function.name or "",
                        "arguments": "",
                        "status": "in_progress",
                    }
                )
            if call.function.arguments:
                self._delta("response.function_call_arguments.delta", call.function.arguments)

    def _delta(self, kind: str, text: str, **fields: Any) -> None:
        self.text += text
        self.emit(kind, item_id=self.open["id"], output_index=self.index, delta=text, **fields)

    def close(self, status: str = "completed") -> None:
        """Finish the open item: its `.done` events, then `output_item.done` with the whole."""
        item, self.open = self.open, None
        if item is None:
            return
        where = {"item_id": item["id"], "output_index": self.index}
        text = self.text
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            self.emit("response.reasoning_text.done", **where, content_index=0, text=text)
            self.emit("response.content_part.done", **where, content_index=0, part=part)
            item["content"] = [part]
        elif item["type"] == "message":
            lps = self.logprobs
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": lps}
            self.emit(
                "response.output_text.done", **where, content_index=0, text=text, logprobs=lps
            )
            self.emit("response.content_part.done", **where, content_index=0, part=part)
            item["content"] = [part]
        else:
            item["arguments"] = text
            self.emit(
                "response.function_call_arguments.done", **where, arguments=text, name=item["name"]
            )
        item["status"] = status
        self.emit("response.output_item.done", output_index=self.index, item=item)
