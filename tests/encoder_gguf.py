"""GGUF files of tests/encoder_models.py's encoders (and tests/jina_models.py's), written as
llama.cpp's convert_hf_to_gguf.py writes them: "bert" (BERT, XLM-RoBERTa), "nomic-bert",
"jina-bert-v2" and "modern-bert" (ModernBERT)."""

from __future__ import annotations

import json
from pathlib import Path


def write_encoder_gguf(
    hf_dir: str | Path, out: str | Path, fmt: str = "f32", pooling: bool = True
) -> Path:
    """An encoder folder of build_encoder's written as llama.cpp's convert_hf_to_gguf.py writes
    one ("bert"; NomicBERT's "nomic-bert": its base, its fused Q/K/V; JinaBERT's
    "jina-bert-v2": its fused gate and up product as ffn_up): its names, BERT's
    vocabulary with phantom spaces (a word's first piece
    "\u2581play", a continuation bare) or XLM-RoBERTa's pieces with their scores ("t5"), the
    RoBERTa family's first pad + 1 position rows left out, the sentence-transformers pooling
    (`pooling` false: none written), an XLM-RoBERTa classifier's head as `cls` and
    `cls.output`; matrices in `fmt` (weir's quantizers), norms, biases, the small tables and the
    head F32."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file
    from transformers import AutoConfig

    from gpu.encoder_loader import checkpoint_name
    from gpu.gguf_names import ENCODER_LAYER, ENCODER_TOP, JINA_LAYER, NOMIC_LAYER, NOMIC_TOP
    from gpu.models.encoder_spec import EncoderSpec
    from server.embedding_config import sentence_transformers_pooling

    hf_dir, out = Path(hf_dir), Path(out)
    config = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    nomic = config["model_type"] == "nomic_bert"
    jina = config.get("position_embedding_type") == "alibi"  # (JinaBERT: tests/jina_models.py)
    bert = config["model_type"] == "bert" or nomic  # (NomicBERT's vocabulary is BERT's)
    arch = "nomic-bert" if nomic else "jina-bert-v2" if jina else "bert"
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(config["num_hidden_layers"])
    offset = 0 if bert else config["pad_token_id"] + 1  # RoBERTa's rows never read
    w.add_context_length(config["max_position_embeddings"] - offset)
    if nomic:
        w.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_layer_norm_eps(config["layer_norm_eps"])
    w.add_causal_attention(False)
    kinds = {"mean": gguf.PoolingType.MEAN, "cls": gguf.PoolingType.CLS}
    kind = sentence_transformers_pooling(hf_dir) if pooling else None
    if kind is not None:
        w.add_pooling_type(kinds[kind])
    w.add_token_type_count(config["type_vocab_size"])
    specials = {t["content"]: t["id"] for t in tok["added_tokens"]}
    if bert:
        vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
        tokens = [
            t if t in specials else t[2:] if t.startswith("##") else "\u2581" + t for t, _ in vocab
        ]
        types = [3 if t in specials else 1 for t, _ in vocab]
        pad = config["vocab_size"] - len(tokens)  # the table's rows past the vocabulary's
        tokens += [f"[PAD{i}]" for i in range(len(tokens), config["vocab_size"])]
        types += [5] * pad  # (unused, as the converter writes them)
        w.add_tokenizer_model("bert")
        w.add_token_list(tokens)
        w.add_token_types(types)
        ids = dict(bos="[CLS]", eos="[SEP]", unk="[UNK]", sep="[SEP]", pad="[PAD]", mask="[MASK]")
    else:
        pieces = tok["model"]["vocab"]
        w.add_tokenizer_model("t5")
        w.add_token_list([p for p, _ in pieces])
        w.add_token_scores([float(s) for _, s in pieces])
        w.add_token_types([3 if p in specials else 1 for p, _ in pieces])
        w.add_add_space_prefix(True)
        w.add_remove_extra_whitespaces(True)
        ids = dict(bos="<s>", eos="</s>", unk="<unk>", sep="</s>", pad="<pad>", mask="<mask>")
    w.add_bos_token_id(specials[ids["bos"]])
    w.add_eos_token_id(specials[ids["eos"]])
    w.add_unk_token_id(specials[ids["unk"]])
    w.add_sep_token_id(specials[ids["sep"]])
    w.add_pad_token_id(specials[ids["pad"]])
    w.add_mask_token_id(specials[ids["mask"]])
    top = {v: k for k, v in (NOMIC_TOP if nomic else ENCODER_TOP).items()}
    names = NOMIC_LAYER if nomic else JINA_LAYER if jina else ENCODER_LAYER
    layer = {v: k for k, v in names.items()}
    spec = EncoderSpec.from_hf_config(AutoConfig.from_pretrained(hf_dir, trust_remote_code=False))
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        name = name.removeprefix("roberta.")  # a classifier's encoder
        if jina:  # (weir's names: mlp.wo read as mlp.down_proj, the MLM head none)
            name = checkpoint_name(name, spec)
            if name is None:
                continue
        if nomic:  # (its own names, as transformers 5 saves them: weir's, Wqkv kept whole)
            name = checkpoint_name(name, spec)
            if name.startswith("layers."):
                name = "encoder.layer." + name.removeprefix("layers.")
        stem, _, kind = name.rpartition(".")
        parts = stem.split(".")
        if stem in top:
            target = f"{top[stem]}.{kind}"
        elif parts[:2] == ["encoder", "layer"] and ".".join(parts[3:]) in layer:
            target = f"blk.{parts[2]}.{layer['.'.join(parts[3:])]}.{kind}"
        else:
            continue  # pooler, buffers (a BERT classifier's head: not written here)
        t = np.ascontiguousarray(t, dtype=np.float32)
        if target == "position_embd.weight":
            t = np.ascontiguousarray(t[offset:])
        small = target.startswith(("position_embd", "token_types", "cls"))
        _add(w, target, t, "f32" if small else fmt)
    return _close(w, out)


def _add(w, name: str, t, fmt: str) -> None:
    """A tensor written in `fmt` (weir's quantizers), a vector in F32."""
    import gguf
    import numpy as np

    from gpu.quant.formats import FORMATS
    from gpu.quant.quantize import quantize

    t = np.ascontiguousarray(t, dtype=np.float32)
    f = FORMATS["f32" if t.ndim == 1 else fmt]
    if f.name == "f32":
        w.add_tensor(name, t)
    else:
        data = quantize(t, f.name)
        qtype = gguf.GGMLQuantizationType(f.ggml_type)
        w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)


def _close(w, out: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def write_modernbert_gguf(hf_dir: str | Path, out: str | Path, fmt: str = "f32") -> Path:
    """A ModernBERT folder of build_encoder's as llama.cpp's converter writes it
    ("modern-bert"): its names, the bases of its global and local layers, its whole local
    window, its byte-level BPE vocabulary with [CLS] and [SEP] as BOS and EOS, its pooling (a
    classifier's own: `classifier.pooling_type`) and head (`cls`, `cls.norm`, `cls.output`)."""
    import gguf
    from safetensors.numpy import load_file

    from gpu.gguf_names import MODERNBERT_LAYER, MODERNBERT_TOP
    from gpu.quant.gguf_tokens import write_tokenizer
    from server.embedding_config import sentence_transformers_pooling

    hf_dir, out = Path(hf_dir), Path(out)
    config = json.loads((hf_dir / "config.json").read_text())
    a = "modern-bert"
    w = gguf.GGUFWriter(str(out), a)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    rope = config["rope_parameters"]
    w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(config["norm_eps"])  # (the key the converter writes)
    w.add_causal_attention(False)
    kinds = {"mean": gguf.PoolingType.MEAN, "cls": gguf.PoolingType.CLS}
    kind = sentence_transformers_pooling(hf_dir)
    if kind is not None:
        w.add_pooling_type(kinds[kind])
    w.add_uint32(f"{a}.classifier.pooling_type", int(kinds[config["classifier_pooling"]]))
    w.add_sliding_window(config["local_attention"])
    w.add_vocab_size(config["vocab_size"])
    w.add_string(f"{a}.hidden_activation", config["hidden_activation"])
    write_tokenizer(w, hf_dir, config, bert=True)
    top = {v: k for k, v in MODERNBERT_TOP.items()}
    layer = {v: k for k, v in MODERNBERT_LAYER.items()}
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        stem, _, part = name.removeprefix("model.").rpartition(".")
        pieces = stem.split(".")
        if stem in top:
            target = f"{top[stem]}.{part}"
        elif pieces[0] == "layers" and ".".join(pieces[2:]) in layer:
            target = f"blk.{pieces[1]}.{layer['.'.join(pieces[2:])]}.{part}"
        else:
            raise ValueError(f"no GGUF name for {name}")
        _add(w, target, t, "f32" if target.startswith("cls") else fmt)
    return _close(w, out)
