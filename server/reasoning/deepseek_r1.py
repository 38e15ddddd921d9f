"""DeepSeek-R1 and its distills: the output starts inside the reasoning (the template opens
`<think>`, or older ones leave the model to) and `</think>` ends it; no end marker means the
whole output was reasoning."""

from __future__ import annotations

from server.reasoning.think import ThinkParser


class DeepSeekR1Parser(ThinkParser):
    assume_reasoning = True
