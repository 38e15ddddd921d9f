"""Write new K/V rows into the paged cache at their slots (slot -1 is padding: nothing written),
in the cache's dtype (FP8 as gpu/cuda/kernels/fp8_cache.py rounds it)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu.cuda.kernels.fp8_cache import cache_kind, emulate, to_cache


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    key_stride_t,
    key_stride_h,
    value_stride_t,
    value_stride_h,
    cache_stride_block,
    cache_stride_slot,
    cache_stride_head,
    block_size,
    num_heads,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KIND: tl.constexpr,
    EMULATE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        block = slot // block_size
        offset = slot % block_size
        h = tl.arange(0, HEADS_PAD)[:, None]
        d = tl.arange(0, HEAD_PAD)[None, :]
        mask = (h < num_heads) & (d < HEAD_DIM)
        dst = block * cache_stride_block + offset * cache_stride_slot + h * cache_stride_head + d
        k = tl.load(key_ptr + t * key_stride_t + h * key_stride_h + d, mask=mask)
        tl.store(k_cache_ptr + dst, to_cache(k, k_cache_ptr, KIND, EMULATE), mask=mask)
        v = tl.load(value_ptr + t * value_stride_t + h * value_stride_h + d, mask=mask)
        tl.store(v_cache_ptr + dst, to_cache(v, v_cache_ptr, KIND, EMULATE), mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key, value: [num_tokens, num_kv_heads, head_dim]; caches: [num_blocks, block_size,
    num_kv_heads, head_dim]; slot_mapping: [num_tokens] int64, -1 for padding."""
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(
            f"key and value must be [tokens, heads, head_dim], got {tuple(key.shape)} "
            f"and {tuple(value.shape)}"
        )
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache and v_cache must be [blocks, block_size, heads, head_dim] alike")
    t, h, d = key.shape
    if k_cache.shape[2:] != (h, d):
        raise ValueError(f"cache heads/head_dim {tuple(k_cache.shape[2:])} != key {(h, d)}")
    if slot_mapping.shape != (t,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError("slot_mapping must be a [num_tokens] integer tensor")
    if key.stride(-1) != 1 or value.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("the head_dim axis must be contiguous")
    if not (key.device == value.device == k_cache.device == slot_mapping.device):
        raise ValueError("all tensors must be on one device")
    if t == 0:
        return
    _store_kv_kernel[(t,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.shape[1],
        h,
        HEAD_DIM=d,
        HEAD_PAD=triton.next_power_of_2(d),
        HEADS_PAD=triton.next_power_of_2(h),
        KIND=cache_kind(k_cache),
        EMULATE=emulate(k_cache),
    )
