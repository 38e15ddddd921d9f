"""Products on oneDNN-prepacked weights (`weir serve --cpu-matmul onednn`), float32.

torch's CPU `F.linear` goes to MKL's sgemm with the weight in its plain layout; oneDNN can
reorder the weight once into the blocked layout its kernels read best and then run every product
on it (the op torch's own compiler, inductor with weight freezing, emits for CPU linears).
Weights under MIN_ELEMENTS stay with MKL: oneDNN's fixed cost per call outweighs its faster
kernel there. A gated MLP whose three weights are all packed runs as three products and no other
pass: the activation is the gate product's post-op, the multiply the up product's, the residual
add the down product's (figures: docs/benchmarks.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

MIN_ELEMENTS = 1 << 18

# oneDNN's post-op for each activation a gated MLP may use (transformers' hidden_act names).
POST_OPS = {
    "silu": ("swish", ""),
    "gelu": ("gelu", "none"),
    "gelu_pytorch_tanh": ("gelu", "tanh"),
}


def usable(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 and torch.backends.mkldnn.is_available()


class OneDnnWeight(NamedTuple):
    """An [out_features, in_features] weight in oneDNN's blocked layout, and its bias."""

    packed: torch.Tensor
    out_features: int
    bias: torch.Tensor | None


class OneDnnGated(NamedTuple):
    gate: OneDnnWeight
    up: OneDnnWeight
    post_op: tuple[str, str]


def _rows(x: torch.Tensor) -> torch.Tensor:
    x = x.reshape(-1, x.shape[-1])
    return x if x.is_contiguous() else x.contiguous()


def big_enough(weight: torch.Tensor) -> bool:
    return weight.numel() >= MIN_ELEMENTS


def prepare(weight: torch.Tensor, bias: torch.Tensor | None) -> OneDnnWeight:
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    bias = None if bias is None else bias.detach().clone()
    return OneDnnWeight(packed, weight.shape[0], bias)


def linear(
    x: torch.Tensor,
    w: OneDnnWeight,
    residual: torch.Tensor | None = None,
    post_op: tuple[str, str] = ("none", ""),
) -> torch.Tensor:
    """x W^T + b, then `post_op` (a oneDNN eltwise: ("swish", "") is SiLU), or plus `residual`,
    in the same pass over the output."""
    shape = x.shape
    if residual is not None:
        out = torch.ops.mkldnn._linear_pointwise.binary(
            _rows(x), _rows(residual), w.packed, w.bias, "add"
        )
    else:
        out = torch.ops.mkldnn._linear_pointwise(
            _rows(x), w.packed, w.bias, post_op[0], [], post_op[1]
        )
    return out.view(*shape[:-1], w.out_features)


def prepare_gated(gate: torch.Tensor, up: torch.Tensor, act: str) -> OneDnnGated:
    return OneDnnGated(prepare(gate, None), prepare(up, None), POST_OPS[act])


def gated(x: torch.Tensor, w: OneDnnGated) -> torch.Tensor:
    """act(x G^T) * (x U^T): the activation as the gate product's post-op, the multiply as the
    up product's."""
    shape = x.shape
    g = linear(x, w.gate, post_op=w.post_op)
    out = torch.ops.mkldnn._linear_pointwise.binary(
        _rows(x), _rows(g), w.up.packed, w.up.bias, "mul"
    )
    return out.view(*shape[:-1], w.up.out_features)
