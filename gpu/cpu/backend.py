"""CpuBackend: weir's compiled CPU kernels for a float32 model (gpu/backend.py's interface).

Products on weir's packed kernel (gemm.py; oneDNN's with `--cpu-matmul onednn`, onednn.py), Q/K/V
as one product, a bias-free gated MLP as one gated product; RMSNorm and Q/K norm + rotation in
one pass per row (norm.py); paged attention read in place (attention.py); the argmax and the
grammar bitmask on weir's pool (sample.py). With `--cpu-forward auto` (the default) the whole
layer stack runs as one compiled call when the model fits it (forward.py), else layer by layer,
with a log line naming why; `fused` refuses to start instead, `modules` always goes layer by
layer.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from gpu.attention.backend import AttentionBackend
from gpu.backend import TorchBackend
from gpu.cpu import gemm, norm, onednn, sample
from gpu.cpu import build as cpu_build

log = logging.getLogger("weir.cpu")

MATMULS = ("weir", "onednn")
FORWARDS = ("auto", "fused", "modules")


class OneDnnBackend(TorchBackend):
    """A float32 model's products on oneDNN's packed weights (MKL's for small ones), Q/K/V as
    one product; norms, attention and sampling through torch. CpuBackend with --cpu-matmul
    onednn, and the CPU backend where weir's kernels cannot be built."""

    def __init__(self, attention: AttentionBackend, name: str = "cpu, oneDNN products") -> None:
        super().__init__(attention, fuse=False, name=name)
        self.fuse_qkv = True  # small K and V weights are one product with Q's
        self.matmul = "onednn"
        self.forward_mode = "modules"

    def prepare_linear(self, weight: torch.Tensor, bias: torch.Tensor | None) -> Any:
        if onednn.big_enough(weight):
            return onednn.prepare(weight, bias)
        return super().prepare_linear(weight, bias)  # MKL, through torch

    def linear(self, x, w, residual=None) -> torch.Tensor:
        if isinstance(w, onednn.OneDnnWeight):
            return onednn.linear(x, w, residual)
        return super().linear(x, w, residual)

    def prepare_mlp(self, gate, up, down, act: str) -> tuple[Any, Any]:
        bias_free = gate[1] is None and up[1] is None and down[1] is None
        big = all(onednn.big_enough(w) for w, _ in (gate, up, down))
        if bias_free and act in onednn.POST_OPS and big:
            return onednn.prepare_gated(gate[0], up[0], act), onednn.prepare(*down)
        return super().prepare_mlp(gate, up, down, act)

    def gated(self, x, w) -> torch.Tensor:
        if isinstance(w, onednn.OneDnnGated):
            return onednn.gated(x, w)
        return super().gated(x, w)


class CpuBackend(OneDnnBackend):
    def __init__(
        self, attention: AttentionBackend, matmul: str = "weir", forward: str = "auto"
    ) -> None:
        if matmul not in MATMULS:
            raise ValueError(f"--cpu-matmul must be one of {', '.join(MATMULS)}, not {matmul!r}")
        if forward not in FORWARDS:
            raise ValueError(f"--cpu-forward must be one of {', '.join(FORWARDS)}, not {forward!r}")
        cpu_build.load()  # BuildError here: the caller picks another backend
        super().__init__(attention, name=f"cpu, {matmul} products")
        self.matmul = matmul
        self.forward_mode = forward

    # ---- products ----
    def prepare_linear(self, weight: torch.Tensor, bias: torch.Tensor | None) -> Any:
        if self.matmul == "weir":
            return gemm.prepare(weight, bias)
        return super().prepare_linear(weight, bias)

    def linear(self, x, w, residual=None) -> torch.Tensor:
        if isinstance(w, gemm.GemmWeight):
            return gemm.linear(x, w, residual)
        return super().linear(x, w, residual)

    def prepare_mlp(self, gate, up, down, act: str) -> tuple[Any, Any]:
        bias_free = gate[1] is None and up[1] is None and down[1] is None
        if self.matmul == "weir" and bias_free and act in gemm.ACTIVATIONS:
            return gemm.prepare_gated(gate[0], up[0], act), self.prepare_linear(*down)
        if self.matmul == "weir":  # biases, or an activation the kernel has not: two products
            return TorchBackend.prepare_mlp(self, gate, up, down, act)
        return super().prepare_mlp(gate, up, down, act)

    def gated(self, x, w) -> torch.Tensor:
        if isinstance(w, gemm.GemmGated):
            return gemm.gated(x, w)
        return super().gated(x, w)
    # ---- norms and rotation ----
    def rms_norm(self, x, weight, eps) -> torch.Tensor:
        return norm.rms_norm(x, weight, eps)

    def norm_rope(self, x, weight, eps, cos, sin) -> torch.Tensor:
        return norm.norm_rope(x, weight, eps, cos, sin)

    # ---- sampling ----
    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        ids = sample.argmax(logits)
        return ids if ids is not None else super().argmax(logits)

    def apply_token_bitmask(self, logits, rows, mask) -> torch.Tensor:
        if sample.apply_token_bitmask(logits, rows, mask):
            return logits
        return super().apply_token_bitmask(logits, rows, mask)

    # ---- the whole stack ----
    def stack(self, model) -> Any:
        from gpu.cpu.forward import FusedStack, unfit

        reason = unfit(model, self)
        if reason is None:
            log.info("CPU forward: the layer stack in one compiled call")
            return FusedStack(model)
        if self.forward_mode == "fused":
            raise ValueError(f"--cpu-forward fused: this model cannot run as one call: {reason}")
        log.info("CPU forward layer by layer: %s", reason)
        return None

    def describe(self) -> str:
        return f"{self.name}, {self.forward_mode} forward"
