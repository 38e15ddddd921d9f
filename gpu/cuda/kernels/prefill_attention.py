"""Paged attention for prefill chunks: `_prefill_kernel` and its launcher (see
gpu/cuda/kernels/paged_attention.py for the family and the shared pieces)."""

from __future__ import annotations

import triton
import triton.language as tl

from gpu.cuda.kernels.paged_attention import (
    _attend,
    _check,
    _kv_offsets,
    _precision,
    _upcast,
    _with_sink,
)


@triton.jit
def _prefill_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_ptr,
    seq_lens_ptr,
    seq_ids_ptr,
    scale,
    softcap,
    sinks_ptr,
    q_stride_t,
    q_stride_h,
    o_stride_t,
    o_stride_h,
    bt_stride,
    cache_stride_block,
    cache_stride_slot,
    cache_stride_head,
    block_size,
    queries_per_kv,
    sliding_window,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
):
    seq = tl.load(seq_ids_ptr + tl.program_id(0))
    head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if tile * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        context = seq_len - q_len
        kv_head = head // queries_per_kv
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_PAD)
        m_mask = offs_m < q_len
        d_mask = offs_d < HEAD_DIM
        rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(
            q_ptr + rows[:, None] * q_stride_t + head * q_stride_h + offs_d[None, :],
            mask=m_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        q_pos = context + offs_m

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
        kv_end = tl.minimum(seq_len, context + (tile + 1) * BLOCK_M)
        kv_start = 0
        if SLIDING:
            kv_start = tl.maximum(context + tile * BLOCK_M - sliding_window + 1, 0)
            kv_start = (kv_start // BLOCK_N) * BLOCK_N
        for start in range(kv_start, kv_end, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_mask = offs_n < kv_end
            kv_off = _kv_offsets(
                block_tables_ptr,
                seq,
                bt_stride,
                offs_n,
                n_mask,
                block_size,
                kv_head,
                cache_stride_block,
                cache_stride_slot,
                cache_stride_head,
            )
            visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
            if SLIDING:
                visible = visible & (offs_n[None, :] > q_pos[:, None] - sliding_window)
            m_i, l_i, acc = _attend(
                q,
                k_cache_ptr,
                v_cache_ptr,
                kv_off,
                n_mask[:, None] & d_mask[None, :],
                offs_d,
                visible,
                scale,
                softcap,
                m_i,
                l_i,
                acc,
                PRECISION,
                UPCAST,
                SOFTCAP,
            )
        if SINKS:
            sink = tl.load(sinks_ptr + head).to(tl.float32)
            l_i, acc = _with_sink(m_i, l_i, acc, sink)
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + rows[:, None] * o_stride_t + head * o_stride_h + offs_d[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=m_mask[:, None] & d_mask[None, :],
        )


def prefill_attention(
    out,
    query,
    k_cache,
    v_cache,
    block_tables,
    query_start_loc,
    seq_lens,
    seq_ids,
    max_query_len: int,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
    sinks=None,
    block_m: int = 16,
    block_n: int = 32,
) -> None:
    """Attention for the sequences listed in `seq_ids` (several query tokens each), into `out`."""
    _check(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, seq_ids)
    n = seq_ids.shape[0]
    if n == 0:
        return
    heads, head_dim = query.shape[1], query.shape[2]
    grid = (n, heads, triton.cdiv(max_query_len, block_m))
    _prefill_kernel[grid](
        out,
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        seq_ids,
        scale,
        float(softcap) or 1.0,
        out if sinks is None else sinks,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.shape[1],
        heads // k_cache.shape[2],
        sliding_window,
        HEAD_DIM=head_dim,
        HEAD_PAD=triton.next_power_of_2(head_dim),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PRECISION=_precision(query.dtype),
        UPCAST=_upcast(query.dtype),
        SLIDING=sliding_window > 0,
        SOFTCAP=softcap > 0,
        SINKS=sinks is not None,
    )
