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
from gpu.backend import ACTIVATIONS, TorchBackend
from gpu.cpu import gemm, norm, onednn, quant, sample
from gpu.cpu import build as cpu_build
from gpu.cpu.prepared import GatedPair, Stacked
from gpu.cpu.stack_parts import UNGATED
from gpu.quant.formats import FORMATS
from gpu.quant.quantize import quantize
from gpu.quant.fp8 import Fp8Tensor
from gpu.quant.tensor import BlockTensor, cat_rows

log = logging.getLogger("weir.cpu")

MATMULS = ("weir", "onednn")
FORWARDS = ("auto", "fused", "modules")


class OneDnnBackend(TorchBackend):
    """A float32 model's products on oneDNN's packed weights (MKL's for small ones), Q/K/V as
    one product; norms, attention and sampling through torch. CpuBackend with --cpu-matmul
    onednn, and the CPU backend where weir's kernels cannot be built."""

    def __init__(
        self, attention: AttentionBackend, name: str = "cpu, oneDNN products", lora: bool = False
    ) -> None:
        """`lora`: adapters may run (--enable-lora)."""
        super().__init__(attention, fuse=False, name=name)
        self.fuse_qkv = True  # small K and V weights are one product with Q's
        self.matmul = "onednn"
        self.forward_mode = "modules"
        self.lora = lora

    def prepare_linear(self, weight: Any, bias: Any) -> Any:
        weight, bias = self.dense(weight), self.dense(bias)
        if onednn.big_enough(weight):
            return onednn.prepare(weight, bias)
        return super().prepare_linear(weight, bias)  # MKL, through torch

    def linear(self, x, w, residual=None) -> torch.Tensor:
        if isinstance(w, onednn.OneDnnWeight):
            return onednn.linear(x, w, residual)
        return super().linear(x, w, residual)

    def linear_act(self, x, w, act: str) -> torch.Tensor:
        if isinstance(w, onednn.OneDnnWeight) and act in onednn.POST_OPS:
            return onednn.linear(x, w, post_op=onednn.POST_OPS[act])  # the activation a post-op
        return super().linear_act(x, w, act)

    def prepare_mlp(self, gate, up, down, act: str) -> tuple[Any, Any]:
        gate, up, down = [(self.dense(w), self.dense(b)) for w, b in (gate, up, down)]
        bias_free = gate[1] is None and up[1] is None and down[1] is None
        big = all(onednn.big_enough(w) for w, _ in (gate, up, down))
        # The activation and the multiply as post-ops leave no place for an addend before the
        # activation (LoRA's deltas): with adapters, gate and up are two products, for every
        # row alike, so that a row without an adapter computes what it would in any batch.
        if bias_free and act in onednn.POST_OPS and big and not self.lora:
            return onednn.prepare_gated(gate[0], up[0], act), onednn.prepare(*down)
        return super().prepare_mlp(gate, up, down, act)

    def gated(self, x, w, addend=None) -> torch.Tensor:
        if isinstance(w, onednn.OneDnnGated):
            return onednn.gated(x, w)  # never with an addend: see prepare_mlp
        return super().gated(x, w, addend)


class CpuBackend(OneDnnBackend):
    """weir's kernels. Weights stay as the checkpoint holds them unless --dtype or
    --quantization says otherwise: float32 on the float32 kernel (gemm.py), BF16, F16 and GGUF's
    block formats on the block kernels (quant.py); activations are float32 throughout."""

    def __init__(
        self,
        attention: AttentionBackend,
        matmul: str = "weir",
        forward: str = "auto",
        *,
        keep_dtype: bool = False,
        quantization: str | None = None,
        lora: bool = False,
        prefill: bool = False,
    ) -> None:
        """`prefill`: every product is a whole input's (an encoder's), many rows at once:
        float32 weights go to oneDNN's prepacked products, 1.3-1.6x weir's kernel on 4,096
        rows on Zen 4 (docs/benchmarks.md, encoders); 16-bit and block formats stay on weir's."""
        if matmul not in MATMULS:
            raise ValueError(f"--cpu-matmul must be one of {', '.join(MATMULS)}, not {matmul!r}")
        if forward not in FORWARDS:
            raise ValueError(f"--cpu-forward must be one of {', '.join(FORWARDS)}, not {forward!r}")
        cpu_build.load()  # BuildError here: the caller picks another backend
        super().__init__(attention, name=f"cpu, {matmul} products", lora=lora)
        self.matmul = matmul
        self.forward_mode = forward
        self.keep_dtype = keep_dtype  # --dtype auto: weights in the checkpoint's own dtype
        self.quantization = None if quantization is None else FORMATS[quantization]
        self.weight_dtype = torch.float32
        self.resident: dict[str, int] = {}  # weight bytes held, by format
        self.prefill = prefill and onednn.usable(torch.float32)
        if self.prefill:
            self.name = "cpu, oneDNN float32 products, weir's others"

    def bind(self, device: torch.device, dtype: torch.dtype) -> torch.dtype:
        self.device, self.weight_dtype = device, dtype
        self.dtype = torch.float32  # activations, norms; dense() gives float32
        return torch.float32

    def _source(self, t: Any) -> Any:
        """A checkpoint weight in the form it is served in: a float32 tensor (the float32
        kernel), or a BlockTensor (the block kernels: BF16, F16, GGUF's formats). An FP8
        checkpoint's weight is dequantized to bfloat16 (no FP8 products here)."""
        if isinstance(t, BlockTensor):
            return t
        if isinstance(t, Fp8Tensor):
            t = t.dequantize(torch.bfloat16)
        if self.quantization is not None:
            fmt = self.quantization
            k = t.shape[-1]
            if k % fmt.block_size:  # as llama.cpp does: the nearest format whose blocks fit
                fmt = FORMATS["q8_0"] if k % 32 == 0 else FORMATS["bf16"]
            rows = quantize(t.detach().float().numpy(), fmt.name)
            return BlockTensor(rows, fmt, tuple(t.shape))
        dtype = t.dtype if self.keep_dtype else self.weight_dtype
        if dtype == torch.float32 or self.matmul != "weir":
            return t.detach().float().contiguous()
        fmt = FORMATS["bf16" if dtype == torch.bfloat16 else "f16"]
        t = t.detach().to(dtype).contiguous()
        return BlockTensor(t.view(torch.uint8).numpy(), fmt, tuple(t.shape))

    def _count(self, w: Any) -> Any:
        if isinstance(w, quant.QuantWeight):
            name = w.fmt.name
            self.resident[name] = self.resident.get(name, 0) + w.resident_bytes
        elif isinstance(w, gemm.GemmWeight | gemm.GemmGated):
            self.resident["f32"] = self.resident.get("f32", 0) + 4 * w.packed.numel()
        elif isinstance(w, onednn.OneDnnWeight):
            self.resident["f32"] = self.resident.get("f32", 0) + 4 * w.packed.numel()
        return w

    # ---- products ----
    def prepare_linear(self, weight: Any, bias: Any) -> Any:
        src = self._source(weight)
        bias = None if bias is None else bias.detach().float().contiguous()
        if isinstance(src, BlockTensor):
            return self._count(quant.pack(src.rows, src.fmt, src.shape, bias))
        if self.prefill:  # (a call's fixed cost is small beside thousands of rows)
            return self._count(onednn.prepare(src, bias))
        if self.matmul == "weir":
            return self._count(gemm.prepare(src, bias))
        return self._count(super().prepare_linear(src, bias))

    def prepare_stacked(self, parts: list[tuple[Any, Any]]) -> Any:
        sources = [self._source(w) for w, _ in parts]
        bias = None if parts[0][1] is None else torch.cat([b.float() for _, b in parts])
        if all(isinstance(s, torch.Tensor) for s in sources):
            return self.prepare_linear(torch.cat(sources), bias)
        if all(isinstance(s, BlockTensor) for s in sources):
            joined = cat_rows(sources)
            if joined is not None:
                return self.prepare_linear(joined, bias)
        prepared = [self.prepare_linear(s, b) for s, (_, b) in zip(sources, parts)]
        return Stacked(prepared, None if bias is None else bias.contiguous())

    def linear(self, x, w, residual=None) -> torch.Tensor:
        if isinstance(w, quant.QuantWeight):
            return quant.linear(x, w, residual)
        if isinstance(w, gemm.GemmWeight):
            return gemm.linear(x, w, residual)
        if isinstance(w, Stacked):
            if all(isinstance(p, quant.QuantWeight) and not p.act for p in w.parts):
                return quant.linear_parts(x, w.parts, w.bias, residual)
            y = torch.cat([self.linear(x, p) for p in w.parts], dim=-1)
            return y if residual is None else residual + y
        return super().linear(x, w, residual)

    def prepare_mlp(self, gate, up, down, act: str) -> tuple[Any, Any]:
        g, u = self._source(gate[0]), self._source(up[0])
        floats = isinstance(g, torch.Tensor) and isinstance(u, torch.Tensor)
        if self.matmul != "weir" or (self.prefill and floats):
            return super().prepare_mlp(gate, up, down, act)
        bias_free = gate[1] is None and up[1] is None and down[1] is None
        same = (
            isinstance(g, torch.Tensor)
            and isinstance(u, torch.Tensor)
            or isinstance(g, BlockTensor)
            and isinstance(u, BlockTensor)
            and g.fmt == u.fmt
        )
        if bias_free and act in gemm.ACTIVATIONS and same:
            if isinstance(g, torch.Tensor):
                pair = gemm.prepare_gated(g, u, act)
            else:
                pair = quant.pack(g.rows, g.fmt, g.shape, up=u.rows, act=act)
            return self._count(pair), self.prepare_linear(*down)
        # biases, an activation the kernels have not, or formats that differ: two products
        pair = GatedPair(self.prepare_linear(g, gate[1]), self.prepare_linear(u, up[1]), act)
        return pair, self.prepare_linear(*down)

    def gated(self, x, w, addend=None) -> torch.Tensor:
        if isinstance(w, gemm.GemmGated):
            return gemm.gated(x, w, addend)
        if isinstance(w, quant.QuantWeight):
            return quant.linear(x, w, addend)
        if isinstance(w, GatedPair):
            ga, ua = (None, None) if addend is None else addend.chunk(2, dim=-1)
            return ACTIVATIONS[w.act](self.linear(x, w.gate, ga)) * self.linear(x, w.up, ua)
        return super().gated(x, w, addend)

    def experts(self, x, ws, counts, gated) -> torch.Tensor:
        kinds = {(type(w), w.act) if isinstance(w, quant.QuantWeight) else None for w in ws}
        if len(kinds) == 1 and None not in kinds and (ws[0].act != 0) == gated:
            return quant.linear_experts(x, ws, counts)  # one pass of the threads
        return super().experts(x, ws, counts, gated)

    # ---- LoRA ----
    def lora_add(self, y, x, group, batch) -> None:
        if y.dtype == torch.float32 and x.dtype == torch.float32 and x.dim() == 2:
            cpu_build.load().lora_add_(y, x, group.a, group.b, group.ranks, group.cols, batch.rows)
            return
        super().lora_add(y, x, group, batch)

    # ---- embeddings ----
    def prepare_embedding(self, weight: Any) -> Any:
        src = self._source(weight)
        if isinstance(src, BlockTensor):
            return self._count(quant.pack(src.rows, src.fmt, src.shape))
        self.resident["f32"] = self.resident.get("f32", 0) + 4 * src.numel()
        return src

    def embed(self, input_ids: torch.Tensor, w: Any) -> torch.Tensor:
        if isinstance(w, quant.QuantWeight):
            return quant.gather(w, input_ids)
        return super().embed(input_ids, w)

    def tied_logits(self, hidden: torch.Tensor, w: Any) -> torch.Tensor:
        if isinstance(w, quant.QuantWeight):
            return quant.linear(hidden, w)
        return super().tied_logits(hidden, w)

    # ---- norms and rotation ----
    def rms_norm(self, x, weight, eps) -> torch.Tensor:
        return norm.rms_norm(x, weight, eps)

    def ungated(self, x, w, act, fn=None) -> torch.Tensor:
        """On weir's kernels, the activation is the compiled loop the one-call stack runs (with
        xIELU's constants: `fn.constants()`)."""
        code = UNGATED.get(act)
        if code is None or not isinstance(w, gemm.GemmWeight | quant.QuantWeight):
            return super().ungated(x, w, act, fn)
        y = self.linear(x, w)
        cpu_build.load().activate_(y, code, fn.constants() if fn is not None else [])
        return y

    def layer_norm(self, x, weight, eps, bias=None) -> torch.Tensor:
        return norm.layer_norm(x, weight, eps, bias)

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
