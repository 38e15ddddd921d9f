"""The HF configs of GGUF decoders whose files llama.cpp's converter writes with keys of their own
(gpu/gguf_config.py reads the others): Granite and GraniteMoE (their four factors), SmolLM3,
Ministral 3 (its attention temperature and YaRN), Hunyuan's dense models, EXAONE 4, GLM-4, ERNIE
4.5, Seed-OSS, Cohere's Command R and Cohere 2, Arcee (its ungated MLP), Nemotron, StarCoder2,
Phi-2, Gemma 1, StableLM, Apertus and OLMo 1. Each reader takes the open file's HfConfigOf (`f`:
its `get`, `tensors`, `arch` and `path`), the fields every decoder shares and the head size."""

from __future__ import annotations

from typing import Any

from core.config import CheckpointError


def sliding_layers(pattern: int | list, n: int) -> list[bool]:
    """Which of n layers slide, as llama.cpp reads `attention.sliding_window_pattern`: a flag
    per layer, or a period (set_swa_pattern: every p-th layer global; 0 all sliding, 1 none)."""
    if isinstance(pattern, list):
        return [bool(p) for p in pattern]
    p = int(pattern)
    return [p == 0 or i % p < p - 1 for i in range(n)]


def granite(f: Any, common: dict, head_dim: int) -> Any:
    """Granite (its factors as llama.cpp reads them: an absent attention scale is 1/sqrt(head
    size), an absent embedding or residual one none; the logits' required), GraniteMoE (those
    over experts of feed_forward_length) or SmolLM3 (llama.cpp's every fourth layer unrotated,
    as its config's default)."""
    from transformers import GraniteConfig, GraniteMoeConfig, SmolLM3Config

    a = f.arch
    if head_dim * common["num_attention_heads"] != common["hidden_size"]:
        raise CheckpointError(f"{f.path.name}: {a} with a head size of {head_dim}")
    if a == "smollm3":
        return SmolLM3Config(**common, no_rope_layer_interval=4)
    factors = dict(
        attention_multiplier=float(f.get(f"{a}.attention.scale", 0.0) or head_dim**-0.5),
        embedding_multiplier=float(f.get(f"{a}.embedding_scale", 0.0) or 1.0),
        residual_multiplier=float(f.get(f"{a}.residual_scale", 0.0) or 1.0),
        logits_scaling=float(f.get(f"{a}.logit_scale")),
    )
    if a == "granite":
        return GraniteConfig(**common, **factors)
    if f.get(f"{a}.expert_shared_feed_forward_length", 0):
        raise CheckpointError(f"{f.path.name}: GraniteMoE's shared experts are not served")
    return GraniteMoeConfig(
        **common,
        **factors,
        num_local_experts=int(f.get(f"{a}.expert_count")),
        num_experts_per_tok=int(f.get(f"{a}.expert_used_count")),
    )


def mistral3(f: Any, common: dict, head_dim: int) -> Any:
    """Ministral 3 as llama.cpp reads its file: its attention temperature's beta
    (attention.temperature_scale) over YaRN's original context; YaRN's log multiplier as
    transformers' mscale_all_dim against an mscale of 1 (Ministral 3's: both 1, no factor on the
    rotation). Without a temperature it is Mistral 3's text model of Mistral Small: a Mistral."""
    from transformers import Ministral3Config, MistralConfig

    beta = float(f.get("mistral3.attention.temperature_scale", 0.0) or 0.0)
    if not beta:
        common["architectures"] = ["MistralForCausalLM"]
        return MistralConfig(**common, head_dim=head_dim)
    rope = common["rope_parameters"]
    if rope.get("rope_type") != "yarn":
        raise CheckpointError(f"{f.path.name}: a temperature scale without YaRN")
    rope.update(
        beta_fast=float(f.get("mistral3.rope.scaling.yarn_beta_fast", 32.0)),
        beta_slow=float(f.get("mistral3.rope.scaling.yarn_beta_slow", 1.0)),
        mscale=1.0,
        mscale_all_dim=float(f.get("mistral3.rope.scaling.yarn_log_multiplier", 1.0)),
        llama_4_scaling_beta=beta,
    )
    return Ministral3Config(**common, head_dim=head_dim)


def hunyuan(f: Any, common: dict, head_dim: int) -> Any:
    """Hunyuan's dense model: the file's base is the stretched one, a plain rotation."""
    from transformers import HunYuanDenseV1Config

    bias = "blk.0.attn_q.bias" in f.tensors
    return HunYuanDenseV1Config(**common, head_dim=head_dim, attention_bias=bias)


def exaone4(f: Any, common: dict, head_dim: int) -> Any:
    """EXAONE 4: its sliding layers by the file's pattern (the global ones unrotated)."""
    return _windowed(f, common, head_dim, "Exaone4Config")


def cohere(f: Any, common: dict, head_dim: int) -> Any:
    """Command R and Cohere 2: the layer norm's epsilon and logit_scale; Cohere 2's sliding
    layers by the file's pattern (llama.cpp's default: three of every four)."""
    from transformers import CohereConfig

    a = f.arch
    common.pop("rms_norm_eps")
    common["layer_norm_eps"] = float(f.get(f"{a}.attention.layer_norm_epsilon"))
    common["logit_scale"] = float(f.get(f"{a}.logit_scale"))
    if a == "command-r":
        return CohereConfig(**common)
    return _windowed(f, common, head_dim, "Cohere2Config", period=4)


def seed_oss(f: Any, common: dict, head_dim: int) -> Any:
    """Seed-OSS: Q/K/V biases and O's, each where the file has them."""
    from transformers import SeedOssConfig

    bias = "blk.0.attn_q.bias" in f.tensors
    out = "blk.0.attn_output.bias" in f.tensors
    return SeedOssConfig(
        **common, head_dim=head_dim, attention_bias=bias, attention_out_bias=out
    )


def glm4(f: Any, common: dict, head_dim: int) -> Any:
    """GLM-4 and ERNIE 4.5: Q/K/V biases (ERNIE's: on every product) where the file has them."""
    from transformers import Ernie4_5Config, Glm4Config

    bias = "blk.0.attn_q.bias" in f.tensors
    if f.arch == "ernie4_5":
        return Ernie4_5Config(**common, head_dim=head_dim, use_bias=bias)
    return Glm4Config(**common, head_dim=head_dim, attention_bias=bias)


def _windowed(f: Any, common: dict, head_dim: int, cls: str, period: int = 0) -> Any:
    """A config whose layer_types say which layers slide (the file's window and pattern; no
    window: every layer global)."""
    import transformers

    a, n = f.arch, common["num_hidden_layers"]
    window = int(f.get(f"{a}.attention.sliding_window", 0) or 0)
    pattern = f.get(f"{a}.attention.sliding_window_pattern", period or [0] * n)
    slides = sliding_layers(pattern, n) if window else [False] * n
    kinds = ["sliding_attention" if s else "full_attention" for s in slides]
    return getattr(transformers, cls)(
        **common, head_dim=head_dim, sliding_window=window or None, layer_types=kinds
    )


def arcee(f: Any, common: dict, head_dim: int) -> Any:
    """Arcee (AFM-4.5B): a Llama file (its Q/K rows permuted as Llama's) whose MLP is ungated,
    relu squared as llama.cpp computes it."""
    from transformers import ArceeConfig

    return ArceeConfig(**common, head_dim=head_dim, hidden_act="relu2")


def nemotron(f: Any, common: dict, head_dim: int) -> Any:
    """Nemotron: its layer norms' epsilon (layer_norm_epsilon), an ungated MLP of relu squared,
    part of each head rotated (rope.dimension_count)."""
    from transformers import NemotronConfig

    eps = common["rms_norm_eps"]
    return NemotronConfig(**common, head_dim=head_dim, norm_eps=eps, hidden_act="relu2")


def starcoder2(f: Any, common: dict, head_dim: int) -> Any:
    """StarCoder2: its layer norms' epsilon, biases on its products where the file has them,
    and no window (llama.cpp attends to the whole context; its converter writes none)."""
    from transformers import Starcoder2Config

    eps, bias = common["rms_norm_eps"], "blk.0.attn_q.bias" in f.tensors
    return Starcoder2Config(**common, norm_epsilon=eps, use_bias=bias, sliding_window=None)


def phi2(f: Any, common: dict, head_dim: int) -> Any:
    """Phi-2: its layer norm's epsilon, part of each head rotated (rope.dimension_count)."""
    from transformers import PhiConfig

    return PhiConfig(**common, layer_norm_eps=common["rms_norm_eps"], hidden_act="gelu_new")


def gemma(f: Any, common: dict, head_dim: int) -> Any:
    """Gemma 1: its head size (256 at 2B and 7B, not hidden / heads) and gelu's tanh form, as
    llama.cpp computes it (its norms' 1 + w: gpu/gguf_file.py)."""
    from transformers import GemmaConfig

    act = "gelu_pytorch_tanh"
    return GemmaConfig(**common, head_dim=head_dim, hidden_act=act, hidden_activation=act)


def stablelm(f: Any, common: dict, head_dim: int) -> Any:
    """StableLM: its layer norms' epsilon, Q/K/V biases where the file has them, both blocks on
    one norm where it says so (use_parallel_residual), part of each head rotated."""
    from transformers import StableLmConfig

    if "blk.0.attn_q_norm.weight" in f.tensors:
        raise CheckpointError(f"{f.path.name}: StableLM with Q/K layer norms is not served")
    return StableLmConfig(
        **common,
        layer_norm_eps=common["rms_norm_eps"],
        use_qkv_bias="blk.0.attn_q.bias" in f.tensors,
        use_parallel_residual=bool(f.get(f"{f.arch}.use_parallel_residual", False)),
    )


def apertus(f: Any, common: dict, head_dim: int) -> Any:
    """Apertus: Q/K norms, its head size, an ungated MLP of xIELU (whose parameters the file
    holds as metadata: gpu/gguf_file.py)."""
    from transformers import ApertusConfig

    return ApertusConfig(**common, head_dim=head_dim, hidden_act="xielu")


def olmo(f: Any, common: dict, head_dim: int) -> Any:
    """OLMo 1: layer norms without weights (their epsilon fixed), Q/K/V clamped where the file
    says (attention.clamp_kqv)."""
    from transformers import OlmoConfig

    return OlmoConfig(**common, clip_qkv=f.get(f"{f.arch}.attention.clamp_kqv", None))


FAMILIES = {
    "granite": granite,
    "granitemoe": granite,
    "smollm3": granite,
    "mistral3": mistral3,
    "hunyuan-dense": hunyuan,
    "exaone4": exaone4,
    "glm4": glm4,
    "ernie4_5": glm4,
    "seed_oss": seed_oss,
    "command-r": cohere,
    "cohere2": cohere,
    "arcee": arcee,
    "nemotron": nemotron,
    "starcoder2": starcoder2,
    "phi2": phi2,
    "gemma": gemma,
    "stablelm": stablelm,
    "apertus": apertus,
    "olmo": olmo,
}
