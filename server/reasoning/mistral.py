"""Magistral (Mistral's reasoning models, 2507 and later): `[THINK]reasoning[/THINK]answer`, the
two markers special tokens of its tokenizer, so the reply is decoded with special tokens kept
(`special_tokens`) and the markers stay out of both parts. No opening marker: no reasoning."""

from __future__ import annotations

from server.reasoning.think import ThinkParser


class MistralParser(ThinkParser):
    start = "[THINK]"
    end = "[/THINK]"
    special_tokens = True
