"""ModelSpec: the few numbers and switches a decoder needs, read from a Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.config import CheckpointError
from gpu.models import spec_families as families
from gpu.models.rope import context_length, rope_parameters

# Architecture -> how it differs from plain Llama. Mistral is Llama with its own config defaults;
# Phi-3 is Llama with Q/K/V and gate/up each one tensor in its checkpoint (gpu/fused_weights.py)
# and LongRoPE (rope.py).
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"qk_norm": False},
    # Cohere (aya-expanse-8b, command-r: CohereForCausalLM) and Cohere 2 (command-r7b: its
    # sliding layers rotated beside global ones that are not): attention and MLP side by side on
    # one mean-centred layer norm, GLM's rotation of adjacent pairs, the logits scaled
    "CohereForCausalLM": {"qk_norm": False, "cohere": True},
    "Cohere2ForCausalLM": {"qk_norm": False, "cohere": True},
    # Seed-OSS (Seed-OSS-36B): Llama's layer, Q/K/V biases (attention_bias) apart from O's
    # (attention_out_bias)
    "SeedOssForCausalLM": {"qk_norm": False, "seed_oss": True},
    # InternLM3 (internlm3-8b-instruct): Llama's model under its own name (transformers reads its
    # config as Llama's, qkv_bias and bias as attention_bias and mlp_bias)
    "InternLM3ForCausalLM": {"qk_norm": False},
    # Arcee (AFM-4.5B): Llama's layer with an ungated MLP, down(relu(up(x))^2)
    "ArceeForCausalLM": {"qk_norm": False, "ungated": True},
    # Nemotron (Nemotron-Mini-4B, Minitron): Arcee's ungated MLP under layer norms with a bias
    # whose weights are stored as w where 1 + w multiplies, half of each head rotated
    "NemotronForCausalLM": {"qk_norm": False, "ungated": True, "nemotron": True},
    # StarCoder2 (3B, 7B, 15B): layer norms with a bias, an ungated MLP (c_fc, c_proj:
    # gpu/models/renames.py), biases on every product (use_bias), one window for every layer
    "Starcoder2ForCausalLM": {"qk_norm": False, "ungated": True, "starcoder2": True},
    # Phi-2 and Phi-1.5 (PhiForCausalLM): attention and an ungated gelu MLP side by side on one
    # layer norm with a bias (as Cohere's), biases on every product and on the LM head, part of
    # each head rotated; dense, fc1, fc2 and final_layernorm by their names (renames.py)
    "PhiForCausalLM": {"qk_norm": False, "ungated": True, "phi": True},
    # StableLM (stablelm-2-1_6b, stablelm-zephyr-3b, stablelm-3b-4e1t): Llama's layer under layer
    # norms with a bias, a quarter of each head rotated, Q/K/V biases where use_qkv_bias, both
    # blocks on one norm where use_parallel_residual
    "StableLmForCausalLM": {"qk_norm": False, "stablelm": True},
    # Apertus (Apertus-8B, -70B): Llama's layer with Q/K norms, its norms by their own names
    # (renames.py) and an ungated MLP of xIELU, each layer's four parameters its own (mlp.py)
    "ApertusForCausalLM": {"qk_norm": True, "ungated": True},
    # OLMo (1: OLMo-1B/7B, 0424, 0724): Llama's layer under layer norms without weights, Q/K/V
    # clamped after their products (clip_qkv)
    "OlmoForCausalLM": {"qk_norm": False, "olmo1": True},
    "MistralForCausalLM": {"qk_norm": False},
    "Phi3ForCausalLM": {"qk_norm": False},
    # Gemma 3 (text): norms before and after each block, weights as 1 + w, scaled embeddings,
    # its own attention scale, sliding layers with their own rotation (gpu/models/gemma.py)
    "Gemma3ForCausalLM": {"qk_norm": True, "gemma": True},
    # Gemma (1: gemma-2b/7b, CodeGemma): Llama's layer with Gemma's norms (1 + w), scaled
    # embeddings and its gelu (tanh) gate
    "GemmaForCausalLM": {"qk_norm": False, "gemma1": True},
    # Gemma 2: Gemma 3's layer without Q/K norms, its attention scores and logits soft-capped
    "Gemma2ForCausalLM": {"qk_norm": False, "gemma": True},
    "Qwen2ForCausalLM": {"qk_norm": False, "qkv_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
    # mixtures of experts in place of the MLP (gpu/models/moe.py)
    "MixtralForCausalLM": {"qk_norm": False, "moe": True},
    "Qwen3MoeForCausalLM": {"qk_norm": True, "moe": True},
    # Qwen2's attention (Q/K/V biases) over a mixture with one shared expert beside it
    "Qwen2MoeForCausalLM": {"qk_norm": False, "qkv_bias": True, "moe": True},
    # gpt-oss: every other layer sliding, attention sinks and biases, a mixture of experts with
    # a router bias, biased experts and a clamped SwiGLU (gpu/models/gpt_oss.py)
    "GptOssForCausalLM": {"qk_norm": False, "moe": True, "gpt_oss": True},
    # OLMo 2: norms after attention and after the MLP and none before them (Gemma 3's layer
    # without its first norms: gpu/models/gemma.py), Q/K norms over all heads at once
    "Olmo2ForCausalLM": {"qk_norm": True, "olmo": True},
    # OLMo 3: OLMo 2's layer, three sliding layers to a global one, each kind its own rotation
    "Olmo3ForCausalLM": {"qk_norm": True, "olmo": True},
    # Granite (3.x): Llama's layer with four factors of its config (_granite): the embeddings',
    # the attention's scale, each block's output before its residual add, the logits' divisor
    "GraniteForCausalLM": {"qk_norm": False, "granite": True},
    # Granite's MoE (3.0/3.1 1B-A400M, 3B-A800M): its factors over a mixture of experts of
    # intermediate_size, the softmax of the chosen experts' logits (renormalized)
    "GraniteMoeForCausalLM": {"qk_norm": False, "granite": True, "moe": True},
    # Granite 4.0's transformer-only models (granite-4.0-micro, -1b, -350m): Granite's layer,
    # its MLP named shared_mlp (gpu/models/granite.py); Mamba layers and experts refused
    "GraniteMoeHybridForCausalLM": {"qk_norm": False, "granite": True, "granite4": True},
    # SmolLM3: Llama's layer, every fourth (no_rope_layers) attending without rotation
    # GLM (glm-4-9b-chat-hf, GLM-Edge): Llama's layer with Q/K/V biases, gate and up one tensor,
    # half of each head turned by adjacent pairs; GLM-4 (0414) adds norms after both blocks
    # (Gemma's sandwich, its own names: gpu/models/glm.py)
    "GlmForCausalLM": {"qk_norm": False, "glm": True},
    "Glm4ForCausalLM": {"qk_norm": False, "glm": True},
    # EXAONE 4.0: OLMo 2's layer (norms after the blocks only) with Q/K norms per head; sliding
    # layers (layer_types) beside global ones that attend without rotation (_exaone4)
    "Exaone4ForCausalLM": {"qk_norm": True, "exaone4": True},
    # Ministral 3 (3B, 8B, 14B; Mistral 3's text model): Mistral's layer, YaRN, and Llama 4's
    # attention temperature past the pretrained context (gpu/models/query_scale.py)
    "Ministral3ForCausalLM": {"qk_norm": False, "ministral3": True},
    # Hunyuan's dense models: Llama's layer with Q/K norms per head after the rotation, NTK
    # alpha's stretched base (gpu/models/hunyuan.py)
    "HunYuanDenseV1ForCausalLM": {"qk_norm": True, "hunyuan": True},
    # Helium (kyutai's Helium-1 2B): Llama's layer with GLM's rotation of adjacent pairs, Q/K/V
    # biases (attention_bias) and none on O
    "HeliumForCausalLM": {"qk_norm": False, "glm": True},
    # ERNIE 4.5 (dense: ERNIE-4.5-0.3B): Llama's layer, each head turned by adjacent pairs (as
    # GLM's), `use_bias` on every product but the head
    "Ernie4_5ForCausalLM": {"qk_norm": False, "glm": True, "ernie": True},
    "SmolLM3ForCausalLM": {"qk_norm": False, "smollm3": True},
    # OLMoE: Llama's layer with OLMo's Q/K norms over a mixture of experts of intermediate_size
    "OlmoeForCausalLM": {"qk_norm": True, "olmo": True, "moe": True},
}
# Each causal LM's sequence classifier (a reranker, a classifier): the same decoder under a head
# of one row a label (`score`) read at the last token; no LM head. (Gemma 3's text classifier
# has a name of its own: Gemma3ForSequenceClassification is its multimodal model's.)
CLASSIFIERS = {
    a.replace("ForCausalLM", "ForSequenceClassification"): a
    for a in ARCHITECTURES
    if a not in ("GptOssForCausalLM", "Gemma3ForCausalLM")
}
CLASSIFIERS["Gemma3TextForSequenceClassification"] = "Gemma3ForCausalLM"
# Architectures whose O projection has no bias even where the config sets attention_bias (it
# sets their Q/K/V biases alone)
NO_O_BIAS = (
    "Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Phi3ForCausalLM",
    "GlmForCausalLM",
    "Glm4ForCausalLM",
    "HeliumForCausalLM",
)


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    mlp_bias: bool
    qk_norm: bool
    hidden_act: str
    max_position_embeddings: int  # the positions served, rope scaling included (rope.py)
    sliding_window: int = 0  # 0: every layer attends to the whole context
    rotary_dim: int = 0  # elements of a head rotated (partial_rope.py); 0: all of them
    # Gemma 3 (gpu/models/gemma.py): each layer's window (0: global), the embeddings' factor,
    # the attention's scale (0: head_dim ** -0.5), norms after attention and MLP too, and norm
    # weights stored as w where 1 + w multiplies (the loader adds the 1)
    layer_windows: tuple[int, ...] = ()
    embed_scale: float = 1.0
    attn_scale: float = 0.0
    sandwich_norms: bool = False
    norm_plus_one: bool = False
    # Gemma 2's soft caps: each attention score becomes c * tanh(score / c), and each logit
    # likewise with its own c (0: none)
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    # A mixture of experts (gpu/models/moe.py): each token's MLP is the weighted sum of the
    # top `experts_per_token` of `num_experts` gated MLPs of `moe_intermediate_size` (0: a dense
    # MLP of intermediate_size); their weights renormalized over the chosen ones when
    # `norm_topk_prob`; `dense_layers`: the layers that keep the dense MLP all the same;
    # `shared_expert_size`: Qwen2-MoE's expert every token runs besides, of that size, its
    # output weighted by the sigmoid of its own gate (0: none)
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    dense_layers: tuple[int, ...] = ()
    shared_expert_size: int = 0
    # the O projection's bias (attention_bias, where it covers O too: Llama's, Qwen3's, ...)
    o_bias: bool = False
    # gpt-oss (gpu/models/gpt_oss.py): a learned logit per head in each attention softmax's sum
    # (`sinks`), a bias on the router, and its experts' activation, (up + 1) * gate *
    # sigmoid(alpha * gate) with gate clamped above and up on both sides at `swiglu_limit`
    # (0: the model's hidden_act)
    attn_sinks: bool = False
    router_bias: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 0.0
    # A sequence classifier (CLASSIFIERS): its labels' count (0: a causal LM). `architecture`
    # then names the causal LM whose decoder it shares, and `tie_word_embeddings` is set: it has
    # no LM head (its logits are never sampled)
    num_labels: int = 0
    # --hf-overrides' classifier_from_token (gpu/hf_overrides.py): the head is these tokens'
    # rows of the causal LM's own head (their difference, the second less the first)
    score_token_ids: tuple[int, ...] = ()
    score_difference: bool = False
    # OLMo 2 and OLMoE: the Q/K norms span all heads at once (a weight of num_heads *
    # head_dim, applied before the heads are split), not each head; OLMo 2's layer has no norms
    # before its blocks (`sandwich_norms` with the first two left out)
    qk_norm_whole: bool = False
    post_norms_only: bool = False
    # Granite's: each block's output times `residual_scale` before its residual add (taken on
    # the O and down products' inputs: the same, as neither has a bias), and the logits divided
    # by `logits_scaling`
    residual_scale: float = 1.0
    logits_scaling: float = 1.0
    # SmolLM3's layers that attend without rotating Q and K (NoPE)
    nope_layers: tuple[int, ...] = ()
    # GLM's rotation of adjacent pairs (served by reordering Q/K heads at load: partial_rope.py)
    rope_interleaved: bool = False
    # Ministral 3's attention temperature (gpu/models/query_scale.py): each rotated query times
    # 1 + beta * log(1 + floor(position / length)) (beta 0: none)
    query_scale_beta: float = 0.0
    query_scale_length: int = 0
    # Hunyuan's Q/K norms, taken after the rotation (gpu/models/hunyuan.py)
    qk_norm_after_rope: bool = False
    # Cohere's layer: mean-centred layer norms (weight only) in place of RMSNorm, and attention
    # and MLP both on the layer's one norm, their outputs added to the stream together
    layer_norm: bool = False
    parallel_block: bool = False
    # An ungated MLP (Arcee's): down(act(up(x))), no gate product
    gated_mlp: bool = True
    # the layer norms' bias (Nemotron's)
    norm_bias: bool = False
    # the LM head's bias (Phi-2's)
    head_bias: bool = False
    # OLMo's: layer norms without weights (nor bias), and Q/K/V clamped to [-clip, clip] (0: no)
    norm_weightless: bool = False
    qkv_clip: float = 0.0

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelSpec:
        archs = getattr(config, "architectures", None) or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        classifier = None
        if arch is None:
            classifier = next((a for a in archs if a in CLASSIFIERS), None)
            arch = CLASSIFIERS.get(classifier)
        if arch is None:
            raise CheckpointError(
                f"unsupported architecture {archs or config.model_type!r}; "
                f"weir serves {', '.join(ARCHITECTURES)} and their ForSequenceClassification"
            )
        labels = int(getattr(config, "num_labels", 0) or 0) if classifier else 0
        if classifier and labels < 1:
            raise CheckpointError(f"{classifier} with {labels} labels")
        extra = ARCHITECTURES[arch]
        heads = config.num_attention_heads
        # Mistral's, Mixtral's and Phi-3's sliding window applies to every layer. (Qwen2's optional
        # per-layer window is off in released checkpoints and not supported.)
        windowed = arch in (
            "MistralForCausalLM",
            "MixtralForCausalLM",
            "Phi3ForCausalLM",
            "Ministral3ForCausalLM",
            "Starcoder2ForCausalLM",
        )
        window = getattr(config, "sliding_window", None) if windowed else None
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        partial = rope_parameters(config).get(
            "partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)
        )
        rotary_dim = int(head_dim * float(partial or 1.0))
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise CheckpointError(
                f"partial_rotary_factor {partial}: {rotary_dim} rotated elements of a head of "
                f"{head_dim} (an even number, at least 2, is needed)"
            )
        attention_bias = bool(getattr(config, "attention_bias", False))
        fields: dict[str, Any] = dict(
            architecture=arch,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            rms_norm_eps=(  # (Nemotron's: norm_eps; StarCoder2's: norm_epsilon)
                getattr(config, "rms_norm_eps", None)
                or getattr(config, "layer_norm_eps", None)
                or getattr(config, "norm_epsilon", None)
                or getattr(config, "norm_eps", None)
                or 1e-5  # (OLMo's layer norm: a fixed epsilon)
            ),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False) or labels),
            qkv_bias=extra.get("qkv_bias", attention_bias),
            o_bias=attention_bias and arch not in NO_O_BIAS,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=extra["qk_norm"],
            hidden_act=getattr(config, "hidden_act", "silu"),
            max_position_embeddings=context_length(config),
            sliding_window=int(window or 0),
            rotary_dim=rotary_dim if rotary_dim < head_dim else 0,
            num_labels=labels,
            score_token_ids=tuple(getattr(config, "weir_score_token_ids", ()) or ()),
            score_difference=bool(getattr(config, "weir_score_difference", False)),
        )
        if extra.get("gemma"):
            fields.update(families.gemma(config, arch))
        if extra.get("gemma1"):
            act = getattr(config, "hidden_activation", None) or config.hidden_act
            fields.update(embed_scale=float(config.hidden_size) ** 0.5, norm_plus_one=True)
            fields.update(hidden_act=act)
        if extra.get("moe"):
            fields.update(families.moe(config, arch))
        if extra.get("gpt_oss"):
            fields.update(families.gpt_oss(config))
        if extra.get("olmo"):
            if getattr(config, "clip_qkv", None) is not None:
                raise CheckpointError(f"{arch} with clip_qkv is not served")
            post = arch != "OlmoeForCausalLM"  # OLMo 2's and 3's norms after the blocks only
            fields.update(qk_norm_whole=True, post_norms_only=post, sandwich_norms=post)
            if arch == "Olmo3ForCausalLM":  # its sliding layers turn with their own rotation
                window = int(config.sliding_window or 0)
                types = config.layer_types
                fields.update(layer_windows=tuple(window * (t != "full_attention") for t in types))
        if extra.get("granite"):
            fields.update(families.granite(config, arch))
        if extra.get("granite4"):
            fields.update(families.granite4(config, arch))
        if extra.get("smollm3"):
            fields.update(families.smollm3(config, arch))
        if extra.get("glm"):  # (GLM-4's layer: Gemma's sandwich, its norm weights plain)
            fields.update(rope_interleaved=True, sandwich_norms=arch == "Glm4ForCausalLM")
        if extra.get("seed_oss"):
            fields.update(o_bias=bool(getattr(config, "attention_out_bias", False)))
        if extra.get("cohere"):
            fields.update(families.cohere(config, arch))
        if extra.get("hunyuan"):
            fields.update(qk_norm_after_rope=True)
        if extra.get("exaone4"):
            fields.update(families.exaone4(config))
        if extra.get("ministral3"):
            fields.update(families.query_scale(config, arch))
        if extra.get("ungated"):
            fields.update(gated_mlp=False)
        if extra.get("starcoder2"):
            bias = bool(getattr(config, "use_bias", True))
            eps = float(config.norm_epsilon)
            fields.update(layer_norm=True, norm_bias=True, rms_norm_eps=eps)
            fields.update(qkv_bias=bias, o_bias=bias, mlp_bias=bias)
        if extra.get("phi"):  # (gelu_new is gelu's tanh form)
            if getattr(config, "qk_layernorm", False):
                raise CheckpointError(f"{arch} with qk_layernorm is not served")
            fields.update(layer_norm=True, norm_bias=True, parallel_block=True, head_bias=True)
            fields.update(qkv_bias=True, o_bias=True, mlp_bias=True)
            if fields["hidden_act"] == "gelu_new":
                fields.update(hidden_act="gelu_pytorch_tanh")
        if extra.get("stablelm"):
            if getattr(config, "qk_layernorm", False):
                raise CheckpointError(f"{arch} with qk_layernorm is not served")
            parallel = bool(getattr(config, "use_parallel_residual", False))
            fields.update(layer_norm=True, norm_bias=True, parallel_block=parallel)
            fields.update(qkv_bias=bool(getattr(config, "use_qkv_bias", False)), o_bias=False)
        if extra.get("olmo1"):
            clip = float(getattr(config, "clip_qkv", None) or 0.0)
            fields.update(layer_norm=True, norm_weightless=True, qkv_clip=clip, rms_norm_eps=1e-5)
        if extra.get("nemotron"):  # LayerNorm1P: weight 1 + w, and a bias
            eps = float(config.norm_eps)
            fields.update(layer_norm=True, norm_bias=True, norm_plus_one=True, rms_norm_eps=eps)
        if extra.get("ernie"):
            bias = bool(getattr(config, "use_bias", False))
            fields.update(qkv_bias=bias, o_bias=bias, mlp_bias=bias)
        return cls(**fields)

    def is_moe_layer(self, index: int) -> bool:
        return self.num_experts > 0 and index not in self.dense_layers
