"""Batched LoRA products on the GPU: one product group's adapters (gpu/lora.py LoraGroup) for a
whole step's batch, every token row with its own adapter or none, in two launches: the shrink
(v = x A^T, per slice of the group) then the expand (y[:, slice] += v B^T).

Rows are taken adapter by adapter, in the order the host grouped them (gpu/lora.py LoraBatch:
`order` lists the rows with an adapter, slot 0's first, `starts` and `counts` where each slot's
run lies), so that a program multiplies a tile of rows of one adapter by that adapter's A or B
on the tensor cores. The third grid axis is the slot: a program whose tile lies past its slot's
rows, or whose slice the adapter leaves alone (rank 0), returns at once. Rows without an
adapter are in no run, and are not touched.

The grids, the split of k and every other launch decision come from shapes alone (the number of
rows, the slots, the group's widths): never from which adapters a step has, so a decode step
with adapters captures as a CUDA graph over static row buffers (gpu/cuda/graphs.py).

Arithmetic: x A^T accumulated in float32 over the input dtype (k split across programs for few
rows, the shares summed in a fixed order by the expand: deterministic), v rounded to the
activations' dtype for the expand (as torch's bmm in the model's dtype rounds it), v B^T in
float32 added to y in float32 and rounded once. A float32 model multiplies in IEEE float32.
Slots held in another dtype than the activations (--lora-dtype) are converted to the
activations' as each tile is loaded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK_M = 16  # rows of one adapter a program takes (tl.dot's smallest)
BLOCK_K = 64
BLOCK_N = 64


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    if UPCAST:  # float32 weights, or Triton's CPU interpreter (no 16-bit products)
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    ranks_ptr,
    order_ptr,
    counts_ptr,
    starts_ptr,
    v_ptr,
    k,
    num_slices,
    x_stride,
    a_stride_slot,
    a_stride_slice,
    v_stride_split,
    v_stride_slice,
    R_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """v[split, slice, p, :rank] = x[order[p]] A^T over the split's share of k, for the tile of
    positions p of program 0's index within slot program 2's run."""
    pid_m = tl.program_id(0)
    slice_id = tl.program_id(1) // SPLIT_K
    split = tl.program_id(1) % SPLIT_K
    slot = tl.program_id(2)
    count = tl.load(counts_ptr + slot)
    if pid_m * BLOCK_M >= count:
        return
    rank = tl.load(ranks_ptr + slot * num_slices + slice_id)
    if rank == 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < count
    pos = tl.load(starts_ptr + slot) + offs_m
    rows = tl.load(order_ptr + pos, mask=m_mask, other=0).to(tl.int64)
    offs_r = tl.arange(0, R_PAD)
    r_mask = offs_r < rank
    a = a_ptr + slot.to(tl.int64) * a_stride_slot + slice_id * a_stride_slice
    tiles = tl.cdiv(k, BLOCK_K)
    per_split = tl.cdiv(tiles, SPLIT_K)
    first = split * per_split
    last = tl.minimum(first + per_split, tiles)
    acc = tl.zeros([BLOCK_M, R_PAD], dtype=tl.float32)
    for t in range(first, last):
        offs_k = t * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k
        xt = tl.load(
            x_ptr + rows[:, None] * x_stride + offs_k[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        at = tl.load(  # A^T's tile [BLOCK_K, R_PAD], in x's dtype
            a + offs_r[None, :] * k + offs_k[:, None],
            mask=r_mask[None, :] & k_mask[:, None],
            other=0.0,
        ).to(x_ptr.dtype.element_ty)
        acc += _dot(xt, at, UPCAST, PRECISION)
    out = v_ptr + split * v_stride_split + slice_id * v_stride_slice
    tl.store(out + pos[:, None] * R_PAD + offs_r[None, :], acc, mask=m_mask[:, None])


@triton.jit
def _lora_expand_kernel(
    v_ptr,
    b_ptr,
    ranks_ptr,
    cols_ptr,
    order_ptr,
    counts_ptr,
    starts_ptr,
    y_ptr,
    n,
    num_slices,
    tiles_per_slice,
    y_stride,
    b_stride_slot,
    v_stride_split,
    v_stride_slice,
    R_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """y[order[p], tile of the slice's columns] += v[slice, p] B^T for the tile of positions p
    of program 0's index within slot program 2's run."""
    pid_m = tl.program_id(0)
    slice_id = tl.program_id(1) // tiles_per_slice
    tile = tl.program_id(1) % tiles_per_slice
    slot = tl.program_id(2)
    count = tl.load(counts_ptr + slot)
    if pid_m * BLOCK_M >= count:
        return
    rank = tl.load(ranks_ptr + slot * num_slices + slice_id)
    if rank == 0:
        return
    c0 = tl.load(cols_ptr + slice_id) + tile * BLOCK_N
    c1 = tl.load(cols_ptr + slice_id + 1)
    if c0 >= c1:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < count
    pos = tl.load(starts_ptr + slot) + offs_m
    rows = tl.load(order_ptr + pos, mask=m_mask, other=0).to(tl.int64)
    offs_r = tl.arange(0, R_PAD)
    offs_n = c0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < c1
    v = tl.zeros([BLOCK_M, R_PAD], dtype=tl.float32)
    vp = v_ptr + slice_id * v_stride_slice + pos[:, None] * R_PAD + offs_r[None, :]
    for split in tl.static_range(SPLIT_K):
        v += tl.load(vp + split * v_stride_split, mask=m_mask[:, None], other=0.0)
    bt = tl.load(  # B^T's tile [R_PAD, BLOCK_N], in y's dtype
        b_ptr + slot.to(tl.int64) * b_stride_slot + offs_r[:, None] * n + offs_n[None, :],
        mask=(offs_r < rank)[:, None] & n_mask[None, :],
        other=0.0,
    ).to(y_ptr.dtype.element_ty)
    d = _dot(v.to(bt.dtype), bt, UPCAST, PRECISION)
    mask = m_mask[:, None] & n_mask[None, :]
    yp = y_ptr + rows[:, None] * y_stride + offs_n[None, :]
    y = tl.load(yp, mask=mask, other=0.0).to(tl.float32)
    tl.store(yp, (y + d).to(y_ptr.dtype.element_ty), mask=mask)


def rank_pad(max_rank: int) -> int:
    """The rank axis as the kernels tile it: a power of two, at least tl.dot's 16."""
    return max(16, triton.next_power_of_2(max_rank))


def split_k_for(tokens: int, k: int, sms: int) -> int:
    """Split k when few rows leave the GPU idle (decode steps); a share keeps four k tiles."""
    if triton.cdiv(tokens, BLOCK_M) * 8 >= sms:
        return 1
    return max(1, min(8, triton.cdiv(k, BLOCK_K) // 4))


def lora_shrink_expand(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    ranks: torch.Tensor,
    cols: torch.Tensor,
    cols_list: list[int],
    order: torch.Tensor,
    counts: torch.Tensor,
    starts: torch.Tensor,
    split_k: int | None = None,
) -> None:
    """y [tokens, n] += (x [tokens, k] A^T) B^T in place, each row with the adapter of its run
    in `order` (gpu/lora.py LoraBatch) and the others untouched. a [slots, slices, max_rank, k],
    b [slots, max_rank, n], ranks [slots, slices] int32, cols [slices + 1] int64 (and the same
    as `cols_list`), order [tokens] int32, counts and starts [slots] int32: gpu/lora.py's
    layouts. Rows of x and y contiguous; y may be a view into a wider tensor."""
    if x.dim() != 2 or y.dim() != 2 or x.stride(1) != 1 or y.stride(1) != 1:
        raise ValueError("x and y must be [tokens, k] and [tokens, n] with contiguous rows")
    t, k = x.shape
    if a.dim() != 4 or not a.is_contiguous() or a.shape[3] != k:
        raise ValueError(f"a must be a contiguous [slots, slices, max_rank, {k}] tensor")
    slots, slices, max_rank, _ = a.shape
    n = cols_list[-1]
    if y.shape != (t, n):
        raise ValueError(f"y must be [{t}, {n}], got {tuple(y.shape)}")
    if b.shape != (slots, max_rank, n) or not b.is_contiguous():
        raise ValueError(f"b must be a contiguous [{slots}, {max_rank}, {n}] tensor")
    if len(cols_list) != slices + 1 or cols.shape != (slices + 1,) or cols.dtype != torch.int64:
        raise ValueError(f"cols must be [{slices + 1}] int64")
    if ranks.shape != (slots, slices) or ranks.dtype != torch.int32 or not ranks.is_contiguous():
        raise ValueError(f"ranks must be a contiguous [{slots}, {slices}] int32 tensor")
    for name, v, size in (
        ("order", order, t),
        ("counts", counts, slots),
        ("starts", starts, slots),
    ):
        if v.shape != (size,) or v.dtype != torch.int32 or not v.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [{size}] int32 tensor")
    if y.dtype != x.dtype or b.dtype != a.dtype:
        raise ValueError("x and y must share one dtype, and the slots' a and b another")
    if x.dtype not in DTYPES or a.dtype not in DTYPES:
        raise ValueError("x and the slots must be float32, float16 or bfloat16")
    if any(v.device != x.device for v in (y, a, b, ranks, cols, order, counts, starts)):
        raise ValueError("every tensor must be on one device")
    if t == 0:
        return
    r_pad = rank_pad(max_rank)
    if split_k is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 8
        split_k = split_k_for(t, k, sms)
    upcast = not x.is_cuda or x.dtype == torch.float32
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    v = torch.empty((split_k, slices, t, r_pad), dtype=torch.float32, device=x.device)
    tiles_m = triton.cdiv(t, BLOCK_M)
    _lora_shrink_kernel[(tiles_m, slices * split_k, slots)](
        x,
        a,
        ranks,
        order,
        counts,
        starts,
        v,
        k,
        slices,
        x.stride(0),
        a.stride(0),
        a.stride(1),
        v.stride(0),
        v.stride(1),
        R_PAD=r_pad,
        BLOCK_M=BLOCK_M,
        BLOCK_K=BLOCK_K,
        SPLIT_K=split_k,
        UPCAST=upcast,
        PRECISION=precision,
    )
    widest = max(c1 - c0 for c0, c1 in zip(cols_list, cols_list[1:]))
    tiles_n = triton.cdiv(widest, BLOCK_N)
    _lora_expand_kernel[(tiles_m, slices * tiles_n, slots)](
        v,
        b,
        ranks,
        cols,
        order,
        counts,
        starts,
        y,
        n,
        slices,
        tiles_n,
        y.stride(0),
        b.stride(0),
        v.stride(0),
        v.stride(1),
        R_PAD=r_pad,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        SPLIT_K=split_k,
        UPCAST=upcast,
        PRECISION=precision,
    )
