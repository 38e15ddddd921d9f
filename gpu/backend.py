"""Backend: what a model's layers run on, chosen once, when the model is built.

A decoder is built with one backend (gpu/models/decoder.py): every linear layer holds its weight
in the backend's own form (`prepare_linear`, `prepare_gated`, after the checkpoint is read) and
runs its product through it; norms, rotary embedding, attention and the sampler's argmax and
grammar mask go through it too. Nothing is patched or swapped after loading. The backend may
also run the whole layer stack in one call (`stack`), and says so, or why not, when the model is
built.

TorchBackend is torch's own ops, and the reference the others are held to: the CPU where weir's
kernels do not apply (16-bit weights, or no compiler). gpu/cuda/backend.py's CudaBackend is it with
Q/K/V and gate/up each one product and the work between the products in Triton kernels (norms with
their residual add, the gated activation, rotation with the K/V write); gpu/cpu/backend.py's
CpuBackend is weir's compiled CPU kernels, layer by layer or in one call.

Besides the single operations, the interface has two composite steps a backend may run as one
kernel: `linear_norm` (a product, the residual add and the RMSNorm after it) and `rope_store_kv`
(Q/K norm, rotation and the K/V cache write); here they are the single operations in sequence.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

from gpu.attention.backend import AttentionBackend
from gpu.models.rope import apply_rope
from gpu.quant.fp8 import Fp8Tensor
from gpu.quant.tensor import BlockTensor

log = logging.getLogger("weir.backend")

ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}
# after a plain product (an encoder's MLP: `linear_act`)
PLAIN_ACTIVATIONS = {**ACTIVATIONS, "relu": F.relu, "relu2": lambda x: F.relu(x).square()}


class TorchBackend:
    """torch's ops. `fuse`: Q/K/V as one product and gate/up as another (one launch instead of
    three, and two, per layer on CUDA; on CPU the fused gate/up product measured slower).
    Weights are dense tensors of the model's dtype on its device (a block-format weight from a
    GGUF file is dequantized to it)."""

    def __init__(self, attention: AttentionBackend, fuse: bool, name: str = "torch") -> None:
        self.name = name
        self.attention = attention
        self.fuse_qkv = fuse
        self.fuse_gate_up = fuse
        self.device = torch.device("cpu")
        self.dtype = torch.float32

    def bind(self, device: torch.device, dtype: torch.dtype) -> torch.dtype:
        """Weights go to `device` in `dtype` (the checkpoint's, or --dtype); returns the dtype
        the model's own small tensors (norms) and its activations take."""
        self.device, self.dtype = device, dtype
        return dtype

    def dense(self, t: Any) -> Any:
        """A checkpoint tensor (or None) as a tensor of the model's dtype on its device."""
        if (
            t is None
            or isinstance(t, torch.Tensor)
            and t.dtype == self.dtype
            and t.device == self.device
        ):
            return t
        if isinstance(t, BlockTensor | Fp8Tensor):
            t = t.dequantize(self.dtype)
        return t.to(device=self.device, dtype=self.dtype)

    # ---- products ----
    def prepare_linear(self, weight: Any, bias: Any) -> Any:
        """The backend's form of an [out, in] weight (and bias), made once after loading."""
        return self.dense(weight), self.dense(bias)

    def prepare_stacked(self, parts: list[tuple[Any, Any]]) -> Any:
        """Weights sharing an input stacked by output rows (Q, K and V), as one product."""
        weight = torch.cat([self.dense(w) for w, _ in parts])
        bias = None if parts[0][1] is None else torch.cat([self.dense(b) for _, b in parts])
        return self.prepare_linear(weight, bias)

    def linear(self, x: torch.Tensor, w: Any, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T + b, plus `residual` when given."""
        weight, bias = w
        y = F.linear(x, weight, bias)
        return y if residual is None else residual + y

    def linear_act(self, x: torch.Tensor, w: Any, act: str) -> torch.Tensor:
        """act(x W^T + b), `act` one of PLAIN_ACTIVATIONS (an encoder's MLP)."""
        return PLAIN_ACTIVATIONS[act](self.linear(x, w))

    def ungated(self, x: torch.Tensor, w: Any, act: str, fn=None) -> torch.Tensor:
        """An ungated MLP's first half, act(x W^T + b) (Arcee's, StarCoder2's); `fn`: an
        activation with parameters of its own (Apertus's xIELU: gpu/models/mlp.py XIELU)."""
        if fn is not None:
            return fn(self.linear(x, w))
        return self.linear_act(x, w, act)

    def prepare_mlp(self, gate, up, down, act: str) -> tuple[Any, Any]:
        """A gated MLP's (weight, bias) pairs, gate and up [intermediate, hidden] and down
        [hidden, intermediate]: (its gated form, for `gated`; down's form, for `linear`)."""
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {act!r}")
        gate, up, down = [(self.dense(w), self.dense(b)) for w, b in (gate, up, down)]
        if self.fuse_gate_up:
            bias = None if gate[1] is None else torch.cat([gate[1], up[1]])
            pair = ("fused", self.prepare_linear(torch.cat([gate[0], up[0]]), bias), act)
        else:
            pair = ("pair", (self.prepare_linear(*gate), self.prepare_linear(*up)), act)
        return pair, self.prepare_linear(*down)

    def gated(self, x: torch.Tensor, w: Any, addend: torch.Tensor | None = None) -> torch.Tensor:
        """act(x G^T + g) * (x U^T + u); `addend` [tokens, 2 * width]: added to gate's (its
        first half) and up's outputs before the activation (LoRA's deltas)."""
        kind, weights, act = w
        if kind == "fused":
            g, u = self.linear(x, weights, addend).chunk(2, dim=-1)
        else:
            ga, ua = (None, None) if addend is None else addend.chunk(2, dim=-1)
            g, u = self.linear(x, weights[0], ga), self.linear(x, weights[1], ua)
        return ACTIVATIONS[act](g) * u

    def experts(self, x: torch.Tensor, ws: list[Any], counts: list[int], gated: bool):
        """A mixture's experts (gpu/models/moe.py) over x's rows ordered by expert, counts[i] of
        them ws[i]'s: each expert's gated pair (`gated`: gate/up's form) or product (down's),
        the outputs in x's rows' order."""
        f = self.gated if gated else self.linear
        return torch.cat([f(part, w) for part, w in zip(x.split(counts), ws)])

    def prepare_moe(self, moe) -> Any:
        """A mixture's experts (gpu/models/moe.py SparseMoE, each prepared) in a form `moe`
        runs in one pass, or None: the portable path runs a product per expert."""
        return None

    def moe(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, form: Any):
        """The mixture's output [tokens, hidden] for `prepare_moe`'s form: each token's chosen
        experts [tokens, k] weighted [tokens, k] and summed."""
        raise NotImplementedError

    # ---- LoRA ----
    def lora_add(self, y: torch.Tensor, x: torch.Tensor, group: Any, batch: Any) -> None:
        """y [tokens, n] += each row's adapter's delta of x [tokens, k], in place: the batched
        shrink then expand of one product group (gpu/lora.py LoraGroup), every row with the
        adapter in its slot (gpu/lora.py LoraBatch) or none (-1, untouched)."""
        from gpu.lora import lora_add_reference

        lora_add_reference(y, x, group, batch.rows)

    # ---- embeddings ----
    def prepare_embedding(self, weight: Any) -> Any:
        """The token embeddings' form, for `embed` and, tied, `tied_logits`."""
        return self.dense(weight)

    def embed(self, input_ids: torch.Tensor, w: Any) -> torch.Tensor:
        return F.embedding(input_ids, w)

    def tied_logits(self, hidden: torch.Tensor, w: Any) -> torch.Tensor:
        """The logits of a head tied to the embeddings `w`."""
        return F.linear(hidden, w)

    # ---- norms and rotation ----
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x.to(dtype)

    def layer_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Cohere's: each row less its mean, over its deviation, times weight (plus bias:
        Nemotron's) (float32 inside, as transformers computes it)."""
        dtype = x.dtype
        x = x.float()
        centred = x - x.mean(-1, keepdim=True)
        x = weight.float() * (centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps))
        return (x if bias is None else x + bias.float()).to(dtype)

    def norm_rope(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        eps: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """x [tokens, heads, head_dim]: RMSNorm per head row with `weight` (none if None), then
        the rotation by cos/sin [tokens, head_dim]."""
        if weight is not None:
            x = self.rms_norm(x, weight, eps)
        return apply_rope(x, cos, sin)

    def linear_norm(
        self, x: torch.Tensor, w: Any, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(h, weight, eps), h) with h = residual + x W^T + b: a layer's output product,
        the residual stream's add and the norm that follows it."""
        h = self.linear(x, w, residual)
        return self.rms_norm(h, weight, eps), h

    def rope_store_kv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_weight: torch.Tensor | None,
        k_weight: torch.Tensor | None,
        eps: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        slot_mapping: torch.Tensor,
        muls: tuple[float, float] | None = None,
    ) -> torch.Tensor:
        """q [tokens, heads, head_dim], k and v [tokens, kv_heads, head_dim] (views of the Q/K/V
        product): q and k normed per head (when the weights are given) and rotated, k and v
        written into the caches `kv` at `slot_mapping` (times `muls`' two float32 factors, when
        given: a checkpoint's FP8 KV scales, gpu/kv_scales.py); returns q."""
        q = self.norm_rope(q, q_weight, eps, cos, sin)
        k = self.norm_rope(k, k_weight, eps, cos, sin)
        if muls is not None:  # in float32 whatever the model's dtype, as the kernels multiply
            k, v = k.float() * muls[0], v.float() * muls[1]
        self.attention.write_kv(k, v, kv[0], kv[1], slot_mapping)
        return q

    # ---- sampling ----
    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Over the last dimension: the first of equal maxima, NaN above all."""
        return logits.argmax(dim=-1)

    def apply_token_bitmask(
        self, logits: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """-inf on every token of `rows` whose bit in `mask` [rows, words] is clear."""
        from gpu.grammar_mask import allowed

        sub = logits.index_select(0, rows)
        sub.masked_fill_(~allowed(mask, logits.shape[1]), float("-inf"))
        return logits.index_copy(0, rows, sub)

    # ---- the whole stack ----
    def stack(self, model) -> Any:
        """The layer stack in one call for `model`, or None (layer by layer)."""
        return None

    def describe(self) -> str:
        return self.name
