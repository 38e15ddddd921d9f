"""The CPU float32 forward in one compiled call (gpu/cpu/csrc/forward.cpp, through
torch.classes.weir.DecoderStack).

After loading, a model whose every layer runs on the CPU kernels (weir's packed products, the
norm/rotary kernel, the paged attention kernel) gets a CpuForward: DecoderForCausalLM.forward
then embeds the tokens and computes the rotary tables in torch and hands the whole layer stack
and the final norm to C++, which calls the same kernels in the same order as the modules do
(bitwise the same hidden states) without a dozen op dispatches per layer in between.
WEIR_CPU_FORWARD=modules keeps the module-by-module path (for A/B benchmarks).
"""

from __future__ import annotations

import logging
import os

import torch

from gpu.attention.backend import AttentionMetadata
from gpu.cpu import build as cpu_build
from gpu.cpu.attention import DTYPES

log = logging.getLogger("weir.cpu_forward")


def unfit(model) -> str | None:
    """Why `model` cannot run as one call (None when it can)."""
    from gpu.cpu.gemm import GemmGatedMLP, GemmLinear

    if os.environ.get("WEIR_CPU_FORWARD", "fused") == "modules":
        return "WEIR_CPU_FORWARD=modules"
    if model.tp is not None:
        return "tensor parallel"
    if model.model.norm.kernel is None:
        return "no norm kernel"
    embed = model.model.embed_tokens.weight
    if embed.dtype != torch.float32 or not embed.is_contiguous():
        return "embeddings not float32 and contiguous"
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(attn.qkv_proj, GemmLinear) or not isinstance(attn.o_proj, GemmLinear):
            return "attention products not on weir's kernel"
        if attn.o_proj.bias is not None:
            return "an output projection bias"
        if not isinstance(mlp, GemmGatedMLP):
            return "MLP not a packed gated pair"
        if attn.norm_rope is None or layer.input_layernorm.kernel is None:
            return "no norm kernel"
    if len({layer.self_attn.sliding_window for layer in model.model.layers}) > 1:
        return "per-layer sliding windows"
    return None


class CpuForward:
    def __init__(self, model) -> None:
        self._classes = cpu_build.classes()
        self.model = model
        self._caches: list | None = None  # the kv_caches list the stack was built over
        self._stack = None
        # The LM head when the call can take it too: an untied, bias-free one on weir's kernel
        # (a tied head multiplies by the embedding's plain weight, through torch).
        from gpu.cpu.gemm import GemmLinear

        head = getattr(model, "lm_head", None)
        tied = model.spec.tie_word_embeddings
        ok = isinstance(head, GemmLinear) and head.bias is None and not tied
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
                    attn.qkv_proj.packed,
                    none if attn.qkv_proj.bias is None else attn.qkv_proj.bias,
                    attn.q_norm.weight.detach() if attn.qk_norm else none,
                    attn.k_norm.weight.detach() if attn.qk_norm else none,
                    attn.o_proj.packed,
                    layer.mlp.gate_up,
                    layer.mlp.down_proj.packed,
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
            first.mlp.width,
            first.self_attn.sliding_window or 0,
            first.mlp.act,
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

    def usable(self, kv_caches, backend) -> bool:
        """The compiled path needs the CPU attention kernel's layout: contiguous caches of
        float32, bfloat16 or float16."""
        if getattr(backend, "name", None) != "cpu":
            return False
        k, v = kv_caches[0]
        return k.dtype in DTYPES and k.is_contiguous() and v.is_contiguous()

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches,
        meta: AttentionMetadata,
        logits_rows: torch.Tensor | None = None,
    ):
        """The final norm [tokens, hidden] of the layer stack over the embeddings of input_ids
        at `positions`, whose rotary rows are those of the cos / sin tables [rows, head_dim]
        (gpu/models/rope.py Rope.tables).

        With `logits_rows` (int64 row indices; needs self.lm_head), (that, the LM head's
        logits [len(logits_rows), vocab] of those rows) instead."""
        if kv_caches is not self._caches:
            self._bind(kv_caches)
        if logits_rows is not None and self.lm_head is None:
            raise ValueError("this model's LM head is not on the compiled path")
        out, logits = self._stack.run(
            input_ids.to(torch.int64).contiguous(),
            positions.to(torch.int64).contiguous(),
            cos,
            sin,
            meta.slot_mapping,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            None if logits_rows is None else logits_rows.to(torch.int64).contiguous(),
        )
        return out if logits_rows is None else (out, logits)


PROFILE_OPS = ("norm", "qkv", "rope", "kv write", "attention", "o", "gate/up", "down", "lm head")


def profile(enable: bool = True) -> dict[str, float]:
    """Seconds the compiled forward spent per kind of op since the last call (while enabled),
    and zeroed; `enable` switches the timing on or off from here on (benchmarks only)."""
    return dict(zip(PROFILE_OPS, cpu_build.load().forward_profile(enable)))


def attach(model) -> bool:
    """Give `model` a CpuForward when all of it can run as one call; False (and why, logged)
    when not."""
    reason = unfit(model)
    if reason is not None:
        log.info("CPU forward layer by layer: %s", reason)
        return False
    model.cpu_forward = CpuForward(model)
    return True
