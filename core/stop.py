"""Stop strings: matched in the detokenized text across token boundaries, never shown half-sent.

Streamed text withholds its last `len(longest stop) - 1` characters until they are known not to
start a stop string (or the request ends); each search looks only at that held tail plus the new
text, so the cost per token does not grow with the output.
"""

from __future__ import annotations


class StopStrings:
    __slots__ = ("stops", "include", "hold", "pending")

    def __init__(self, stops: list[str], include_in_output: bool) -> None:
        self.stops = stops
        self.include = include_in_output
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """New text in; (text safe to emit now, whether a stop string matched)."""
        text = self.pending + delta
        best = -1
        cut = 0
        for stop in self.stops:
            i = text.find(stop)
            if i >= 0 and (best < 0 or i < best):
                best = i
                cut = i + len(stop) if self.include else i
        if best >= 0:
            self.pending = ""
            return text[:cut], True
        if len(text) <= self.hold:
            self.pending = text
            return "", False
        split = len(text) - self.hold
        self.pending = text[split:]
        return text[:split], False

    def flush(self) -> str:
        """The held tail, released when the request ends for another reason."""
        out, self.pending = self.pending, ""
        return out
