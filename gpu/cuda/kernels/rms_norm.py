"""RMSNorm of each row, optionally after adding a residual: one read and one write of the
activations instead of torch's seven or so kernels (casts, pow, mean, add, rsqrt, mul, mul).

It rounds where gpu/backend.py TorchBackend.rms_norm rounds: the row in float32, x * rsqrt(mean(x^2)
+ eps) rounded to the input's dtype, then times the weight rounded to the result's dtype (torch's
promotion of the two); the residual sum x + residual is rounded to their dtype first, as torch's
add is. The sum of squares is taken in another order than torch's mean, so a result may differ
from torch's by one rounding of the dtype (float32: a few units in the last place); the residual
sum is equal bit for bit.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TILE = 2048  # elements a program takes at least: several short rows, or one long row


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    sum_ptr,
    x_stride,
    residual_stride,
    num_rows,
    n,
    eps,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    ADD: tl.constexpr,
):
    """ROWS rows of n (short rows share a program)."""
    rows = (tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS))[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (rows < num_rows) & (cols < n)
    x = tl.load(x_ptr + rows * x_stride + cols, mask=mask, other=0.0)
    if ADD:
        r = tl.load(residual_ptr + rows * residual_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + rows * n + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / n + eps)[:, None]
    y = (xf * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows * n + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(name: str, t: torch.Tensor, n: int) -> torch.Tensor:
    """t [..., n] as [rows, n] with contiguous rows (a view when it can be)."""
    if t.dtype not in DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
    if t.dim() == 0 or t.shape[-1] != n:
        raise ValueError(f"{name} must be [..., {n}], got {tuple(t.shape)}")
    t = t.reshape(math.prod(t.shape[:-1]), n)
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(x, residual, weight, eps, out_dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    n = weight.shape[0] if weight.dim() == 1 else -1
    if n < 1 or weight.dtype not in DTYPES or weight.stride(0) != 1:
        raise ValueError(f"weight must be a contiguous [hidden] float tensor, got {weight.shape}")
    shape = x.shape
    x2 = _rows("x", x, n)
    r2 = x2 if residual is None else _rows("residual", residual, n)
    if residual is not None and (residual.shape != shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} must match x "
            f"{tuple(shape)} {x.dtype}"
        )
    if not (x.device == r2.device == weight.device):
        raise ValueError("x, residual and weight must be on one device")
    out = torch.empty(shape, dtype=out_dtype, device=x.device)
    total = None if residual is None else torch.empty(shape, dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if rows:
        block = triton.next_power_of_2(n)
        per = min(max(TILE // block, 1), 16)  # rows a program
        _rms_norm_kernel[(triton.cdiv(rows, per),)](
            x2,
            r2,
            weight,
            out,
            out if total is None else total,
            x2.stride(0),
            r2.stride(0),
            rows,
            n,
            float(eps),
            ROWS=per,
            BLOCK=block,
            ADD=residual is not None,
            num_warps=min(max(per * block // 256, 1), 16),
            enable_fp_fusion=False,  # each product rounded, as torch's ops round
        )
    return out, total


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., hidden] normalized over its last axis, times weight [hidden]; in torch's promotion
    of x's and weight's dtypes, as TorchBackend.rms_norm returns it."""
    out, _ = _launch(x, None, weight, eps, torch.promote_types(x.dtype, weight.dtype))
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(h, weight, eps), h) with h = x + residual (both [..., hidden], one dtype)."""
    out, total = _launch(x, residual, weight, eps, torch.promote_types(x.dtype, weight.dtype))
    return out, total
