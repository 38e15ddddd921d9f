"""act(gate) * up over the fused gate/up product's output: one kernel instead of torch's two (the
activation, then the product), each reading and writing the intermediate activations.

It rounds where gpu/backend.py TorchBackend.gated does: act(gate) computed in float32 and rounded
to the dtype, then the product with up in float32, rounded. The activation's exp, erf and tanh are
Triton's (exp is the GPU's fast approximation), so a result may differ from torch's by one
rounding of the dtype (float32: a few units in the last place).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The models' activations (spec.hidden_act; the CPU kernels take the same three).
ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_pytorch_tanh": 2}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TILE = 1024  # elements a program takes


@triton.jit
def _gated_act_kernel(
    y_ptr,
    out_ptr,
    y_stride,
    num_rows,
    m,
    ACT: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """ROWS rows by BLOCK columns of the output."""
    rows = (tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS))[:, None]
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    mask = (rows < num_rows) & (cols < m)
    g = tl.load(y_ptr + rows * y_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(y_ptr + rows * y_stride + m + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:  # silu: x / (1 + e^-x), as torch writes it
        a = g / (1.0 + tl.exp(-g))
    elif ACT == 1:  # gelu: x/2 (1 + erf(x / sqrt 2))
        a = g * 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))
    else:  # gelu, tanh approximation: x/2 (1 + tanh(z)) = x / (1 + e^-2z)
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = g / (1.0 + tl.exp(-2.0 * z))
    a = a.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + rows * m + cols, (a * u).to(out_ptr.dtype.element_ty), mask=mask)


def gated_act(y: torch.Tensor, act: str) -> torch.Tensor:
    """y [tokens, 2 * m], gate then up side by side (the fused product's output):
    act(y[:, :m]) * y[:, m:], [tokens, m] in y's dtype. `act`: one of ACTIVATIONS."""
    if act not in ACTIVATIONS:
        raise ValueError(f"unknown activation {act!r} (one of {', '.join(ACTIVATIONS)})")
    if y.dim() != 2 or y.shape[1] % 2:
        raise ValueError(f"y must be [tokens, 2 * intermediate], got {tuple(y.shape)}")
    if y.dtype not in DTYPES:
        raise ValueError(f"y must be float32, float16 or bfloat16, got {y.dtype}")
    if y.stride(1) != 1:
        raise ValueError("y's rows must be contiguous")
    t, m = y.shape[0], y.shape[1] // 2
    out = torch.empty((t, m), dtype=y.dtype, device=y.device)
    if t and m:
        block = min(TILE, triton.next_power_of_2(m))
        per = min(TILE // block, 16)  # rows a program: several when they are short
        _gated_act_kernel[(triton.cdiv(t, per), triton.cdiv(m, block))](
            y,
            out,
            y.stride(0),
            t,
            m,
            ACT=ACTIVATIONS[act],
            ROWS=per,
            BLOCK=block,
            num_warps=4,
            enable_fp_fusion=False,  # each product rounded, as torch's ops round
        )
    return out
