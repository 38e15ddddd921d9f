"""The Triton attention backend: the kernels in gpu/cuda/kernels/ behind the backend interface."""

from __future__ import annotations

import torch

from gpu.attention.backend import AttentionMetadata
from gpu.cuda.kernels.decode_attention import decode_attention
from gpu.cuda.kernels.prefill_attention import prefill_attention
from gpu.cuda.kernels.store_kv import store_kv


class TritonAttention:
    name = "triton"
    graph_safe = True

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        store_kv(key.contiguous(), value.contiguous(), k_cache, v_cache, slot_mapping)

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
        query = query.contiguous()
        if sinks is not None:
            sinks = sinks.float().contiguous()
        out = torch.empty_like(query)
        if meta.decode_seq_ids_cpu:
            decode_attention(
                out,
                query,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.query_start_loc,
                meta.seq_lens,
                meta.decode_seq_ids,
                meta.max_decode_seq_len,
                scale,
                sliding_window,
                softcap=softcap,
                sinks=sinks,
            )
        if meta.prefill_seq_ids_cpu:
            prefill_attention(
                out,
                query,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.query_start_loc,
                meta.seq_lens,
                meta.prefill_seq_ids,
                meta.max_prefill_query_len,
                scale,
                sliding_window,
                softcap=softcap,
                sinks=sinks,
            )
        return out
