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
"""

from __future__ import annotations

from typing import Any

import torch

from gpu.attention.backend import AttentionBackend
from gpu.backend import TorchBackend
from gpu.cuda.kernels.gated_act import gated_act
from gpu.cuda.kernels.rms_norm import add_rms_norm, rms_norm
from gpu.cuda.kernels.rope_store import rope_store


class CudaBackend(TorchBackend):
    def __init__(self, attention: AttentionBackend, name: str = "cuda") -> None:
        super().__init__(attention, fuse=True, name=name)

    def gated(self, x: torch.Tensor, w: Any) -> torch.Tensor:
        _, weights, act = w  # always "fused": gate and up are one product's two halves
        return gated_act(self.linear(x, weights), act)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def linear_norm(self, x, w, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(self.linear(x, w), residual, weight, eps)

    def rope_store_kv(
        self, q, k, v, q_weight, k_weight, eps, cos, sin, kv, slot_mapping
    ) -> torch.Tensor:
        # The cache layout is gpu/kv_cache.py's, whichever attention backend then reads it.
        return rope_store(q, k, v, cos, sin, kv[0], kv[1], slot_mapping, q_weight, k_weight, eps)
