"""The CUDA backend: torch's products (Q/K/V one, gate/up another: cuBLAS) and the work between
them in Triton kernels (gpu/cuda/kernels/), so that a layer is a handful of launches:

    norm | Q/K/V product | q/k norm, rotation, K/V write | attention | O product |
    residual add + norm | gate/up product | act * up | down product | residual add + next norm

where torch's ops take several kernels for each norm, the rotation, the activation and each
residual add. Each kernel rounds where TorchBackend's ops round (gpu/backend.py stays the
reference; the kernels' docstrings say where they may differ from it in the last place). None
syncs with the host or decides anything from the tensors' values, so decode steps capture as CUDA
graphs (gpu/cuda/graphs.py). They run on CPU tensors under TRITON_INTERPRET=1, which is how the
tests run this backend without a GPU.

4-bit weights (GGUF's Q4_0 / Q4_1 blocks, and AWQ / GPTQ checkpoints, which the loader repacks
into those) stay 4-bit in their GPU form (gpu/cuda/int4_weight.py) and run on the W4A16 Triton
product (gpu/cuda/kernels/w4a16.py); other block formats are dequantized to the model's dtype.
"""

from __future__ import annotations

from typing import Any

import torch

from gpu.attention.backend import AttentionBackend
from gpu.backend import ACTIVATIONS, TorchBackend
from gpu.cuda import int4_weight
from gpu.cuda.int4_weight import Int4Weight
from gpu.cuda.kernels.gated_act import gated_act
from gpu.cuda.kernels.rms_norm import add_rms_norm, rms_norm
from gpu.cuda.kernels.rope_store import rope_store
from gpu.cuda.kernels.w4a16 import w4a16_linear
from gpu.quant.tensor import BlockTensor, cat_rows


def _int4(*weights: Any) -> bool:
    """Block weights all in one 4-bit format that keeps its GPU form."""
    return (
        all(isinstance(w, BlockTensor) and w.fmt.name in int4_weight.FORMATS for w in weights)
        and len({w.fmt for w in weights}) == 1
    )


class CudaBackend(TorchBackend):
    def __init__(self, attention: AttentionBackend, name: str = "cuda") -> None:
        super().__init__(attention, fuse=True, name=name)

    # ---- products: 4-bit weights kept as they are ----
    def prepare_linear(self, weight: Any, bias: Any) -> Any:
        if _int4(weight):
            return Int4Weight.from_blocks(weight, self.device), self.dense(bias)
        return super().prepare_linear(weight, bias)

    def prepare_stacked(self, parts: list[tuple[Any, Any]]) -> Any:
        weights = [w for w, _ in parts]
        if _int4(*weights):
            bias = None if parts[0][1] is None else torch.cat([self.dense(b) for _, b in parts])
            return self.prepare_linear(cat_rows(weights), bias)
        return super().prepare_stacked(parts)

    def prepare_mlp(self, gate, up, down, act: str) -> tuple[Any, Any]:
        if not _int4(gate[0], up[0]):
            return super().prepare_mlp(gate, up, down, act)
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {act!r}")
        bias = None if gate[1] is None else torch.cat([self.dense(gate[1]), self.dense(up[1])])
        pair = ("fused", self.prepare_linear(cat_rows([gate[0], up[0]]), bias), act)
        return pair, self.prepare_linear(*down)

    def linear(self, x: torch.Tensor, w: Any, residual: torch.Tensor | None = None) -> torch.Tensor:
        weight, bias = w
        if not isinstance(weight, Int4Weight):
            return super().linear(x, w, residual)
        rows = x.reshape(-1, x.shape[-1])
        y = w4a16_linear(rows, weight.qweight, weight.scales, weight.mins, int4_weight.GROUP, bias)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y if residual is None else residual + y

    def gated(self, x: torch.Tensor, w: Any, addend: torch.Tensor | None = None) -> torch.Tensor:
        _, weights, act = w  # always "fused": gate and up are one product's two halves
        return gated_act(self.linear(x, weights, addend), act)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def linear_norm(self, x, w, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(self.linear(x, w), residual, weight, eps)

    def rope_store_kv(
        self, q, k, v, q_weight, k_weight, eps, cos, sin, kv, slot_mapping
    ) -> torch.Tensor:
        # The cache layout is gpu/kv_cache.py's, whichever attention backend then reads it.
        return rope_store(q, k, v, cos, sin, kv[0], kv[1], slot_mapping, q_weight, k_weight, eps)
