"""The tiny models' tokenizer: a byte-level BPE trained on made-up text (words of several scripts,
accents and emoji, so that any text encodes and decodes as a real model's would), with a ChatML
chat template. gpu/tiny_model.py builds the models around it; tests build their own with it."""

from __future__ import annotations

import random

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_WORDS = (
    "the a an of to and in is it you that he was for on are with as his they be at one have this "
    "from or had by hot word but what some we can out other were all there when up use your how "
    "said each she which do their time if will way about many then them write would like so these "
    "her long make thing see him two has look more day could go come did number sound no most "
    "people my over know water than call first who may down side been now find any new work part "
    "take get place made live where after back little only round man year came show every good me "
    "give our under name very through just form sentence great think say help low line differ turn "
    "cause much mean before move right boy old too same tell does set three want air well "
    "also play "
    "server token model stream engine cache block batch request hello world weir river flow "
    "café naïve résumé über straße façade jalapeño crème brûlée "
    "你好 世界 模型 缓存 请求 数据 こんにちは ありがとう 東京 안녕하세요 감사합니다 "
    "Привет мир данные γειά σου κόσμε مرحبا שלום "
    "😀 🎉 🚀 👍🏽 🇫🇷 ❤️ 🤖 🌊"
).split()


def corpus(n_lines: int = 4000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 16))]
        line = " ".join(words)
        if rng.random() < 0.3:
            line = line.capitalize() + rng.choice([".", "!", "?", ",", ":"])
        if rng.random() < 0.1:
            line += f" {rng.randint(0, 10000)}"
        lines.append(line)
    return lines


def train_tokenizer(vocab_size: int = 1024, seed: int = 0, pretokenizer: str = "gpt-2"):
    """A byte-level BPE tokenizer (every byte has a token, so any text encodes), its text split
    as the `tokenizer.ggml.pre` name says (gpu/gguf_tokenizer.py: "gpt-2", "llama-bpe" as
    Llama 3 splits, "qwen2" as Qwen does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from gpu.gguf_tokenizer import ignores_merges, pre_tokenizer

    tok = Tokenizer(models.BPE(ignore_merges=ignores_merges(pretokenizer)))
    tok.pre_tokenizer = pre_tokenizer(pretokenizer)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed=seed), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML,
    )
