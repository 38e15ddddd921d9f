"""IBM Granite 3.2's reasoning (vLLM's `granite`; on with `chat_template_kwargs: {"thinking":
true}`): `Here is my thought process:` reasoning, then `Here is my response:` and the answer, the
markers plain text. Some (quantized) models write "Here's" for "Here is", so either opens and
either closes; `start` and `end` are the forms the chat template asks for (a constraint's think
block uses them)."""

from __future__ import annotations

from server.markers import held
from server.reasoning.think import ThinkParser

STARTS = ("Here is my thought process:", "Here's my thought process:")
ENDS = ("Here is my response:", "Here's my response:")


class GraniteParser(ThinkParser):
    start, end = STARTS[0], ENDS[0]

    def split(self, text: str, final: bool = False) -> tuple[str | None, str]:
        opened = "" if self.in_reasoning else next((s for s in STARTS if text.startswith(s)), None)
        if opened is None:
            if not final and any(s.startswith(text) for s in STARTS):
                return "", ""  # the output may be opening its thought process
            return None, text
        body = text[len(opened) :]
        found = [(i, e) for e in ENDS if (i := body.find(e)) >= 0]
        if found:
            i, closing = min(found)
            return body[:i], body[i + len(closing) :]
        if final:
            return body, ""
        return body[: len(body) - max(held(body, e) for e in ENDS)], ""
