"""A Hugging Face directory's byte-level BPE tokenizer written into a GGUF file as llama.cpp's
converter writes it (`tokenizer.ggml.*`: its tokens and their types, merges, special tokens and
chat template), for the files gpu/quant/gguf_write.py and the tests write."""

from __future__ import annotations

import json
from pathlib import Path

import gguf

from gpu.gguf_tokenizer import split_of


def write_tokenizer(w: gguf.GGUFWriter, hf_dir: Path, config: dict, bert: bool = False) -> None:
    """`hf_dir`'s byte-level BPE tokenizer as `tokenizer.ggml.*` entries; `bert`: its [CLS] and
    [SEP] written as BOS and EOS, both added, as llama.cpp's converter writes ModernBERT's."""
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    if tok["model"]["type"] != "BPE":
        raise ValueError("gguf_write: only BPE tokenizers are written")
    vocab = dict(tok["model"]["vocab"])
    special = {a["content"]: a["id"] for a in tok.get("added_tokens", [])}
    added = {a["content"] for a in tok.get("added_tokens", []) if not a.get("special")}
    vocab.update(special)
    size = config["vocab_size"]
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [gguf.TokenType.UNUSED] * size
    for text, i in vocab.items():
        if i < size:
            tokens[i] = text
            types[i] = (
                gguf.TokenType.USER_DEFINED
                if text in added
                else gguf.TokenType.CONTROL
                if text in special
                else gguf.TokenType.NORMAL
            )
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(split_of(tok["pre_tokenizer"]))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    tcfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    for key, add in (
        ("sep_token" if bert else "eos_token", w.add_eos_token_id),
        ("pad_token", w.add_pad_token_id),
        ("cls_token" if bert else "bos_token", w.add_bos_token_id),
    ):
        value = tcfg.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if value in vocab:
            add(vocab[value])
    w.add_add_bos_token(bert)
    if bert:
        w.add_add_eos_token(True)
    template = tcfg.get("chat_template")
    jinja = hf_dir / "chat_template.jinja"
    if not template and jinja.exists():
        template = jinja.read_text()
    if template:
        w.add_chat_template(template)
