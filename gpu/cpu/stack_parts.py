"""A model's parts as the compiled CPU stack takes them (gpu/cpu/forward.py FusedStack): each
product's format code and tensors, a mixture's experts and shared expert, the embeddings, and the
per-layer extras of Gemma's and OLMo's norms and gpt-oss's sinks; None where a part is not on
weir's kernels (forward.py's `unfit` then says why the stack does not run the model)."""

from __future__ import annotations

import torch

from gpu.cpu import gemm, quant
from gpu.cpu.prepared import GatedPair, Stacked
from gpu.models.moe import SparseMoE


def experts_of(moe: SparseMoE) -> tuple[list[int], list[torch.Tensor], int] | None:
    """A mixture's experts as the stack takes them ([router format, E, top_k, flags (1:
    renormalize, 2: gate/up plain products, gpt-oss's), intermediate, E gate/ups' formats, E
    downs' formats], [router, E gate/ups, E downs], the activation's code: gpt-oss's, set by
    set_gpt_oss, stands in as SiLU's), or None when any is not a packed block-format weight."""
    router = part_of(moe.router)
    pairs, downs = [e.gate_up for e in moe.experts], [e.down for e in moe.experts]
    packed = all(isinstance(w, quant.QuantWeight) for w in pairs + downs)
    if router is None or not packed or any(d.act for d in downs):
        return None
    if any(w.bias is not None for w in pairs + downs):  # gpt-oss's are apart (set_gpt_oss)
        return None
    plain = moe.swiglu is not None
    acts = {p.act for p in pairs}
    if len(acts) != 1 or (0 in acts) != plain:
        return None
    width = pairs[0].out_features // 2 if plain else moe.experts[0].widths[0] // 2
    formats = [router[0], len(pairs), moe.top_k, int(moe.renormalize) | (2 * plain), width]
    formats += [w.fmt.ggml_type for w in pairs + downs]
    act = gemm.ACTIVATIONS["silu"] if plain else acts.pop()
    return formats, [router[1]] + [w.packed for w in pairs + downs], act


def shared_of(moe: SparseMoE) -> tuple[list[torch.Tensor], list[int]] | None:
    """Qwen2-MoE's shared expert as set_shared takes it ([gate_up0, gate_up1, down, gate],
    [their formats, its intermediate size]), or None when a part is not on weir's kernels or
    its activation is not the experts'."""
    expert = moe.shared_expert
    gated, down, gate = gated_of(expert.gate_up), parts_of(expert.down), part_of(moe.shared_gate)
    if gated is None or down is None or len(down) != 1 or gate is None:
        return None
    pairs, act = gated
    if act != moe.experts[0].gate_up.act:
        return None
    (gu0, t0), (gu1, t1) = pairs[0], (pairs[1] if len(pairs) > 1 else (-1, torch.empty(0)))
    ((d_fmt, d, _),) = down
    formats = [gu0, gu1, d_fmt, gate[0], expert.widths[0] // 2]
    return [t0, t1, d, gate[1]], formats


# An ungated MLP's activations the call applies after up's product, by code (weir.h Gated and
# kRelu2; the module path runs the same loop: backend.ungated)
UNGATED = {"silu": 1, "gelu": 2, "gelu_pytorch_tanh": 3, "relu2": 4, "xielu": 5}


def part_of(w) -> tuple[int, torch.Tensor, int] | None:
    """(format, packed tensor, outputs) of a plain weight on weir's kernels, else None."""
    if isinstance(w, gemm.GemmWeight):
        return 0, w.packed, w.out_features
    if isinstance(w, quant.QuantWeight) and w.act == 0:
        return w.fmt.ggml_type, w.packed, w.out_features
    return None


def parts_of(w) -> list[tuple[int, torch.Tensor, int]] | None:
    """A product's weight as the stack's parts (Q/K/V in formats that differ: several)."""

    parts = [part_of(p) for p in w.parts] if isinstance(w, Stacked) else [part_of(w)]
    return None if any(p is None for p in parts) or len(parts) > 3 else parts


def gated_of(w) -> tuple[list[tuple[int, torch.Tensor]], int] | None:
    """A gated MLP's gate/up as the stack takes it: ([(format, the packed pair)] or [gate,
    up], the activation's code)."""

    if isinstance(w, gemm.GemmGated):
        return [(0, w.packed)], w.act
    if isinstance(w, quant.QuantWeight) and w.act:
        return [(w.fmt.ggml_type, w.packed)], w.act
    if isinstance(w, GatedPair) and w.act in gemm.ACTIVATIONS:
        g, u = part_of(w.gate), part_of(w.up)
        if g is None or u is None or w.gate.bias is not None or w.up.bias is not None:
            return None
        return [g[:2], u[:2]], gemm.ACTIVATIONS[w.act]
    return None


def bias_of(w, none: torch.Tensor) -> torch.Tensor:
    """A product's bias (Q/K/V in parts: Stacked.bias, theirs joined), or `none`."""
    bias = getattr(w, "bias", None)
    return none if bias is None else bias


def embed_of(model) -> tuple[int, torch.Tensor] | None:
    w = model.model.embed_tokens.w
    if isinstance(w, quant.QuantWeight):
        return w.fmt.ggml_type, w.packed
    if isinstance(w, torch.Tensor) and w.dtype == torch.float32 and w.is_contiguous():
        return 0, w
    return None


SANDWICH = ("post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


def weight_of(norm, none: torch.Tensor) -> torch.Tensor:
    return norm.weight.detach() if hasattr(norm, "weight") else none  # (an absent norm: empty)


def gemma_of(model) -> tuple[list[list[torch.Tensor]], list[int], list[int], float, float]:
    """set_gemma's arguments: each layer's norms after its blocks (none: empty), window and
    rotation, the embeddings' factor as the module path rounds it (float32 activations), and
    Gemma 2's cap on the attention scores (0: none)."""
    none = torch.empty(0)
    norms, windows, local = [], [], []
    for layer in model.model.layers:
        sandwich = getattr(layer, "sandwich", False)
        norms.append([weight_of(getattr(layer, n), none) if sandwich else none for n in SANDWICH])
        windows.append(layer.self_attn.sliding_window or 0)
        local.append(int(layer.local_rope))
    factor = torch.tensor(model.spec.embed_scale, dtype=torch.float32).item()
    return norms, windows, local, factor, model.spec.attn_softcap


def gpt_oss_of(model) -> tuple[list[list[torch.Tensor]], float, float] | None:
    """set_gpt_oss's arguments: each layer's [O bias, sinks, router bias, the experts' gate/up
    biases [E, 2I] and down's [E, hidden]] as float32 (none: empty) and the experts' clamped
    SwiGLU's limit and alpha; None when no layer has any of them."""
    none = torch.empty(0)

    def f32(t) -> torch.Tensor:
        return none if t is None else t.detach().float().contiguous()

    per_layer, swiglu = [], None
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        moe = mlp if isinstance(mlp, SparseMoE) else None
        router_bias = getattr(moe.router, "bias", None) if moe else None
        biases = (moe.expert_biases if moe and moe.swiglu else None) or (None, None)
        swiglu = swiglu or (moe.swiglu if moe else None)
        parts = [getattr(attn.o, "bias", None), attn.sinks, router_bias, *biases]
        per_layer.append([f32(t) for t in parts])
    if all(not t.numel() for layer in per_layer for t in layer) and swiglu is None:
        return None
    limit, alpha = swiglu or (1.0, 1.0)  # (unread without plain experts; set_gpt_oss wants > 0)
    return per_layer, float(limit), float(alpha)
