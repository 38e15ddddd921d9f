"""What reasoning and tool-call parsers share about markers that arrive token by token."""

from __future__ import annotations


def held(text: str, marker: str) -> int:
    """How many trailing characters of `text` could be the start of `marker` (held back from a
    stream until the next text says whether the marker follows)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def without(text: str, markers: tuple[str, ...], final: bool, hold: tuple[str, ...] = ()) -> str:
    """`text` with every whole `markers` taken out; unless `final`, less a trailing beginning of
    any of them or of `hold` (markup that may still follow). Prefix-stable: a longer text's
    result extends this one's."""
    if not final:
        text = text[: len(text) - max((held(text, m) for m in (*markers, *hold)), default=0)]
    for marker in markers:
        text = text.replace(marker, "")
    return text
