"""The CUDA backend's mixture of experts: every expert's weights stacked once at load
(`stack`), then each layer's experts in two launches of gpu/cuda/kernels/fused_moe.py with the
activation between (`forward`), where the portable path (gpu/models/moe.py) reads the routing
back to the host and runs a product per expert.

Dense experts only (the model's dtype: bfloat16, float16, float32), gated (SiLU, GELU) or
gpt-oss's (plain gate/up products with biases and its clamped SwiGLU); quantized experts (4-bit
blocks, FP8) keep the portable path. Stacking replaces each expert's weights by views into the
stack, so the memory is held once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gpu.cuda.kernels.fused_moe import align, moe_products
from gpu.cuda.kernels.gated_act import gated_act


@dataclass
class MoeStack:
    gate_up: torch.Tensor  # [E, 2I, H]: gate's rows, then up's
    gate_up_bias: torch.Tensor | None  # [E, 2I]
    down: torch.Tensor  # [E, H, I]
    down_bias: torch.Tensor | None  # [E, H]
    act: str  # the gated activation (unread with swiglu)
    swiglu: tuple[float, float] | None  # gpt-oss's (limit, alpha)


def _dense(form: Any) -> bool:
    return isinstance(form, tuple) and len(form) == 2 and isinstance(form[0], torch.Tensor)


def stack(moe) -> MoeStack | None:
    """The mixture `moe` (gpu/models/moe.py SparseMoE, its experts prepared on the CUDA backend)
    stacked, or None when an expert is not dense in one form."""
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
    if not all(_dense(f) for f in pairs + downs):
        return None
    if len({f[0].shape for f in pairs}) != 1 or len({f[0].shape for f in downs}) != 1:
        return None

    if any(len({f[1] is None for f in forms}) > 1 for forms in (pairs, downs)):
        return None  # biases on some experts only: each keeps its own product

    def stacked(forms: list[Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        w = torch.stack([f[0] for f in forms]).contiguous()
        b = None if forms[0][1] is None else torch.stack([f[1] for f in forms]).contiguous()
        return w, b

    (w1, b1), (w2, b2) = stacked(pairs), stacked(downs)
    if biases is not None:
        b1, b2 = biases[0].contiguous(), biases[1].contiguous()
    for i, e in enumerate(experts):  # views into the stack: the weights held once
        up_form = (w1[i], None if b1 is None or biases is not None else b1[i])
        e.gate_up = up_form if moe.swiglu is not None else ("fused", up_form, act)
        e.down = (w2[i], None if b2 is None or biases is not None else b2[i])
    return MoeStack(w1, b1, w2, b2, act, moe.swiglu)


def forward(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, s: MoeStack):
    """sum over each token's choices of weight * expert(x) [tokens, hidden] (moe.py's)."""
    from gpu.models.gpt_oss import swiglu

    t, k = chosen.shape
    sorted_ids, blocks = align(chosen, s.gate_up.shape[0])
    h = moe_products(x.contiguous(), s.gate_up, s.gate_up_bias, sorted_ids, blocks, k, True)
    h = swiglu(h, *s.swiglu) if s.swiglu is not None else gated_act(h, s.act)
    scale = weights.flatten().contiguous()
    y = moe_products(h.contiguous(), s.down, s.down_bias, sorted_ids, blocks, k, False, scale)
    return y.view(t, k, -1).sum(dim=1)
