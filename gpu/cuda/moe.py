"""The CUDA backend's mixture of experts: every expert's weights stacked once at load
(`stack`), then each layer's experts in two launches of gpu/cuda/kernels/fused_moe.py with the
activation between (`forward`), where the portable path (gpu/models/moe.py) reads the routing
back to the host and runs a product per expert.

The experts dense (the model's dtype: bfloat16, float16, float32) or 4-bit (gpu/cuda/
int4_weight.py's form: Q4_0 / Q4_1 blocks, AWQ / GPTQ, gpt-oss's MXFP4), gated (SiLU, GELU) or
gpt-oss's (plain gate/up products with biases and its clamped SwiGLU); FP8 experts, or experts
of mixed forms, keep the portable path. Stacking replaces each expert's weights by views into
the stack, so the memory is held once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gpu.cuda.int4_weight import Int4Weight
from gpu.cuda.kernels.fused_moe import align, moe_products
from gpu.cuda.kernels.gated_act import gated_act


@dataclass
class MoeStack:
    gate_up: torch.Tensor | Int4Weight  # [E, 2I, H]: gate's rows, then up's (or 4-bit forms)
    gate_up_bias: torch.Tensor | None  # [E, 2I]
    down: torch.Tensor | Int4Weight  # [E, H, I]
    down_bias: torch.Tensor | None  # [E, H]
    act: str  # the gated activation (unread with swiglu)
    swiglu: tuple[float, float] | None  # gpt-oss's (limit, alpha)

    @property
    def num_experts(self) -> int:
        w = self.gate_up
        return (w.qweight if isinstance(w, Int4Weight) else w).shape[0]


def _kind(form: Any) -> Any:
    """A product's form (weight, bias): "dense", its 4-bit format, or None (anything else)."""
    if not (isinstance(form, tuple) and len(form) == 2):
        return None
    w = form[0]
    if isinstance(w, Int4Weight):  # (Q8_0 experts keep their own products: no fused mode)
        return w.fmt if w.bits == 4 else None
    return "dense" if isinstance(w, torch.Tensor) else None


def _shape(w: torch.Tensor | Int4Weight) -> tuple:
    return w.shape if isinstance(w, Int4Weight) else tuple(w.shape)


def _stack_weights(ws: list) -> tuple[torch.Tensor | Int4Weight, list]:
    """The experts' weights stacked on a new first axis, and each expert's view of it."""
    if isinstance(ws[0], torch.Tensor):
        w = torch.stack(ws).contiguous()
        return w, list(w)
    parts = [torch.stack([getattr(x, f) for x in ws]).contiguous() for f in ("qweight", "scales")]
    mins = None if ws[0].mins is None else torch.stack([x.mins for x in ws]).contiguous()
    first = ws[0]
    w = Int4Weight(parts[0], parts[1], mins, first.shape, first.fmt)
    views = [
        Int4Weight(parts[0][i], parts[1][i], None if mins is None else mins[i], x.shape, x.fmt)
        for i, x in enumerate(ws)
    ]
    return w, views


def stack(moe) -> MoeStack | None:
    """The mixture `moe` (gpu/models/moe.py SparseMoE, its experts prepared on the CUDA backend)
    stacked, or None unless every expert's two products are each of one form (dense or one
    4-bit format) and shape."""
    experts = list(moe.experts)
    if moe.swiglu is not None:  # gpt-oss: gate/up one plain product, the biases apart
        pairs = [e.gate_up for e in experts]
        act, biases = "silu", moe.expert_biases
    else:
        gated = [e.gate_up for e in experts]
        if not all(isinstance(g, tuple) and len(g) == 3 and g[0] == "fused" for g in gated):
            return None
        pairs, act = [g[1] for g in gated], gated[0][2]
        if any(g[2] != act for g in gated):
            return None
        biases = None
    downs = [e.down for e in experts]
    for forms in (pairs, downs):  # one form, one shape in each of the two products
        if None in {_kind(f) for f in forms} or len({(_kind(f), _shape(f[0])) for f in forms}) != 1:
            return None

    if any(len({f[1] is None for f in forms}) > 1 for forms in (pairs, downs)):
        return None  # biases on some experts only: each keeps its own product

    def stacked(forms: list[Any]) -> tuple[Any, list, torch.Tensor | None]:
        w, views = _stack_weights([f[0] for f in forms])
        b = None if forms[0][1] is None else torch.stack([f[1] for f in forms]).contiguous()
        return w, views, b

    (w1, v1, b1), (w2, v2, b2) = stacked(pairs), stacked(downs)
    if biases is not None:
        b1, b2 = biases[0].contiguous(), biases[1].contiguous()
    for i, e in enumerate(experts):  # views into the stack: the weights held once
        up_form = (v1[i], None if b1 is None or biases is not None else b1[i])
        e.gate_up = up_form if moe.swiglu is not None else ("fused", up_form, act)
        e.down = (v2[i], None if b2 is None or biases is not None else b2[i])
    return MoeStack(w1, b1, w2, b2, act, moe.swiglu)


def forward(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, s: MoeStack):
    """sum over each token's choices of weight * expert(x) [tokens, hidden] (moe.py's)."""
    from gpu.models.gpt_oss import swiglu

    t, k = chosen.shape
    sorted_ids, blocks = align(chosen, s.num_experts)
    h = moe_products(x.contiguous(), s.gate_up, s.gate_up_bias, sorted_ids, blocks, k, True)
    h = swiglu(h, *s.swiglu) if s.swiglu is not None else gated_act(h, s.act)
    scale = weights.flatten().contiguous()
    y = moe_products(h.contiguous(), s.down, s.down_bias, sorted_ids, blocks, k, False, scale)
    return y.view(t, k, -1).sum(dim=1)
