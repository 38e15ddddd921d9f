"""A GGUF encoder's metadata read as llama.cpp reads it, into the Hugging Face config of the
model it holds (gpu/gguf_config.py reads decoders'): llama.cpp's "bert" (BERT, XLM-RoBERTa,
RoBERTa, told by the vocabulary), "modern-bert" (ModernBERT), "nomic-bert" (NomicBERT) and
"jina-bert-v2" (JinaBERT). The models: gpu/models/encoder.py, modernbert.py, nomic.py, jina.py."""

from __future__ import annotations

from typing import Any

from core.config import CheckpointError

ENCODER_ARCHES = ("bert", "modern-bert", "nomic-bert", "jina-bert-v2")
HEAD = "cls.output.weight"  # llama.cpp's classification head: [labels, hidden]


def encoder_config(f: Any) -> Any:
    """The config of an open encoder file (`f`: gpu/gguf_config.py HfConfigOf: its `get`,
    `tensors`, `arch`, `path`, `_dtype`)."""
    if f.arch == "nomic-bert":
        return nomic(f)
    if f.arch == "jina-bert-v2":
        return jina(f)
    return modernbert(f) if f.arch == "modern-bert" else bert(f)


def _labels(f: Any, arch: str) -> tuple[str, dict[str, Any]]:
    """A classifier's architecture and its labels as the file has them (their count its
    head's rows), or the embedder's architecture and none."""
    if HEAD not in f.tensors:
        return arch, {}
    shape = f.tensors[HEAD].shape
    count = int(shape[1]) if len(shape) == 2 else 1
    names = list(f.get(f"{f.arch}.classifier.output_labels", None) or [])
    names = names if len(names) == count else [f"LABEL_{i}" for i in range(count)]
    return arch.replace("Model", "ForSequenceClassification"), dict(
        num_labels=count,
        id2label=dict(enumerate(names)),
        label2id={n: i for i, n in enumerate(names)},
    )


def bert(f: Any) -> Any:
    """An encoder as llama.cpp's converter writes one ("bert"), told by its vocabulary:
    BERT's WordPiece ("bert"), XLM-RoBERTa's SentencePiece ("t5"), RoBERTa's byte-level BPE
    ("gpt2"). The RoBERTa family's first pad + 1 position rows, never read, are not in the
    file: the config counts them (gpu/encoder_loader.py puts them back as zeros), so positions
    are counted as transformers counts them. Its GELU is transformers' (llama.cpp computes the
    tanh approximation). A RoBERTa-family classifier's head (`cls` dense and `cls.output`: a
    reranker such as bge-reranker-v2-m3) makes it a sequence classifier; a BERT one is refused
    (the converter leaves out its pooler), as is a causal one."""
    from transformers import BertConfig, RobertaConfig, XLMRobertaConfig

    kinds = {
        "bert": (BertConfig, "BertModel"),
        "t5": (XLMRobertaConfig, "XLMRobertaModel"),
        "gpt2": (RobertaConfig, "RobertaModel"),
    }
    vocab = f.get("tokenizer.ggml.model", "bert")
    heads = [n for n in (HEAD, "cls.weight") if n in f.tensors]
    what = None
    if heads and not (len(heads) == 2 and vocab in ("t5", "gpt2")):
        what = (
            f"a classification head ({', '.join(heads)}; served for the RoBERTa family's "
            "dense and out_proj: llama.cpp's converter leaves out BERT's pooler)"
        )
    elif vocab not in kinds:
        what = f"a {vocab!r} vocabulary"
    elif f.get("bert.attention.causal", False):
        what = "causal attention"
    if what is not None:
        raise CheckpointError(
            f"{f.path.name}: a GGUF encoder with {what} is not served (BERT, XLM-RoBERTa and "
            "RoBERTa embedders: vocabularies bert, t5, gpt2)"
        )
    cls, arch = kinds[vocab]
    arch, labels = _labels(f, arch)
    bert = vocab == "bert"
    pad = int(f.get("tokenizer.ggml.padding_token_id", 0 if bert else 1))
    positions = int(f.get("bert.context_length"))
    return cls(
        **labels,
        architectures=[arch],
        vocab_size=int(f.tensors["token_embd.weight"].shape[1]),
        hidden_size=int(f.get("bert.embedding_length")),
        num_hidden_layers=int(f.get("bert.block_count")),
        num_attention_heads=int(f.get("bert.attention.head_count")),
        intermediate_size=int(f.get("bert.feed_forward_length")),
        max_position_embeddings=positions if bert else positions + pad + 1,
        layer_norm_eps=float(f.get("bert.attention.layer_norm_epsilon")),
        type_vocab_size=int(f.get("tokenizer.ggml.token_type_count", 2 if bert else 1)),
        hidden_act="gelu",
        pad_token_id=pad,
        dtype=f._dtype(),
    )


def modernbert(f: Any) -> Any:
    """ModernBERT as llama.cpp's converter writes it ("modern-bert"): its bases for the global
    and local layers (`rope.freq_base`, `rope.freq_base_swa`), the local layers' whole window
    (`attention.sliding_window`: local_attention) and their pattern (every third layer global
    where the file names none, as llama.cpp reads it), its gated MLP's activation; biases where
    the file has them; a classifier's head (`cls`, `cls.norm`, `cls.output`) and its pooling
    (`classifier.pooling_type`: mean or CLS)."""
    from transformers import ModernBertConfig

    a = f.arch
    if f.get(f"{a}.attention.causal", False):
        raise CheckpointError(f"{f.path.name}: a causal modern-bert file is not served")
    arch, labels = _labels(f, "ModernBertModel")
    if labels and "cls.weight" not in f.tensors:
        raise CheckpointError(f"{f.path.name}: a classifier without its head's dense (cls)")
    kinds = {1: "mean", 2: "cls"}
    pooling = kinds.get(int(f.get(f"{a}.classifier.pooling_type", 2) or 2), "cls")
    eps = f.get(f"{a}.attention.layer_norm_epsilon", None)
    eps = f.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-5) if eps is None else eps
    pattern = f.get(f"{a}.attention.sliding_window_pattern", 3)
    types = None  # (a flag a layer, where the file gives them so: true for a local layer)
    if isinstance(pattern, list):
        types = ["sliding_attention" if p else "full_attention" for p in pattern]
    return ModernBertConfig(
        **labels,
        architectures=[arch],
        vocab_size=int(f.tensors["token_embd.weight"].shape[1]),
        hidden_size=int(f.get(f"{a}.embedding_length")),
        num_hidden_layers=int(f.get(f"{a}.block_count")),
        num_attention_heads=int(f.get(f"{a}.attention.head_count")),
        intermediate_size=int(f.get(f"{a}.feed_forward_length")),
        max_position_embeddings=int(f.get(f"{a}.context_length")),
        norm_eps=float(eps),
        norm_bias="token_embd_norm.bias" in f.tensors,
        attention_bias="blk.0.attn_qkv.bias" in f.tensors,
        mlp_bias="blk.0.ffn_up.bias" in f.tensors,
        hidden_activation=str(f.get(f"{a}.hidden_activation", "gelu")),
        local_attention=int(f.get(f"{a}.attention.sliding_window", 128)),
        layer_types=types,
        global_attn_every_n_layers=3 if types else int(pattern),
        global_rope_theta=float(f.get(f"{a}.rope.freq_base", 160_000.0)),
        local_rope_theta=float(f.get(f"{a}.rope.freq_base_swa", 10_000.0)),
        classifier_pooling=pooling,
        classifier_bias="cls.bias" in f.tensors,
        pad_token_id=f.get("tokenizer.ggml.padding_token_id", None),
        # its [CLS] and [SEP], the file's BOS and EOS (ModernBertConfig's own are its 50k's)
        bos_token_id=f.get("tokenizer.ggml.bos_token_id", None),
        cls_token_id=f.get("tokenizer.ggml.bos_token_id", None),
        eos_token_id=f.get("tokenizer.ggml.eos_token_id", None),
        sep_token_id=f.get("tokenizer.ggml.seperator_token_id", None),
        dtype=f._dtype(),
    )


def nomic(f: Any) -> Any:
    """NomicBERT as llama.cpp's converter writes it ("nomic-bert": nomic-embed-text, Ollama's
    embedder): its rotation's base, its context (the converter's: the 2,048 tokens v1 and v1.5
    were trained at), token types, its WordPiece vocabulary (SentencePiece for v2's, not
    served: its experts)."""
    from transformers import NomicBertConfig

    a = f.arch
    if f.get(f"{a}.attention.causal", False) or HEAD in f.tensors:
        raise CheckpointError(f"{f.path.name}: a causal nomic-bert file, or a classifier's")
    if f.get("tokenizer.ggml.model", "bert") != "bert":
        raise CheckpointError(f"{f.path.name}: a nomic-bert file with a SentencePiece vocabulary")
    return NomicBertConfig(
        architectures=["NomicBertModel"],
        **_shapes(f),
        rope_parameters={"rope_type": "default", "rope_theta": float(f.get(f"{a}.rope.freq_base"))},
    )


def jina(f: Any) -> Any:
    """JinaBERT as llama.cpp's converter writes it ("jina-bert-v2": jina-embeddings-v2-small-en
    and -base-en): BERT's layers without positions (ALiBi), its gated MLP one product
    (`ffn_up`, gate rows first), token types, a WordPiece vocabulary. Refused by name: the
    variant with Q/K norms and a second attention norm (jina-embeddings-v2-base-code's), a
    split gate, other vocabularies, a causal or classifier file."""
    from transformers import BertConfig

    a = f.arch
    extra = [
        n
        for n in ("blk.0.attn_q_norm.weight", "blk.0.attn_norm_2.weight", "blk.0.ffn_gate.weight")
        if n in f.tensors
    ]
    what = None
    if f.get(f"{a}.attention.causal", False) or HEAD in f.tensors:
        what = "causal attention or a classification head"
    elif extra:
        what = f"{', '.join(extra)} (jina-embeddings-v2-base-code's layers, or a split gate)"
    elif f.get("tokenizer.ggml.model", "bert") != "bert":
        what = f"a {f.get('tokenizer.ggml.model')!r} vocabulary (WordPiece's is served)"
    if what is not None:
        raise CheckpointError(f"{f.path.name}: a jina-bert-v2 file with {what} is not served")
    return BertConfig(
        architectures=["JinaBertModel"],
        **_shapes(f),
        position_embedding_type="alibi",
        feed_forward_type="geglu",
        hidden_act="gelu",
    )


def _shapes(f: Any) -> dict[str, Any]:
    """What a NomicBERT or JinaBERT file says alike: its sizes, context, norm epsilon, token
    types, padding id and dtype."""
    a = f.arch
    return dict(
        vocab_size=int(f.tensors["token_embd.weight"].shape[1]),
        hidden_size=int(f.get(f"{a}.embedding_length")),
        num_hidden_layers=int(f.get(f"{a}.block_count")),
        num_attention_heads=int(f.get(f"{a}.attention.head_count")),
        intermediate_size=int(f.get(f"{a}.feed_forward_length")),
        max_position_embeddings=int(f.get(f"{a}.context_length")),
        layer_norm_eps=float(f.get(f"{a}.attention.layer_norm_epsilon")),
        type_vocab_size=int(f.get("tokenizer.ggml.token_type_count", 2)),
        pad_token_id=int(f.get("tokenizer.ggml.padding_token_id", 0)),
        dtype=f._dtype(),
    )
