"""Weights the CUDA backend keeps quantized, and their products.

- 4-bit: GGUF's Q4_0 / Q4_1 blocks, AWQ / GPTQ checkpoints (which the loader repacks into
  those) and gpt-oss's MXFP4 experts, in their GPU form (gpu/cuda/int4_weight.py) on the W4A16
  Triton product (gpu/cuda/kernels/w4a16.py); and 8-bit Q8_0 blocks (GGUF, compressed-tensors
  W8A16 / W8A8, GPTQ 8-bit) on the same product's int8 mode;
- FP8: an FP8 checkpoint's weights, or a 16-bit one's quantized at load (`--quantization fp8`),
  on torch's scaled FP8 product (gpu/quant/fp8.py), where the GPU has FP8 arithmetic.
Weights sharing an input (Q/K/V, gate/up) are joined into one product when they are all of one
such kind; any other weight is dense, in the model's dtype.
"""

from __future__ import annotations

from typing import Any

import torch

from gpu.cuda import int4_weight
from gpu.cuda.int4_weight import Int4Weight
from gpu.cuda.kernels.fp8_quant import quantize_rows
from gpu.cuda.kernels.w4a16 import w4a16_linear
from gpu.quant import fp8
from gpu.quant.fp8 import Fp8Tensor
from gpu.quant.tensor import BlockTensor, cat_rows


def _int4(w: Any) -> bool:
    return isinstance(w, BlockTensor) and int4_weight.fits(w)


def kept(w: Any, fp8_products: bool) -> bool:
    """Whether the backend keeps this checkpoint weight quantized."""
    return _int4(w) or (fp8_products and isinstance(w, Fp8Tensor))


def join(weights: list[Any], fp8_products: bool) -> Any:
    """The weights stacked by output rows, when all are kept and of one kind; else None."""
    if not all(kept(w, fp8_products) for w in weights):
        return None
    if all(_int4(w) for w in weights):
        return cat_rows(weights)  # None when their block formats differ
    if all(isinstance(w, Fp8Tensor) for w in weights):
        return fp8.cat_rows(weights)
    return None


def form(w: Any, device: torch.device) -> Any:
    """A kept weight in its form on the device."""
    if isinstance(w, Fp8Tensor):
        return Fp8Tensor(w.weight.to(device), w.scale.to(device), w.input_scale)
    return Int4Weight.from_blocks(w, device)


def linear(x: torch.Tensor, weight: Any, bias: torch.Tensor | None) -> torch.Tensor:
    if isinstance(weight, Fp8Tensor):
        # on a GPU the input's quantization is one kernel; interpreted on CPU, torch's ops
        # (the interpreter does not round to float8 as a GPU does)
        quantize = quantize_rows if x.is_cuda else fp8.quantize_activations
        return fp8.fp8_linear(x, weight, bias, quantize)
    rows = x.reshape(-1, x.shape[-1])
    y = w4a16_linear(
        rows, weight.qweight, weight.scales, weight.mins, int4_weight.GROUP, bias,
        fp4=weight.fp4, int8=weight.bits == 8,
    )  # fmt: skip
    return y.reshape(*x.shape[:-1], y.shape[-1])
