"""The tiny models' configs, one architecture each: the shapes gpu/tiny_model.py writes, with each
family's own settings chosen so that what distinguishes it shows in a test (windows shorter than
the prompts, factors far from 1, biases and norm weights drawn by the caller)."""

from __future__ import annotations

from typing import Any


def tiny_config(
    arch: str,
    common: dict[str, Any],
    *,
    hidden_size,
    num_heads,
    head_dim,
    tie_word_embeddings,
    sliding_window,
    global_every,
    query_pre_attn_scalar,
    num_experts,
    experts_per_token,
    norm_topk_prob,
    shared_expert_size,
    softcaps,
    dense_layers,
    intermediate_size,
    max_position_embeddings,
    rope_scaling,
    mlp_bias,
    attention_bias,
    num_layers,
) -> Any:
    """`arch`'s transformers config of `common`'s shape (build_tiny_model's arguments)."""
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    if arch == "llama":
        config = LlamaConfig(
            **common,
            tie_word_embeddings=bool(tie_word_embeddings),
            mlp_bias=mlp_bias,
            attention_bias=attention_bias,
        )
    elif arch == "mistral":
        config = MistralConfig(
            **common, tie_word_embeddings=bool(tie_word_embeddings), sliding_window=sliding_window
        )
    elif arch == "phi3":  # fused qkv_proj and gate_up_proj; original_max_position_embeddings
        # as its configs carry it (LongRoPE's pretrained length)
        config = Phi3Config(
            **common,
            tie_word_embeddings=bool(tie_word_embeddings),
            sliding_window=sliding_window,
            original_max_position_embeddings=(rope_scaling or {}).get(
                "original_max_position_embeddings", max_position_embeddings
            ),
        )
    elif arch == "gemma3":  # every third layer global, the others a window of sliding_window
        config = Gemma3TextConfig(
            **common,
            head_dim=head_dim or hidden_size // num_heads,
            tie_word_embeddings=tie_word_embeddings is not False,
            sliding_window=sliding_window or 8,
            layer_types=[
                "full_attention" if (i + 1) % global_every == 0 else "sliding_attention"
                for i in range(num_layers)
            ],
            query_pre_attn_scalar=query_pre_attn_scalar or 24,
        )
        config.architectures = ["Gemma3ForCausalLM"]
    elif arch == "gemma2":  # every other layer global; scores and logits soft-capped
        config = Gemma2Config(
            **common,
            head_dim=head_dim or hidden_size // num_heads,
            tie_word_embeddings=tie_word_embeddings is not False,
            sliding_window=sliding_window or 8,
            layer_types=[
                "full_attention" if (i + 1) % 2 == 0 else "sliding_attention"
                for i in range(num_layers)
            ],
            query_pre_attn_scalar=query_pre_attn_scalar or 24,
            attn_logit_softcapping=softcaps[0],
            final_logit_softcapping=softcaps[1],
        )
    elif arch == "qwen2":
        config = Qwen2Config(**common, tie_word_embeddings=tie_word_embeddings is not False)
    elif arch == "qwen3":
        config = Qwen3Config(
            **common,
            head_dim=head_dim or hidden_size // num_heads,
            tie_word_embeddings=tie_word_embeddings is not False,
        )
    elif arch == "mixtral":
        config = MixtralConfig(
            **common,
            tie_word_embeddings=bool(tie_word_embeddings),
            sliding_window=sliding_window,
            num_local_experts=num_experts,
            num_experts_per_tok=experts_per_token,
        )
    elif arch == "qwen3_moe":  # the dense intermediate_size is unused: every layer sparse
        config = Qwen3MoeConfig(
            **common,
            head_dim=head_dim or hidden_size // num_heads,
            tie_word_embeddings=bool(tie_word_embeddings),
            moe_intermediate_size=intermediate_size,
            num_experts=num_experts,
            num_experts_per_tok=experts_per_token,
            norm_topk_prob=norm_topk_prob,
        )
    elif arch == "qwen2_moe":  # and its shared expert
        config = Qwen2MoeConfig(
            **common,
            tie_word_embeddings=bool(tie_word_embeddings),
            moe_intermediate_size=intermediate_size,
            shared_expert_intermediate_size=shared_expert_size or 2 * intermediate_size,
            num_experts=num_experts,
            num_experts_per_tok=experts_per_token,
            norm_topk_prob=norm_topk_prob,
            mlp_only_layers=list(dense_layers),
        )
    elif arch == "gpt_oss":  # every other layer sliding; its default YaRN rotation
        from transformers import GptOssConfig

        config = GptOssConfig(
            **common,
            head_dim=head_dim or hidden_size // num_heads,
            tie_word_embeddings=bool(tie_word_embeddings),
            sliding_window=sliding_window or 8,
            num_local_experts=num_experts,
            num_experts_per_tok=experts_per_token,
        )
    elif arch == "olmo2":  # norms after the blocks only; Q/K norms over all heads
        from transformers import Olmo2Config

        config = Olmo2Config(**common, tie_word_embeddings=bool(tie_word_embeddings))
    elif arch == "olmo3":  # OLMo 2's layer, every third layer global, the others a window
        from transformers import Olmo3Config

        config = Olmo3Config(
            **common,
            tie_word_embeddings=bool(tie_word_embeddings),
            sliding_window=sliding_window or 8,
            layer_types=[
                "full_attention" if (i + 1) % global_every == 0 else "sliding_attention"
                for i in range(num_layers)
            ],
        )
    elif arch == "olmoe":  # OLMo's Q/K norms over experts of intermediate_size
        from transformers import OlmoeConfig

        config = OlmoeConfig(
            **common,
            tie_word_embeddings=bool(tie_word_embeddings),
            num_experts=num_experts,
            num_experts_per_tok=experts_per_token,
            norm_topk_prob=norm_topk_prob,
        )
    elif arch == "granite":  # Llama's layer with Granite 3's four factors, far from 1 (the
        # embeddings' smaller than its 12: at this initialization they would drown the blocks)
        from transformers import GraniteConfig

        config = GraniteConfig(
            **common,
            tie_word_embeddings=tie_word_embeddings is not False,
            embedding_multiplier=2.5,
            attention_multiplier=0.0625,
            residual_multiplier=0.45,
            logits_scaling=8.0,
        )
    elif arch == "granitemoe":  # Granite's factors (as "granite") over experts
        from transformers import GraniteMoeConfig

        config = GraniteMoeConfig(
            **common,
            tie_word_embeddings=tie_word_embeddings is not False,
            embedding_multiplier=2.5,
            attention_multiplier=0.0625,
            residual_multiplier=0.45,
            logits_scaling=8.0,
            num_local_experts=num_experts,
            num_experts_per_tok=experts_per_token,
        )
    elif arch in ("glm", "glm4"):  # half of each head turned by adjacent pairs; Q/K/V biases
        from transformers import Glm4Config, GlmConfig

        config = (GlmConfig if arch == "glm" else Glm4Config)(
            **common,
            head_dim=head_dim or hidden_size // num_heads,
            tie_word_embeddings=bool(tie_word_embeddings),
            attention_bias=True,
            partial_rotary_factor=0.5,
        )
    elif arch == "exaone4":  # every third layer global (unrotated), the others a window of 8
        from transformers import Exaone4Config

        config = Exaone4Config(
            **common,
            head_dim=head_dim or hidden_size // num_heads,
            tie_word_embeddings=bool(tie_word_embeddings),
            sliding_window=sliding_window or 8,
            sliding_window_pattern=global_every,
        )
    elif arch == "ministral3":  # YaRN over a pretrained context of 8 (the temperature past it)
        from transformers import Ministral3Config

        config = Ministral3Config(
            **common,
            head_dim=head_dim or hidden_size // num_heads,
            tie_word_embeddings=bool(tie_word_embeddings),
            rope_parameters={
                "rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0,
                "original_max_position_embeddings": 8, "beta_fast": 32.0, "beta_slow": 1.0,
                "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1,
            },  # fmt: skip
        )
    elif arch == "hunyuan":  # Q/K norms after the rotation; NTK alpha's stretched base
        from transformers import HunYuanDenseV1Config

        config = HunYuanDenseV1Config(
            **common,
            head_dim=head_dim or hidden_size // num_heads,
            tie_word_embeddings=tie_word_embeddings is not False,
            rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 50.0,
                             "factor": 1.0},  # fmt: skip
        )
    elif arch == "helium":  # each head turned by adjacent pairs; Q/K/V and MLP biases drawn
        from transformers import HeliumConfig

        config = HeliumConfig(
            **common,
            head_dim=head_dim or hidden_size // num_heads,
            tie_word_embeddings=bool(tie_word_embeddings),
            attention_bias=True,
            mlp_bias=mlp_bias,
        )
    elif arch == "ernie4_5":  # each head turned by adjacent pairs
        from transformers import Ernie4_5Config

        config = Ernie4_5Config(
            **common,
            head_dim=head_dim or hidden_size // num_heads,
            tie_word_embeddings=tie_word_embeddings is not False,
            use_bias=attention_bias,
        )
    elif arch == "granite4":  # Granite 4.0's transformer-only shape (granite-4.0-micro's)
        from transformers import GraniteMoeHybridConfig

        config = GraniteMoeHybridConfig(
            **common,
            tie_word_embeddings=tie_word_embeddings is not False,
            embedding_multiplier=2.5,
            attention_multiplier=0.0625,
            residual_multiplier=0.45,
            logits_scaling=8.0,
            num_local_experts=0,
            shared_intermediate_size=intermediate_size,
            position_embedding_type="rope",
            layer_types=["attention"] * num_layers,
        )
    elif arch in ("cohere", "cohere2"):  # Cohere 2: every third layer global (unrotated)
        from transformers import Cohere2Config, CohereConfig

        extra = {} if arch == "cohere" else dict(sliding_window=sliding_window or 8)
        if arch == "cohere2":
            extra["layer_types"] = [
                "full_attention" if (i + 1) % global_every == 0 else "sliding_attention"
                for i in range(num_layers)
            ]
        config = (CohereConfig if arch == "cohere" else Cohere2Config)(
            **common,
            tie_word_embeddings=tie_word_embeddings is not False,
            logit_scale=0.25,
            **extra,
        )
    elif arch == "seed_oss":  # Q/K/V biases, and O's apart (drawn by the caller)
        from transformers import SeedOssConfig

        config = SeedOssConfig(
            **common,
            head_dim=head_dim or hidden_size // num_heads,
            tie_word_embeddings=bool(tie_word_embeddings),
            attention_bias=True,
            attention_out_bias=attention_bias,
        )
    elif arch == "smollm3":  # every fourth layer without rotation (no_rope_layer_interval)
        from transformers import SmolLM3Config

        config = SmolLM3Config(**common, tie_word_embeddings=tie_word_embeddings is not False)
    elif arch == "arcee":  # Llama's layer, its MLP ungated: down(relu(up(x))^2)
        from transformers import ArceeConfig

        config = ArceeConfig(
            **common, tie_word_embeddings=bool(tie_word_embeddings), mlp_bias=mlp_bias
        )
    elif arch == "starcoder2":  # layer norms with a bias, biases on every product (drawn by the
        from transformers import Starcoder2Config  # caller), an ungated MLP, one window

        config = Starcoder2Config(
            **common,
            tie_word_embeddings=tie_word_embeddings is not False,
            sliding_window=sliding_window,
            use_bias=True,
            norm_epsilon=1e-5,
        )
    elif arch == "gemma":  # Gemma 1: Llama's layer, Gemma's norms, scaled embeddings, its gate
        from transformers import GemmaConfig

        config = GemmaConfig(
            **common,
            head_dim=head_dim or hidden_size // num_heads,
            tie_word_embeddings=tie_word_embeddings is not False,
            hidden_act="gelu_pytorch_tanh",
        )
    elif arch == "stablelm":  # layer norms with a bias, a quarter of each head rotated, Q/K/V
        from transformers import StableLmConfig  # biases (drawn by the caller); `global_every`
        # 1: attention and MLP side by side (use_parallel_residual)

        config = StableLmConfig(
            **common,
            tie_word_embeddings=bool(tie_word_embeddings),
            use_qkv_bias=True,
            use_parallel_residual=global_every == 1,
            layer_norm_eps=1e-5,
        )
    elif arch == "apertus":  # Llama's layer with Q/K norms, an ungated MLP of xIELU (its
        from transformers import ApertusConfig  # parameters drawn by the caller)

        config = ApertusConfig(
            **common,
            tie_word_embeddings=bool(tie_word_embeddings),
            dtype="float32",
            rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        )
    elif arch == "olmo":  # OLMo 1: layer norms without weights, Q/K/V clipped at 0.5 (where
        from transformers import OlmoConfig  # the tiny model's products reach past it)

        config = OlmoConfig(**common, tie_word_embeddings=bool(tie_word_embeddings), clip_qkv=0.5)
    elif arch == "phi":  # Phi-2: side by side on a layer norm with a bias, biases everywhere
        from transformers import PhiConfig  # (drawn by the caller), 0.4 of each head rotated

        rope = {"rope_theta": 10000.0, "partial_rotary_factor": 0.4, "rope_type": "default"}
        config = PhiConfig(
            **{**common, "rope_parameters": rope, "num_key_value_heads": num_heads},
            tie_word_embeddings=bool(tie_word_embeddings),
            layer_norm_eps=1e-5,
        )
    elif arch == "nemotron":  # Arcee's ungated MLP, layer norms 1 + w with a bias, half a head
        from transformers import NemotronConfig  # rotated (norms drawn by the caller)

        rope = {"rope_theta": 10000.0, "partial_rotary_factor": 0.5, "rope_type": "default"}
        config = NemotronConfig(
            **{**common, "rope_parameters": rope},
            head_dim=head_dim or hidden_size // num_heads,
            tie_word_embeddings=bool(tie_word_embeddings),
            norm_eps=1e-5,
        )
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}")
    return config
