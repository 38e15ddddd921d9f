"""The spec fields (gpu/models/encoder_spec.py EncoderSpec) of encoders whose modelling code lives
in their hubs' remote code, which weir never runs: GTE's ("new": NomicBERT's layer with biases, a
GELU gate and an NTK-scaled rotation, gpu/models/nomic.py) and Jina's v2 (JinaBERT: BERT's
attention with ALiBi biases instead of positions and a GELU-gated MLP, gpu/models/jina.py).
GTE's config class is not transformers' (REMOTE_TYPES: read from config.json here); JinaBERT's is
BERT's with more fields."""

from __future__ import annotations

from typing import Any

from core.config import CheckpointError

# JinaBERT's feed_forward_type and GTE's hidden_act -> their gate's activation (gpu/backend.py
# ACTIVATIONS' names)
JINA_GATES = {"geglu": "gelu"}
GTE_GATES = {"gelu": "gelu"}

# model types whose config class transformers does not ship: read by weir from config.json
REMOTE_TYPES = ("new", "gte")


def remote_config(raw: dict[str, Any]) -> Any:
    """A config.json of REMOTE_TYPES as a transformers config (its rotation kept as written, in
    `rope_parameters`, where transformers would check it against its own kinds)."""
    from transformers import PretrainedConfig

    raw = dict(raw)
    rope = {"rope_theta": float(raw.pop("rope_theta", 10000.0) or 10000.0)}
    scaling = raw.pop("rope_scaling", None) or {}
    if scaling:
        rope.update(scaling, rope_type=scaling.get("rope_type") or scaling.get("type"))
    raw.pop("rope_parameters", None)
    config = PretrainedConfig.from_dict(raw)
    config.rope_parameters = {"rope_type": "default", **rope}
    return config


def gte_fields(config: Any, arch: str) -> dict[str, Any]:
    """GTE's fields: NomicBERT's layer (norms after the blocks, a rotation, no position table)
    with biases on Q/K/V, the output and the down product, none on the gate and up products, a
    GELU gate; token types where it has them; the rotation at rope_theta, NTK-scaled where
    rope_scaling says so. What weir does not compute is refused by name."""
    raw = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    for key, want in (("position_embedding_type", "rope"), ("layer_norm_type", "layer_norm")):
        if raw.get(key, want) != want:
            raise CheckpointError(f"{arch} with {key} {raw[key]!r} is not served")
    act = str(raw.get("hidden_act", "gelu"))
    if act not in GTE_GATES:
        raise CheckpointError(f"{arch} with hidden_act {act!r} is not served (gelu)")
    positions = int(raw.get("max_position_embeddings", 8192))
    if raw.get("logn_attention_scale") and positions > 8192:  # (it scales past 8,192 only)
        raise CheckpointError(f"{arch} with logn_attention_scale past 8,192 positions")
    rope = dict(raw.get("rope_parameters") or {})
    kind = rope.get("rope_type") or "default"
    if kind not in ("default", "ntk"):
        raise CheckpointError(f"{arch} with rope_scaling {kind!r} is not served (ntk is)")
    mixed = rope.get("mixed_b")
    return dict(
        layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
        hidden_act=GTE_GATES[act],
        max_position_embeddings=positions,
        position_rows=0,
        pad_token_id=int(raw.get("pad_token_id") or 0),
        type_vocab_size=int(raw.get("type_vocab_size", 0) or 0),
        attention_bias=True,
        mlp_bias=True,
        gated_bias=False,
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        rope_ntk=float(rope.get("factor", 1.0)) if kind == "ntk" else 0.0,
        rope_mixed_b=float(mixed) if mixed is not None else None,
    )


def jina_fields(config: Any, arch: str) -> dict[str, Any]:
    """JinaBERT's fields: no position table (ALiBi: each head's scores less its slope times
    the two tokens' distance), token types, post-norm layers with biases, a gated MLP whose
    gate (the first half of `gated_layers`) is GELU'd (feed_forward_type geglu), no bias on
    the gate and up products, one on the down product (`wo`)."""
    raw = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    kind = raw.get("position_embedding_type", "alibi")
    if kind != "alibi":
        raise CheckpointError(f"{arch} with position_embedding_type {kind!r} (alibi only)")
    gate = raw.get("feed_forward_type", "geglu")
    if gate not in JINA_GATES:
        raise CheckpointError(
            f"{arch} with feed_forward_type {gate!r} is not served ({', '.join(JINA_GATES)})"
        )
    return dict(
        layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
        hidden_act=JINA_GATES[gate],
        max_position_embeddings=int(raw.get("max_position_embeddings", 8192)),
        position_rows=0,
        pad_token_id=int(raw.get("pad_token_id") or 0),
        type_vocab_size=int(raw.get("type_vocab_size", 0) or 0),
        mlp_bias=True,
        gated_bias=False,
    )
