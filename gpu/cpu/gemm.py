"""Linear layers on weir's own CPU matrix-product kernel (gpu/cpu/csrc/gemm.cpp, through
torch.ops.weir.gemm).

Drop-ins for gpu/cpu/onednn.py's oneDNN layers (same forward and forward_binary), for float32 on
CPU: the weight is packed once into column panels, and each product hands its panels to the
threads one at a time from a shared counter, so a thread that another process preempts holds up
one panel rather than half the product (the barrier stalls of issue 18). The gated MLP's
activation and multiply happen as the gate/up panels are written, and a residual is added in the
same pass, as with oneDNN's post-ops.
"""

from __future__ import annotations

import torch
from torch import nn

from gpu.cpu.onednn import gated_parts  # what counts as a gated MLP, as on the oneDNN path
from gpu.cpu import build as cpu_build


def _ops():
    return cpu_build.load()


def _pack(first: torch.Tensor, second: torch.Tensor | None) -> torch.Tensor:
    first = first.detach().float().contiguous()
    second = None if second is None else second.detach().float().contiguous()
    return _ops().gemm_pack(first, second)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


class GemmLinear(nn.Module):
    """An nn.Linear at inference on the packed kernel."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self._ops = _ops()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = _pack(linear.weight, None)
        self.bias = None if linear.bias is None else linear.bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = self._ops.gemm(_rows(x), self.packed, self.out_features, 0, self.bias, None)
        return out.view(*shape[:-1], self.out_features)

    def forward_binary(self, x: torch.Tensor, other: torch.Tensor, op: str) -> torch.Tensor:
        """other + (x @ W.T + b): the residual added as the product is written."""
        if op != "add":
            raise ValueError(f"cpu gemm: post-op {op!r} is not supported")
        shape = x.shape
        out = self._ops.gemm(_rows(x), self.packed, self.out_features, 0, self.bias, _rows(other))
        return out.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weir packed"


# The kernel's code for each activation a gated MLP may use (transformers' hidden_act names).
ACTIVATIONS = {"silu": 1, "gelu": 2, "gelu_pytorch_tanh": 3}


class GemmGatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) [+ residual] in two products: gate and up packed side by
    side in each panel, the activation and the multiply applied as their panel is written."""

    def __init__(self, gate: nn.Linear, up: nn.Linear, down: nn.Linear, act: str) -> None:
        super().__init__()
        self._ops = _ops()
        self.act = ACTIVATIONS[act]
        self.width = gate.out_features
        self.gate_up = _pack(gate.weight, up.weight)
        self.down_proj = GemmLinear(down)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        h = self._ops.gemm(_rows(x), self.gate_up, self.width, self.act, None, None)
        h = h.view(*shape[:-1], self.width)
        if residual is None:
            return self.down_proj(h)
        return self.down_proj.forward_binary(h, residual, "add")


def use_gemm(module: nn.Module) -> int:
    """Replace every nn.Linear below `module` by a GemmLinear and every bias-free gated MLP by a
    GemmGatedMLP; returns how many weights were packed."""
    count = 0
    for name, child in list(module.named_children()):
        parts = gated_parts(child)
        if parts is not None:
            setattr(module, name, GemmGatedMLP(*parts, child.hidden_act))
            count += 3
        elif type(child) is nn.Linear:
            setattr(module, name, GemmLinear(child))
            count += 1
        else:
            count += use_gemm(child)
    return count
