"""Cohere's Command R7B and Command A calls (vLLM's `command`; llama.cpp's "Command R7B" format):
after its tool plan, `<|START_ACTION|>` and a JSON list of `{"tool_call_id", "tool_name",
"parameters"}` objects, then `<|END_ACTION|>`. The markers are special tokens of its tokenizer,
so the reply is read with special tokens kept: the answer's own `<|START_RESPONSE|>` /
`<|END_RESPONSE|>` (and the tool plan's thinking markers, where no reasoning parser took them)
are taken out of the content. Its chat template writes `<|START_ACTION|>`, which is how `auto`
knows it."""

from __future__ import annotations

from typing import Any

from server.tool_parsers.base import Call, call_from
from server.tool_parsers.enclosed_list import EnclosedListParser


class CommandParser(EnclosedListParser):
    name = "command"
    start, end = "<|START_ACTION|>", "<|END_ACTION|>"
    markers = (start,)
    # the answer's and the tool plan's markup: never content
    markup = ("<|START_RESPONSE|>", "<|END_RESPONSE|>", "<|START_THINKING|>", "<|END_THINKING|>")
    keys = {"key": "parameters", "name_key": "tool_name", "id_key": "tool_call_id"}

    def item_call(self, item: Any, complete: bool) -> Call | None:
        """{tool_call_id, tool_name, parameters} as a Call (None without a whole name)."""
        if not isinstance(item, dict) or "tool_name" not in item:
            return None
        obj = {"name": item["tool_name"]}
        if "parameters" in item:
            obj["arguments"] = item["parameters"]
        return call_from(obj, complete)
