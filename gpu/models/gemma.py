"""Gemma 3's (and Gemma 2's) layer: a norm before and after each block (attention, then the
MLP), each block's output normalized before its residual add, as transformers'
Gemma3DecoderLayer computes it:

    x = x + post_attention_layernorm(attention(input_layernorm(x)))
    x = x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))

OLMo 2's layer is this one with the two norms before the blocks left out (identities).
Gemma's other differences are data: norm weights w stored as 1 + w at load (gpu/loader.py), the
embeddings scaled by sqrt(hidden), the attention scale from query_pre_attn_scalar, a window on
the sliding layers, which turn with their own rotation (gpu/models/spec.py, rope.py)."""

from __future__ import annotations


def sandwich_forward(layer, x, h, cos, sin, kv, meta, next_norm, lora=None):
    """The layer over the residual stream x, given h = input_layernorm(x): (next_norm(y), y) of
    its output y. Under tensor parallelism each block's row-parallel output is a partial sum,
    completed by one all-reduce before its norm."""
    tp = layer.tp
    a = layer.self_attn(h, cos, sin, kv, meta, None, lora=lora)
    if tp is not None:
        a = tp.all_reduce(a)
    x = x + layer.post_attention_layernorm(a)
    m = layer.mlp(layer.pre_feedforward_layernorm(x), lora=lora)
    if tp is not None:
        m = tp.all_reduce(m)
    x = x + layer.post_feedforward_layernorm(m)
    return next_norm(x), x
