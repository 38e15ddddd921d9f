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
from gpu.tiny_configs import tiny_config
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
    from transformers import AutoModelForCausalLM, GenerationConfig

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
    config = tiny_config(
        arch,
        common,
        hidden_size=hidden_size,
        num_heads=num_heads,
        head_dim=head_dim,
        tie_word_embeddings=tie_word_embeddings,
        sliding_window=sliding_window,
        global_every=global_every,
        query_pre_attn_scalar=query_pre_attn_scalar,
        num_experts=num_experts,
        experts_per_token=experts_per_token,
        norm_topk_prob=norm_topk_prob,
        shared_expert_size=shared_expert_size,
        softcaps=softcaps,
        dense_layers=dense_layers,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        rope_scaling=rope_scaling,
        mlp_bias=mlp_bias,
        attention_bias=attention_bias,
        num_layers=num_layers,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    drawn = arch.startswith(("glm", "helium", "seed", "starcoder", "stablelm")) or arch == "phi"
    if attention_bias or mlp_bias or drawn:
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
    # norm weights drawn (they start at one): a norm read at the wrong width or place shows
    norm_drawn = ("olmo", "glm", "exaone", "hunyuan", "cohere", "nemotron", "starcoder", "stablelm")
    if arch.startswith(norm_drawn) or arch in ("phi", "gemma"):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(1.0, 0.3)
    if arch == "apertus":  # each layer's xIELU parameters drawn (they start alike)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".act_fn." in name:
                    p.add_(torch.randn_like(p) * 0.3)
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
