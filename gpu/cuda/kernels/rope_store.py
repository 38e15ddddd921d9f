"""After the Q/K/V product, one kernel instead of torch's dozen or more: each query and key head
optionally RMS-normalized (Qwen3's q_norm/k_norm), rotated (the rotate-half rotary embedding of
gpu/models/rope.py apply_rope over the whole head), the queries written out contiguous for the
attention kernels, and the keys and values stored into the paged cache at their slots (slot -1 is
padding: nothing stored, as gpu/cuda/kernels/store_kv.py does). Q, K and V are read where the
product left them (views of its output), so no copy is made before.

It rounds where the torch code does (TorchBackend.norm_rope, then the cache write): the norm as
gpu/cuda/kernels/rms_norm.py (the per-head sum of squares in another order than torch's mean: one
rounding of the dtype apart at most), then x * cos and rotate_half(x) * sin each rounded to the
dtype (compiled without fused multiply-adds), their sum rounded, and the cast to the cache's
dtype. Without the norm the results equal torch's bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu.cuda.kernels.fp8_cache import cache_kind, emulate, to_cache

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CACHE_DTYPES = (*DTYPES, torch.float8_e4m3fn, torch.float8_e5m2)  # --kv-cache-dtype's


@triton.jit
def _norm_rope(
    row, d, partner, mask, cos, sin, w_ptr, eps, NORM: tl.constexpr, HEAD_DIM: tl.constexpr
):
    """Head rows starting at the pointers `row` [rows, 1], each normalized (NORM) and rotated;
    float32 values of their dtype."""
    dt = row.dtype.element_ty
    x = tl.load(row + d, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(row + partner, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        inv = tl.math.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
        w = tl.load(w_ptr + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
        x = (w * (x * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        xp = (wp * (xp * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    # rotate_half: (-x[half:], x[:half]); the sign is exact, so it goes on the product
    a = (x * cos).to(dt).to(tl.float32)
    b = (xp * sin).to(dt).to(tl.float32)
    b = tl.where(d < HEAD_DIM // 2, -b, b)
    return (a + b).to(dt)


@triton.jit
def _rope_store_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    cos_ptr,
    sin_ptr,
    q_weight_ptr,
    k_weight_ptr,
    eps,
    k_mul,
    v_mul,
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    q_out_stride_t,
    cos_stride_t,
    sin_stride_t,
    cache_stride_block,
    cache_stride_slot,
    cache_stride_head,
    block_size,
    num_tokens,
    num_heads,
    num_kv_heads,
    q_programs,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    ROWS: tl.constexpr,
    NORM: tl.constexpr,
    KIND: tl.constexpr,
    EMULATE: tl.constexpr,
    SCALED: tl.constexpr,
):
    """ROWS (token, head) rows a program: the first q_programs take the query heads, the rest
    the key and value heads (rows whose slot is -1 store nothing; SCALED: K and V stored times
    k_mul and v_mul, in float32)."""
    pid = tl.program_id(0)
    d = tl.arange(0, HEAD_PAD)[None, :]
    partner = tl.where(d < HEAD_DIM // 2, d + HEAD_DIM // 2, d - HEAD_DIM // 2)
    r = tl.arange(0, ROWS)[:, None]
    # (token, head) pairs counted in int32 (tokens x heads < 2^31), offsets in int64
    if pid < q_programs:
        row = pid * ROWS + r
        t, h = (row // num_heads).to(tl.int64), row % num_heads
        mask = (t < num_tokens) & (d < HEAD_DIM)
        cos = tl.load(cos_ptr + t * cos_stride_t + d, mask=mask, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + t * sin_stride_t + d, mask=mask, other=0.0).to(tl.float32)
        src = q_ptr + t * q_stride_t + h * q_stride_h
        q = _norm_rope(src, d, partner, mask, cos, sin, q_weight_ptr, eps, NORM, HEAD_DIM)
        tl.store(q_out_ptr + t * q_out_stride_t + h * HEAD_DIM + d, q, mask=mask)
    else:
        row = (pid - q_programs) * ROWS + r
        t, h = (row // num_kv_heads).to(tl.int64), row % num_kv_heads
        slot = tl.load(slot_ptr + t, mask=t < num_tokens, other=-1).to(tl.int32)
        mask = (slot >= 0) & (d < HEAD_DIM)
        cos = tl.load(cos_ptr + t * cos_stride_t + d, mask=mask, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + t * sin_stride_t + d, mask=mask, other=0.0).to(tl.float32)
        src = k_ptr + t * k_stride_t + h * k_stride_h
        k = _norm_rope(src, d, partner, mask, cos, sin, k_weight_ptr, eps, NORM, HEAD_DIM)
        dst = (
            (slot // block_size).to(tl.int64) * cache_stride_block
            + (slot % block_size) * cache_stride_slot
            + h * cache_stride_head
            + d
        )
        v = tl.load(v_ptr + t * v_stride_t + h * v_stride_h + d, mask=mask)
        if SCALED:
            k = k * k_mul
            v = v.to(tl.float32) * v_mul
        tl.store(k_cache_ptr + dst, to_cache(k, k_cache_ptr, KIND, EMULATE), mask=mask)
        tl.store(v_cache_ptr + dst, to_cache(v, v_cache_ptr, KIND, EMULATE), mask=mask)


def _check_heads(name: str, x: torch.Tensor, t: int, d: int, dtype: torch.dtype) -> None:
    if x.dim() != 3 or x.shape[0] != t or x.shape[2] != d:
        raise ValueError(f"{name} must be [{t}, heads, {d}], got {tuple(x.shape)}")
    if x.dtype != dtype:
        raise ValueError(f"{name} is {x.dtype}, q is {dtype}")
    if x.stride(2) != 1:
        raise ValueError(f"{name}'s head_dim axis must be contiguous")


def rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    muls: tuple[float, float] | None = None,
) -> torch.Tensor:
    """q [tokens, heads, head_dim], k and v [tokens, kv_heads, head_dim] (views with any token
    and head strides), cos and sin [tokens, head_dim] in q's dtype; caches [num_blocks,
    block_size, kv_heads, head_dim]; slot_mapping [tokens] (-1: padding). q_weight, k_weight:
    per-head RMSNorm weights [head_dim] applied before the rotation (both or neither). Stores the
    rotated keys and the values (times `muls`' K and V factors in float32, when given: a
    checkpoint's FP8 KV scales, gpu/kv_scales.py); returns the rotated queries, contiguous."""
    if q.dtype not in DTYPES:
        raise ValueError(f"q must be float32, float16 or bfloat16, got {q.dtype}")
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, heads, head_dim], got {tuple(q.shape)}")
    t, h, d = q.shape
    if d % 2:
        raise ValueError(f"head_dim {d} must be even to rotate halves")
    _check_heads("k", k, t, d, q.dtype)
    _check_heads("v", v, t, d, q.dtype)
    kv_heads = k.shape[1]
    if v.shape != k.shape:
        raise ValueError(f"v {tuple(v.shape)} must match k {tuple(k.shape)}")
    for name, c in (("cos", cos), ("sin", sin)):
        if c.shape != (t, d) or c.dtype != q.dtype or c.stride(1) != 1:
            raise ValueError(
                f"{name} must be [{t}, {d}] {q.dtype} with contiguous rows, got "
                f"{tuple(c.shape)} {c.dtype}"
            )
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight go together")
    if q_weight is not None:
        for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
            if w.shape != (d,) or w.dtype != q.dtype or w.stride(0) != 1:
                raise ValueError(f"{name} must be a contiguous [{d}] {q.dtype} tensor")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache and v_cache must be [blocks, block_size, heads, head_dim] alike")
    if k_cache.shape[2:] != (kv_heads, d):
        raise ValueError(f"cache heads/head_dim {tuple(k_cache.shape[2:])} != k {(kv_heads, d)}")
    if (
        k_cache.dtype not in CACHE_DTYPES
        or v_cache.dtype != k_cache.dtype
        or k_cache.stride(3) != 1
    ):
        raise ValueError("the caches must be one float dtype with a contiguous head_dim axis")
    if slot_mapping.shape != (t,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError("slot_mapping must be a [tokens] integer tensor")
    tensors = (k, v, cos, sin, k_cache, v_cache, slot_mapping)
    if any(x.device != q.device for x in tensors):
        raise ValueError("all tensors must be on one device")
    out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    norm = q_weight is not None
    pad = triton.next_power_of_2(d)
    # (token, head) rows a program: a tile of 2048 elements (Qwen3-0.6B: one token's 16 query
    # heads), fewer when the whole step has fewer rows
    rows = min(max(1, 2048 // pad), triton.next_power_of_2(t * max(h, kv_heads)))
    q_programs = triton.cdiv(t * h, rows)
    _rope_store_kernel[(q_programs + triton.cdiv(t * kv_heads, rows),)](
        q,
        k,
        v,
        out,
        k_cache,
        v_cache,
        slot_mapping,
        cos,
        sin,
        q_weight if norm else cos,
        k_weight if norm else cos,
        float(eps),
        float(muls[0]) if muls else 1.0,
        float(muls[1]) if muls else 1.0,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        cos.stride(0),
        sin.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.shape[1],
        t,
        h,
        kv_heads,
        q_programs,
        HEAD_DIM=d,
        HEAD_PAD=pad,
        ROWS=rows,
        NORM=norm,
        KIND=cache_kind(k_cache),
        EMULATE=emulate(k_cache),
        SCALED=muls is not None,
        num_warps=max(1, min(rows * pad // 512, 8)),
        enable_fp_fusion=False,  # x cos + rot(x) sin: two roundings, as torch's ops round
    )
    return out
