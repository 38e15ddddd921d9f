"""Tencent Hunyuan's replies (vLLM's `hunyuan_a13b`; Hunyuan-A13B and the dense 0.5B-7B models):
`<think>reasoning</think>` then the answer wrapped as `<answer>\\n...\\n</answer>` (its fast mode
writes an empty think block). The markers are plain text. The wrapper, and the line breaks just
inside it, are taken off the content; an answer written without one is content as it is."""

from __future__ import annotations

from server.markers import held
from server.reasoning.think import ThinkParser

OPEN, CLOSE = "<answer>", "</answer>"


class HunyuanParser(ThinkParser):
    def split(self, text: str, final: bool = False) -> tuple[str | None, str]:
        reasoning, content = super().split(text, final)
        return reasoning, unwrap(content, final)


def unwrap(content: str, final: bool) -> str:
    """The answer inside its `<answer>` wrapper (prefix-stable: what may still be the wrapper
    is held back unless `final`)."""
    lead = content.lstrip()
    if not lead.startswith(OPEN):
        if not final and (not lead or OPEN.startswith(lead)):
            return ""  # the wrapper may still open
        return content
    body = lead[len(OPEN) :]
    if body.startswith("\n"):
        body = body[1:]
    elif not body and not final:
        return ""
    end = body.find(CLOSE)
    if end >= 0:
        body = body[:end]
        return body[:-1] if body.endswith("\n") else body
    if final:
        return body
    return body[: len(body) - max(held(body, "\n" + CLOSE), held(body, CLOSE))]
