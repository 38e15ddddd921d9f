"""A mixture's experts in two launches (the CUDA backend's `moe`), where gpu/models/moe.py's
portable path gathers rows on the host and runs a product per expert.

Each token's top k (expert, weight) choices are laid out on the device (`align`): the (token,
choice) pairs sorted by expert, each expert's run padded to whole blocks of BLOCK_M rows, and
each block's expert. `moe_products` then runs one program per (block, column tile): the block's
rows of the input (the token's hidden row, or the pair's own row for the second product) times
that expert's weight [N, K], plus its bias, optionally times the pair's routing weight, stored
at the pair's row. Shapes depend only on the token count: no read back to the host, the same
launches every step.

The experts' weights are dense [E, n, k] in the model's dtype, or 4-bit (gpu/cuda/int4_weight.py's
form with a leading expert axis: codes [E, k / 8, n], scales and mins [E, k / 32, n]), each tile
decoded in the kernel as the W4A16 product decodes it (kernels/w4a16.py `int4_tile`): Q4_0 /
Q4_1 blocks (a GGUF's, AWQ's, GPTQ's) or MXFP4's (gpt-oss's experts).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu.cuda.int4_weight import GROUP, Int4Weight
from gpu.cuda.kernels.w4a16 import int4_tile

BLOCK_M = 16  # rows of a block: one expert's pairs, padded (tl.dot's least)


@triton.jit
def _moe_kernel(
    a_ptr,
    w_ptr,
    scales_ptr,
    mins_ptr,
    bias_ptr,
    scale_ptr,
    out_ptr,
    sorted_ptr,
    block_expert_ptr,
    pairs,
    n,
    k,
    a_stride,
    top_k,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BY_TOKEN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SCALE: tl.constexpr,
    UPCAST: tl.constexpr,
    QUANT: tl.constexpr,  # 0: dense weights; 1: 4-bit codes, scale and min; 2: MXFP4 codes
    GROUP: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows < pairs  # not padding (every row of a block past the last expert is)
    a_rows = (rows // top_k) if BY_TOKEN else rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n
    e = tl.maximum(expert, 0)
    if QUANT:  # 4-bit: codes [k / 8, n], scales and mins [k / GROUP, n]
        w_base = w_ptr + e * (k // 8) * n
        s_base = scales_ptr + e * (k // GROUP) * n
        m_base = mins_ptr + e * (k // GROUP) * n
    else:  # dense: [n, k]
        w_base = w_ptr + e * n * k
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k
        a = tl.load(
            a_ptr + a_rows[:, None].to(tl.int64) * a_stride + offs_k[None, :],
            mask=valid[:, None] & k_mask[None, :],
            other=0.0,
        )
        if QUANT:
            w = int4_tile(
                w_base, s_base, m_base, k0, n, k, offs_n, n_mask,
                GROUP, BLOCK_K, BLOCK_N, QUANT == 2,
            ).to(a.dtype)  # fmt: skip
        else:
            w = tl.load(
                w_base + offs_n[None, :].to(tl.int64) * k + offs_k[:, None],
                mask=k_mask[:, None] & n_mask[None, :],
                other=0.0,
            )
        if UPCAST:  # float32 weights, or Triton's CPU interpreter (no 16-bit products)
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    if HAS_BIAS:
        b = tl.load(bias_ptr + e * n + offs_n, mask=n_mask, other=0.0)
        acc += b.to(tl.float32)[None, :]
    if SCALE:
        acc *= tl.load(scale_ptr + rows, mask=valid, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + rows[:, None].to(tl.int64) * n + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


def align(chosen: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """chosen [tokens, k] expert ids -> (sorted [P]: the pairs (token * k + choice) by expert,
    tokens in order within one, each expert's run padded to a multiple of BLOCK_M with `pairs`
    (no pair); the expert of each block of BLOCK_M [P / BLOCK_M], -1 past the last). P, the most
    the pairs can take padded, depends on the shape alone."""
    flat = chosen.flatten().to(torch.int64)
    pairs, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    by_expert = flat[order]
    first = torch.cumsum(counts, 0) - counts  # each expert's first place among the sorted pairs
    rank = torch.arange(pairs, device=device) - first[by_expert]
    size = triton.cdiv(pairs + num_experts * (BLOCK_M - 1), BLOCK_M) * BLOCK_M
    sorted_ids = torch.full((size,), pairs, dtype=torch.int64, device=device)
    sorted_ids[(ends - padded)[by_expert] + rank] = order
    starts = torch.arange(0, size, BLOCK_M, device=device)
    block_expert = torch.searchsorted(ends, starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return sorted_ids, block_expert


def moe_products(
    a: torch.Tensor,
    w: torch.Tensor | Int4Weight,
    bias: torch.Tensor | None,
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    top_k: int,
    by_token: bool,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """out [pairs, n]: each pair's row of `a` (its token's, `by_token`, else its own) times its
    expert's weight [n, k]^T (w [E, n, k], or the experts' 4-bit forms stacked), plus bias
    [E, n], times scale [pairs] when given."""
    pairs = (a.shape[0] * top_k) if by_token else a.shape[0]
    quant = isinstance(w, Int4Weight)
    n, k = w.shape if quant else w.shape[1:]
    held = (w.qweight, w.scales, w.mins) if quant else (w,)
    if a.dim() != 2 or a.shape[1] != k or a.stride(1) != 1:
        raise ValueError(f"a must be [rows, {k}] with contiguous rows, got {tuple(a.shape)}")
    if not all(t is None or t.is_contiguous() for t in held):
        raise ValueError("the experts' weights must be contiguous")
    if quant and (k % GROUP or w.qweight.shape[1:] != (k // 8, n)):
        raise ValueError(f"4-bit experts need k = {k} in whole groups of {GROUP}")
    out = torch.empty((pairs, n), dtype=a.dtype, device=a.device)
    block_n = 64 if n >= 64 else triton.next_power_of_2(max(n, 16))
    block_k = 64 if k >= 64 or quant else triton.next_power_of_2(max(k, 16))
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _moe_kernel[grid](
        a,
        held[0],
        w.scales if quant else a,  # (the 4-bit form's; unread when dense)
        w.mins if quant and w.mins is not None else a,  # (unread but with integer codes)
        bias if bias is not None else a,
        scale if scale is not None else a,
        out,
        sorted_ids,
        block_expert,
        pairs,
        n,
        k,
        a.stride(0),
        top_k,
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        BY_TOKEN=by_token,
        HAS_BIAS=bias is not None,
        SCALE=scale is not None,
        UPCAST=not a.is_cuda or a.dtype == torch.float32,
        QUANT=(2 if w.fp4 else 1) if quant else 0,
        GROUP=GROUP,
    )
    return out
