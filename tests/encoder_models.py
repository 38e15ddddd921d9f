"""Tiny random-weight encoders saved as Hugging Face folders, as their hubs hold them: BERT with
a trained WordPiece tokenizer ([CLS] a [SEP] b [SEP], the second text type 1) and XLM-RoBERTa
with a trained Unigram tokenizer (<s> a </s></s> b </s>, pad id 1), each as an embedding model
(sentence-transformers' modules.json naming its pooling, where given) or a sequence classifier
(BERT's pooler and classifier, RoBERTa's classification head)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from gpu.tiny_tokenizer import corpus

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

    from gpu.tiny_tokenizer import train_tokenizer

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
    initializer_range: float = 0.2,
    per_token: bool = False,
) -> Path:
    """A random-weight encoder of `family` ("bert", "xlm-roberta", "mpnet", "nomic" or
    "modernbert") written to `path`: an embedding model whose sentence-transformers files name
    `pooling` (None: no such files), or, with `num_labels`, a sequence classifier (with
    `per_token` too, a token classifier: *ForTokenClassification).
    `vocab_size`: embedding rows beyond the tokenizer's (a real model's table, for
    benchmarks, with a real model's `initializer_range`, 0.02: deep random models of 0.2 are
    chaotic, their float32 and float64 transformers vectors already apart). ModernBERT: every
    third layer global (the first), the others local with a window of 8 (4 either way), its
    classifier pooling `pooling` (cls or mean)."""
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        BertModel,
        MPNetConfig,
        MPNetForSequenceClassification,
        MPNetModel,
        NomicBertConfig,
        NomicBertForSequenceClassification,
        NomicBertModel,
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
    builders = {
        "bert": bert_tokenizer,
        "nomic": bert_tokenizer,
        "xlm-roberta": xlmr_tokenizer,
        "mpnet": xlmr_tokenizer,
    }
    tokenizer = builders.get(family, modernbert_tokenizer)()
    common = dict(
        vocab_size=max(vocab_size or 0, len(tokenizer)),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        intermediate_size=intermediate_size,
        hidden_act=hidden_act,
        initializer_range=initializer_range,
        pad_token_id=tokenizer.pad_token_id,
    )
    if bert:
        config = BertConfig(**common, max_position_embeddings=max_position_embeddings)
        classes = BertModel, BertForSequenceClassification
    elif family == "nomic":  # (its activation is SwiGLU's: its config's default, silu)
        common.pop("hidden_act")
        config = NomicBertConfig(**common, max_position_embeddings=max_position_embeddings)
        classes = NomicBertModel, NomicBertForSequenceClassification
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
        if per_token:
            import transformers

            name = classes[1].__name__.replace("Sequence", "Token")
            model = getattr(transformers, name)(config)
        else:
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


def nomic_hub_layout(folder: str | Path, out: str | Path) -> Path:
    """A NomicBERT folder of build_encoder's as nomic's own checkpoints on the hub hold it (what
    transformers 5 converts as it loads): its config.json names (n_embd, n_layer, ...), its
    tensor names (encoder.layers.N.attn.Wqkv fused, mlp.fc11 / fc12 / fc2, norm1 / norm2,
    emb_ln; transformers 5 itself saves these tensor names, its own config's)."""
    import shutil

    import numpy as np
    from safetensors.numpy import load_file, save_file

    folder, out = Path(folder), Path(out)
    shutil.copytree(folder, out, ignore=shutil.ignore_patterns("*.safetensors"))
    c = json.loads((folder / "config.json").read_text())
    hub = {
        "architectures": c["architectures"], "model_type": "nomic_bert",
        "n_embd": c["hidden_size"], "n_layer": c["num_hidden_layers"],
        "n_head": c["num_attention_heads"], "n_inner": c["intermediate_size"],
        "n_positions": 8192, "max_trained_positions": 2048,  # (nomic-embed-text-v1.5's)
        "layer_norm_epsilon": c["layer_norm_eps"],
        "rotary_emb_base": c["rope_parameters"]["rope_theta"], "rotary_emb_fraction": 1.0,
        "rotary_emb_interleaved": False, "prenorm": False, "activation_function": "swiglu",
        "qkv_proj_bias": False, "mlp_fc1_bias": False, "mlp_fc2_bias": False, "causal": False,
        "rotary_emb_scale_base": None,
        "type_vocab_size": c["type_vocab_size"], "vocab_size": c["vocab_size"],
        "pad_token_id": c.get("pad_token_id"), "num_labels": c.get("num_labels", 2),
        "id2label": c.get("id2label"), "label2id": c.get("label2id"),
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(hub))
    names = {
        "layers.": "encoder.layers.", "embeddings.LayerNorm.": "emb_ln.",
        ".self_attn.o_proj.": ".attn.out_proj.", ".mlp.up_proj.": ".mlp.fc11.",
        ".mlp.gate_proj.": ".mlp.fc12.", ".mlp.down_proj.": ".mlp.fc2.",
        ".post_attention_layernorm.": ".norm1.", ".post_mlp_layernorm.": ".norm2.",
    }  # fmt: skip
    state, qkv = {}, {}
    for name, t in load_file(str(folder / "model.safetensors")).items():
        prefix = "nomic_bert." if name.startswith("nomic_bert.") else ""
        name = name.removeprefix(prefix)
        for ours, theirs in names.items():
            name = name.replace(ours, theirs) if name.startswith(ours) or ours[0] == "." else name
        if ".self_attn." in name:  # q, k, v: one Wqkv a layer
            stem, part = name.split(".self_attn.")
            qkv.setdefault(prefix + stem, {})[part[0]] = t
            continue
        state[prefix + name] = t
    for stem, parts in qkv.items():
        state[f"{stem}.attn.Wqkv.weight"] = np.concatenate([parts[k] for k in "qkv"])
    save_file(state, str(out / "model.safetensors"))
    return out
