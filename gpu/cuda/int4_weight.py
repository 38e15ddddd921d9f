"""A 4-bit weight in the GPU's form, for the W4A16 product (gpu/cuda/kernels/w4a16.py).

Made from a block tensor in GGUF's Q4_0 or Q4_1 (a GGUF file's, or an AWQ / GPTQ checkpoint's,
which gpu/quant/int4.py repacks into those blocks without changing a weight): the codes
regrouped K-major, eight to an int32, and each block's scale and min (Q4_0: -8 x scale) as
[k / 32, n] float16 tensors, exactly as the blocks hold them (a bfloat16 model's activations
do not round them), so w = scale * q + min as the checkpoint means it. Or from MXFP4 blocks
(gpt-oss's experts, gpu/quant/mxfp4.py): the codes as they are, each block's scale 2^(e - 128)
as a float16 (`fits`: every scale float16 holds), no min: w = scale * FP4[q], E2M1's values
doubled, decoded in the kernel. Or from Q8_0 blocks (a GGUF file's, or a compressed-tensors or
GPTQ 8-bit checkpoint's: gpu/quant/compressed.py): the int8 codes regrouped K-major four to an
int32, each block's scale as a float16, no min: w = scale * q (`bits` 8).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpu.quant import mxfp4
from gpu.quant.tensor import BlockTensor

FORMATS = ("q4_0", "q4_1", "mxfp4", "q8_0")  # the block formats this form takes
GROUP = 32
FP4 = torch.tensor([2 * v for v in mxfp4.FP4_VALUES])  # each code's value, doubled


def fits(t: BlockTensor) -> bool:
    """Whether `t` has this form: Q4_0 / Q4_1 / Q8_0, or MXFP4 whose every scale float16
    holds."""
    return t.fmt.name in FORMATS and (t.fmt.name != "mxfp4" or mxfp4.transcodable(t.rows))


@dataclass
class Int4Weight:
    qweight: torch.Tensor  # [k / 8, n] int32
    scales: torch.Tensor  # [k / GROUP, n] float16
    mins: torch.Tensor | None  # [k / GROUP, n] float16; None for MXFP4 (no min)
    shape: tuple[int, int]  # (n, k)
    fmt: str  # the block format it was made from (q4_0, q4_1, mxfp4)

    @property
    def fp4(self) -> bool:
        return self.fmt == "mxfp4"

    @property
    def bits(self) -> int:
        return 8 if self.fmt == "q8_0" else 4

    @classmethod
    def from_blocks(cls, t: BlockTensor, device) -> Int4Weight:
        if not fits(t):
            raise ValueError(f"a {t.fmt.name} weight has no GPU block form (only {FORMATS})")
        n, k = t.shape
        blocks = t.rows.reshape(n, k // GROUP, t.fmt.block_bytes)
        if t.fmt.name == "q8_0":  # the f16 scale, then 32 int8 codes
            scale = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
            by_k = np.ascontiguousarray(blocks[:, :, 2:].reshape(n, k).T)  # [k, n] codes' bytes
            by_k = by_k.reshape(k // 4, 4, n).astype(np.uint32)
            words = np.zeros((k // 4, n), dtype=np.uint32)
            for j in range(4):  # code j of word i: k = 4 i + j, bits 8 j
                words |= by_k[:, j, :] << np.uint32(8 * j)
            return cls(
                torch.from_numpy(words.view(np.int32)).to(device),
                torch.from_numpy(np.ascontiguousarray(scale.T)).to(device, torch.float16),
                None,
                (n, k),
                "q8_0",
            )
        low = None
        if t.fmt.name == "mxfp4":  # the scale byte (a block of zeros: any), then the codes
            scale = mxfp4.half_scales(t.rows)[1].reshape(n, k // GROUP).astype(np.float32)
            qs = blocks[:, :, 1:17]
        else:
            scale = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        if t.fmt.name == "q4_1":
            low = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            qs = blocks[:, :, 4:20]
        elif t.fmt.name == "q4_0":
            low = -8.0 * scale
            qs = blocks[:, :, 2:18]
        # GGUF's nibble order: byte j of a block holds codes j (low) and j + 16 (high).
        codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(n, k)
        by_k = codes.T.reshape(k // 8, 8, n).astype(np.uint32)
        words = np.zeros((k // 8, n), dtype=np.uint32)
        for j in range(8):
            words |= by_k[:, j, :] << np.uint32(4 * j)

        def to(a: np.ndarray, dt) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dt)

        return cls(
            to(words.view(np.int32), torch.int32),
            to(scale.T, torch.float16),
            None if low is None else to(low.T, torch.float16),
            (n, k),
            t.fmt.name,
        )

    def format_bytes(self) -> tuple[str, int]:
        """(format, bytes held): what the model's memory report counts."""
        held = (self.qweight, self.scales, self.mins)
        return self.fmt, sum(t.numel() * t.element_size() for t in held if t is not None)

    def dequantize(self) -> torch.Tensor:
        """The float weight [n, k] this form holds (for tests)."""
        n, k = self.shape
        words = self.qweight.to(torch.int64) & 0xFFFFFFFF
        per = 32 // self.bits
        shifts = self.bits * torch.arange(per, device=words.device)
        mask = (1 << self.bits) - 1
        codes = ((words[:, None, :] >> shifts[None, :, None]) & mask).reshape(k, n)
        scale = self.scales.float().repeat_interleave(GROUP, 0)
        if self.bits == 8:  # int8 codes
            return ((codes - (codes >> 7) * 256).float() * scale).T.contiguous()
        if self.fp4:
            return (FP4.to(codes.device)[codes] * scale).T.contiguous()
        low = self.mins.float().repeat_interleave(GROUP, 0)
        return (codes.float() * scale + low).T.contiguous()
