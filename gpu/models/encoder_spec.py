"""EncoderSpec: what a BERT-family encoder (BERT, RoBERTa, XLM-RoBERTa) needs, read from its
Hugging Face config. Such a model attends both ways over a whole input, so it embeds and
classifies; it never generates (gpu/models/encoder.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.config import CheckpointError

# Architecture -> (family, head). The family says how positions are counted (RoBERTa's start
# past its padding id); the head is what a classifier puts its first token's row through:
# BERT's pooler (dense, tanh) then `classifier`, RoBERTa's `classifier.dense`, tanh, then
# `classifier.out_proj`; "" for an embedding model (its pooler, if any, is not read).
ENCODERS: dict[str, tuple[str, str]] = {
    "BertModel": ("bert", ""),
    "BertForSequenceClassification": ("bert", "bert"),
    "RobertaModel": ("roberta", ""),
    "RobertaForSequenceClassification": ("roberta", "roberta"),
    "XLMRobertaModel": ("roberta", ""),
    "XLMRobertaForSequenceClassification": ("roberta", "roberta"),
}
# hidden_act -> the activation's name in gpu/backend.py PLAIN_ACTIVATIONS
ACTS = {
    "gelu": "gelu",
    "gelu_new": "gelu_pytorch_tanh",
    "gelu_pytorch_tanh": "gelu_pytorch_tanh",
    "relu": "relu",
    "silu": "silu",
}


def encoder_architecture(config: Any) -> str | None:
    """The config's encoder architecture, or None (a decoder, or something else)."""
    archs = getattr(config, "architectures", None) or []
    return next((a for a in archs if a in ENCODERS), None)


@dataclass(frozen=True)
class EncoderSpec:
    architecture: str
    family: str  # bert, roberta
    head: str  # "" (embeddings), bert, roberta: see ENCODERS
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    intermediate_size: int
    layer_norm_eps: float
    hidden_act: str  # an ACTS value
    max_position_embeddings: int  # the positions served (RoBERTa's: the table less its offset)
    position_rows: int  # the position table's rows
    pad_token_id: int  # RoBERTa's positions count the tokens that are not this one
    type_vocab_size: int  # BERT's segments (a pair's second text is type 1); RoBERTa's: 1
    num_labels: int = 0  # a classifier's (0: an embedding model)

    @classmethod
    def from_hf_config(cls, config: Any) -> EncoderSpec:
        arch = encoder_architecture(config)
        if arch is None:
            raise CheckpointError(f"not an encoder: {getattr(config, 'architectures', None)}")
        family, head = ENCODERS[arch]
        for flag in ("is_decoder", "add_cross_attention"):
            if getattr(config, flag, False):
                raise CheckpointError(f"{arch} with {flag} is not served (weir serves encoders)")
        kind = getattr(config, "position_embedding_type", None) or "absolute"
        if kind != "absolute":
            raise CheckpointError(
                f"{arch} with position_embedding_type {kind!r} is not served (absolute only)"
            )
        act = str(getattr(config, "hidden_act", "gelu"))
        if act not in ACTS:
            raise CheckpointError(
                f"{arch} with hidden_act {act!r} is not served ({', '.join(ACTS)})"
            )
        labels = int(getattr(config, "num_labels", 0) or 0) if head else 0
        if head and labels < 1:
            raise CheckpointError(f"{arch} with {labels} labels")
        heads = int(config.num_attention_heads)
        if config.hidden_size % heads:
            raise CheckpointError(f"{arch}: hidden_size {config.hidden_size} over {heads} heads")
        rows = int(config.max_position_embeddings)
        pad = getattr(config, "pad_token_id", None)
        pad = int(pad if pad is not None else (1 if family == "roberta" else 0))
        # RoBERTa counts positions from padding_idx + 1 (its first rows are never read)
        served = rows - (pad + 1) if family == "roberta" else rows
        if served < 1:
            raise CheckpointError(f"{arch}: {rows} positions with padding id {pad}")
        return cls(
            architecture=arch,
            family=family,
            head=head,
            vocab_size=int(config.vocab_size),
            hidden_size=int(config.hidden_size),
            num_layers=int(config.num_hidden_layers),
            num_heads=heads,
            head_dim=int(config.hidden_size) // heads,
            intermediate_size=int(config.intermediate_size),
            layer_norm_eps=float(getattr(config, "layer_norm_eps", 1e-12)),
            hidden_act=ACTS[act],
            max_position_embeddings=served,
            position_rows=rows,
            pad_token_id=pad,
            type_vocab_size=int(getattr(config, "type_vocab_size", 0) or 0),
            num_labels=labels,
        )
