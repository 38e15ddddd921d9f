"""Stop strings: matched in the detokenized text across token boundaries, never shown half-sent.

Streamed text withholds its last `len(longest stop) - 1` characters until they are known not to
start a stop string (or the request ends); each search looks only at that held tail plus the new
text, so the cost per token does not grow with the output.

As vLLM does, a stop string counts only once `min_tokens` tokens are out: it must end in the
text of a later token (it may start earlier). Until then the text is passed (and held) without
a search, and `floor` marks how much of the held tail came before that point.
"""

from __future__ import annotations


class StopStrings:
    __slots__ = ("stops", "include", "hold", "pending", "floor")

    def __init__(self, stops: list[str], include_in_output: bool) -> None:
        self.stops = stops
        self.include = include_in_output
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending = ""
        # A match must end past this many characters of `pending` (text of the first
        # min_tokens tokens, where no stop string may end).
        self.floor = 0

    def feed(self, delta: str, armed: bool = True) -> tuple[str, str | None]:
        """New text in; (text safe to emit now, the stop string that matched or None). `armed`:
        the text is past min_tokens, so a stop string may end in it."""
        text = self.pending + delta
        best = -1
        cut = 0
        found = None
        if armed:
            floor = self.floor
            for stop in self.stops:
                i = text.find(stop, max(0, floor - len(stop) + 1))
                if i >= 0 and (best < 0 or i < best):
                    best, found = i, stop
                    cut = i + len(stop) if self.include else i
        if best >= 0:
            self.pending = ""
            self.floor = 0
            return text[:cut], found
        if len(text) <= self.hold:
            self.pending = text
            if not armed:
                self.floor = len(text)
            return "", None
        split = len(text) - self.hold
        self.pending = text[split:]
        self.floor = max(0, self.floor - split) if armed else self.hold
        return text[:split], None

    def flush(self) -> str:
        """The held tail, released when the request ends for another reason."""
        out, self.pending = self.pending, ""
        self.floor = 0
        return out
