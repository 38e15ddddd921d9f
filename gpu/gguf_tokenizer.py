"""The tokenizer of a GGUF file, built by weir from its `tokenizer.ggml.*` entries.

A byte-level BPE vocabulary (`tokenizer.ggml.model` "gpt2": Llama 3, Qwen2, Qwen3 and most files
weir serves) is built here with `tokenizers`, as llama.cpp builds its own: the merges and tokens
as written, the text split by the regular expression `tokenizer.ggml.pre` names (the one the
merges were learned on), control tokens special and user-defined ones whole, BOS/EOS/padding
from the file's ids, BOS or EOS added to a plain encoding where the file's `add_bos_token` /
`add_eos_token` say so.

Why not transformers' GGUF converter alone: what it builds depends on its version. 5.17 (the
GPU image's) fails on a Llama file without a BOS id, names the BOS token as EOS when there is
one, and splits a Llama 3 file's text with GPT-2's expression (so "2026" is one piece, where
Llama 3 makes "202" "6"); later versions read `tokenizer.ggml.pre`. Other vocabularies
(SentencePiece "llama", unknown split names) still go to transformers; their special tokens are
then set from the file's ids, which it may have got wrong, and BOS added as the file says (5.17
left it out of a SentencePiece file's encodings). A SentencePiece file converted by llama.cpp
from a trained SentencePiece model encoded as the model's own folder does under 5.24 (8 texts,
with and without special tokens), and under 5.17 as SentencePiece itself does, leading spaces
included (docs/benchmarks.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("weir.gguf")

# Part of the key of a file's tokenizer in weir's cache (gpu/launch.py): a change to what is built
# here bumps it, so that tokenizers built before are built again.
VERSION = 2

# The split expressions by the names llama.cpp's converter writes (llama-vocab.cpp's table);
# None: GPT-2's own, which the ByteLevel pre-tokenizer applies itself.
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k's (gpt-oss, GPT-4o), as its tokenizer.json writes it
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLITS: dict[str, str | None] = {
    "gpt-2": None,
    "default": None,
    "llama-bpe": _LLAMA3,  # what llama.cpp's converter writes for Llama 3 (first: split_name)
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "falcon3": _LLAMA3,
    "pixtral": _LLAMA3,
    "smaug-bpe": _LLAMA3,
    "dbrx": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "megrez": _QWEN2,
    "gpt-4o": _GPT4O,
}

_CONTROL, _USER_DEFINED, _UNUSED = 3, 4, 5  # gguf.TokenType
# Tokens special (not text: skipped when a reply is decoded, as llama.cpp writes nothing for
# them): control tokens, and the unused ones files pad their vocabularies with ([PAD151643]).
_SPECIAL = (_CONTROL, _UNUSED)


def split_name(expression: str | None) -> str:
    """The `tokenizer.ggml.pre` name a split expression is written under (None: GPT-2's)."""
    for name, known in SPLITS.items():
        if known == expression:
            return name
    raise ValueError(f"no tokenizer.ggml.pre name for the split expression {expression!r}")


def ignores_merges(name: str) -> bool:
    """Llama 3's tokenizer takes a piece that is a whole token as it is (llama.cpp does too)."""
    return SPLITS[name] == _LLAMA3


def split_of(pre_tokenizer_json: dict) -> str:
    """The split name of a tokenizer.json's pre-tokenizer (the two forms pre_tokenizer makes)."""
    kind = pre_tokenizer_json.get("type")
    if kind == "ByteLevel" and pre_tokenizer_json.get("use_regex", True):
        return split_name(None)
    parts = pre_tokenizer_json.get("pretokenizers", []) if kind == "Sequence" else []
    if len(parts) == 2 and parts[0].get("type") == "Split" and parts[1].get("type") == "ByteLevel":
        return split_name(parts[0].get("pattern", {}).get("Regex"))
    raise ValueError(f"no tokenizer.ggml.pre name for the pre-tokenizer {pre_tokenizer_json}")


def pre_tokenizer(name: str) -> Any:
    """The `tokenizers` pre-tokenizer of a split name: the expression, then the byte alphabet."""
    from tokenizers import Regex, pre_tokenizers

    split = SPLITS[name]
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def build_byte_level(get: Callable[[str, Any], Any]) -> Any | None:
    """A PreTrainedTokenizerFast for a byte-level BPE file whose split weir knows, else None.
    `get(key, default)` reads the file's metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pre = get("tokenizer.ggml.pre", "default")
    if get("tokenizer.ggml.model", None) != "gpt2":
        return None
    if pre not in SPLITS:
        log.warning("tokenizer.ggml.pre %r is not one weir knows; transformers builds it", pre)
        return None
    tokens = list(get("tokenizer.ggml.tokens", None))
    types = list(get("tokenizer.ggml.token_type", None) or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in get("tokenizer.ggml.merges", None) or []]
    vocab: dict[str, int] = {}
    for i, text in enumerate(tokens):
        vocab.setdefault(text, i)
    tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=ignores_merges(pre)))
    tok.pre_tokenizer = pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens(
        [
            AddedToken(t, special=k in _SPECIAL, normalized=False)
            for i, (t, k) in enumerate(zip(tokens, types))
            if k in (*_SPECIAL, _USER_DEFINED) and vocab[t] == i
        ]
    )
    specials = special_tokens(get, tokens)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, clean_up_tokenization_spaces=False, **specials
    )
    _post_process(fast, get, specials)
    return fast


def build_wordpiece(get: Callable[[str, Any], Any]) -> Any | None:
    """A PreTrainedTokenizerFast for BERT's WordPiece vocabulary ("bert"), else None. llama.cpp's
    converter writes a word's first piece with a phantom space ("▁play") and a continuation
    bare ("ing", transformers' "##ing"), control tokens as they are: undone here, and rebuilt
    as transformers builds BERT's: its normalizer (lowercased unless the file says not), its
    split, [CLS] A [SEP] and [CLS] A [SEP] B [SEP] with B of token type 1."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    if get("tokenizer.ggml.model", None) != "bert":
        return None
    tokens = list(get("tokenizer.ggml.tokens", None))
    types = list(get("tokenizer.ggml.token_type", None) or [1] * len(tokens))
    vocab: dict[str, int] = {}
    for i, (text, kind) in enumerate(zip(tokens, types)):
        if kind != _CONTROL:
            text = text[1:] if text.startswith("▁") else "##" + text
        vocab.setdefault(text, i)
    specials = special_tokens(get, tokens)
    # (the converter writes [CLS] as BOS and [SEP] as EOS and as the separator: its spelling)
    cls = tokens[int(get("tokenizer.ggml.bos_token_id", vocab.get("[CLS]", 101)))]
    sep = tokens[int(get("tokenizer.ggml.seperator_token_id", vocab.get("[SEP]", 102)))]
    tok = Tokenizer(models.WordPiece(vocab, unk_token=specials.get("unk_token", "[UNK]")))
    lower = bool(get("tokenizer.ggml.normalizer.lowercase", True))
    tok.normalizer = normalizers.BertNormalizer(lowercase=lower)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(
        [AddedToken(t, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL]
    )
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])],
    )
    mask = get("tokenizer.ggml.mask_token_id", None)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        cls_token=cls,
        sep_token=sep,
        mask_token=tokens[int(mask)] if mask is not None else None,
        **{k: v for k, v in specials.items() if k in ("unk_token", "pad_token")},
    )


def build_unigram(get: Callable[[str, Any], Any]) -> Any | None:
    """A PreTrainedTokenizerFast for XLM-RoBERTa's SentencePiece vocabulary ("t5": pieces and
    their scores), else None, as transformers 5 converts XLM-RoBERTa's SentencePiece model: the
    file's precompiled normalization, the text split at whitespace where the file removes
    extra whitespace, a phantom space before each word unless it says not, <s> A </s> and <s>
    A </s></s> B </s>."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    if get("tokenizer.ggml.model", None) != "t5":
        return None
    tokens = list(get("tokenizer.ggml.tokens", None))
    types = list(get("tokenizer.ggml.token_type", None) or [1] * len(tokens))
    scores = list(get("tokenizer.ggml.scores", None) or [0.0] * len(tokens))
    unk = int(get("tokenizer.ggml.unknown_token_id", 3))
    tok = Tokenizer(models.Unigram(list(zip(tokens, map(float, scores))), unk_id=unk))
    charsmap = get("tokenizer.ggml.precompiled_charsmap", None)
    if charsmap:
        tok.normalizer = normalizers.Precompiled(bytes(int(b) & 0xFF for b in charsmap))
    prepend = "always" if get("tokenizer.ggml.add_space_prefix", True) else "never"
    split = pre_tokenizers.Metaspace(prepend_scheme=prepend)
    if get("tokenizer.ggml.remove_extra_whitespaces", True):  # no leading, trailing or double
        split = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), split])
    tok.pre_tokenizer = split
    tok.decoder = decoders.Metaspace(prepend_scheme=prepend)
    tok.add_special_tokens(
        [AddedToken(t, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL]
    )
    specials = special_tokens(get, tokens)
    bos, eos = specials.get("bos_token", "<s>"), specials.get("eos_token", "</s>")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}",
        pair=f"{bos} $A {eos} {eos} $B {eos}",
        special_tokens=[(bos, tokens.index(bos)), (eos, tokens.index(eos))],
    )
    mask = get("tokenizer.ggml.mask_token_id", None)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        cls_token=bos,
        sep_token=eos,
        mask_token=tokens[int(mask)] if mask is not None else None,
        **specials,
    )


def special_tokens(get: Callable[[str, Any], Any], tokens: list[str]) -> dict[str, str]:
    """bos/eos/unk/pad tokens by the file's ids (those it names and that exist)."""
    out = {}
    for name, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        i = get(f"tokenizer.ggml.{key}", None)
        if i is not None and 0 <= int(i) < len(tokens):
            out[name] = tokens[int(i)]
    return out


def set_special_tokens(tok: Any, get: Callable[[str, Any], Any]) -> None:
    """Put the file's BOS/EOS/padding on a tokenizer transformers built, and add BOS/EOS to a
    plain encoding as the file says (see the module note: 5.17 builds a SentencePiece file's
    tokenizer without the BOS its `add_bos_token` asks for)."""
    tokens = list(get("tokenizer.ggml.tokens", None) or [])
    specials = special_tokens(get, tokens)
    for name, text in specials.items():
        if getattr(tok, name, None) != text:
            setattr(tok, name, text)
    types = list(get("tokenizer.ggml.token_type", None) or [])
    unused = [t for t, k in zip(tokens, types) if k == _UNUSED]
    if unused:  # not text: skipped when decoding (the converter had made them text)
        from tokenizers import AddedToken

        tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in unused], True)
    _post_process(tok, get, specials)


def bert_pairs(tok: Any) -> None:
    """BERT's template on a tokenizer whose BOS is its [CLS] and EOS its [SEP] (ModernBERT's
    file): [CLS] A [SEP], and a pair's second text then its [SEP] of token type 1."""
    from tokenizers import processors

    cls, sep = tok.bos_token, tok.eos_token
    ids = tok.convert_tokens_to_ids
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, ids(cls)), (sep, ids(sep))],
    )


def _post_process(tok: Any, get: Callable[[str, Any], Any], specials: dict[str, str]) -> None:
    """BOS and EOS added to a plain encoding as the file says (Llama 3: BOS, Qwen: neither)."""
    from tokenizers import processors

    bos = specials.get("bos_token") if get("tokenizer.ggml.add_bos_token", False) else None
    eos = specials.get("eos_token") if get("tokenizer.ggml.add_eos_token", False) else None
    if bos is None and eos is None:
        return
    first = " ".join(x for x in (bos, "$A", eos) if x)
    pair = " ".join(x for x in (bos, "$A", eos, bos, "$B:1", eos) if x)
    ids = tok.convert_tokens_to_ids
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=first,
        pair=pair,
        special_tokens=[(t, ids(t)) for t in {bos, eos} if t],
    )
