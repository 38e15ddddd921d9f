"""Linear layers with oneDNN-prepacked weights for CPU inference.

torch's CPU `F.linear` goes to MKL's sgemm with the weight in its plain layout; oneDNN can reorder
the weight once into the blocked layout its kernels read best and then run every product on it.
On the 2-core AVX-512 machine benchmarks/ runs on, that measured 1.2-2x the GFLOP/s of MKL for
768x2048 weights from 16 to 4,096 rows (the largest gain at the small batches of decode steps);
small weights stay with MKL (see MIN_ELEMENTS).
This is the op torch's own compiler (inductor, with weight freezing) emits for CPU linears.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("weir.cpu_linear")


def usable(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 and torch.backends.mkldnn.is_available()


class PackedLinear(nn.Module):
    """Drop-in for an nn.Linear at inference: same input and output, weight held prepacked."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: torch.Tensor, post_op: tuple[str, str] = ("none", "")) -> torch.Tensor:
        """x @ W.T + b, then `post_op` (a oneDNN eltwise: ("swish", "") is SiLU) in the same
        pass over the output."""
        shape = x.shape
        x = _rows(x)
        out = torch.ops.mkldnn._linear_pointwise(
            x, self.packed, self.bias, post_op[0], [], post_op[1]
        )
        return out.view(*shape[:-1], self.out_features)

    def forward_binary(self, x: torch.Tensor, other: torch.Tensor, op: str) -> torch.Tensor:
        """(x @ W.T + b) `op` other, for op "add" or "mul", with the elementwise op applied as the
        product's output is written: no separate pass over a [tokens, out_features] tensor."""
        shape = x.shape
        out = torch.ops.mkldnn._linear_pointwise.binary(
            _rows(x), _rows(other), self.packed, self.bias, op
        )
        return out.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN packed"


def _rows(x: torch.Tensor) -> torch.Tensor:
    x = x.reshape(-1, x.shape[-1])
    return x if x.is_contiguous() else x.contiguous()


# oneDNN's post-op for each activation a gated MLP may use (transformers' hidden_act names).
POST_OPS = {
    "silu": ("swish", ""),
    "gelu": ("gelu", "none"),
    "gelu_pytorch_tanh": ("gelu", "tanh"),
}


class PackedGatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) [+ residual] in three oneDNN products and no other pass: the
    activation is the gate product's post-op, the multiply the up product's, the residual add
    the down product's. In prefill, where these tensors are tokens x 2,048 floats and outgrow the
    caches, the separate activation, multiply and add passes cost as much as a fifth of the MLP
    (77M benchmark model, 4,096 tokens: 282 -> 231 ms per layer; unchanged at decode batches)."""

    def __init__(self, gate: nn.Linear, up: nn.Linear, down: nn.Linear, act: str) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (
            PackedLinear(gate),
            PackedLinear(up),
            PackedLinear(down),
        )
        self.post_op = POST_OPS[act]

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        h = self.up_proj.forward_binary(x, self.gate_proj(x, self.post_op), "mul")
        if residual is None:
            return self.down_proj(h)
        return self.down_proj.forward_binary(h, residual, "add")


# Below this many weights oneDNN's fixed cost per call outweighs its faster kernel: measured on
# the same machine, a 256x768 product at 1 row took 46 us packed vs 29 us with MKL (1 thread),
# and a 3-layer model with 128x384 weights ran decode steps 3-28% slower packed; from 512x512 up
# packed was as fast or faster at 1, 8 and 64 rows (up to 4x at 1 row for 1024x3072).
MIN_ELEMENTS = 1 << 18


def pack_linears(module: nn.Module, min_elements: int = MIN_ELEMENTS) -> int:
    """Replace every nn.Linear below `module` with at least `min_elements` weights by a
    PackedLinear, and every gated MLP whose three are all that big by a PackedGatedMLP; returns
    how many linears were packed."""
    count = 0
    for name, child in list(module.named_children()):
        parts = gated_parts(child)
        if parts is not None and all(p.weight.numel() >= min_elements for p in parts):
            setattr(module, name, PackedGatedMLP(*parts, child.hidden_act))
            count += 3
        elif type(child) is nn.Linear:
            if child.weight.numel() >= min_elements:
                setattr(module, name, PackedLinear(child))
                count += 1
        else:
            count += pack_linears(child, min_elements)
    return count


def gated_parts(module: nn.Module) -> tuple[nn.Linear, nn.Linear, nn.Linear] | None:
    """A gated MLP's gate, up and down linears (unfused, bias-free, activation oneDNN has)."""
    parts = tuple(getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj"))
    if getattr(module, "hidden_act", None) not in POST_OPS:
        return None
    if not all(type(p) is nn.Linear and p.bias is None for p in parts):
        return None
    return parts
