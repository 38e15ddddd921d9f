"""The CPU attention backend: a compiled kernel that reads K/V in place from the paged cache.

The torch reference copies each sequence's context out of the cache every layer and step; this
calls gpu/cpu/csrc/attention.cpp once per layer, over all sequences, with no copy.
"""

from __future__ import annotations

import torch

from gpu.attention.backend import AttentionMetadata
from gpu.attention.torch_ref import TorchAttention
from gpu.cpu import build as cpu_build
from gpu.kv_cache import FP8

# The element types the compiled attention takes (query and K/V cache; weir.h DType), and FP8,
# a cache's only.
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
CACHE_DTYPES = {**DTYPES, torch.float8_e5m2: 3, torch.float8_e4m3fn: 4}


class CpuAttention(TorchAttention):
    """K/V writes as the reference does them; attention through the compiled kernel."""

    name = "cpu"
    graph_safe = False

    def __init__(self) -> None:
        self._ops = cpu_build.load()

    def forward(
        self,
        query,
        k_cache,
        v_cache,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # The cache is the query's dtype, 16-bit under a float32 query or FP8 under any
        # (--kv-cache-dtype).
        if (
            query.dtype not in DTYPES
            or k_cache.dtype not in CACHE_DTYPES
            or v_cache.dtype != k_cache.dtype
            or (k_cache.dtype not in (query.dtype, *FP8) and query.dtype != torch.float32)
        ):
            raise ValueError(f"cpu attention: unsupported dtypes {query.dtype}, {k_cache.dtype}")
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("cpu attention: caches must be contiguous")
        query = query.contiguous()
        return self._ops.paged_attention(
            query,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            scale,
            sliding_window,
            softcap,
            None if sinks is None else sinks.float().contiguous(),
        )
