"""Incremental detokenization: streamed deltas concatenate to `tokenizer.decode(all_ids)`."""

from __future__ import annotations

import random

import pytest

from core.detokenizer import Detokenizer

TEXTS = [
    "plain ascii text, with punctuation!",
    "café naïve résumé crème brûlée façade",
    "你好世界，模型缓存请求。東京 こんにちは 안녕하세요",
    "emoji 😀🎉🚀 👍🏽 flags 🇫🇷🇯🇵 family 👨‍👩‍👧‍👦 heart ❤️",
    "mixed: Привет 🌊 γειά σου 🤖 شلوم 12345 ü",
]


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir("qwen3")).backend_tokenizer


def stream(tokenizer, prompt_ids, ids):
    d = Detokenizer(tokenizer, prompt_ids)
    pieces = [d.step(t) for t in ids]
    return "".join(pieces) + d.flush(), pieces


@pytest.mark.parametrize("text", TEXTS)
def test_stream_matches_full_decode(tokenizer, text):
    prompt = tokenizer.encode("User says: ").ids
    ids = tokenizer.encode(text).ids
    got, pieces = stream(tokenizer, prompt, ids)
    assert got == tokenizer.decode(ids) == text
    # Characters made of several byte-level tokens are held back, never emitted half-done.
    assert all("\ufffd" not in p for p in pieces)


def test_multibyte_characters_really_split_across_tokens(tokenizer):
    # The tokenizer's vocabulary is small, so an emoji takes several tokens: the case that matters.
    ids = tokenizer.encode("🇫🇷👨‍👩‍👧‍👦").ids
    assert len(ids) > 2
    d = Detokenizer(tokenizer, [])
    pieces = [d.step(t) for t in ids]
    assert "" in pieces  # some steps completed no character and emitted nothing


def test_random_token_streams_match_decode(tokenizer):
    # Model output need not be valid UTF-8; the stream must still agree with decode() at the end.
    rng = random.Random(0)
    vocab = tokenizer.get_vocab_size()
    for _ in range(50):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(0, 10))]
        ids = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))]
        got, _ = stream(tokenizer, prompt, ids)
        assert got == tokenizer.decode(ids)


def test_ending_mid_character_flushes_like_decode(tokenizer):
    ids = tokenizer.encode("ok 🦀").ids  # not in the training text: one token per byte
    cut = ids[:-1]  # the crab's last byte never arrives
    assert tokenizer.decode(cut).endswith("\ufffd")
    got, _ = stream(tokenizer, [], cut)
    assert got == tokenizer.decode(cut)
    assert got.startswith("ok")


def test_special_tokens_are_skipped(tokenizer):
    end = tokenizer.token_to_id("<|im_end|>")
    ids = tokenizer.encode("hello").ids + [end]
    got, _ = stream(tokenizer, [], ids)
    assert got == "hello"
