"""Paged attention over the block-table KV cache.

Two kernels and a reduction:
- `_prefill_kernel`: sequences with several new query tokens (a prefill chunk). One program per
  (sequence, query head, tile of BLOCK_M queries) walks the sequence's keys through its block table
  with an online softmax, causally: query j of a chunk sits at position seq_len - q_len + j.
- `_decode_kernel`: sequences with one new token. One program per (sequence, KV head, KV split)
  handles every query head of the KV group at once, so each K/V row is read once per group; long
  contexts are split across programs (flash-decoding) and `_reduce_kernel` merges the splits by
  their log-sum-exp.
Both read K/V straight from the paged cache, so the batch can mix any number of each.

This module holds what both share (the dot product, K/V addressing, the online-softmax step,
the argument checks); the kernels are in gpu/cuda/kernels/prefill_attention.py and
gpu/cuda/kernels/decode_attention.py.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with fp32 accumulation. UPCAST: compute in fp32 (Triton's CPU interpreter has no
    bfloat16 matmul)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b.to(a.dtype), input_precision=PRECISION)


@triton.jit
def _kv_offsets(
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
):
    """Element offsets of K/V rows for the positions `offs_n`, through the block table."""
    block = tl.load(
        block_tables_ptr + seq * bt_stride + offs_n // block_size, mask=n_mask, other=0
    ).to(tl.int64)
    return (
        block * cache_stride_block
        + (offs_n % block_size) * cache_stride_slot
        + kv_head * cache_stride_head
    )


@triton.jit
def _attend(
    q,
    k_cache_ptr,
    v_cache_ptr,
    kv_off,
    kv_mask,
    offs_d,
    visible,
    scale,
    softcap,
    m_i,
    l_i,
    acc,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """One online-softmax step: fold a tile of keys/values (where `visible`) into the running
    max `m_i`, normalizer `l_i` and unnormalized output `acc`. With SOFTCAP each score is
    first capped as Gemma 2's are: softcap * tanh(score / softcap), tanh as 2 sigmoid(2x) - 1."""
    # A 16-bit cache under a float32 query, or an FP8 one (--kv-cache-dtype), is widened as it
    # is read.
    k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    k = k.to(q.dtype)
    s = _dot(q, tl.trans(k), PRECISION, UPCAST) * scale
    if SOFTCAP:
        s = (2.0 * tl.sigmoid(2.0 * (s / softcap)) - 1.0) * softcap
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    v = v.to(q.dtype)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
    return m_new, l_i, acc


@triton.jit
def _with_sink(m_i, l_i, acc, sink):
    """Fold gpt-oss's sink (a logit with no value) into a finished online softmax: it takes its
    share of the sum, none of the output. Returns (l_i, acc) rescaled to the new maximum."""
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp(m_i - m_new)
    return l_i * alpha + tl.exp(sink - m_new), acc * alpha[:, None]


def _check(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, seq_ids):
    if query.dim() != 3:
        raise ValueError(f"query must be [tokens, heads, head_dim], got {tuple(query.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError(
            "k_cache and v_cache must be [blocks, block_size, kv_heads, head_dim] alike"
        )
    heads, head_dim = query.shape[1], query.shape[2]
    kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"head_dim {head_dim} != cache head_dim {k_cache.shape[3]}")
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    if query.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("the head_dim axis must be contiguous")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache {k_cache.dtype} and v_cache {v_cache.dtype} dtypes differ")
    floats = (torch.float32, torch.float16, torch.bfloat16)
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    if query.dtype not in floats or k_cache.dtype not in (*floats, *fp8):
        raise ValueError(f"unsupported dtypes {query.dtype}, {k_cache.dtype}")
    # The cache is the query's dtype, 16-bit under a float32 query, or FP8 (--kv-cache-dtype).
    if k_cache.dtype not in (query.dtype, *fp8) and query.dtype != torch.float32:
        raise ValueError(f"unsupported dtypes: a {k_cache.dtype} cache under a {query.dtype} query")
    for name, t in (
        ("block_tables", block_tables),
        ("query_start_loc", query_start_loc),
        ("seq_lens", seq_lens),
        ("seq_ids", seq_ids),
    ):
        if t.dtype not in (torch.int32, torch.int64) or t.device != query.device:
            raise ValueError(f"{name} must be an integer tensor on {query.device}")
    if block_tables.dim() != 2 or block_tables.stride(1) != 1:
        raise ValueError("block_tables must be [num_seqs, max_blocks], row-major")


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs: exact fp32 products (no tf32), to match the torch reference.
    return "ieee" if dtype == torch.float32 else "tf32"


def _upcast(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
