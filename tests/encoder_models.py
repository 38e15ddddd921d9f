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
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=BERT_SPECIAL, show_progress=False
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
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
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
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
    """A random-weight encoder of `family` ("bert" or "xlm-roberta") written to `path`: an
    embedding model (BertModel, XLMRobertaModel) whose sentence-transformers files name
    `pooling` (None: no such files), or, with `num_labels`, a sequence classifier.
    `vocab_size`: embedding rows beyond the tokenizer's (a real model's table, for
    benchmarks)."""
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        BertModel,
        XLMRobertaConfig,
        XLMRobertaForSequenceClassification,
        XLMRobertaModel,
    )

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    bert = family == "bert"
    tokenizer = bert_tokenizer() if bert else xlmr_tokenizer()
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
            if "LayerNorm" in name:
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
