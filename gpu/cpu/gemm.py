"""Products on weir's own CPU matrix-product kernel (gpu/cpu/csrc/gemm.cpp, torch.ops.weir.gemm),
float32.

A weight is packed once into column panels; each product hands its panels to the threads one at
a time from a shared counter, so a thread that another process preempts holds up one panel
rather than half the product. A gated MLP's gate and up weights are packed side by side in each
panel, and the activation and the multiply are applied as the panel is written; a residual is
added in the same pass as the product.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from gpu.cpu import build as cpu_build

# The kernel's code for each activation a gated MLP may use (transformers' hidden_act names).
ACTIVATIONS = {"silu": 1, "gelu": 2, "gelu_pytorch_tanh": 3}


class GemmWeight(NamedTuple):
    """An [out_features, in_features] weight packed for the kernel, and its bias."""

    packed: torch.Tensor
    out_features: int
    bias: torch.Tensor | None


class GemmGated(NamedTuple):
    """A gated MLP's gate and up weights [width, in_features] each, packed as one pair."""

    packed: torch.Tensor
    width: int
    act: int


def _rows(x: torch.Tensor) -> torch.Tensor:
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def prepare(weight: torch.Tensor, bias: torch.Tensor | None) -> GemmWeight:
    packed = cpu_build.load().gemm_pack(weight.detach().float().contiguous(), None)
    bias = None if bias is None else bias.detach().float().contiguous()
    return GemmWeight(packed, weight.shape[0], bias)


def linear(x: torch.Tensor, w: GemmWeight, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b (+ residual, added as the product is written)."""
    shape = x.shape
    res = None if residual is None else _rows(residual)
    out = cpu_build.load().gemm(_rows(x), w.packed, w.out_features, 0, w.bias, res)
    return out.view(*shape[:-1], w.out_features)


def prepare_gated(gate: torch.Tensor, up: torch.Tensor, act: str) -> GemmGated:
    packed = cpu_build.load().gemm_pack(
        gate.detach().float().contiguous(), up.detach().float().contiguous()
    )
    return GemmGated(packed, gate.shape[0], ACTIVATIONS[act])


def gated(x: torch.Tensor, w: GemmGated, addend: torch.Tensor | None = None) -> torch.Tensor:
    """act(x G^T) * (x U^T), in one product; `addend` [rows, 2 * width] is added to gate's and
    up's outputs before the activation (LoRA's deltas)."""
    shape = x.shape
    add = None if addend is None else _rows(addend)
    h = cpu_build.load().gemm(_rows(x), w.packed, w.width, w.act, None, add)
    return h.view(*shape[:-1], w.width)
