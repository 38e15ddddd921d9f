"""A product's input quantized to FP8 per token: one kernel where torch's ops take five (the
row's |x| and amax, the scale, the division with its clamp, the cast), before each of a layer's
four FP8 products. On the H200 an FP8 Qwen3-0.6B stepped at batch 1 in 3.3 ms where bf16 took
1.5: at that size the step is its kernels' latency, and these were a third of them.

Each row's scale is max(amax / 448, 1e-12) in float32 (or the checkpoint's static scale), each
element x / scale with IEEE division, clamped to +-448 and rounded to float8_e4m3fn: the values
gpu/quant/fp8.py quantize_activations gives on torch's ops, bit for bit on a GPU. (Triton's
interpreter does not round to float8 as a GPU does, so on CPU the tests read the values before
that cast: `out_dtype=torch.float32`.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu.quant.fp8 import FP8, FP8_MAX

BLOCK = 1024


@triton.jit
def _quantize_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    static_scale,
    x_stride,
    n,
    FP8_LIMIT: tl.constexpr,
    BLOCK: tl.constexpr,
    STATIC: tl.constexpr,
):
    """One row: its scale (unless static), then its values quantized."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    scale = tl.full((), 0.0, tl.float32) + static_scale
    if not STATIC:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, n, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < n, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        limit = tl.full((), FP8_LIMIT, tl.float32)
        scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), limit), 1e-12)
    tl.store(scale_ptr + row, scale)
    for start in range(0, n, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < n, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_LIMIT), FP8_LIMIT)
        tl.store(q_ptr + row * n + cols, q.to(q_ptr.dtype.element_ty), mask=cols < n)


def quantize_rows(
    rows: torch.Tensor, static_scale: float | None = None, out_dtype: torch.dtype = FP8
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [rows, n] in `out_dtype`, scales [rows, 1] float32) of a [rows, n] input whose
    last dimension is contiguous; `static_scale`: the checkpoint's one activation scale."""
    if rows.dim() != 2 or rows.stride(-1) != 1:
        raise ValueError(f"rows must be [rows, n] with contiguous rows, got {tuple(rows.shape)}")
    count, n = rows.shape
    values = torch.empty((count, n), dtype=out_dtype, device=rows.device)
    scales = torch.empty((count, 1), dtype=torch.float32, device=rows.device)
    if count and n:
        _quantize_kernel[(count,)](
            rows,
            values,
            scales,
            0.0 if static_scale is None else float(static_scale),
            rows.stride(0),
            n,
            FP8_LIMIT=FP8_MAX,
            BLOCK=min(BLOCK, triton.next_power_of_2(n)),
            STATIC=static_scale is not None,
        )
    return values, scales
