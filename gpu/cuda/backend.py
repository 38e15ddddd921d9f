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

With adapters in a step (--enable-lora), each product group adds its adapters' deltas in two
more launches for the whole batch, the shrink and the expand (kernels/lora.py).

Quantized weights (4-bit, FP8) stay quantized where the GPU runs their products
(gpu/cuda/quantized.py); other block formats are dequantized to the model's dtype.
"""

from __future__ import annotations

from typing import Any

import torch

from gpu.attention.backend import AttentionBackend
from gpu.backend import ACTIVATIONS, TorchBackend
from gpu.cuda import moe as cuda_moe
from gpu.cuda import quantized
from gpu.cuda.kernels.gated_act import gated_act
from gpu.cuda.kernels.lora import lora_shrink_expand
from gpu.cuda.kernels.rms_norm import add_rms_norm, rms_norm
from gpu.cuda.kernels.rope_store import rope_store
from gpu.quant.fp8 import Fp8Tensor


class CudaBackend(TorchBackend):
    def __init__(
        self,
        attention: AttentionBackend,
        name: str = "cuda",
        quantize_fp8: bool = False,
        fp8_products: bool = True,
    ) -> None:
        """`quantize_fp8`: a 16-bit checkpoint's products quantized to FP8 at load
        (--quantization fp8); `fp8_products`: the GPU has FP8 arithmetic (else an FP8
        checkpoint is dequantized)."""
        super().__init__(attention, fuse=True, name=name)
        self.quantize_fp8 = quantize_fp8
        self.fp8_products = fp8_products

    # ---- products: quantized weights kept as they are ----
    def prepare_linear(self, weight: Any, bias: Any) -> Any:
        if self.quantize_fp8 and isinstance(weight, torch.Tensor):
            weight = Fp8Tensor.quantize(self.dense(weight))
        if quantized.kept(weight, self.fp8_products):
            return quantized.form(weight, self.device), self.dense(bias)
        return super().prepare_linear(weight, bias)

    def prepare_stacked(self, parts: list[tuple[Any, Any]]) -> Any:
        joined = quantized.join([w for w, _ in parts], self.fp8_products)
        if joined is None:
            return super().prepare_stacked(parts)  # dense, joined, then prepare_linear
        bias = None if parts[0][1] is None else torch.cat([self.dense(b) for _, b in parts])
        return self.prepare_linear(joined, bias)

    def prepare_mlp(self, gate, up, down, act: str) -> tuple[Any, Any]:
        joined = quantized.join([gate[0], up[0]], self.fp8_products)
        if joined is None:
            return super().prepare_mlp(gate, up, down, act)
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {act!r}")
        bias = None if gate[1] is None else torch.cat([self.dense(gate[1]), self.dense(up[1])])
        pair = ("fused", self.prepare_linear(joined, bias), act)
        return pair, self.prepare_linear(*down)

    def linear(self, x: torch.Tensor, w: Any, residual: torch.Tensor | None = None) -> torch.Tensor:
        weight, bias = w
        if isinstance(weight, torch.Tensor):
            return super().linear(x, w, residual)
        y = quantized.linear(x, weight, bias)
        return y if residual is None else residual + y

    def gated(self, x: torch.Tensor, w: Any, addend: torch.Tensor | None = None) -> torch.Tensor:
        _, weights, act = w  # always "fused": gate and up are one product's two halves
        return gated_act(self.linear(x, weights, addend), act)

    def prepare_moe(self, moe) -> Any:
        return cuda_moe.stack(moe)

    def moe(self, x, weights, chosen, form) -> torch.Tensor:
        return cuda_moe.forward(x, weights, chosen, form)

    def lora_add(self, y, x, group, batch) -> None:
        # Two launches for the whole batch, from shapes alone: graph-safe (kernels/lora.py).
        lora_shrink_expand(
            y,
            x,
            group.a,
            group.b,
            group.ranks,
            group.cols,
            group.cols_list,
            batch.order,
            batch.counts,
            batch.starts,
        )

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def linear_norm(self, x, w, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(self.linear(x, w), residual, weight, eps)

    def rope_store_kv(
        self, q, k, v, q_weight, k_weight, eps, cos, sin, kv, slot_mapping, muls=None
    ) -> torch.Tensor:
        # The cache layout is gpu/kv_cache.py's, whichever attention backend then reads it.
        return rope_store(
            q, k, v, cos, sin, kv[0], kv[1], slot_mapping, q_weight, k_weight, eps, muls
        )
