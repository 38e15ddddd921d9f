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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if not x.is_contiguous():
            x = x.contiguous()
        out = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return out.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN packed"


# Below this many weights oneDNN's fixed cost per call outweighs its faster kernel: measured on
# the same machine, a 256x768 product at 1 row took 46 us packed vs 29 us with MKL (1 thread),
# and a 3-layer model with 128x384 weights ran decode steps 3-28% slower packed; from 512x512 up
# packed was as fast or faster at 1, 8 and 64 rows (up to 4x at 1 row for 1024x3072).
MIN_ELEMENTS = 1 << 18


def pack_linears(module: nn.Module, min_elements: int = MIN_ELEMENTS) -> int:
    """Replace every nn.Linear below `module` with at least `min_elements` weights by a
    PackedLinear; returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if type(child) is nn.Linear:
            if child.weight.numel() >= min_elements:
                setattr(module, name, PackedLinear(child))
                count += 1
        else:
            count += pack_linears(child, min_elements)
    return count
