"""The built-in tiny model: random weights plus a byte-level BPE tokenizer trained on made-up text.

Written once as a normal Hugging Face directory (config.json, model.safetensors, tokenizer files
with a ChatML template) and then loaded like any checkpoint. Tests build their own with
`build_tiny_model`. Its answers are noise: it exists to exercise the whole serving path offline.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from gpu.cache import cache_dir
from gpu.tiny_tokenizer import train_tokenizer

TINY_NAME = "weir-tiny"
TINY_VERSION = 1


def build_tiny_model(
    path: str | Path,
    arch: str = "qwen3",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 1024,
    max_position_embeddings: int = 4096,
    tie_word_embeddings: bool | None = None,
    seed: int = 0,
    rope_scaling: dict | None = None,
    initializer_range: float = 0.2,
    shard_bytes: str | int | None = None,
    sliding_window: int | None = None,
    head_dim: int | None = None,
    model_vocab_size: int | None = None,
    dtype: str = "float32",
    added_tokens: tuple[str, ...] = (),
    special_tokens: tuple[str, ...] = (),
    extra_eos: tuple[str, ...] = (),
    zero_padding_rows: bool = False,
    mlp_bias: bool = False,
    attention_bias: bool = False,
    pretokenizer: str = "gpt-2",
    global_every: int = 3,
    query_pre_attn_scalar: int | None = None,
    num_experts: int = 4,
    experts_per_token: int = 2,
    norm_topk_prob: bool = True,
    shared_expert_size: int | None = None,
    softcaps: tuple[float, float] = (50.0, 30.0),
    dense_layers: tuple[int, ...] = (),
) -> Path:
    """Write a random-weight model of the given shape with a trained tokenizer to `path`.
    `added_tokens`: whole-text tokens added to the vocabulary, not special (as Qwen3's
    `<think>` and `</think>` are: they stay in the decoded text); `special_tokens` are added as
    special (as Mistral's [TOOL_CALLS]: skipped in decoded text unless asked). `extra_eos`:
    tokens listed after `<|im_end|>` in generation_config.json's eos_token_id (as Llama 3 lists
    two).
    `zero_padding_rows`: the output rows past the tokenizer's tokens zeroed, so that greedy
    decoding (whose best logit over random rows is positive) never picks a token without text,
    as a real model never does; the matrix products keep their full size. `mlp_bias`: biases
    on the MLP's products, `attention_bias` on Q/K/V and O (Llama's config options; drawn at
    random). `pretokenizer`: how the tokenizer splits
    text (train_tokenizer). Gemma 3: every `global_every`-th layer global, the others sliding;
    `query_pre_attn_scalar` (24 unless given); Gemma 2 ("gemma2"): every other layer global, its
    attention scores' and logits' `softcaps`. Mixtral, Qwen3-MoE and Qwen2-MoE ("mixtral",
    "qwen3_moe", "qwen2_moe"): `num_experts` of `intermediate_size` each, `experts_per_token` of
    them per token (Qwen's renormalized when `norm_topk_prob`); Qwen2-MoE's shared expert of
    `shared_expert_size` (twice an expert's unless given), and `dense_layers` (mlp_only_layers)
    with a dense MLP of `intermediate_size` instead. gpt-oss ("gpt_oss"): every other layer a
    window of `sliding_window` (8 unless given), `num_experts` of `intermediate_size`, random
    biases and sinks. OLMo 2, OLMo 3 (every `global_every`-th layer global, the others a window of
    `sliding_window`, 8 unless given) and OLMoE ("olmo2", "olmo3", "olmoe": `num_experts` of
    `intermediate_size`): random norm weights. Granite ("granite"): Granite 3's factors
    (GraniteMoE, "granitemoe": over `num_experts`); SmolLM3 ("smollm3"): every fourth layer
    unrotated; GLM and GLM-4 ("glm", "glm4"): half of each head turned by adjacent pairs, random
    Q/K/V biases and norm weights; ERNIE 4.5 ("ernie4_5"): each head turned so, biases on every
    product with `attention_bias`; EXAONE 4 ("exaone4"): OLMo 2's layer with per-head Q/K norms,
    every `global_every`-th layer global and unrotated, the others a window of `sliding_window`
    (8 unless given); Ministral 3 ("ministral3"): YaRN from a context of 8, past
    which its attention temperature rises."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        Gemma2Config,
        Gemma3TextConfig,
        GenerationConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(vocab_size, seed, pretokenizer)
    if added_tokens:
        tokenizer.add_tokens(list(added_tokens))
    if special_tokens:
        tokenizer.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    common = dict(
        # A model may have more embedding rows than the tokenizer has tokens (Qwen pads to 151,936).
        vocab_size=max(model_vocab_size or 0, len(tokenizer)),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=eos,
        bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=initializer_range,
    )
    if rope_scaling is not None:
        common["rope_parameters"] = {"rope_theta": 10000.0, **rope_scaling}
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
    elif arch == "smollm3":  # every fourth layer without rotation (no_rope_layer_interval)
        from transformers import SmolLM3Config

        config = SmolLM3Config(**common, tie_word_embeddings=tie_word_embeddings is not False)
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    if attention_bias or mlp_bias or arch.startswith(("glm", "helium")):  # drawn (from zero)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0.0, 0.5)
    if arch == "gpt_oss":  # biases and sinks drawn too (they start at zero), large enough to
        with torch.no_grad():  # matter, and experts that reach the activation's clamp
            for name, p in model.named_parameters():
                if name.endswith(("bias", "sinks")):
                    p.normal_(0.0, 0.5)
                elif ".experts." in name:
                    p.mul_(20.0)
    if arch.startswith(("olmo", "glm", "exaone")):  # norm weights drawn (they start at one): a norm
        with torch.no_grad():  # read at the wrong width or place shows
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(1.0, 0.3)
    if zero_padding_rows:
        with torch.no_grad():
            model.get_output_embeddings().weight[len(tokenizer) :] = 0
    kwargs = {"max_shard_size": shard_bytes} if shard_bytes is not None else {}
    model.save_pretrained(path, **kwargs)
    eos_ids = [eos, *tokenizer.convert_tokens_to_ids(list(extra_eos))]
    GenerationConfig(eos_token_id=eos_ids, bos_token_id=None).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def ensure_tiny_model() -> Path:
    """The built-in model's directory, built on first use (atomically: a crash leaves nothing)."""
    final = cache_dir() / f"{TINY_NAME}-v{TINY_VERSION}"
    if (final / "config.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=final.parent))
    try:
        build_tiny_model(
            tmp,
            "qwen3",
            hidden_size=128,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=384,
            vocab_size=2048,
            max_position_embeddings=4096,
        )
        try:
            tmp.rename(final)
        except OSError:  # another process won the race; use theirs
            if not (final / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
