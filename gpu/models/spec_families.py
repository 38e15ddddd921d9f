"""Each family's own ModelSpec fields (gpu/models/spec.py), read from its Hugging Face config:
mixtures of experts, gpt-oss, Gemma 2 and 3, Granite 3 and 4, SmolLM3, Ministral 3's attention
temperature and EXAONE 4's layer; what a family has that weir does not compute is refused here by
name."""

from __future__ import annotations

from typing import Any

from core.config import CheckpointError
from gpu.models.rope import rope_parameters


def moe(config: Any, arch: str) -> dict[str, Any]:
    """A mixture of experts' fields: Mixtral's (every layer sparse, its chosen experts' weights
    always renormalized) or Qwen3-MoE's and Qwen2-MoE's (norm_topk_prob; dense layers by
    mlp_only_layers and decoder_sparse_step, as transformers builds them; Qwen2-MoE's shared
    expert)."""
    experts = int(getattr(config, "num_local_experts", None) or getattr(config, "num_experts", 0))
    k = int(getattr(config, "num_experts_per_tok", 0) or 0)
    if not 0 < k <= experts:
        raise CheckpointError(f"{arch} with {k} experts per token of {experts}")
    n = config.num_hidden_layers
    if arch in ("MixtralForCausalLM", "GptOssForCausalLM", "GraniteMoeForCausalLM"):
        # the top k's softmax: renormalized
        size, norm, dense = config.intermediate_size, True, ()
    elif arch == "OlmoeForCausalLM":  # every layer sparse, its experts of intermediate_size
        size, norm, dense = config.intermediate_size, bool(config.norm_topk_prob), ()
    else:
        size = int(config.moe_intermediate_size)
        norm = bool(getattr(config, "norm_topk_prob", False))
        step = int(getattr(config, "decoder_sparse_step", 1) or 1)
        only = set(getattr(config, "mlp_only_layers", None) or ())
        dense = tuple(i for i in range(n) if i in only or (i + 1) % step)
    return dict(
        num_experts=experts,
        experts_per_token=k,
        moe_intermediate_size=size,
        norm_topk_prob=norm,
        dense_layers=dense,
        shared_expert_size=int(getattr(config, "shared_expert_intermediate_size", 0) or 0),
    )


def gpt_oss(config: Any) -> dict[str, Any]:
    """gpt-oss's fields: sliding and full layers by layer_types, sinks, the router's bias, the
    experts' biases and clamped SwiGLU."""
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None) or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)
    ]
    window = int(getattr(config, "sliding_window", 0) or 0)
    return dict(
        layer_windows=tuple(window if t == "sliding_attention" else 0 for t in types),
        attn_sinks=True,
        router_bias=True,
        mlp_bias=True,
        # transformers 5.17 (the GPU image's) has no such fields (its experts hold the constants);
        # gpt-oss's own config.json names the limit alone: its reference's 7.0 and 1.702
        swiglu_limit=float(getattr(config, "swiglu_limit", 7.0)),
        swiglu_alpha=float(getattr(config, "swiglu_alpha", 1.702)),
    )


def gemma(config: Any, arch: str) -> dict[str, Any]:
    """Gemma 3's and Gemma 2's fields (refusing what weir does not compute: bidirectional
    attention)."""
    if getattr(config, "use_bidirectional_attention", False):
        raise CheckpointError(f"{arch} with bidirectional attention is not served")
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if not types:  # transformers 4's configs: every pattern-th layer global
        pattern = int(getattr(config, "sliding_window_pattern", 6) or 1)
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding" for i in range(n)]
    window = int(getattr(config, "sliding_window", 0) or 0)
    if not window and any(t != "full_attention" for t in types):
        # its sliding layers would still turn with their own rotation: not what weir computes
        raise CheckpointError(f"{arch} with sliding layers but no sliding_window is not served")
    scalar = getattr(config, "query_pre_attn_scalar", None)
    return dict(
        layer_windows=tuple(window if t != "full_attention" else 0 for t in types),
        embed_scale=float(config.hidden_size) ** 0.5,
        attn_scale=float(scalar) ** -0.5 if scalar else 0.0,
        sandwich_norms=True,
        norm_plus_one=True,
        attn_softcap=float(getattr(config, "attn_logit_softcapping", None) or 0.0),
        final_softcap=float(getattr(config, "final_logit_softcapping", None) or 0.0),
        hidden_act=getattr(config, "hidden_activation", None) or "gelu_pytorch_tanh",
        # its positions are the model's own (a linear scaling's factor is inside them)
        max_position_embeddings=int(config.max_position_embeddings),
    )


def granite(config: Any, arch: str) -> dict[str, Any]:
    """Granite's four factors (its config's multipliers; 1 where absent). Its biases are
    refused: the residual factor is taken on the products' inputs, which holds without them
    (no released Granite has any)."""
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise CheckpointError(f"{arch} with attention_bias or mlp_bias is not served")
    scaling = float(getattr(config, "logits_scaling", 1.0) or 1.0)
    return dict(
        embed_scale=float(getattr(config, "embedding_multiplier", 1.0)),
        attn_scale=float(getattr(config, "attention_multiplier", 0.0) or 0.0),
        residual_scale=float(getattr(config, "residual_multiplier", 1.0)),
        logits_scaling=scaling,
    )


def smollm3(config: Any, arch: str) -> dict[str, Any]:
    """SmolLM3's NoPE layers: those whose no_rope_layers flag is 0 (every fourth unless the
    config lists them). Its optional sliding layers are refused (released ones have none)."""
    if getattr(config, "use_sliding_window", False):
        raise CheckpointError(f"{arch} with use_sliding_window is not served")
    n = config.num_hidden_layers
    flags = getattr(config, "no_rope_layers", None)
    if flags is None:
        every = int(getattr(config, "no_rope_layer_interval", 4) or 4)
        flags = [int((i + 1) % every != 0) for i in range(n)]
    if len(flags) != n:
        raise CheckpointError(f"{arch}: no_rope_layers has {len(flags)} flags for {n} layers")
    return dict(nope_layers=tuple(i for i, f in enumerate(flags) if not f))


def query_scale(config: Any, arch: str) -> dict[str, Any]:
    """Ministral 3's attention temperature: its beta and the rotation's pretrained context."""
    params = rope_parameters(config)
    beta = float(params.get("llama_4_scaling_beta") or 0.0)
    if not beta:
        return {}
    length = int(params.get("original_max_position_embeddings") or 0)
    if length <= 0:
        raise CheckpointError(
            f"{arch}: llama_4_scaling_beta without original_max_position_embeddings"
        )
    return dict(query_scale_beta=beta, query_scale_length=length)


def exaone4(config: Any) -> dict[str, Any]:
    """EXAONE 4.0's layer: norms after its blocks only, and, with a sliding window, its sliding
    layers (layer_types) rotated and its global ones not (none slide without a window: every
    layer global and rotated, as EXAONE-4.0-1.2B)."""
    fields: dict[str, Any] = dict(post_norms_only=True, sandwich_norms=True)
    window = int(getattr(config, "sliding_window", None) or 0)
    if window:
        types = config.layer_types
        fields.update(
            layer_windows=tuple(window * (t == "sliding_attention") for t in types),
            nope_layers=tuple(i for i, t in enumerate(types) if t != "sliding_attention"),
        )
    return fields


def granite4(config: Any, arch: str) -> dict[str, Any]:
    """Granite 4.0's transformer-only layers: its MLP of shared_intermediate_size, every layer
    unrotated where its position_embedding_type is not "rope". Mamba layers and experts are
    refused by name (weir has neither a Mamba layer nor an expert mixture beside a shared MLP)."""
    kinds = set(getattr(config, "layer_types", None) or ["attention"])
    others = kinds - {"attention", "full_attention"}  # (transformers 5's name for the first)
    if others:  # Mamba's: "mamba", transformers 5's "linear_attention"
        raise CheckpointError(f"{arch} with {sorted(others)} layers is not served")
    if int(getattr(config, "num_local_experts", 0) or 0):
        raise CheckpointError(f"{arch} with experts beside its shared MLP is not served")
    fields: dict[str, Any] = dict(intermediate_size=int(config.shared_intermediate_size))
    if getattr(config, "position_embedding_type", None) != "rope":
        fields.update(nope_layers=tuple(range(config.num_hidden_layers)))
    return fields


def cohere(config: Any, arch: str) -> dict[str, Any]:
    """Cohere's layer (its layer norms, attention and MLP side by side, adjacent pairs turned,
    the logits times logit_scale) and Cohere 2's windows: its sliding layers rotated, its global
    ones not. Per-head Q/K layer norms (command-r-plus's use_qk_norm) are refused by name."""
    if getattr(config, "use_qk_norm", False):
        raise CheckpointError(f"{arch} with use_qk_norm is not served")
    fields: dict[str, Any] = dict(
        layer_norm=True,
        parallel_block=True,
        rope_interleaved=True,
        logits_scaling=1.0 / float(config.logit_scale),
    )
    window = int(getattr(config, "sliding_window", None) or 0)
    if arch == "Cohere2ForCausalLM" and window:
        types = config.layer_types
        fields.update(
            layer_windows=tuple(window * (t == "sliding_attention") for t in types),
            nope_layers=tuple(i for i, t in enumerate(types) if t != "sliding_attention"),
        )
    return fields
