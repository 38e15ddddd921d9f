"""A decoder layer's MLP (gated, or Arcee's ungated one), a mixture of experts' construction
(gpu/models/moe.py runs it), and what both blocks of a layer share: a product's LoRA addend and
a block's output product with its residual add (and the norm after it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu.backend import PLAIN_ACTIVATIONS
from gpu.models.layers import LayerNorm, Linear, RMSNorm
from gpu.models.moe import SparseMoE
from gpu.models.spec import ModelSpec


def plus_lora(backend, x, lora, group: str, base, width: int):
    """What a product adds to its output with the step's adapters: `base` (a residual, or None)
    plus each row's adapter's delta of `group` for the product's input x. Rows without an
    adapter keep `base` as it is (zeros when None), so they compute what they would with no
    adapter in the batch; without adapters in the step, `base` itself and no LoRA work."""
    if lora is None:
        return base
    y = x.new_zeros(x.shape[0], width) if base is None else base.clone()
    backend.lora_add(y, x, lora.groups[group], lora.batch)
    return y


def block_output(backend, x, w, residual, norm: RMSNorm | None):
    """A block's output product plus the residual; with `norm`, (norm(that), that) in one
    backend call, which may fuse the residual add into the RMSNorm (a layer norm after it)."""
    if norm is None:
        return backend.linear(x, w, residual)
    if isinstance(norm, LayerNorm):
        y = backend.linear(x, w, residual)
        return norm(y), y
    return backend.linear_norm(x, w, residual, norm.weight, norm.eps)


class MLP(nn.Module):
    """A gated MLP of `intermediate` (the model's intermediate_size unless given: an expert's),
    or the model's ungated one (Arcee's: down(act(up(x))), `up` its one product before down)."""

    def __init__(self, spec: ModelSpec, backend, intermediate: int = 0) -> None:
        super().__init__()
        h, m = spec.hidden_size, intermediate or spec.intermediate_size
        self.backend = backend
        self.is_gated = spec.gated_mlp or intermediate > 0  # (experts are gated)
        if self.is_gated:
            self.gate_proj = Linear(backend, h, m, spec.mlp_bias)
        self.up_proj = Linear(backend, h, m, spec.mlp_bias)
        self.down_proj = Linear(backend, m, h, spec.mlp_bias)
        self.hidden_act = spec.hidden_act
        self.residual_scale = spec.residual_scale  # Granite's, on down's input (1: none)
        self.widths = (2 * m if self.is_gated else m, h)  # gate/up's outputs, down's
        # Apertus's xIELU: the layer's own four parameters (None: an activation without any)
        self.act_fn = XIELU() if self.hidden_act == "xielu" else None
        self.gate_up = None  # the backend's gated form of gate and up
        self.up = None  # an ungated MLP's product
        self.down = None

    def prepare(self) -> None:
        b = self.backend
        if not self.is_gated:
            if self.hidden_act not in PLAIN_ACTIVATIONS and self.hidden_act != "xielu":
                raise ValueError(f"unsupported activation {self.hidden_act!r}")
            self.up = b.prepare_linear(*self.up_proj.take())
            self.down = b.prepare_linear(*self.down_proj.take())
            del self.up_proj, self.down_proj
            return
        self.gate_up, self.down = b.prepare_mlp(
            self.gate_proj.take(), self.up_proj.take(), self.down_proj.take(), self.hidden_act
        )
        del self.gate_proj, self.up_proj, self.down_proj

    def forward(self, x, residual=None, norm=None, lora=None):
        """mlp(x), plus residual when given; with `norm`, the pair (norm(that), that).
        `lora`: the step's adapters (gpu/lora.py LoraLayer)."""
        b = self.backend
        if not self.is_gated:  # (adapters on it are refused: gpu/lora.py)
            h = b.ungated(x, self.up, self.hidden_act, self.act_fn)
        else:
            add = plus_lora(b, x, lora, "gate_up", None, self.widths[0])
            h = b.gated(x, self.gate_up) if add is None else b.gated(x, self.gate_up, add)
        if self.residual_scale != 1.0:
            h = h * self.residual_scale
        residual = plus_lora(b, h, lora, "down", residual, self.widths[1])
        return block_output(b, h, self.down, residual, norm)


def mixture(spec: ModelSpec, backend) -> SparseMoE:
    """A mixture of experts (gpu/models/moe.py): its router and its experts, built here."""
    router = Linear(backend, spec.hidden_size, spec.num_experts, spec.router_bias)
    experts = [MLP(spec, backend, spec.moe_intermediate_size) for _ in range(spec.num_experts)]
    shared = None
    if spec.shared_expert_size:  # Qwen2-MoE's: an MLP and its gate (hidden -> one logit)
        gate = Linear(backend, spec.hidden_size, 1, False)
        shared = (MLP(spec, backend, spec.shared_expert_size), gate)
    return SparseMoE(spec, backend, router, experts, shared)


class XIELU(nn.Module):
    """xIELU (Apertus's activation), with the parameters its checkpoint stores per layer:
    x > 0: softplus(alpha_p) x^2 + beta x; else (expm1(min(x, eps)) - x) alpha_n' + beta x with
    alpha_n' = beta + softplus(alpha_n); computed in float32, as transformers computes it for a
    float32 model."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha_p = nn.Parameter(torch.zeros(1))
        self.alpha_n = nn.Parameter(torch.zeros(1))
        self.beta = nn.Parameter(torch.zeros(()))
        self.eps = nn.Parameter(torch.zeros(()))

    def constants(self) -> list[float]:
        """[softplus(alpha_p), beta + softplus(alpha_n), beta, eps] in float32 (the compiled
        activation's: weir.h kXielu)."""
        with torch.no_grad():
            p = [t.float().reshape(()) for t in (self.alpha_p, self.alpha_n, self.beta, self.eps)]
            values = (F.softplus(p[0]), p[2] + F.softplus(p[1]), p[2], p[3])
            return [float(v) for v in values]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = [t.to(x.dtype) for t in (self.alpha_p, self.alpha_n, self.beta, self.eps)]
        alpha_p, beta = F.softplus(p[0]), p[2]
        alpha_n = beta + F.softplus(p[1])
        negative = (torch.expm1(torch.minimum(x, p[3])) - x) * alpha_n + beta * x
        return torch.where(x > 0, alpha_p * x * x + beta * x, negative)
