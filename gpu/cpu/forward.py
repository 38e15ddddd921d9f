"""The CPU float32 layer stack in one compiled call (gpu/cpu/csrc/forward.cpp, through
torch.classes.weir.DecoderStack).

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
from gpu.cpu import gemm
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
    "mlp_bias": (lambda v: not v, "an MLP bias"),
    "qk_norm": None,
    "hidden_act": (lambda v: v in gemm.ACTIVATIONS, "an activation the kernel has not"),
    "max_position_embeddings": None,
    "sliding_window": None,  # one window for every layer, or none
}


def unfit(model, backend) -> str | None:
    """Why `model` (built on `backend`, its weights prepared) cannot run as one call; None when
    it can."""
    if backend.forward_mode == "modules":
        return "--cpu-forward modules"
    if backend.matmul != "weir":
        return f"--cpu-matmul {backend.matmul}: the stack runs weir's products"
    if getattr(backend.attention, "name", None) != "cpu":
        return f"attention backend {backend.attention.name}: the stack runs weir's CPU attention"
    if model.tp is not None:
        return "tensor parallel"
    spec: ModelSpec = model.local_spec
    fields = {f.name for f in dataclasses.fields(ModelSpec)}
    if fields != set(HANDLED):
        return f"spec fields it does not state: {', '.join(sorted(fields ^ set(HANDLED)))}"
    for name, rule in HANDLED.items():
        if rule is not None and not rule[0](getattr(spec, name)):
            return rule[1]
    embed = model.model.embed_tokens.weight
    if embed.dtype != torch.float32 or not embed.is_contiguous():
        return "embeddings not float32 and contiguous"
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(attn.qkv, gemm.GemmWeight) or not isinstance(attn.o, gemm.GemmWeight):
            return "attention products not on weir's kernel"
        if attn.o.bias is not None:
            return "an output projection bias"
        if not isinstance(mlp.gate_up, gemm.GemmGated):
            return "MLP not a packed gated pair"
    return None


class FusedStack:
    def __init__(self, model) -> None:
        self._classes = cpu_build.classes()
        self.model = model
        self._caches: list | None = None  # the kv_caches list the stack was built over
        self._stack = None
        # The LM head when the call can take it too: an untied, bias-free one on weir's kernel
        # (a tied head multiplies by the embedding's plain weight, through torch).
        head = None if model.spec.tie_word_embeddings else model.lm_head.w
        ok = isinstance(head, gemm.GemmWeight) and head.bias is None
        self.lm_head = head if ok else None

    def _bind(self, kv_caches) -> None:
        """The compiled stack over the model's weights and these caches (it holds them)."""
        model, spec = self.model, self.model.local_spec
        layers = model.model.layers
        none = torch.empty(0)
        per_layer = []
        for layer, (k, v) in zip(layers, kv_caches):
            attn = layer.self_attn
            per_layer.append(
                [
                    layer.input_layernorm.weight.detach(),
                    layer.post_attention_layernorm.weight.detach(),
                    attn.qkv.packed,
                    none if attn.qkv.bias is None else attn.qkv.bias,
                    attn.q_norm.weight.detach() if attn.qk_norm else none,
                    attn.k_norm.weight.detach() if attn.qk_norm else none,
                    attn.o.packed,
                    layer.mlp.gate_up.packed,
                    layer.mlp.down.packed,
                    k,
                    v,
                ]
            )
        first = layers[0]
        head = self.lm_head
        dims = [
            spec.hidden_size,
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
            first.mlp.gate_up.width,
            first.self_attn.sliding_window or 0,
            first.mlp.gate_up.act,
            head.out_features if head is not None else 0,
        ]
        self._stack = self._classes.DecoderStack(
            per_layer,
            dims,
            model.model.norm.eps,
            first.self_attn.scale,
            model.model.embed_tokens.weight.detach(),
            model.model.norm.weight.detach(),
            head.packed if head is not None else none,
        )
        self._caches = kv_caches

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches,
        meta: AttentionMetadata,
        logits_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the final norm [tokens, hidden] of the layer stack over the embeddings of input_ids
        at `positions`, whose rotary rows are those of the cos / sin tables [rows, head_dim]
        (gpu/models/rope.py Rope.tables); the LM head's logits of `logits_rows` when the head
        is on this path and rows are asked for, else None)."""
        if kv_caches is not self._caches:
            self._bind(kv_caches)
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
        )
        return out, (logits if rows is not None else None)


PROFILE_OPS = ("norm", "qkv", "rope", "kv write", "attention", "o", "gate/up", "down", "lm head")


def profile(enable: bool = True) -> dict[str, float]:
    """Seconds the compiled forward spent per kind of op since the last call (while enabled),
    and zeroed; `enable` switches the timing on or off from here on (benchmarks only)."""
    return dict(zip(PROFILE_OPS, cpu_build.load().forward_profile(enable)))
