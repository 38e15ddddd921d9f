"""Qwen3 (and QwQ): `<think>...</think>` in the output, or opened by the template in the prompt
(the thinking-only 2507 models); `enable_thinking: false` closes an empty block in the prompt."""

from __future__ import annotations

from server.reasoning.think import ThinkParser


class Qwen3Parser(ThinkParser):
    assume_reasoning = False
