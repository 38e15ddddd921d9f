"""EncoderSpec: what an encoder (BERT, RoBERTa, XLM-RoBERTa: gpu/models/encoder.py; ModernBERT:
gpu/models/modernbert.py) needs, read from its Hugging Face config. Such a model attends both
ways over a whole input, so it embeds and classifies; it never generates."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.config import CheckpointError
from gpu.models.remote_encoder_spec import gte_fields, jina_fields

# Architecture -> (family, head). The family says which layer it is and how positions count
# (RoBERTa's start past its padding id; ModernBERT's rotate); the head is what a classifier puts
# its first token's row through: BERT's pooler (dense, tanh) then `classifier`, RoBERTa's
# `classifier.dense`, tanh, then `classifier.out_proj`, ModernBERT's `head` (dense, act,
# norm) over its CLS row or mean then `classifier`; "" for an embedding model (its pooler, if
# any, is not read).
ENCODERS: dict[str, tuple[str, str]] = {
    "BertModel": ("bert", ""),
    "BertForSequenceClassification": ("bert", "bert"),
    "RobertaModel": ("roberta", ""),
    "RobertaForSequenceClassification": ("roberta", "roberta"),
    "XLMRobertaModel": ("roberta", ""),
    "XLMRobertaForSequenceClassification": ("roberta", "roberta"),
    # MPNet: RoBERTa's positions (its padding id always 1), no token types, and a bias on each
    # head's scores by the two tokens' relative distance (in buckets, one table for all layers)
    "MPNetModel": ("mpnet", ""),
    "MPNetForSequenceClassification": ("mpnet", "roberta"),
    # NomicBERT: rotated positions, SwiGLU, norms after the blocks (gpu/models/nomic.py)
    "NomicBertModel": ("nomic", ""),
    "NomicBertForSequenceClassification": ("nomic", "bert"),
    "ModernBertModel": ("modernbert", ""),
    "ModernBertForSequenceClassification": ("modernbert", "modernbert"),
    "BertForTokenClassification": ("bert", "token"),
    "RobertaForTokenClassification": ("roberta", "token"),
    "XLMRobertaForTokenClassification": ("roberta", "token"),
    # BGE-M3 (vLLM's name, through --hf-overrides '{"architectures": ["BgeM3EmbeddingModel"]}'):
    # XLM-RoBERTa's dense CLS vector, and its sparse_linear.pt and colbert_linear.pt heads
    "BgeM3EmbeddingModel": ("roberta", "bge_m3"),
    "MPNetForTokenClassification": ("mpnet", "token"),
    "NomicBertForTokenClassification": ("nomic", "token"),
    "ModernBertForTokenClassification": ("modernbert", "modernbert_token"),
    # GTE (Alibaba's "new" remote code: gte-base-en-v1.5, gte-multilingual-base and -reranker,
    # snowflake-arctic-embed-m-v2.0's GteModel; vLLM's names GteNewModel, ...): NomicBERT's layer
    # with biases, a GELU gate and an optionally NTK-scaled rotation (gpu/models/nomic.py)
    "NewModel": ("gte", ""),
    "GteNewModel": ("gte", ""),
    "GteModel": ("gte", ""),
    "NewForSequenceClassification": ("gte", "bert"),
    "GteNewForSequenceClassification": ("gte", "bert"),
    # JinaBERT (jina-embeddings-v2-small/base-en and the like; gpu/models/jina.py)
    "JinaBertForMaskedLM": ("jina", ""),
    "JinaBertModel": ("jina", ""),
}

PER_TOKEN_HEADS = ("token", "modernbert_token", "bge_m3")
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
    family: str  # bert, roberta, modernbert
    head: str  # "" (embeddings), bert, roberta, modernbert, token, modernbert_token: ENCODERS
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    intermediate_size: int
    layer_norm_eps: float
    hidden_act: str  # an ACTS value
    max_position_embeddings: int  # the positions served (RoBERTa's: the table less its offset)
    position_rows: int  # the position table's rows (ModernBERT: none, it rotates)
    pad_token_id: int  # RoBERTa's positions count the tokens that are not this one
    type_vocab_size: int  # BERT's segments (a pair's second text is type 1); RoBERTa's: 1
    num_labels: int = 0  # a classifier's (0: an embedding model)
    relative_buckets: int = 0  # MPNet's relative-position buckets (0: none)
    # ModernBERT's: biases on the norms, on attention's products and on the MLP's; the
    # rotation's bases for the global and the local layers, which layers are local, and how far
    # a local layer's token sees (|i - j| <= window); its classifier's pooling (cls, mean), head
    # bias and activation
    norm_bias: bool = True
    attention_bias: bool = True
    mlp_bias: bool = True
    rope_theta: float = 0.0
    local_rope_theta: float = 0.0
    local_layers: tuple[bool, ...] = ()
    window: int = 0
    classifier_pooling: str = "cls"
    classifier_bias: bool = True
    classifier_act: str = "gelu"
    # a gated MLP's gate and up products have biases where mlp_bias says so (GTE's: none, its
    # down product one); a rotation scaled as GTE's NTK scaling does (factor; 0: none) and
    # its mixed variant's exponent
    gated_bias: bool = True
    rope_ntk: float = 0.0
    rope_mixed_b: float | None = None

    @classmethod
    def from_hf_config(cls, config: Any) -> EncoderSpec:
        arch = encoder_architecture(config)
        if arch is None:
            raise CheckpointError(f"not an encoder: {getattr(config, 'architectures', None)}")
        family, head = ENCODERS[arch]
        if family == "nomic":
            config = _nomic_names(config, arch)
        for flag in ("is_decoder", "add_cross_attention"):
            if getattr(config, flag, False):
                raise CheckpointError(f"{arch} with {flag} is not served (weir serves encoders)")
        labels = int(getattr(config, "num_labels", 0) or 0) if head not in ("", "bge_m3") else 0
        if head not in ("", "bge_m3") and labels < 1:
            raise CheckpointError(f"{arch} with {labels} labels")
        heads = int(config.num_attention_heads)
        if config.hidden_size % heads:
            raise CheckpointError(f"{arch}: hidden_size {config.hidden_size} over {heads} heads")
        common = dict(
            architecture=arch,
            family=family,
            head=head,
            vocab_size=int(config.vocab_size),
            hidden_size=int(config.hidden_size),
            num_layers=int(config.num_hidden_layers),
            num_heads=heads,
            head_dim=int(config.hidden_size) // heads,
            intermediate_size=int(config.intermediate_size),
            num_labels=labels,
        )
        if family == "modernbert":
            return cls(**common, **_modernbert(config, arch))
        if family == "nomic":
            return cls(**common, **_nomic(config, arch))
        if family == "gte":
            return cls(**common, **gte_fields(config, arch))
        if family == "jina":
            return cls(**common, **jina_fields(config, arch))
        return cls(**common, **_bert(config, arch, family))


def act_name(arch: str, name: str, what: str = "hidden_act") -> str:
    if name not in ACTS:
        raise CheckpointError(f"{arch} with {what} {name!r} is not served ({', '.join(ACTS)})")
    return ACTS[name]


def _bert(config: Any, arch: str, family: str) -> dict[str, Any]:
    """BERT's, the RoBERTa family's and MPNet's fields: learned positions (RoBERTa's and
    MPNet's past the padding id), token types (not MPNet's), post-norm layers with biases;
    MPNet's relative-position buckets."""
    kind = getattr(config, "position_embedding_type", None) or "absolute"
    if kind != "absolute":
        raise CheckpointError(
            f"{arch} with position_embedding_type {kind!r} is not served (absolute only)"
        )
    rows = int(config.max_position_embeddings)
    pad = getattr(config, "pad_token_id", None)
    pad = int(pad if pad is not None else (1 if family == "roberta" else 0))
    if family == "mpnet":
        pad = 1  # (transformers' MPNet counts positions past 1, whatever the config's id)
    # RoBERTa counts positions from padding_idx + 1 (its first rows are never read)
    served = rows - (pad + 1) if family in ("roberta", "mpnet") else rows
    if served < 1:
        raise CheckpointError(f"{arch}: {rows} positions with padding id {pad}")
    return dict(
        layer_norm_eps=float(getattr(config, "layer_norm_eps", 1e-12)),
        hidden_act=act_name(arch, str(getattr(config, "hidden_act", "gelu"))),
        max_position_embeddings=served,
        position_rows=rows,
        pad_token_id=pad,
        type_vocab_size=int(getattr(config, "type_vocab_size", 0) or 0) if family != "mpnet" else 0,
        relative_buckets=int(config.relative_attention_num_buckets) if family == "mpnet" else 0,
    )


def _modernbert(config: Any, arch: str) -> dict[str, Any]:
    """ModernBERT's fields: rotated positions (a base for global and one for local layers),
    local layers that see `local_attention // 2` tokens either way, pre-norm layers, a gated
    MLP, no token types; its classifier's pooling and head."""
    # (transformers 5's config; earlier ones, and the hub's config.json files, name the bases
    # global_rope_theta and local_rope_theta, and the pattern global_attn_every_n_layers)
    rope = getattr(config, "rope_parameters", None) or {}
    thetas = {}
    for kind, old, default in (
        ("full_attention", "global_rope_theta", 160_000.0),
        ("sliding_attention", "local_rope_theta", 10_000.0),
    ):
        params = rope.get(kind) or {}
        if params.get("rope_type", "default") != "default":
            raise CheckpointError(f"{arch} with {kind} rope {params.get('rope_type')!r}")
        thetas[kind] = float(params.get("rope_theta", getattr(config, old, None) or default))
    n = int(config.num_hidden_layers)
    types = list(getattr(config, "layer_types", None) or [])
    if not types:
        every = int(getattr(config, "global_attn_every_n_layers", 3) or 1)
        types = ["full_attention" if i % every == 0 else "sliding_attention" for i in range(n)]
    if len(types) != n:
        raise CheckpointError(f"{arch}: {len(types)} layer_types for {config.num_hidden_layers}")
    pooling = str(getattr(config, "classifier_pooling", "cls"))
    if pooling not in ("cls", "mean"):
        raise CheckpointError(f"{arch} with classifier_pooling {pooling!r} is not served")
    return dict(
        layer_norm_eps=float(getattr(config, "norm_eps", 1e-5)),
        hidden_act=act_name(
            arch, str(getattr(config, "hidden_activation", "gelu")), "hidden_activation"
        ),
        max_position_embeddings=int(config.max_position_embeddings),
        position_rows=0,
        pad_token_id=int(getattr(config, "pad_token_id", 0) or 0),
        type_vocab_size=0,
        norm_bias=bool(getattr(config, "norm_bias", False)),
        attention_bias=bool(getattr(config, "attention_bias", False)),
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        rope_theta=thetas["full_attention"],
        local_rope_theta=thetas["sliding_attention"],
        local_layers=tuple(t == "sliding_attention" for t in types),
        window=int(getattr(config, "local_attention", 128)) // 2,
        classifier_pooling=pooling,
        classifier_bias=bool(getattr(config, "classifier_bias", False)),
        classifier_act=act_name(
            arch, str(getattr(config, "classifier_activation", "gelu")), "classifier_activation"
        ),
    )


# nomic's own config.json names (the hub's, which transformers 5 does not read: it keeps its
# defaults) -> transformers'
NOMIC_NAMES = {
    "n_embd": "hidden_size",
    "n_layer": "num_hidden_layers",
    "n_head": "num_attention_heads",
    "n_inner": "intermediate_size",
    "n_positions": "max_position_embeddings",
    "layer_norm_epsilon": "layer_norm_eps",
    "rotary_emb_base": "rope_theta",
}


def _nomic_names(config: Any, arch: str) -> Any:
    """A NomicBERT config with transformers' names, read from nomic's own where the config has
    them; what weir does not compute refused by name (prenorm layers, a partial, interleaved or
    scaled rotation, biases, an activation but SwiGLU)."""
    from types import SimpleNamespace

    raw = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    if "n_embd" not in raw:
        return config
    for key, bad in (
        ("prenorm", True),
        ("use_rms_norm", True),
        ("parallel_block", True),
        ("causal", True),
        ("rotary_emb_interleaved", True),
        ("qkv_proj_bias", True),
        ("mlp_fc1_bias", True),
        ("mlp_fc2_bias", True),
    ):
        if raw.get(key) is bad:
            raise CheckpointError(f"{arch} with {key} {bad} is not served")
    if float(raw.get("rotary_emb_fraction", 1.0) or 1.0) != 1.0:
        raise CheckpointError(f"{arch} with rotary_emb_fraction {raw['rotary_emb_fraction']}")
    if raw.get("rotary_scaling_factor"):
        raise CheckpointError(
            f"{arch} with rotary_scaling_factor {raw['rotary_scaling_factor']} (dynamic NTK "
            "scaling) is not served"
        )
    if raw.get("activation_function", "swiglu") != "swiglu":
        raise CheckpointError(f"{arch} with activation_function {raw['activation_function']!r}")
    out = {**raw, **{ours: raw[theirs] for theirs, ours in NOMIC_NAMES.items() if theirs in raw}}
    # the length it was trained at (nomic-embed-text-v1.5: 2,048 of its 8,192 positions, the
    # rest for the dynamic scaling refused above), as vLLM and llama.cpp's converter serve it
    trained = raw.get("max_trained_positions")
    if trained:
        out["max_position_embeddings"] = min(int(out["max_position_embeddings"]), int(trained))
    out["hidden_act"] = "silu"
    out["rope_parameters"] = {"rope_theta": float(out.get("rope_theta", 1000.0))}
    return SimpleNamespace(**out)


def _nomic(config: Any, arch: str) -> dict[str, Any]:
    """NomicBERT's fields: no position table (it rotates, at its base), token types, norms
    after the blocks with biases, no biases on its products, SwiGLU."""
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise CheckpointError(f"{arch} with rope {rope.get('rope_type')!r} is not served")
    return dict(
        layer_norm_eps=float(getattr(config, "layer_norm_eps", 1e-12)),
        hidden_act=act_name(arch, str(getattr(config, "hidden_act", "silu"))),
        max_position_embeddings=int(config.max_position_embeddings),
        position_rows=0,
        pad_token_id=int(getattr(config, "pad_token_id", 0) or 0),
        type_vocab_size=int(getattr(config, "type_vocab_size", 2) or 1),
        attention_bias=False,
        mlp_bias=False,
        rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 1000.0))),
    )
