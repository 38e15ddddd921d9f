"""y = x @ W.T with W in 4 bits (W4A16): AWQ and GPTQ int4 checkpoints and GGUF's Q4_0 / Q4_1,
dequantized tile by tile inside the product; and in 8 (W8A16: GGUF's Q8_0, compressed-tensors'
and GPTQ's 8-bit layers, `int8`: int8 codes four to a word, a scale per 32, no min).

The weight (gpu/cuda/int4_weight.py `Int4Weight`) is K-major so that a tile of it is one
coalesced read: `qweight` [k / 8, n] int32, eight 4-bit codes of consecutive k per word (code
j of word i is bits 4j..4j+3, for k = 8 i + j); `scales` and `mins` [k / group, n] float16:
w = scale * q + min (Q4_0's and symmetric GPTQ's min is -8 scale), formed in float32. With FP4
(MXFP4's codes: sign, two exponent bits, one mantissa bit) there is no min: w = scale * v with v
the code's E2M1 value doubled (0, 1, 2, 3, 4, 6, 8, 12, signed), decoded from its bits.

One program computes a [BLOCK_M, BLOCK_N] tile of y over a 1 / SPLIT_K share of k, reading its
codes once and their group's scale and min; with few rows (decode) the k axis is split across
programs so that the GPU fills, and the shares are summed in a second pass (fp32, in a fixed
order: the result does not depend on timing). From DEQUANT_ROWS rows on (a batch, a prefill) the
weight is instead dequantized once, in one kernel, to x's dtype and multiplied by torch's product
(cuBLAS on a GPU), as vLLM does for AWQ from 256 tokens: the tiled product reached a quarter of
bf16's speed at 64 rows on an H200 (docs/benchmarks.md), and the dequantized weight's extra bytes
cost less than that there. Everything is decided from shapes: graph-safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Rows from which the weight is dequantized for torch's product (None: never); the benchmark
# (benchmarks/quant_gpu.py) measures both sides of it.
DEQUANT_ROWS: int | None = 64


@triton.jit
def _spread(rows, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    """[BLOCK_K / GROUP, BLOCK_N] -> [BLOCK_K, BLOCK_N]: each row repeated GROUP times."""
    wide = tl.broadcast_to(rows[:, None, :], (BLOCK_K // GROUP, GROUP, BLOCK_N))
    return tl.reshape(wide, (BLOCK_K, BLOCK_N))


@triton.jit
def _codes(q_ptr, k0, n, k, offs_n, n_mask, BITS: tl.constexpr, BLOCK_K: tl.constexpr,
           BLOCK_N: tl.constexpr):  # fmt: skip
    """The unsigned codes [BLOCK_K, BLOCK_N] at rows k0.. of q [k / PER, n] int32 (PER = 32 /
    BITS codes a word: code j of word i, bits BITS j.., is k = PER i + j); zero past k and n.
    Each word is read once."""
    PER: tl.constexpr = 32 // BITS
    offs_w = k0 // PER + tl.arange(0, BLOCK_K // PER)
    words = tl.load(
        q_ptr + offs_w[:, None].to(tl.int64) * n + offs_n[None, :],
        mask=(offs_w[:, None] < k // PER) & n_mask[None, :],
        other=0,
    )
    shifts = tl.arange(0, PER) * BITS
    codes = (words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)
    return tl.reshape(codes, (BLOCK_K, BLOCK_N))


@triton.jit
def _per_group(ptr, k0, n, k, offs_n, n_mask, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
               BLOCK_N: tl.constexpr):  # fmt: skip
    """The float32 values [BLOCK_K, BLOCK_N] of a [k / GROUP, n] tensor (scales, mins) for the
    tile's rows k0..: each read once and spread over its GROUP rows."""
    offs_g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
    g_mask = (offs_g[:, None] < k // GROUP) & n_mask[None, :]
    group = offs_g[:, None].to(tl.int64) * n + offs_n[None, :]
    values = tl.load(ptr + group, mask=g_mask, other=0.0).to(tl.float32)
    return _spread(values, BLOCK_K, BLOCK_N, GROUP)


@triton.jit
def int4_tile(
    q_ptr,
    scales_ptr,
    mins_ptr,
    k0,
    n,
    k,
    offs_n,
    n_mask,
    GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP4: tl.constexpr,
):
    """The weight's float32 tile [BLOCK_K, BLOCK_N] at rows k0.. (a multiple of BLOCK_K, whole
    groups) and columns offs_n, from its codes q [k / 8, n] int32 and scales / mins
    [k / GROUP, n] (mins unread with FP4); zero past k and n."""
    codes = _codes(q_ptr, k0, n, k, offs_n, n_mask, 4, BLOCK_K, BLOCK_N)
    scale = _per_group(scales_ptr, k0, n, k, offs_n, n_mask, GROUP, BLOCK_K, BLOCK_N)
    if FP4:  # magnitudes 0..7 -> 0, 1, 2, 3, 4, 6, 8, 12; bit 3 the sign
        mag = codes & 7
        v = tl.where(mag < 4, mag, tl.where(mag < 6, (mag - 2) * 2, (mag - 4) * 4))
        v = tl.where(codes >= 8, -v, v)
        w = v.to(tl.float32) * scale
    else:
        low = _per_group(mins_ptr, k0, n, k, offs_n, n_mask, GROUP, BLOCK_K, BLOCK_N)
        w = codes.to(tl.float32) * scale + low
    return w


@triton.jit
def int8_tile(
    q_ptr,
    scales_ptr,
    k0,
    n,
    k,
    offs_n,
    n_mask,
    GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Q8_0's float32 tile [BLOCK_K, BLOCK_N], as int4_tile's: codes q [k / 4, n] int32 (signed
    bytes), scales [k / GROUP, n]: w = scale * q."""
    codes = _codes(q_ptr, k0, n, k, offs_n, n_mask, 8, BLOCK_K, BLOCK_N)
    codes = codes - ((codes >> 7) << 8)  # 128..255 are -128..-1
    scale = _per_group(scales_ptr, k0, n, k, offs_n, n_mask, GROUP, BLOCK_K, BLOCK_N)
    return codes.to(tl.float32) * scale


@triton.jit
def _w4a16_kernel(
    x_ptr,
    qweight_ptr,
    scales_ptr,
    mins_ptr,
    out_ptr,
    m,
    n,
    k,
    x_stride,
    out_stride_split,
    out_stride_m,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    UPCAST: tl.constexpr,
    FP4: tl.constexpr,
    INT8: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < m
    n_mask = offs_n < n
    # This program's share of k: whole BLOCK_K tiles.
    tiles = tl.cdiv(k, BLOCK_K)
    per_split = tl.cdiv(tiles, SPLIT_K)
    first = split * per_split
    last = tl.minimum(first + per_split, tiles)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for t in range(first, last):
        offs_k = t * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k
        x = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * x_stride + offs_k[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        if INT8:
            w = int8_tile(
                qweight_ptr, scales_ptr, t * BLOCK_K, n, k, offs_n, n_mask, GROUP, BLOCK_K, BLOCK_N
            )
        else:
            w = int4_tile(
                qweight_ptr, scales_ptr, mins_ptr, t * BLOCK_K, n, k, offs_n, n_mask,
                GROUP, BLOCK_K, BLOCK_N, FP4,
            )  # fmt: skip
        if UPCAST:  # float32 activations, or Triton's CPU interpreter (no 16-bit products)
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    out = out_ptr + split * out_stride_split + offs_m[:, None] * out_stride_m + offs_n[None, :]
    tl.store(out, acc, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _dequant_kernel(
    qweight_ptr,
    scales_ptr,
    mins_ptr,
    out_ptr,
    n,
    k,
    GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP4: tl.constexpr,
    INT8: tl.constexpr,
):
    """out [k, n] (the weight transposed, in out's dtype), one [BLOCK_K, BLOCK_N] tile a
    program: the very tile the product decodes."""
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n
    k0 = tl.program_id(0) * BLOCK_K
    if INT8:
        w = int8_tile(qweight_ptr, scales_ptr, k0, n, k, offs_n, n_mask, GROUP, BLOCK_K, BLOCK_N)
    else:
        w = int4_tile(
            qweight_ptr, scales_ptr, mins_ptr, k0, n, k, offs_n, n_mask,
            GROUP, BLOCK_K, BLOCK_N, FP4,
        )  # fmt: skip
    out = out_ptr + offs_k[:, None].to(tl.int64) * n + offs_n[None, :]
    tl.store(
        out,
        w.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
        mask=(offs_k[:, None] < k) & n_mask[None, :],
    )


def dequantize_int4(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    group: int,
    dtype: torch.dtype,
    fp4: bool = False,
    int8: bool = False,
) -> torch.Tensor:
    """The weight W.T [k, n] in `dtype` (each value formed in float32 and rounded once, as the
    product rounds it for a 16-bit tl.dot), from the arguments w4a16_linear takes."""
    k, n = qweight.shape[0] * (4 if int8 else 8), qweight.shape[1]
    out = torch.empty((k, n), dtype=dtype, device=qweight.device)
    block_n, block_k = 64, max(64, group)
    grid = (triton.cdiv(k, block_k), triton.cdiv(n, block_n))
    _dequant_kernel[grid](
        qweight, scales, scales if mins is None else mins, out, n, k,
        GROUP=group, BLOCK_K=block_k, BLOCK_N=block_n, FP4=fp4, INT8=int8,
    )  # fmt: skip
    return out


def split_k_for(m: int, n: int, k: int, block_m: int, block_n: int, block_k: int, sms: int):
    """Split k when the output tiles alone would leave most of the GPU idle (decode rows);
    each share keeps at least four k tiles."""
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    want = triton.cdiv(2 * sms, tiles)
    most = max(1, triton.cdiv(k, block_k) // 4)
    return max(1, min(want, most, 16))


def w4a16_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    group: int,
    bias: torch.Tensor | None = None,
    split_k: int | None = None,
    fp4: bool = False,
    int8: bool = False,
) -> torch.Tensor:
    """x [m, k] (float16 / bfloat16 / float32, rows contiguous) times the 4-bit weight [n, k]
    held as qweight [k / 8, n] int32, scales and mins [k / group, n] float16 (`fp4`: MXFP4's
    codes, no mins; `int8`: Q8_0's codes, qweight [k / 4, n], no mins); returns [m, n] in x's
    dtype (plus bias)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [rows, k] with contiguous rows, got {tuple(x.shape)}")
    m, k = x.shape
    if fp4 and int8:
        raise ValueError("fp4 and int8 codes are two formats")
    per = 4 if int8 else 8  # codes an int32
    if qweight.dtype != torch.int32 or qweight.dim() != 2 or not qweight.is_contiguous():
        raise ValueError(f"qweight must be a contiguous [k / {per}, n] int32 tensor")
    n = qweight.shape[1]
    if k % group or group % 8 or group & (group - 1) or qweight.shape[0] * per != k:
        raise ValueError(
            f"k = {k} must be qweight's rows x {per} and a multiple of group {group} (a power "
            "of two)"
        )
    if (mins is None) != (fp4 or int8):
        raise ValueError("mins are given for 4-bit integer codes, and only for them")
    for name, t in (("scales", scales), ("mins", scales if mins is None else mins)):
        if t.shape != (k // group, n) or not t.is_contiguous() or t.dtype != torch.float16:
            raise ValueError(f"{name} must be a contiguous [{k // group}, {n}] float16 tensor")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}]")
    if any(t.device != x.device for t in (qweight, scales, scales if mins is None else mins)):
        raise ValueError("x and the weight must be on one device")
    if DEQUANT_ROWS is not None and m >= DEQUANT_ROWS:
        w = dequantize_int4(qweight, scales, mins, group, x.dtype, fp4, int8)
        return x @ w if bias is None else torch.addmm(bias.to(x.dtype), x, w)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n, block_k = 64, max(64, group)  # whole groups in a k tile
    if split_k is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 8
        split_k = split_k_for(m, n, k, block_m, block_n, block_k, sms)
    parts = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)
    _w4a16_kernel[grid](
        x,
        qweight,
        scales,
        scales if mins is None else mins,  # (not read with FP4 or INT8)
        parts,
        m,
        n,
        k,
        x.stride(0),
        parts.stride(0),
        parts.stride(1),
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split_k,
        UPCAST=not x.is_cuda or x.dtype == torch.float32,
        FP4=fp4,
        INT8=int8,
    )
    y = parts[0] if split_k == 1 else parts.sum(0)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
