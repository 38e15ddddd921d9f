"""A GGUF file's tokenizer (gpu/gguf_tokenizer.py): byte-level BPE vocabularies built by weir from
the `tokenizer.ggml.*` entries, split as `tokenizer.ggml.pre` names, checked against the Hugging
Face tokenizer the file was written from; BOS added as the file says, also after the engine's
save and the server's load; other vocabularies left to transformers with the file's special
tokens."""

from __future__ import annotations

import pytest

from gpu.gguf_file import GgufCheckpoint
from gpu.gguf_tokenizer import build_byte_level
from gpu.quant.gguf_write import uniform, write_gguf
from gpu.tiny_model import build_tiny_model

SHAPE = dict(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, num_layers=1)
TEXTS = [
    "the river flows over the stone",
    " héllo 12345 and 2026, 7 or 88",
    "a\n\nb  c\t\td\r\nline   ",
    "I'm sure they'LL say don't",
    "你好 世界 😀 🇫🇷 Привет",
    "x=1+2;  y   == {'k': [3]}",
    "<|im_start|>user\nhi<|im_end|>",
]
SPLITS = ("gpt-2", "llama-bpe", "qwen2", "gpt-4o")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """{split: (Hugging Face folder, GGUF file written from it)}"""
    root = tmp_path_factory.mktemp("gguf-tok")
    out = {}
    for split in SPLITS:
        arch = "qwen3" if split == "qwen2" else "llama"
        hf = build_tiny_model(root / split, arch, pretokenizer=split, **SHAPE)
        out[split] = hf, write_gguf(hf, root / f"{split}.gguf", uniform("f32"))
    return out


def ids(tok, text, special=True):
    return tok(text, add_special_tokens=special).input_ids


@pytest.mark.parametrize("split", SPLITS)
def test_the_file_tokenizes_as_the_folder_it_was_written_from(made, split):
    from transformers import AutoTokenizer

    hf, path = made[split]
    ckpt = GgufCheckpoint(path)
    assert ckpt.get("tokenizer.ggml.pre") == split
    ours, theirs = ckpt.tokenizer(), AutoTokenizer.from_pretrained(hf)
    for text in TEXTS:
        assert ids(ours, text) == ids(theirs, text), text
        assert ours.decode(ids(ours, text)) == text
    assert ours.eos_token == theirs.eos_token == "<|im_end|>"
    assert ours.pad_token == theirs.pad_token
    assert ids(ours, "<|im_end|>") == [ours.eos_token_id]


def test_the_split_is_the_one_the_file_names(made):
    """The vocabularies split digits differently (GPT-2 keeps a run whole, Llama 3 and o200k cut
    it in threes, Qwen in ones; o200k keeps a contraction on its word), so a tokenizer that
    ignored `tokenizer.ggml.pre` would fail the comparison above: the pieces themselves, from
    each file's tokenizer."""
    pieces = {}
    for split, (_, path) in made.items():
        pre = GgufCheckpoint(path).tokenizer().backend_tokenizer.pre_tokenizer
        pieces[split] = [p for p, _ in pre.pre_tokenize_str("a 12345 We're")]
    assert pieces == {
        "gpt-2": ["a", "Ġ12345", "ĠWe", "'re"],
        "llama-bpe": ["a", "Ġ", "123", "45", "ĠWe", "'re"],
        "qwen2": ["a", "Ġ", "1", "2", "3", "4", "5", "ĠWe", "'re"],
        "gpt-4o": ["a", "Ġ", "123", "45", "ĠWe're"],  # o200k keeps a contraction on its word
    }


def overridden(path, **entries):
    """The file's metadata `get`, some tokenizer.ggml entries replaced."""
    ckpt = GgufCheckpoint(path)
    keys = {f"tokenizer.ggml.{k}": v for k, v in entries.items()}
    read = ckpt.get

    def get(key, default=None):
        return keys[key] if key in keys else read(key, default)

    return ckpt, get


def test_bos_added_where_the_file_says_and_kept_through_save_and_load(made, tmp_path):
    from transformers import AutoTokenizer

    _, path = made["llama-bpe"]
    ckpt, get = overridden(path, bos_token_id=0, add_bos_token=True)  # 0: <|endoftext|>
    tok = build_byte_level(get)
    plain = ids(tok, TEXTS[0], special=False)
    assert tok.bos_token == "<|endoftext|>" and tok.bos_token_id == 0
    assert ids(tok, TEXTS[0]) == [0, *plain]
    # the engine saves the tokenizer and the server loads it from that folder
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert ids(again, TEXTS[0]) == [0, *plain]
    assert ids(again, TEXTS[0], special=False) == plain
    # add_bos_token false (Qwen's files): nothing added
    _, get = overridden(path, bos_token_id=0, add_bos_token=False)
    assert ids(build_byte_level(get), TEXTS[0]) == plain


def test_special_token_ids_come_from_the_file(made):
    """The file's EOS id decides, whatever name the vocabulary's config gave."""
    _, path = made["qwen2"]
    ckpt, get = overridden(path, eos_token_id=0)
    tok = build_byte_level(get)
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 0


def test_end_of_turn_and_message_tokens_end_generation(made, monkeypatch):
    """A file's eot and eom ids (Llama 3's <|eot_id|>, <|eom_id|>) end generation beside its
    EOS, as llama.cpp reads them (they had been ignored: an instruct model ran to max_tokens)."""
    from gpu.loader import eos_token_ids

    _, path = made["qwen2"]
    ckpt, get = overridden(path, eos_token_id=2, eot_token_id=7, eom_token_id=9)
    monkeypatch.setattr(ckpt, "get", get)
    assert eos_token_ids(path.parent, ckpt.config()) == {2, 7, 9}
    ckpt, get = overridden(path, eos_token_id=2, eot_token_id=2)
    monkeypatch.setattr(ckpt, "get", get)
    assert ckpt.config().eos_token_id == 2


def test_unused_tokens_are_no_text(made):
    """Tokens a file marks unused (the [PAD...] rows vocabularies are padded with) write nothing
    in a reply, as llama.cpp's token_to_piece gives them (they had been decoded as text)."""
    _, path = made["qwen2"]
    ckpt = GgufCheckpoint(path)
    types = list(ckpt.get("tokenizer.ggml.token_type"))
    types[300] = 5  # gguf.TokenType.UNUSED
    tok = build_byte_level(overridden(path, token_type=types)[1])
    plain = build_byte_level(overridden(path)[1])
    assert tok.decode([40, 300, 41], skip_special_tokens=True) == plain.decode([40, 41])


def test_an_unknown_split_goes_to_transformers_with_the_files_special_tokens(made, monkeypatch):
    _, path = made["qwen2"]  # a Qwen3 file: transformers 5.17 fails on Llama files without BOS
    ckpt, get = overridden(path, pre="some-new-split")
    assert build_byte_level(get) is None
    monkeypatch.setattr(ckpt, "get", get)
    tok = ckpt.tokenizer()  # transformers' converter (which reads the name itself, or not)
    assert tok.eos_token == "<|im_end|>"
    assert ids(tok, TEXTS[0], special=False) == ids(build_byte_level(overridden(path)[1]), TEXTS[0])


def test_a_sentencepiece_file_adds_its_bos(tmp_path):
    """A SentencePiece vocabulary (`tokenizer.ggml.model` "llama": Llama 2, Mistral, TinyLlama)
    is built by transformers; its BOS, EOS and `add_bos_token` come from the file (transformers
    5.17 built it without the BOS: a completion prompt would start without it)."""
    import gguf
    import numpy as np

    words = ["the", "river", "flows", "over", "stone"]
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["▁"]
    pieces += [f"▁{w}" for w in words] + list("abcdefghijklmnopqrstuvwxyz")  # no merges to them
    types = [2, 3, 3] + [6] * 256 + [1] * (len(pieces) - 259)  # unknown, control, byte, normal
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces) - 259)]
    path = tmp_path / "spm.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(pieces)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_tensor("token_embd.weight", np.zeros((len(pieces), 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = GgufCheckpoint(path).tokenizer()
    assert (tok.bos_token, tok.eos_token, tok.unk_token) == ("<s>", "</s>", "<unk>")
    plain = ids(tok, "the river flows", special=False)
    assert plain and 1 not in plain and tok.decode(plain) == "the river flows"
    assert ids(tok, "the river flows") == [1, *plain]
