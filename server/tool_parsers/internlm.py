"""InternLM2.5's and InternLM3's calls (vLLM's `internlm`): `<|action_start|><|plugin|>` then
`{"name": ..., "parameters": {...}}` and `<|action_end|>`, text before them. The markers are
special tokens of its tokenizer, so the reply is read with special tokens kept. Hermes' reading
with other markers (server/tool_parsers/hermes.py); its chat template names the `<|plugin|>`
role, which is how `auto` knows it."""

from __future__ import annotations

from server.tool_parsers.hermes import HermesParser


class InternLMParser(HermesParser):
    name = "internlm"
    markers = ("<|plugin|>", "<|action_start|>")
    open, close = "<|action_start|><|plugin|>", "<|action_end|>"
    key = "parameters"
    before_close = ""
