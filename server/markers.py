"""What reasoning and tool-call parsers share about markers that arrive token by token."""

from __future__ import annotations


def held(text: str, marker: str) -> int:
    """How many trailing characters of `text` could be the start of `marker` (held back from a
    stream until the next text says whether the marker follows)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
