"""Products on weights held in 16-bit and GGUF block formats (gpu/quant/formats.py) with weir's
CPU kernels (gpu/cpu/csrc/quant.cpp, torch.ops.weir.wgemm).

A weight's GGUF rows are repacked once into panels of 16 output columns (the same bytes, laid
out for the CPU's 8-bit and bf16 dot products; `resident_bytes` says how many), and every
product reads each panel once for up to 64 rows of activations. The path (reference, AVX2,
AVX-512 with VNNI and BF16) is chosen from the CPU's flags; every path gives the reference's
results bit for bit (tests/test_cpu_quant.py).
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import numpy as np
import torch

from gpu.cpu import build as cpu_build
from gpu.cpu.gemm import ACTIVATIONS
from gpu.quant import mxfp4
from gpu.quant.formats import FORMATS, Format
from gpu.quant.iq_grids import is_grid, transcode

PATHS = {"auto": 0, "ref": 1, "avx2": 2, "avx512": 3}


class QuantWeight(NamedTuple):
    """An [out_features, in_features] weight packed in `fmt` (a gated pair: gate and up, each
    [out_features, in_features], with act the activation's code), and its bias."""

    packed: torch.Tensor  # uint8
    fmt: Format
    out_features: int
    in_features: int
    bias: torch.Tensor | None
    act: int = 0

    @property
    def resident_bytes(self) -> int:
        return self.packed.numel() + (0 if self.bias is None else 4 * self.bias.numel())


def kernel_format(fmt: Format) -> bool:
    """Whether the kernels take weights in `fmt` (F32 goes to the float32 kernel instead)."""
    return fmt.name != "f32"


def available_paths() -> list[str]:
    ops = cpu_build.load()
    return [name for name, code in PATHS.items() if code and ops.qpath_available(code)]


def _bytes(rows: np.ndarray | torch.Tensor) -> torch.Tensor:
    if isinstance(rows, np.ndarray):
        with warnings.catch_warnings():  # a GGUF file's read-only map: the kernels only read it
            warnings.simplefilter("ignore", UserWarning)
            rows = torch.from_numpy(np.ascontiguousarray(rows))
    return rows.contiguous().view(torch.uint8).reshape(-1)


def pack(
    rows: np.ndarray | torch.Tensor,
    fmt: Format,
    shape: tuple[int, int],
    bias: torch.Tensor | None = None,
    *,
    up: np.ndarray | torch.Tensor | None = None,
    act: str | None = None,
) -> QuantWeight:
    """GGUF's rows of a [n, k] weight (bytes, or bf16/f16 elements) -> a QuantWeight; with
    `up` (the up projection's rows) and `act`, a gated MLP pair."""
    n, k = shape
    if is_grid(fmt.name):  # the kernels read grid blocks rewritten (gpu/quant/iq_grids.py)
        rows = transcode(np.asarray(rows), fmt.name)
        up = None if up is None else transcode(np.asarray(up), fmt.name)
    elif fmt.name == "mxfp4":  # in 4 bits where float16 holds every scale, else Q8_0 (mxfp4.py)
        parts = [np.asarray(r) for r in (rows, up) if r is not None]
        if all(mxfp4.transcodable(r) for r in parts):
            rows, *rest = [mxfp4.transcode(r) for r in parts]
        else:
            rows, *rest = [mxfp4.ggml_to_q8_0(r) for r in parts]
            fmt = FORMATS["q8_0"]
        up = rest[0] if rest else None
    ops = cpu_build.load()
    packed = ops.wpack(_bytes(rows), None if up is None else _bytes(up), fmt.ggml_type, n, k)
    bias = None if bias is None else bias.detach().float().contiguous()
    code = ACTIVATIONS[act] if up is not None else 0
    return QuantWeight(packed, fmt, n, k, bias, code)


def dequantize(w: QuantWeight) -> torch.Tensor:
    """The float32 weight a plain QuantWeight stands for (the GGUF dequantization)."""
    return cpu_build.load().wdequant(w.packed, w.fmt.ggml_type, w.out_features, w.in_features)


def gather(w: QuantWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the weight as float32 (an embedding lookup), shaped [*ids.shape, k]."""
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = cpu_build.load().wgather(w.packed, w.fmt.ggml_type, w.out_features, w.in_features, flat)
    return out.view(*ids.shape, w.in_features)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def linear(
    x: torch.Tensor, w: QuantWeight, residual: torch.Tensor | None = None, path: str = "auto"
) -> torch.Tensor:
    """x W^T + b (+ residual, added as the product is written); a gated pair: act(x G^T) *
    (x U^T), its residual an addend [rows, 2 * width] before the activation."""
    shape = x.shape
    res = None if residual is None else _rows(residual)
    out = cpu_build.load().wgemm(
        _rows(x), w.packed, w.fmt.ggml_type, w.out_features, w.act, w.bias, res, PATHS[path]
    )
    return out.view(*shape[:-1], w.out_features)


def linear_parts(
    x: torch.Tensor,
    parts: list[QuantWeight],
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    path: str = "auto",
) -> torch.Tensor:
    """Plain weights sharing x, each in its own format (Q, K and V of a Q4_K_M file), their
    outputs side by side: one pass of the threads, x converted once per form; each part's
    columns are `linear(x, part)`'s bit for bit. `bias`: over all the outputs (Stacked.bias;
    the parts' own biases are not read)."""
    shape = x.shape
    res = None if residual is None else _rows(residual)
    out = cpu_build.load().wgemm_parts(
        _rows(x),
        [p.packed for p in parts],
        [p.fmt.ggml_type for p in parts],
        [p.out_features for p in parts],
        bias,
        res,
        PATHS[path],
    )
    return out.view(*shape[:-1], sum(p.out_features for p in parts))


def linear_experts(
    x: torch.Tensor, experts: list[QuantWeight], counts: list[int], path: str = "auto"
) -> torch.Tensor:
    """A mixture's experts over x's rows ordered by expert (counts[i] of them experts[i]'s), in
    one pass of the threads, x converted once: each row's outputs are `linear(row, expert)`'s
    bit for bit. The experts are all plain weights or all gated pairs of one activation."""
    w = experts[0]
    out = cpu_build.load().wgemm_experts(
        _rows(x),
        [e.packed for e in experts],
        [e.fmt.ggml_type for e in experts],
        w.out_features,
        counts,
        w.act,
        PATHS[path],
    )
    return out.view(*x.shape[:-1], w.out_features)
