"""The CPU layer stack in one compiled call (gpu/cpu/csrc/forward.cpp, through
torch.classes.weir.DecoderStack): float32 activations, weights in float32 or in the block and
16-bit formats of gpu/cpu/quant.py, each product by its own format.

DecoderForCausalLM.forward hands the whole layer stack, the final norm and, for an untied head on
weir's kernel, the LM head's sampled rows to C++, which gathers the embeddings and rotary rows
and calls the same kernels in the same order as the modules do (bitwise the same hidden states),
without a dozen op dispatches per layer in between.

What it implements is stated here, field by field of the model's spec (HANDLED); `unfit` names
what a model has that it does not, and the backend then runs the model layer by layer and says so
(or refuses to start, with --cpu-forward fused). A field added to ModelSpec fails
tests/test_cpu_forward.py until this table says how the compiled stack treats it.
"""

from __future__ import annotations

import dataclasses

import torch

from gpu.attention.backend import AttentionMetadata
from gpu.cpu import build as cpu_build
from gpu.cpu import gemm, quant
from gpu.cpu import stack_parts as sp
from gpu.models.moe import SparseMoE
from gpu.models.spec import ARCHITECTURES, ModelSpec

# ModelSpec field -> what the compiled stack does with it (None: every value; else a predicate
# over the value and the reason a model is refused when it fails).
HANDLED: dict[str, tuple | None] = {
    "architecture": (lambda v: v in ARCHITECTURES, "an architecture it does not know"),
    "vocab_size": None,
    "hidden_size": None,
    "num_layers": None,
    "num_heads": None,
    "num_kv_heads": None,
    "head_dim": (lambda v: v % 2 == 0, "an odd head size"),
    "intermediate_size": None,
    "rms_norm_eps": None,
    "tie_word_embeddings": None,  # a tied head is computed through torch after the call
    "qkv_bias": None,
    "mlp_bias": None,  # gpt-oss's experts' (set_gpt_oss); unfit refuses any other
    "qk_norm": None,
    "hidden_act": (
        lambda v: v in gemm.ACTIVATIONS or v in sp.UNGATED,  # (UNGATED: an ungated MLP's)
        "an activation the kernel has not",
    ),
    "max_position_embeddings": None,
    "sliding_window": None,  # one window for every layer, or none
    "rotary_dim": None,  # a partial rotation: heads reordered at load, cos/sin tables padded
    # Gemma 3's (gpu/models/gemma.py; set_gemma): each layer's window and rotation, the
    # embeddings' factor, the attention's scale (one for all layers), norms after the blocks
    "layer_windows": None,
    "embed_scale": None,
    "attn_scale": None,
    "sandwich_norms": None,
    "norm_plus_one": None,  # the 1 is added to the weights at load
    "attn_softcap": None,  # Gemma 2's (set_gemma)
    "final_softcap": None,  # applied to the call's logits after it (decoder.soft_capped)
    "num_experts": None,  # each layer's experts on the block kernels (unfit checks them)
    "experts_per_token": None,
    "moe_intermediate_size": None,
    "norm_topk_prob": None,
    "dense_layers": None,
    "shared_expert_size": None,  # Qwen2-MoE's shared expert (set_shared; unfit checks it)
    "o_bias": None,  # set_gpt_oss (unfit refuses one beside Gemma's norms after the blocks)
    # gpt-oss's (gpu/models/gpt_oss.py): set_gpt_oss
    "attn_sinks": None,
    "router_bias": None,
    "swiglu_limit": None,  # its experts' gate/up plain products, their activation in moe.cpp
    "swiglu_alpha": None,
    # a sequence classifier's head runs on the call's final hidden states (gpu/pooler.py)
    "num_labels": None,
    "score_token_ids": None,
    "score_difference": None,
    "qk_norm_whole": None,  # OLMo's Q/K norms over all heads: weights of that width
    "post_norms_only": None,  # OLMo 2's first norms absent: empty (set_gemma's too)
    # Granite's: o and the MLP's gated rows scaled before their products, a mixture's routing
    # weights (set_extras), the logits divided after the call
    "residual_scale": None,
    "logits_scaling": None,
    "nope_layers": None,  # SmolLM3's: the second rotation's layers (set_gemma), all angles 0
    "rope_interleaved": None,  # GLM's: its Q/K heads reordered at load (partial_rope.py)
    "query_scale_beta": None,  # Ministral 3's temperature (set_extras), from the positions
    "query_scale_length": None,
    "qk_norm_after_rope": None,  # Hunyuan's (set_extras): turned, then normalized
    # Cohere's (set_extras): mean-centred norms, attention and MLP side by side
    "layer_norm": None,
    "parallel_block": None,
    # Arcee's ungated MLP (up's plain product, relu squared in the call); other activations of
    # an ungated MLP run layer by layer (unfit)
    "gated_mlp": None,
    "norm_bias": None,  # Nemotron's layer norms' biases (set_norm_bias)
    "head_bias": None,  # a biased LM head (Phi-2's) is computed after the call, through torch
    "norm_weightless": None,  # OLMo's layer norms: weights of ones (a buffer), bound as any
    "qkv_clip": None,  # OLMo's clip_qkv (set_extras)
}


def unfit(model, backend) -> str | None:
    """Why `model` (built on `backend`, its weights prepared) cannot run as one call, or None."""
    if backend.forward_mode == "modules":
        return "--cpu-forward modules"
    if backend.matmul != "weir":
        return f"--cpu-matmul {backend.matmul}: the stack runs weir's products"
    if getattr(backend.attention, "name", None) != "cpu":
        return f"attention backend {backend.attention.name}: the stack runs weir's CPU attention"
    if model.tp is not None:
        return "tensor parallel"
    if backend.lora and model.local_spec.sandwich_norms:
        return "LoRA adapters on layers with norms after their blocks"
    spec: ModelSpec = model.local_spec
    fields = {f.name for f in dataclasses.fields(ModelSpec)}
    if fields != set(HANDLED):
        return f"spec fields it does not state: {', '.join(sorted(fields ^ set(HANDLED)))}"
    for name, rule in HANDLED.items():
        if rule is not None and not rule[0](getattr(spec, name)):
            return rule[1]
    if sp.embed_of(model) is None:
        return "embeddings not float32 rows nor a packed weight"
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if sp.parts_of(attn.qkv) is None or sp.parts_of(attn.o) is None:
            return "attention products not on weir's kernels"
        if getattr(attn.o, "bias", None) is not None and spec.sandwich_norms:
            return "an output projection bias beside norms after the blocks"
        gpt_oss = isinstance(mlp, SparseMoE) and mlp.swiglu is not None
        if spec.mlp_bias and not gpt_oss and getattr(mlp, "is_gated", True):
            return "an MLP bias"  # (gpt-oss's experts' and an ungated MLP's are bound)
        if isinstance(mlp, SparseMoE):
            if sp.experts_of(mlp) is None:
                return "experts not all in block formats on weir's kernels"
            if mlp.has_shared and sp.shared_of(mlp) is None:
                return "a shared expert not on weir's kernels, or of another activation"
        elif not mlp.is_gated:
            if spec.hidden_act not in sp.UNGATED:
                return f"an ungated MLP of {spec.hidden_act}"
            if sp.parts_of(mlp.up) is None or len(sp.parts_of(mlp.up)) != 1:
                return "MLP products not on weir's kernels"
            if sp.parts_of(mlp.down) is None:
                return "MLP products not on weir's kernels"
        elif sp.gated_of(mlp.gate_up) is None or sp.parts_of(mlp.down) is None:
            return "MLP products not on weir's kernels"
    return None


class FusedStack:
    def __init__(self, model) -> None:
        self._classes = cpu_build.classes()
        self.model = model
        self._caches: list | None = None  # the kv_caches list the stack was built over
        self._stack = None
        # The LM head when the call can take it too: an untied, bias-free one on weir's kernels,
        # or a tied one whose embeddings are packed (a float32 tied head multiplies by the
        # embeddings' rows through torch).
        if model.spec.tie_word_embeddings:
            w = model.model.embed_tokens.w
            head = sp.part_of(w) if isinstance(w, quant.QuantWeight) else None
        else:
            w = model.lm_head.w
            head = sp.part_of(w) if getattr(w, "bias", None) is None else None
        self.lm_head = head

    def _bind(self, kv_caches) -> None:
        """The compiled stack over the model's weights and these caches (it holds them)."""
        model, spec = self.model, self.model.local_spec
        layers = model.model.layers
        none = torch.empty(0)
        per_layer, formats = [], []
        act = 0
        for layer, (k, v) in zip(layers, kv_caches):
            attn = layer.self_attn
            qkv = sp.parts_of(attn.qkv) + [(0, none, 0)] * (3 - len(sp.parts_of(attn.qkv)))
            ((o_fmt, o, _),) = sp.parts_of(attn.o)
            experts = sp.experts_of(layer.mlp) if isinstance(layer.mlp, SparseMoE) else None
            if experts is None and not layer.mlp.is_gated:  # up alone (-2), then the activation
                ((u_fmt, up, _),) = sp.parts_of(layer.mlp.up)
                gate_up, act = [(u_fmt, up), (-2, none)], sp.UNGATED[spec.hidden_act]
                ((d_fmt, down, _),) = sp.parts_of(layer.mlp.down)
            elif experts is None:
                gate_up, act = sp.gated_of(layer.mlp.gate_up)
                ((d_fmt, down, _),) = sp.parts_of(layer.mlp.down)
            else:  # the MLP's places empty; the experts after the caches
                gate_up, d_fmt, down, act = [(-1, none)], -1, none, experts[2]
            gu = gate_up + [(-1, none)] * (2 - len(gate_up))
            per_layer.append(
                [
                    sp.weight_of(layer.input_layernorm, none),
                    sp.weight_of(getattr(layer, "post_attention_layernorm", None), none),
                    *(t for _, t, _ in qkv),
                    sp.bias_of(attn.qkv, none),
                    sp.weight_of(getattr(attn, "q_norm", None), none),
                    sp.weight_of(getattr(attn, "k_norm", None), none),
                    o,
                    gu[0][1],
                    gu[1][1],
                    down,
                    k,
                    v,
                    *(experts[1] if experts else ()),
                ]
            )
            formats.append(
                [x for fmt, _, n in qkv for x in (fmt, n)]
                + [o_fmt, gu[0][0], gu[1][0], d_fmt]
                + (experts[0] if experts else [])
            )
        embed_fmt, embed = sp.embed_of(model)
        head = self.lm_head
        dims = [
            spec.hidden_size,
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
            spec.intermediate_size,
            layers[0].self_attn.sliding_window or 0,
            act,
            spec.vocab_size,
            embed_fmt,
            head[0] if head is not None else -1,
        ]
        self._stack = self._classes.DecoderStack(
            per_layer,
            formats,
            dims,
            model.model.norm.eps,
            layers[0].self_attn.scale,
            embed,
            model.model.norm.weight.detach(),
            head[1] if head is not None else none,
        )
        layered = spec.sandwich_norms or spec.layer_windows or spec.nope_layers
        if layered or spec.embed_scale != 1.0:
            self._stack.set_gemma(*sp.gemma_of(model))
        scaled = (spec.residual_scale != 1.0, spec.query_scale_beta, spec.qk_norm_after_rope)
        if any(scaled) or spec.layer_norm or spec.parallel_block or spec.qkv_clip:
            self._stack.set_extras(
                spec.residual_scale,
                spec.query_scale_beta,
                spec.query_scale_length,
                spec.qk_norm_after_rope,
                spec.layer_norm,
                spec.parallel_block,
                spec.qkv_clip,
            )
        if spec.mlp_bias and not spec.gated_mlp:  # StarCoder2's MLP biases
            self._stack.set_mlp_bias(
                [[sp.bias_of(x.mlp.up, none), sp.bias_of(x.mlp.down, none)] for x in layers]
            )
        if spec.hidden_act == "xielu":  # Apertus's: each layer's activation constants
            self._stack.set_xielu([x.mlp.act_fn.constants() for x in layers])
        if spec.norm_bias:  # Nemotron's layer norms' biases

            def bias(norm) -> torch.Tensor:
                return none if getattr(norm, "bias", None) is None else norm.bias.detach()

            post = [getattr(x, "post_attention_layernorm", None) for x in layers]  # (Phi-2: none)
            per = [[bias(x.input_layernorm), bias(p)] for x, p in zip(layers, post)]
            self._stack.set_norm_bias(per, bias(model.model.norm))
        if spec.shared_expert_size:  # Qwen2-MoE's shared experts: bound once, like weights
            shared = [
                sp.shared_of(layer.mlp) if getattr(layer.mlp, "has_shared", False) else None
                for layer in layers
            ]
            self._stack.set_shared(
                [s[0] if s else [] for s in shared], [s[1] if s else [] for s in shared]
            )
        extras = sp.gpt_oss_of(model)
        if extras is not None:  # gpt-oss's parts, and any layer's O bias
            self._stack.set_gpt_oss(*extras)
        if model.lora is not None:  # the adapters' slots (gpu/lora.py): bound once, like weights
            self._stack.set_lora(model.lora.stack_tensors())
        applied = [layer.self_attn.kv_applied for layer in layers]
        if any(a is not None for a in applied):  # a checkpoint's FP8 KV scales (gpu/kv_scales.py)
            values = [a and [a.k_mul, a.v_mul, a.score_scale, a.out_scale] for a in applied]
            self._stack.set_kv_scales([v or [] for v in values])
        self._caches = kv_caches

    def unbind(self) -> None:
        """Bind again at the next call (the layers' KV scales changed)."""
        self._caches = None

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches,
        meta: AttentionMetadata,
        logits_rows: torch.Tensor | None = None,
        lora=None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the final norm [tokens, hidden] of the layer stack over the embeddings of input_ids
        at `positions`, whose rotary rows are those of the cos / sin tables [rows, head_dim]
        (gpu/models/rope.py Rope.tables); the LM head's logits of `logits_rows` when the head
        is on this path and rows are asked for, else None). `lora`: each token's adapter slot
        (gpu/lora.py LoraBatch), or None: no LoRA work."""
        if kv_caches is not self._caches:
            self._bind(kv_caches)
        local = (None, None)  # Gemma 3's sliding layers' rotation, when the model has one
        if self.model.rope_local is not None:
            local = self.model.rope_local.tables(max(meta.seq_lens_cpu, default=0), cos.dtype)
        rows = None
        if logits_rows is not None and self.lm_head is not None and logits_rows.numel() > 0:
            rows = logits_rows.to(torch.int64).contiguous()
        out, logits = self._stack.run(
            input_ids.to(torch.int64).contiguous(),
            positions.to(torch.int64).contiguous(),
            cos,
            sin,
            meta.slot_mapping,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            rows,
            None if lora is None else lora.rows,
            *local,
        )
        return out, (logits if rows is not None else None)


PROFILE_OPS = ("norm", "qkv", "rope", "kv write", "attention", "o", "gate/up", "down", "lm head")


def profile(enable: bool = True) -> dict[str, float]:
    """Seconds the compiled forward spent per kind of op since the last call (while enabled),
    and zeroed; `enable` switches the timing on or off from here on (benchmarks only)."""
    return dict(zip(PROFILE_OPS, cpu_build.load().forward_profile(enable)))
