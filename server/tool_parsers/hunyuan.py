"""Tencent Hunyuan's calls (vLLM's `hunyuan_a13b`; Hunyuan-A13B and the dense 0.5B-7B models):
a JSON list of `{"name", "arguments"}` objects between `<tool_calls>` and `</tool_calls>`, in the
answer (server/reasoning/hunyuan.py takes the `<answer>` wrapper off first). Its chat template
writes `<tool_calls>`, which is how `auto` knows it."""

from __future__ import annotations

from server.tool_parsers.enclosed_list import EnclosedListParser


class HunyuanParser(EnclosedListParser):
    name = "hunyuan_a13b"
    start, end = "<tool_calls>", "</tool_calls>"
    markers = (start,)
