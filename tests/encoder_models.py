"""Tiny random-weight encoders saved as Hugging Face folders, as their hubs hold them: BERT with
a trained WordPiece tokenizer ([CLS] a [SEP] b [SEP], the second text type 1) and XLM-RoBERTa
with a trained Unigram tokenizer (<s> a </s></s> b </s>, pad id 1), each as an embedding model
(sentence-transformers' modules.json naming its pooling, where given) or a sequence classifier
(BERT's pooler and classifier, RoBERTa's classification head)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from gpu.tiny_model import corpus

BERT_SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
XLMR_SPECIAL = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]


def bert_tokenizer(vocab_size: int = 600):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=BERT_SPECIAL, show_progress=False
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return bert_template(tok)


def bert_template(tok):
    """`tok` with BERT's template ([CLS] A [SEP], then B [SEP] of type 1) and special tokens."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        mask_token="[MASK]",
        model_max_length=512,
    )


def xlmr_tokenizer(vocab_size: int = 600):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.Unigram())
    # as transformers 5 converts XLM-RoBERTa's SentencePiece model (less its precompiled
    # normalization): split at whitespace, then a phantom space before each word
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace()]
    )
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size, special_tokens=XLMR_SPECIAL, unk_token="<unk>", show_progress=False
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.post_processor = processors.RobertaProcessing(
        ("</s>", tok.token_to_id("</s>")), ("<s>", tok.token_to_id("<s>"))
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        sep_token="</s>",
        cls_token="<s>",
        unk_token="<unk>",
        pad_token="<pad>",
        mask_token="<mask>",
        model_max_length=512,
    )


def modernbert_tokenizer(vocab_size: int = 600):
    """Byte-level BPE (as ModernBERT's, OLMo's) with BERT's special tokens and template."""
    from tokenizers import AddedToken

    from gpu.tiny_model import train_tokenizer

    base = train_tokenizer(vocab_size).backend_tokenizer
    base.add_special_tokens([AddedToken(t, normalized=False) for t in BERT_SPECIAL])
    return bert_template(base)


def build_encoder(
    path: str | Path,
    family: str = "bert",
    *,
    num_labels: int = 0,
    pooling: str | None = "mean",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 128,
    max_position_embeddings: int = 128,
    hidden_act: str = "gelu",
    seed: int = 0,
    vocab_size: int | None = None,
) -> Path:
    """A random-weight encoder of `family` ("bert", "xlm-roberta", "mpnet" or "modernbert") to
    `path`: an embedding model (BertModel, XLMRobertaModel, ModernBertModel) whose
    sentence-transformers files name `pooling` (None: no such files), or, with `num_labels`, a
    sequence classifier. `vocab_size`: embedding rows beyond the tokenizer's (a real model's
    table, for benchmarks). ModernBERT: every third layer global (the first), the others local
    with a window of 8 (4 either way), its classifier pooling `pooling` (cls or mean)."""
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        BertModel,
        MPNetConfig,
        MPNetForSequenceClassification,
        MPNetModel,
        ModernBertConfig,
        ModernBertForSequenceClassification,
        ModernBertModel,
        XLMRobertaConfig,
        XLMRobertaForSequenceClassification,
        XLMRobertaModel,
    )

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    bert = family == "bert"
    builders = {"bert": bert_tokenizer, "xlm-roberta": xlmr_tokenizer, "mpnet": xlmr_tokenizer}
    tokenizer = builders.get(family, modernbert_tokenizer)()
    common = dict(
        vocab_size=max(vocab_size or 0, len(tokenizer)),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        intermediate_size=intermediate_size,
        hidden_act=hidden_act,
        initializer_range=0.2,
        pad_token_id=tokenizer.pad_token_id,
    )
    if bert:
        config = BertConfig(**common, max_position_embeddings=max_position_embeddings)
        classes = BertModel, BertForSequenceClassification
    elif family == "mpnet":  # (its positions too start past its padding id, 1: two rows more)
        config = MPNetConfig(**common, max_position_embeddings=max_position_embeddings + 2)
        classes = MPNetModel, MPNetForSequenceClassification
    elif family == "modernbert":
        common["hidden_activation"] = common.pop("hidden_act")
        config = ModernBertConfig(
            **common,
            max_position_embeddings=max_position_embeddings,
            local_attention=8,
            cls_token_id=tokenizer.cls_token_id,
            sep_token_id=tokenizer.sep_token_id,
            bos_token_id=tokenizer.cls_token_id,
            eos_token_id=tokenizer.sep_token_id,
            classifier_pooling=pooling or "cls",
        )
        classes = ModernBertModel, ModernBertForSequenceClassification
    else:  # RoBERTa's positions start past the padding id: two rows more
        config = XLMRobertaConfig(
            **common,
            max_position_embeddings=max_position_embeddings + 2,
            type_vocab_size=1,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        classes = XLMRobertaModel, XLMRobertaForSequenceClassification
    if num_labels:
        config.num_labels = num_labels
        model = classes[1](config)
    else:
        model = classes[0](config)
    with torch.no_grad():  # LayerNorms drawn too, so that a wrong norm shows
        for name, p in model.named_parameters():
            if "LayerNorm" in name or "norm." in name:
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if name.endswith("weight") else 0.0))
    model.eval().save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    if pooling is not None and not num_labels:
        modes = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}
        (path / "1_Pooling").mkdir(exist_ok=True)
        (path / "1_Pooling" / "config.json").write_text(
            json.dumps({"word_embedding_dimension": hidden_size, modes[pooling]: True})
        )
        st = "sentence_transformers.models."
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": st + "Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": st + "Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": st + "Normalize"},
        ]
        (path / "modules.json").write_text(json.dumps(modules))
    return path


def write_encoder_gguf(
    hf_dir: str | Path, out: str | Path, fmt: str = "f32", pooling: bool = True
) -> Path:
    """An encoder folder of build_encoder's written as llama.cpp's convert_hf_to_gguf.py writes
    one ("bert"): its names, BERT's vocabulary with phantom spaces (a word's first piece
    "\u2581play", a continuation bare) or XLM-RoBERTa's pieces with their scores ("t5"), the
    RoBERTa family's first pad + 1 position rows left out, the sentence-transformers pooling
    (`pooling` false: none written), an XLM-RoBERTa classifier's head as `cls` and
    `cls.output`; matrices in `fmt` (weir's quantizers), norms, biases, the small tables and the
    head F32."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    from gpu.gguf_names import ENCODER_LAYER, ENCODER_TOP
    from server.embedding_config import sentence_transformers_pooling

    hf_dir, out = Path(hf_dir), Path(out)
    config = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    bert = config["model_type"] == "bert"
    w = gguf.GGUFWriter(str(out), "bert")
    w.add_block_count(config["num_hidden_layers"])
    offset = 0 if bert else config["pad_token_id"] + 1  # RoBERTa's rows never read
    w.add_context_length(config["max_position_embeddings"] - offset)
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
    top = {v: k for k, v in ENCODER_TOP.items()}
    layer = {v: k for k, v in ENCODER_LAYER.items()}
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        name = name.removeprefix("roberta.")  # a classifier's encoder
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
    from gpu.quant.gguf_write import write_tokenizer
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
