"""AWQ and GPTQ int4 checkpoints, repacked into GGUF's blocks so that the same kernels serve them.

Both hold a linear layer's weight [n out, k in] as 4-bit integers q with, per group of g inputs
and per output, an f16 scale s and a 4-bit zero z: w = s (q - z).

- AWQ (AutoAWQ's "gemm" layout): `qweight` int32 [k, n / 8], eight outputs per int32 with output
  8j + order[p] in bits 4p..4p+3, order = 0 2 4 6 1 3 5 7; `qzeros` int32 [k / g, n / 8] packed
  the same way; `scales` [k / g, n].
- GPTQ (AutoGPTQ / GPTQModel): `qweight` int32 [k / 8, n], input 8i + p in bits 4p..4p+3;
  `qzeros` int32 [k / g, n / 8], output 8j + p in bits 4p..; `scales` [k / g, n]; `g_idx` [k].
  checkpoint_format "gptq" (the default, v1) stores z - 1, "gptq_v2" z itself.
  GPTQ's 8-bit (bits=8): four inputs an int32 in bits 8p.., zeros likewise; served symmetric
  only (every z = 128), as Q8_0 (w = s (q - 128)).

Each group is whole 32-weight blocks (g a multiple of 32, or -1: one group per row), so the
integers and scales move unchanged (gpu/quant/int_blocks.py): a symmetric checkpoint (every
z = 8) becomes Q4_0 exactly, any other Q4_1.
Activation order (GPTQ's desc_act, a g_idx that is not i / g) is refused as vLLM refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from core.config import CheckpointError
from gpu.quant.int_blocks import q4_blocks, q8_blocks
from gpu.quant.tensor import BlockTensor

AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])  # AWQ: the output in nibble p is 8j + order[p]
PARTS = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True)
class Int4Scheme:
    method: str  # "awq" | "gptq"
    group_size: int  # -1: one group per row
    zero_offset: int  # added to the stored zeros (GPTQ v1: 1)
    sym: bool  # zeros all 8 by construction (GPTQ sym=True)
    bits: int = 4  # GPTQ's 8-bit: codes four to an int32, symmetric only (Q8_0)

    def gathers(self, part: str, stored_dtype: str) -> bool:
        """Whether a checkpoint tensor is one part of a quantized layer (gathered by the loader
        until the layer is complete)."""
        return part in PARTS

    def complete(self, prefix: str, parts: dict[str, Any]) -> bool:
        return set(PARTS[:3]) <= set(parts)  # g_idx, if in a later file, goes unchecked

    def make(self, name: str, parts: dict[str, Any]) -> BlockTensor:
        return repack(self, name, **{p: parts.get(p) for p in PARTS})

    @classmethod
    def from_config(cls, qc: dict[str, Any], where: str) -> Int4Scheme:
        method = str(qc.get("quant_method", "")).lower()
        bits = qc.get("bits", qc.get("w_bit"))
        group = qc.get("group_size", qc.get("q_group_size", -1))
        if bits != 4 and not (method == "gptq" and bits == 8):
            raise CheckpointError(
                f"{where}: {method} with bits={bits} is not served (4, and GPTQ's 8)"
            )
        if not isinstance(group, int) or not (group == -1 or (group > 0 and group % 32 == 0)):
            raise CheckpointError(
                f"{where}: {method} group_size {group} is not served (a multiple of 32, or -1)"
            )
        if method == "awq":
            version = str(qc.get("version", "gemm")).lower()
            if version != "gemm":
                raise CheckpointError(f"{where}: AWQ version {version!r} is not served (gemm)")
            if qc.get("zero_point", True) is False:
                raise CheckpointError(f"{where}: AWQ without zero points is not served")
            return cls("awq", group, 0, False)
        if method == "gptq":
            if qc.get("desc_act") and group != -1:
                raise CheckpointError(
                    f"{where}: GPTQ activation order (desc_act=true) is not served; use a "
                    "checkpoint quantized with desc_act=false"
                )
            fmt = str(qc.get("checkpoint_format", "gptq")).lower()
            if fmt not in ("gptq", "gptq_v2"):
                raise CheckpointError(f"{where}: GPTQ checkpoint_format {fmt!r} is not served")
            sym = bool(qc.get("sym", True))
            if bits == 8 and not sym:
                raise CheckpointError(f"{where}: asymmetric 8-bit GPTQ is not served")
            return cls("gptq", group, 1 if fmt == "gptq" else 0, sym, bits)
        raise CheckpointError(
            f"{where}: weights quantized with {method!r} are not served; weir serves GGUF files, "
            "AWQ and GPTQ int4, FP8 and compressed-tensors checkpoints, and float checkpoints "
            "(--quantization q8_0, q4_0 or q4_k quantizes those at load)"
        )


def _nibbles(packed: np.ndarray, bits: int = 4) -> np.ndarray:
    """int32 [..., c] -> uint8 [..., c, 32 / bits]: code p of each int32 (bits p * bits..) at
    [..., p]."""
    u = packed.astype(np.int64) & 0xFFFFFFFF
    shifts = bits * np.arange(32 // bits, dtype=np.int64)
    return ((u[..., None] >> shifts) & ((1 << bits) - 1)).astype(np.uint8)


def unpack(
    scheme: Int4Scheme, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q [n, k] uint8, z [n, groups] int, s [n, groups] float16) in weir's orientation."""
    qw, qz = qweight.numpy(), qzeros.numpy()
    s = scales.to(torch.float16).numpy().T  # [n, groups]
    if scheme.method == "awq":
        k = qw.shape[0]
        q = _nibbles(qw)[..., np.argsort(AWQ_ORDER)].reshape(k, -1).T  # [n, k]
        z = _nibbles(qz)[..., np.argsort(AWQ_ORDER)].reshape(qz.shape[0], -1).T
    else:  # input (32 / bits) i + p in code p
        q = _nibbles(qw.T, scheme.bits).reshape(qw.shape[1], -1)  # [n, k]
        z = _nibbles(qz, scheme.bits).reshape(qz.shape[0], -1).T
    z = z.astype(np.int16) + scheme.zero_offset
    return np.ascontiguousarray(q), z, np.ascontiguousarray(s)


def repack(
    scheme: Int4Scheme,
    name: str,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None = None,
) -> BlockTensor:
    """The layer's weight as Q4_0 (symmetric) or Q4_1 blocks, exactly its integers and scales."""
    q, z, s = unpack(scheme, qweight, qzeros, scales)
    n, k = q.shape
    groups = s.shape[1]
    group = k if scheme.group_size == -1 else scheme.group_size
    if k % 32 or k != group * groups or z.shape != (n, groups):
        raise CheckpointError(
            f"{name}: {scheme.method} tensors do not fit (weight {n}x{k}, {groups} groups of "
            f"{group}, zeros {z.shape[1] if z.ndim == 2 else z.shape})"
        )
    if g_idx is not None and not np.array_equal(g_idx.numpy(), np.arange(k) // group):
        raise CheckpointError(
            f"{name}: g_idx puts inputs out of order (GPTQ activation order): not served"
        )
    if scheme.bits == 8:  # symmetric: every zero 128, w = s (q - 128)
        if not bool((z == 128).all()):
            raise CheckpointError(f"{name}: 8-bit GPTQ zeros other than 128 (asymmetric)")
        return q8_blocks(name, (q.astype(np.int16) - 128).astype(np.int8), s)
    return q4_blocks(name, q, z, s)
