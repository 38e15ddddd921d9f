"""FP8 weights (W8A8): float8_e4m3fn values with a float32 scale per output row.

Three ways in, as vLLM names them:
- an FP8 checkpoint (config.json's quantization_config `quant_method: fp8`, as AutoFP8 and
  vLLM write them): each quantized layer's `weight` in float8_e4m3fn beside its `weight_scale`
  (one per tensor, or one per output row) and, with `activation_scheme: static`, an
  `input_scale`; block-wise scales (`weight_block_size`) are refused;
- an NVIDIA ModelOpt FP8 checkpoint (`hf_quant_config.json`, quant_algo FP8 or
  FP8_PER_CHANNEL_PER_TOKEN: `Fp8Scheme.from_modelopt`), the same tensors;
- `--quantization fp8`: a 16-bit checkpoint quantized when it is loaded, a scale per output row
  (amax / 448).
Activations are quantized as each product runs: per token (dynamic), or with the checkpoint's
static scale. The products run on GPUs with FP8 arithmetic (compute capability 8.9 and up:
gpu/cuda/backend.py, torch._scaled_mm); elsewhere a weight is dequantized to the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from core.config import CheckpointError

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest float8_e4m3fn
PARTS = ("weight_scale", "input_scale")  # what a quantized layer brings beside its weight


@dataclass
class Fp8Tensor:
    weight: torch.Tensor  # [n, k] float8_e4m3fn
    scale: torch.Tensor  # [n] float32: row i's weights are weight[i] * scale[i]
    input_scale: float | None = None  # a static activation scale (None: per token)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    @classmethod
    def quantize(cls, w: torch.Tensor) -> Fp8Tensor:
        """`w` [n, k] with a scale per output row (a row of zeros gets scale 1)."""
        w = w.detach().float()
        amax = w.abs().amax(dim=1)
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return cls(q, scale)

    @classmethod
    def from_checkpoint(cls, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale):
        n = weight.shape[0]
        scale = weight_scale.detach().float().flatten()
        if scale.numel() == 1:
            scale = scale.expand(n).contiguous()
        if scale.numel() != n:
            raise CheckpointError(
                f"weight_scale of {tuple(weight_scale.shape)} fits neither the tensor nor its "
                f"{n} rows (block-wise FP8 scales are not served)"
            )
        static = None if input_scale is None else float(input_scale.float().max())
        return cls(weight.to(FP8), scale, static)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.weight.float() * self.scale[:, None]).to(dtype)

    def format_bytes(self) -> tuple[str, int]:
        """(format, bytes held): what the model's memory report counts."""
        return "fp8", self.weight.numel() + 4 * self.scale.numel()


def cat_rows(parts: list[Fp8Tensor]) -> Fp8Tensor:
    """Weights stacked by output rows (Q/K/V, gate/up): rows keep their own scales; a static
    activation scale is the largest of the parts' (the input is the same tensor)."""
    statics = [p.input_scale for p in parts]
    static = None if any(s is None for s in statics) else max(statics)
    return Fp8Tensor(
        torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]), static
    )


@dataclass(frozen=True)
class Fp8Scheme:
    method: str = "fp8"
    static: bool = False  # activation_scheme static: the checkpoint's input_scale

    @classmethod
    def from_config(cls, qc: dict[str, Any], where: str) -> Fp8Scheme:
        if qc.get("weight_block_size"):
            raise CheckpointError(
                f"{where}: FP8 with block-wise scales (weight_block_size "
                f"{qc['weight_block_size']}) is not served; per-tensor or per-channel scales are"
            )
        fmt = str(qc.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise CheckpointError(f"{where}: FP8 format {fmt!r} is not served (e4m3)")
        scheme = str(qc.get("activation_scheme", "dynamic")).lower()
        if scheme not in ("dynamic", "static"):
            raise CheckpointError(f"{where}: FP8 activation_scheme {scheme!r} is not served")
        return cls("fp8", scheme == "static")

    @classmethod
    def from_modelopt(cls, qc: dict[str, Any], where: str) -> Fp8Scheme:
        """NVIDIA ModelOpt's FP8 checkpoints (hf_quant_config.json's `quantization`, or
        config.json's quantization_config with quant_method modelopt), as vLLM serves them:
        `FP8` (a weight scale per tensor, a static input scale) and
        `FP8_PER_CHANNEL_PER_TOKEN` (a scale per output row, activations per token). Their
        K/V scales (`k_proj.k_scale`, `v_proj.v_scale`) are gpu/kv_scales.py's."""
        algo = str(qc.get("quant_algo") or "").upper()
        if algo not in ("FP8", "FP8_PER_CHANNEL_PER_TOKEN"):
            raise CheckpointError(
                f"{where}: ModelOpt quant_algo {algo or None!r} is not served (FP8, "
                "FP8_PER_CHANNEL_PER_TOKEN)"
            )
        kv = qc.get("kv_cache_quant_algo")
        if kv and str(kv).upper() != "FP8":
            raise CheckpointError(f"{where}: ModelOpt kv_cache_quant_algo {kv!r} is not served")
        return cls("modelopt", algo == "FP8")

    def gathers(self, part: str, stored_dtype: str) -> bool:
        """Whether a checkpoint tensor is one part of a quantized layer (gathered by the loader
        until the layer is complete): its scales, and a weight stored in FP8."""
        return part in PARTS or (part == "weight" and stored_dtype == "F8_E4M3")

    def complete(self, prefix: str, parts: dict[str, Any]) -> bool:
        need = {"weight", "weight_scale"} | ({"input_scale"} if self.static else set())
        return need <= set(parts)

    def make(self, name: str, parts: dict[str, Any]) -> Fp8Tensor:
        static = parts.get("input_scale") if self.static else None
        return Fp8Tensor.from_checkpoint(parts["weight"], parts["weight_scale"], static)


def quantize_activations(
    rows: torch.Tensor, static_scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 values, float32 scales [rows, 1]) of a product's input rows on torch's ops: each row
    with its own scale (amax / 448), or the checkpoint's static scale
    (gpu/cuda/kernels/fp8_quant.py does the same in one kernel)."""
    if static_scale is None:
        amax = rows.abs().amax(dim=1, keepdim=True).float()
        # a true division by a tensor: torch divides by a Python number on CUDA as a product
        # with its reciprocal (one unit in the last place off IEEE division at times)
        x_scale = torch.clamp(amax / torch.full_like(amax, FP8_MAX), min=1e-12)
    else:
        x_scale = torch.full((rows.shape[0], 1), static_scale, device=rows.device)
    return (rows.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), x_scale


def fp8_linear(
    x: torch.Tensor, w: Fp8Tensor, bias: torch.Tensor | None = None, quantize=quantize_activations
) -> torch.Tensor:
    """x W^T (+ bias) in FP8: x's rows quantized (`quantize`, with the weight's static scale or
    none), then one scaled product with float32 accumulation (rowwise scales need a bfloat16
    result: it is cast to x's dtype). No host sync: graph-safe."""
    rows = x.reshape(-1, x.shape[-1])
    xq, x_scale = quantize(rows, w.input_scale)
    if x.device.type == "cpu":
        # the same product in float32 (exact products of 4-bit significands): torch before 2.13
        # takes only per-tensor scales in its CPU _scaled_mm (the GPU image's 2.11 refused these)
        y = xq.float() @ w.weight.float().t() * x_scale * w.scale[None, :]
    else:
        y = torch._scaled_mm(
            xq, w.weight.t(), scale_a=x_scale, scale_b=w.scale[None, :], out_dtype=torch.bfloat16
        )
    y = y.to(torch.bfloat16).to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], y.shape[-1])
