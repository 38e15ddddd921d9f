"""A mixture of experts in place of a layer's MLP (Mixtral, Qwen3-MoE, Qwen2-MoE), as
transformers computes it: a router's logits over the E experts, their softmax in float32, each
token's top k experts (their probabilities renormalized over the k when the model says so:
Mixtral always, the Qwens by norm_topk_prob), and the token's output the sum of those experts'
gated MLPs weighted by them.

The tokens are grouped by expert on the host (the step's routing is read back: one sync a layer)
and each expert multiplies only its own rows, so a token reads the weights of k experts, not E,
as llama.cpp's and vLLM's kernels do. A token's k outputs are summed in the order of its choices
(transformers adds them into the layer's output expert by expert: in float32 the two agree to
rounding, the greedy tokens exactly). Each expert is an MLP on the backend, so its weights take
every form a dense MLP's can (16-bit, packed float32, GGUF's block formats, ...).

Qwen2-MoE adds a shared expert every token runs (`shared_expert`, an MLP of its own size) with
its output weighted by the sigmoid of its gate's one logit (`shared_expert_gate`), added after
the routed experts' sum, as transformers adds it.

Mixtral's checkpoints name the block `block_sparse_moe` and the experts' products w1 (gate), w3
(up) and w2 (down); `checkpoint_name` reads them as Qwen3-MoE's, the names the modules load by.
GraniteMoE's name it so too, with its router `router.layer` and each product's experts as one
tensor a layer (`cut_stacked`). Its residual factor multiplies the routing weights.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from gpu.models import gpt_oss
from gpu.models.spec import ModelSpec

_MIXTRAL = (
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),
    (re.compile(r"\.mlp\.router\.layer\."), ".mlp.gate."),  # GraniteMoE's router
    (re.compile(r"(\.experts\.\d+)\.w1\."), r"\1.gate_proj."),
    (re.compile(r"(\.experts\.\d+)\.w3\."), r"\1.up_proj."),
    (re.compile(r"(\.experts\.\d+)\.w2\."), r"\1.down_proj."),
)


# GraniteMoE's experts, one tensor a product a layer (after checkpoint_name): input_linear
# [E, 2 inter, hidden] (gate's rows, then up's), output_linear [E, hidden, inter]
STACKED = re.compile(r"^(.*\.mlp)\.(input_linear|output_linear)\.weight$")


def cut_stacked(name: str, value) -> list[tuple[str, object]]:
    """A STACKED tensor (torch or numpy) -> each expert's gate_proj, up_proj or down_proj
    weight [out, in], named as the modules load them."""
    prefix, kind = STACKED.match(name).groups()
    parts = []
    for e in range(value.shape[0]):
        if kind == "output_linear":
            parts.append((f"{prefix}.experts.{e}.down_proj.weight", value[e]))
            continue
        half = value.shape[1] // 2
        parts.append((f"{prefix}.experts.{e}.gate_proj.weight", value[e, :half]))
        parts.append((f"{prefix}.experts.{e}.up_proj.weight", value[e, half:]))
    return parts


def checkpoint_name(name: str) -> str:
    """The name weir's modules load a checkpoint tensor by: Mixtral's expert names as Qwen3-MoE's
    (model.layers.0.block_sparse_moe.experts.3.w1.weight -> ...mlp.experts.3.gate_proj.weight),
    gpt-oss's router as the mixture's gate; any other name as it is."""
    if ".block_sparse_moe." not in name:
        return gpt_oss.checkpoint_name(name)
    for pattern, replacement in _MIXTRAL:
        name = pattern.sub(replacement, name)
    return name


class SparseMoE(nn.Module):
    """The layer's experts (`experts`: the decoder's gated MLPs, of moe_intermediate_size), its
    router (`gate`: the decoder's Linear, hidden -> one logit per expert) and, for Qwen2-MoE,
    `shared`: (its shared expert's MLP, that expert's gate), in the checkpoints' names; the
    decoder builds them (gpu/models/decoder.py)."""

    def __init__(
        self, spec: ModelSpec, backend, router: nn.Module, experts: list, shared=None
    ) -> None:
        super().__init__()
        self.backend = backend
        self.gate = router
        self.experts = nn.ModuleList(experts)
        self.top_k, self.renormalize = spec.experts_per_token, spec.norm_topk_prob
        # Granite's residual factor, on the routing weights (the sum's factor, as the experts
        # and their sum are linear in them; 1: none)
        self.weight_scale = spec.residual_scale
        self.router = None
        self.has_shared = shared is not None
        if shared is not None:
            self.shared_expert, self.shared_expert_gate = shared
        self.shared_gate = None  # the backend's form of shared_expert_gate
        # gpt-oss's experts (gpu/models/gpt_oss.py): their activation's (limit, alpha), and
        # their products' biases apart, once prepared
        self.swiglu = (spec.swiglu_limit, spec.swiglu_alpha) if spec.swiglu_limit else None
        self.expert_biases: tuple[torch.Tensor, torch.Tensor] | None = None
        self.stacked = None  # the backend's one-pass form of the experts (prepare_moe)

    def prepare(self) -> None:
        self.router = self.backend.prepare_linear(*self.gate.take())
        del self.gate
        if self.swiglu is not None:
            self.expert_biases = gpt_oss.prepare_experts(self.backend, self.experts)
        for expert in self.experts if self.swiglu is None else ():
            expert.prepare()
        self.stacked = self.backend.prepare_moe(self)  # one pass for all experts, or None
        if self.has_shared:
            self.shared_expert.prepare()
            self.shared_gate = self.backend.prepare_linear(*self.shared_expert_gate.take())
            del self.shared_expert_gate

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the weights [tokens, k] in x's dtype, the experts [tokens, k]) of each token."""
        logits = self.backend.linear(x, self.router)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weight_scale != 1.0:
            weights = weights * self.weight_scale
        return weights.to(x.dtype), chosen

    def forward(self, x, residual=None, norm=None, lora=None):
        """moe(x), plus residual when given; with `norm`, the pair (norm(that), that) (the
        signature of mlp.MLP's forward). `lora` is not read: an adapter modifies a
        mixture's attention only (core/lora.py refuses one on its experts or router)."""
        b = self.backend
        weights, chosen = self.route(x)
        if self.stacked is not None:  # the backend's own pass (on CUDA: no read back)
            out = b.moe(x, weights, chosen, self.stacked)
        else:
            out = self._experts(x, weights, chosen)
        if self.has_shared:
            weight = torch.sigmoid(b.linear(x, self.shared_gate))
            out = out + weight * self.shared_expert(x)
        if residual is not None:
            out = out + residual
        if norm is None:
            return out
        return b.rms_norm(out, norm.weight, norm.eps), out

    def _experts(self, x, weights, chosen) -> torch.Tensor:
        """The portable path: the routing read back, a product per expert used."""
        b = self.backend
        # The (token, choice) pairs ordered by expert, tokens in order within one: each
        # expert's input rows are one slice of a single gather, its outputs one slice of a
        # single result, put back in (token, choice) order and summed over the choices.
        t, k = chosen.shape
        order = torch.argsort(chosen.flatten(), stable=True)
        counts = torch.bincount(chosen.flatten(), minlength=len(self.experts)).tolist()
        rows = x.index_select(0, order // k)
        used = [i for i, c in enumerate(counts) if c]
        sizes = [counts[i] for i in used]
        if self.swiglu is not None:
            by_row = chosen.flatten().index_select(0, order)
            y = gpt_oss.experts_forward(self, rows, by_row, used, sizes)
        else:
            h = b.experts(rows, [self.experts[i].gate_up for i in used], sizes, gated=True)
            y = b.experts(h, [self.experts[i].down for i in used], sizes, gated=False)
        y = y * weights.flatten().index_select(0, order)[:, None]
        return torch.empty_like(y).index_copy_(0, order, y).view(t, k, -1).sum(dim=1)


def mixtures_on_device(model: nn.Module) -> bool:
    """Whether every mixture of `model` runs its experts in the backend's own pass (stacked:
    nothing read back to the host, so its steps can be captured as CUDA graphs); True for a
    model with none."""
    return all(m.stacked is not None for m in model.modules() if isinstance(m, SparseMoE))
