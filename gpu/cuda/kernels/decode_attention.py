"""Paged attention for single-token decodes: `_decode_kernel`, the split merge `_reduce_kernel`
and their launcher (see gpu/cuda/kernels/paged_attention.py for the family and the shared
pieces)."""

from __future__ import annotations

import torch
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
def _decode_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
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
    num_heads,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
):
    i = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(seq_ids_ptr + i)
    row = tl.load(query_start_ptr + seq).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    first = 0
    if SLIDING:
        first = tl.maximum(seq_len - sliding_window, 0)
    per_split = tl.cdiv(tl.cdiv(seq_len - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start_pos = first + split * per_split
    end_pos = tl.minimum(seq_len, start_pos + per_split)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    g_mask = offs_g < queries_per_kv
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * queries_per_kv + offs_g
    q = tl.load(
        q_ptr + row * q_stride_t + heads[:, None] * q_stride_h + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], dtype=tl.float32)
    for start in range(start_pos, end_pos, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end_pos
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
        m_i, l_i, acc = _attend(
            q,
            k_cache_ptr,
            v_cache_ptr,
            kv_off,
            n_mask[:, None] & d_mask[None, :],
            offs_d,
            n_mask[None, :],
            scale,
            softcap,
            m_i,
            l_i,
            acc,
            PRECISION,
            UPCAST,
            SOFTCAP,
        )

    if SINKS and NUM_SPLITS == 1:  # (split: counted once, in the reduce)
        sink = tl.load(sinks_ptr + heads, mask=g_mask, other=0.0).to(tl.float32)
        l_i, acc = _with_sink(m_i, l_i, acc, sink)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + row * o_stride_t + heads[:, None] * o_stride_h + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=mask,
        )
    else:
        # Partial result of this split and its log-sum-exp (-inf when the split is empty).
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i)))
        base = (i * num_heads + heads) * NUM_SPLITS + split
        tl.store(part_out_ptr + base[:, None] * HEAD_PAD + offs_d[None, :], out, mask=mask)
        tl.store(part_lse_ptr + base, lse, mask=g_mask)


@triton.jit
def _reduce_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    query_start_ptr,
    seq_ids_ptr,
    sinks_ptr,
    o_stride_t,
    o_stride_h,
    num_heads,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    SINKS: tl.constexpr,
):
    i = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(seq_ids_ptr + i)
    row = tl.load(query_start_ptr + seq).to(tl.int64)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    s_mask = offs_s < NUM_SPLITS
    base = (i * num_heads + head) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + base + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    if SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        m = tl.maximum(m, sink)
    w = tl.exp(lse - m)
    w = tl.where(s_mask, w, 0.0)
    parts = tl.load(
        part_out_ptr + (base + offs_s)[:, None] * HEAD_PAD + offs_d[None, :],
        mask=s_mask[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
    )
    total = tl.sum(w, axis=0)
    if SINKS:
        total += tl.exp(sink - m)
    out = tl.sum(parts * w[:, None], axis=0) / total
    tl.store(
        out_ptr + row * o_stride_t + head * o_stride_h + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


def num_splits_for(
    num_seqs: int, kv_heads: int, max_seq_len: int, num_sms: int, block_n: int
) -> int:
    """Split the KV length when there are too few (sequence, KV head) programs to fill the GPU:
    about four programs an SM, rounded up to a power of two (fewer distinct compilations), each
    split at least one KV tile, at most 32. Set from the H200's sweep (`benchmarks.attention
    --split-sweep`, 2026-11-26): at batch 1 x 1k 16 splits took 6.8 µs where 4 took 11.1; at
    batch 32 x 4k/16k 4 splits 151/551 µs where 2 took 177/670 (2 was the worst count there);
    at batch 256 one split is within 8% of the best and stays."""
    programs = max(1, num_seqs * kv_heads)
    want = 1 << (min(triton.cdiv(4 * num_sms, programs), 32) - 1).bit_length()
    most = min(max(1, max_seq_len // block_n), 32)
    return min(want, 1 << (most.bit_length() - 1))


def decode_attention(
    out,
    query,
    k_cache,
    v_cache,
    block_tables,
    query_start_loc,
    seq_lens,
    seq_ids,
    max_seq_len: int,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int = 64,
    num_sms: int | None = None,
) -> None:
    """Attention for the sequences in `seq_ids`, each with exactly one query token."""
    _check(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, seq_ids)
    n = seq_ids.shape[0]
    if n == 0:
        return
    heads, head_dim = query.shape[1], query.shape[2]
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    head_pad = triton.next_power_of_2(head_dim)
    if num_splits is None:
        if num_sms is None:
            num_sms = (
                torch.cuda.get_device_properties(query.device).multi_processor_count
                if query.is_cuda
                else 8
            )
        num_splits = num_splits_for(n, kv_heads, max_seq_len, num_sms, block_n)
    part_out = part_lse = out  # unused when there is one split
    if num_splits > 1:
        part_out = torch.empty(
            (n * heads * num_splits, head_pad), dtype=torch.float32, device=query.device
        )
        part_lse = torch.empty((n * heads * num_splits,), dtype=torch.float32, device=query.device)
    _decode_kernel[(n, kv_heads, num_splits)](
        out,
        part_out,
        part_lse,
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
        group,
        sliding_window,
        heads,
        HEAD_DIM=head_dim,
        HEAD_PAD=head_pad,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        PRECISION=_precision(query.dtype),
        UPCAST=_upcast(query.dtype),
        SLIDING=sliding_window > 0,
        SOFTCAP=softcap > 0,
        SINKS=sinks is not None,
    )
    if num_splits > 1:
        _reduce_kernel[(n, heads)](
            out,
            part_out,
            part_lse,
            query_start_loc,
            seq_ids,
            out if sinks is None else sinks,
            out.stride(0),
            out.stride(1),
            heads,
            HEAD_DIM=head_dim,
            HEAD_PAD=head_pad,
            NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            SINKS=sinks is not None,
        )
