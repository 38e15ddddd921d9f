"""compressed-tensors checkpoints (`quant_method: compressed-tensors`): what llm-compressor writes
and vLLM loads, the form of most quantized checkpoints published for vLLM (W4A16, W8A16, W8A8,
FP8). Each layer's weight is moved into a form weir already serves, without requantizing.

config.json's quantization_config names `config_groups`, each with `targets` (a layer class,
"Linear", a layer name, or "re:" and a regular expression over names), `weights` and
`input_activations` (QuantizationArgs: type int / float, num_bits, strategy tensor / channel /
group, group_size, symmetric, dynamic, actorder) and a storage `format` (the group's, or the
config's own); `ignore` lists layers left in float. What the checkpoint holds per layer:
- pack-quantized (integer weights of 4 or 8 bits): `weight_packed` int32 [n, k bits / 32]
  (value i of a row in bits i * bits, stored with 2^(bits-1) added), `weight_scale` [n, groups]
  ([n, 1] per channel, one per tensor), `weight_shape`, and, asymmetric, `weight_zero_point`
  packed the same way along the rows [n bits / 32, groups]; w = s (q - zp);
- int-quantized / naive-quantized: the integers as an int8 `weight`; float-quantized: an
  FP8 (E4M3) `weight`; each with its `weight_scale` (and `input_scale` for static activations).

Served as (gpu/quant/int_blocks.py, gpu/quant/fp8.py):
- 4-bit integers, grouped by whole 32-weight blocks or per channel: Q4_0 when symmetric, Q4_1
  with zero points;
- 8-bit symmetric integers (W8A16, W8A8): Q8_0;
- FP8 weights per channel or per tensor: FP8 (W8A8), with the static input scale if any.
Scales are GGUF's f16 in the blocks: exact for f16 and for bfloat16 scales from 2^-14 up (a
warning names a layer whose scales change). Integer activations (W8A8, W4A8) are not quantized
per token as the checkpoint intends: the products take 16-bit activations (on CPU, weir's Q8_0 and
Q4 kernels quantize them to int8 per 32 inputs), a warning at load says so. Refused, naming what:
other bit widths, block strategies, groups that are not whole blocks, activation order by
groups (`weight_g_idx` out of order), asymmetric 8-bit weights, sparsity and transforms, and a
`kv_cache_scheme` other than FP8 with a static scale per layer (those scales: gpu/kv_scales.py).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from core.config import CheckpointError
from gpu.quant.fp8 import Fp8Tensor
from gpu.quant.int_blocks import q4_blocks, q8_blocks
from gpu.quant.tensor import BlockTensor

log = logging.getLogger("weir.loader")

INT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
FLOAT_FORMATS = ("float-quantized", "naive-quantized")
PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx",
         "input_scale", "input_zero_point")  # fmt: skip
STORED = ("I8", "F8_E4M3")  # a quantized layer's `weight` as the safetensors header names it


@dataclass(frozen=True)
class Group:
    """One config group: the layers it targets and how their weights are stored."""

    targets: tuple[str, ...]
    fmt: str
    float_weights: bool  # FP8 weights (else integers)
    bits: int
    symmetric: bool
    static_input: bool  # FP8 activations with the checkpoint's input_scale
    int_activations: bool  # the checkpoint means int8 activations (served at 16 bits)

    @classmethod
    def parse(cls, name: str, g: dict[str, Any], default_fmt: str, where: str) -> Group:
        here = f"{where}: compressed-tensors group {name!r}"
        w = g.get("weights") or {}
        kind = str(w.get("type", "int")).lower()
        bits = w.get("num_bits")
        strategy = str(w.get("strategy") or "tensor").lower()
        fmt = str(g.get("format") or default_fmt).lower()
        if not w:
            raise CheckpointError(f"{here}: no weights quantization (activations only)")
        if w.get("dynamic"):
            raise CheckpointError(f"{here}: dynamic weight scales are not served")
        if kind == "float":
            if bits != 8 or fmt not in FLOAT_FORMATS or strategy not in ("channel", "tensor"):
                raise CheckpointError(
                    f"{here}: float weights of {bits} bits by {strategy} in {fmt!r} are not "
                    "served (FP8 per channel or per tensor, float-quantized)"
                )
        elif kind == "int":
            if bits not in (4, 8) or fmt not in INT_FORMATS:
                raise CheckpointError(
                    f"{here}: {bits}-bit integer weights in {fmt!r} are not served (4 or 8 "
                    "bits, pack-quantized or int-quantized)"
                )
            if strategy not in ("channel", "group", "tensor"):
                raise CheckpointError(f"{here}: strategy {strategy!r} is not served")
            if bits == 8 and not w.get("symmetric", True):
                raise CheckpointError(f"{here}: asymmetric 8-bit weights are not served")
            group = w.get("group_size")
            if strategy == "group" and (not isinstance(group, int) or group <= 0 or group % 32):
                raise CheckpointError(
                    f"{here}: group_size {group} is not served (a multiple of 32)"
                )
        else:
            raise CheckpointError(f"{here}: weights of type {kind!r} are not served")
        if str(w.get("actorder")).lower() in ("group", "dynamic"):
            raise CheckpointError(
                f"{here}: activation order by groups (actorder {w['actorder']!r}) is not "
                "served; 'weight' / 'static' order or none is"
            )
        a = g.get("input_activations") or {}
        static = False
        if a:
            akind = str(a.get("type", "int")).lower()
            if kind == "float":
                astrat = str(a.get("strategy") or "tensor").lower()
                if akind != "float" or not (
                    (a.get("dynamic") and astrat == "token")
                    or (not a.get("dynamic") and astrat == "tensor")
                ):
                    raise CheckpointError(
                        f"{here}: FP8 weights with {akind} activations by {astrat} are not "
                        "served (FP8 per token, dynamic, or per tensor, static)"
                    )
                static = not a.get("dynamic")
            elif not a.get("dynamic", True):
                raise CheckpointError(
                    f"{here}: static activation scales of integer weights are not served"
                )
        return cls(
            tuple(str(t) for t in g.get("targets") or ()),
            fmt,
            kind == "float",
            int(bits),
            bool(w.get("symmetric", True)),
            static,
            bool(a) and kind == "int",
        )

    def matches(self, layer: str) -> bool:
        return any(_matches(layer, t) for t in self.targets)

    def complete(self, parts: dict[str, Any]) -> bool:
        need = {"weight_scale"}
        need.add("weight_packed" if self.fmt == "pack-quantized" else "weight")
        if self.fmt == "pack-quantized":
            need.add("weight_shape")
        if not self.symmetric:
            need.add("weight_zero_point")
        if self.static_input:
            need.add("input_scale")
        return need <= set(parts)


def _matches(layer: str, target: str) -> bool:
    """compressed-tensors' matching: "re:" and a pattern matched from a name's start, a class
    (weir's quantized layers are all Linear), or the name itself."""
    if target.startswith("re:"):
        return re.match(target[3:], layer) is not None
    return target == "Linear" or target == layer


@dataclass(frozen=True)
class CompressedScheme:
    groups: tuple[Group, ...]
    ignore: tuple[str, ...]
    method: str = "compressed-tensors"

    @classmethod
    def from_config(cls, qc: dict[str, Any], where: str) -> CompressedScheme:
        status = str(qc.get("quantization_status", "compressed")).lower()
        if status != "compressed":
            raise CheckpointError(
                f"{where}: compressed-tensors weights in status {status!r} are not served "
                "(compressed)"
            )
        kv = qc.get("kv_cache_scheme")
        if kv and not (
            str(kv.get("type", "int")).lower() == "float"
            and kv.get("num_bits") == 8
            and str(kv.get("strategy") or "tensor").lower() == "tensor"
            and not kv.get("dynamic")
        ):
            raise CheckpointError(
                f"{where}: kv_cache_scheme {kv} is not served (FP8 with a static scale per "
                "layer is: gpu/kv_scales.py)"
            )
        for key in ("sparsity_config", "transform_config"):
            if qc.get(key):
                raise CheckpointError(f"{where}: compressed-tensors {key} is not served")
        default = str(qc.get("format") or "dense").lower()
        raw = qc.get("config_groups") or {}
        groups = []
        for name, g in raw.items():
            if not isinstance(g, dict):  # a preset's name over its targets (`W4A16: [Linear]`)
                raise CheckpointError(f"{where}: config group {name!r} is not a scheme")
            groups.append(Group.parse(name, g, default, where))
        if not groups:
            raise CheckpointError(f"{where}: compressed-tensors config without config_groups")
        return cls(tuple(groups), tuple(str(t) for t in qc.get("ignore") or ()))

    @property
    def int_activations(self) -> bool:
        """Whether the checkpoint means int8 activations (W8A8, W4A8), which weir does not
        reproduce (gpu/launch.py check_quantization says so once)."""
        return any(g.int_activations for g in self.groups)

    def group_of(self, layer: str) -> Group:
        if not any(_matches(layer, t) for t in self.ignore):
            for g in self.groups:
                if g.matches(layer):
                    return g
        raise CheckpointError(
            f"{layer}: quantized in the checkpoint, but no compressed-tensors config group "
            "targets it"
        )

    def gathers(self, part: str, stored_dtype: str) -> bool:
        return part in PARTS or (part == "weight" and stored_dtype in STORED)

    def complete(self, prefix: str, parts: dict[str, Any]) -> bool:
        return self.group_of(prefix).complete(parts)

    def make(self, name: str, parts: dict[str, Any]) -> BlockTensor | Fp8Tensor:
        g = self.group_of(name.removesuffix(".weight"))
        if g.float_weights:
            if parts["weight"].dtype != torch.float8_e4m3fn:
                raise CheckpointError(f"{name}: FP8 weights stored as {parts['weight'].dtype}")
            scale = parts["weight_scale"]
            if scale.numel() not in (1, parts["weight"].shape[0]):
                raise CheckpointError(f"{name}: weight_scale {tuple(scale.shape)} is per group")
            return Fp8Tensor.from_checkpoint(
                parts["weight"], scale, parts.get("input_scale") if g.static_input else None
            )
        u = _codes(g, name, parts)  # [n, k] uint8: each integer plus 2^(bits - 1)
        n, k = u.shape
        s = _scales(name, parts["weight_scale"], n)
        _check_order(name, parts.get("weight_g_idx"), k, s.shape[1])
        if g.bits == 8:  # u - 128 as int8 is u with its top bit flipped
            return q8_blocks(name, (u ^ 0x80).view(np.int8), s)
        if g.symmetric:  # w = s (u - z), u and z in 0..15
            z = np.full(s.shape, 8, dtype=np.uint8)
        else:
            z = _zeros(g, name, parts["weight_zero_point"], s.shape)
        return q4_blocks(name, u, z, s)


def _unpack(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """int32 [r, c] of 4- or 8-bit codes, code i of a row in bits i * bits (never across an
    int32) -> uint8 [r, count]: read as the int32s' little-endian bytes (a byte holds codes
    2j and 2j + 1 in its low and high nibbles, or code j)."""
    b = np.ascontiguousarray(packed.astype("<i4", copy=False)).view(np.uint8)
    if bits == 4:
        b = np.stack([b & 0xF, b >> 4], axis=-1).reshape(packed.shape[0], -1)
    if b.shape[1] < count:
        raise CheckpointError(f"{b.shape[1]} packed values where {count} were expected")
    return b[:, :count]


def _codes(g: Group, name: str, parts: dict[str, Any]) -> np.ndarray:
    """The layer's integers plus 2^(bits - 1) (pack-quantized's stored form), uint8 [n, k]."""
    if g.fmt == "pack-quantized":
        shape = tuple(int(x) for x in parts["weight_shape"].flatten().tolist())
        packed = parts["weight_packed"]
        if len(shape) != 2 or packed.dtype != torch.int32 or packed.shape[0] != shape[0]:
            raise CheckpointError(
                f"{name}: weight_packed {tuple(packed.shape)} {packed.dtype} does not hold a "
                f"weight of shape {shape}"
            )
        return np.ascontiguousarray(_unpack(packed.numpy(), g.bits, shape[1]))
    w = parts["weight"]
    if w.dtype != torch.int8:
        raise CheckpointError(f"{name}: integer weights stored as {w.dtype}")
    q = w.numpy()
    if g.bits == 8:
        return q.view(np.uint8) ^ 0x80
    if q.min(initial=0) < -8 or q.max(initial=0) > 7:
        raise CheckpointError(f"{name}: integers outside {g.bits} bits")
    return (q + 8).astype(np.uint8)


def _scales(name: str, scale: torch.Tensor, n: int) -> np.ndarray:
    """weight_scale as f16 [n, groups] (one per tensor spread over the rows)."""
    s = scale.detach().float()
    if s.numel() == 1:
        s = s.reshape(1, 1).expand(n, 1)
    if s.ndim == 1 and s.numel() == n:
        s = s[:, None]
    if s.ndim != 2 or s.shape[0] != n:
        raise CheckpointError(f"{name}: weight_scale {tuple(scale.shape)} does not fit {n} rows")
    if not bool(torch.isfinite(s).all()) or float(s.abs().max()) > 65504:
        raise CheckpointError(f"{name}: weight_scale beyond f16's range (65504)")
    half = s.half()
    if not torch.equal(half.float(), s):
        change = float(((half.float() - s).abs() / s.abs().clamp(min=1e-30)).max())
        log.warning("%s: scales rounded to f16 (relative change up to %.2g)", name, change)
    return half.numpy()


def _zeros(g: Group, name: str, zp: torch.Tensor, shape: tuple[int, int]) -> np.ndarray:
    """Asymmetric 4-bit zero points as 0..15 [n, groups]: packed along the rows."""
    n, groups = shape
    if zp.dtype == torch.int32:  # pack-quantized: [n bits / 32, groups], along the rows
        if zp.ndim != 2 or zp.shape[1] != groups:
            raise CheckpointError(f"{name}: weight_zero_point {tuple(zp.shape)} for {shape}")
        z = _unpack(zp.numpy().T.copy(), g.bits, n).T  # zp + 8
    else:  # stored unpacked (int-quantized): [n, groups]
        z = (zp.numpy().astype(np.int16) + 8).reshape(n, -1)
    if z.shape != shape or z.min(initial=0) < 0 or z.max(initial=0) > 15:
        raise CheckpointError(f"{name}: weight_zero_point {tuple(zp.shape)} for {shape}")
    return np.ascontiguousarray(z.astype(np.uint8))


def _check_order(name: str, g_idx: torch.Tensor | None, k: int, groups: int) -> None:
    if g_idx is not None and not np.array_equal(g_idx.numpy(), np.arange(k) // (k // groups)):
        raise CheckpointError(
            f"{name}: weight_g_idx puts inputs out of order (activation order): not served"
        )
