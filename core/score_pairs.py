"""A (query, document) pair as one input to a reranker (a one-label classifier): the model's
rerank prompt with the two texts filled in, where the model carries one (a GGUF reranker's
`tokenizer.chat_template.rerank`, llama.cpp's `{query}` / `{document}` placeholders, tokenized
as llama.cpp tokenizes it: no special tokens added, those the prompt spells read as tokens),
else the tokenizer's own pair encoding. The server's /score and /rerank and LLM.score share it."""

from __future__ import annotations

from typing import Any

QUERY, DOCUMENT = "{query}", "{document}"


class PairTooLong(ValueError):
    """The pair does not fit in `keep` tokens even with its document emptied."""


def pair_ids(
    tokenizer: Any,
    a: str,
    b: str,
    keep: int | None,
    template: str | None,
    side: str = "right",
) -> tuple[list[int], int | None]:
    """The pair's tokens, cut to `keep` (None: whole): the pair encoding's longer text shortened
    first, at its end (`side` "right") or its start ("left"); a prompt's document shortened from
    its end, the rest kept whole. With them, where
    the pair encoding's second segment starts (its first token of type 1: BERT's token types,
    core/pooling.py `type_start`), or None (a prompt, or an encoding of one type)."""
    if template is None:
        cut = {"truncation": True, "max_length": keep} if keep is not None else {}
        before = tokenizer.truncation_side  # (the tokenizer's own setting, put back at once)
        tokenizer.truncation_side = side
        try:
            encoded = tokenizer(text=a, text_pair=b, return_token_type_ids=True, **cut)
        finally:
            tokenizer.truncation_side = before
        types = encoded.get("token_type_ids") or []
        return encoded["input_ids"], types.index(1) if 1 in types else None
    filled = template.replace(QUERY, a)
    ids = tokenizer.encode(filled.replace(DOCUMENT, b), add_special_tokens=False)
    if keep is None or len(ids) <= keep:
        return ids, None
    head, _, tail = filled.partition(DOCUMENT)
    tail = tail.replace(DOCUMENT, b)
    around = [tokenizer.encode(text, add_special_tokens=False) for text in (head, tail)]
    room = keep - len(around[0]) - len(around[1])
    if room < 0:
        raise PairTooLong(
            f"the rerank prompt with its query gives {keep - room} tokens before any of the "
            f"document, more than truncate_prompt_tokens ({keep})"
        )
    return around[0] + tokenizer.encode(b, add_special_tokens=False)[:room] + around[1], None
