"""MXFP4 (the OCP microscaling format gpt-oss's experts ship in): blocks of 32 FP4 (E2M1) values
sharing one power-of-two scale. A checkpoint's `*_blocks` hold [..., G, 16] bytes, two values a
byte (the low nibble first), and `*_scales` [..., G] bytes, each scale 2^(byte - 127) (E8M0).
Dequantized exactly: every value is a bfloat16 (and float32) number."""

from __future__ import annotations

import torch

from core.config import CheckpointError

# E2M1's sixteen codes: sign, two exponent bits, one mantissa bit
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


def dequantize(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """[..., G, 16] bytes and [..., G] scales -> [..., G * 32] values of `dtype`."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise CheckpointError(f"MXFP4 blocks and scales must be bytes, not {blocks.dtype}")
    if blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise CheckpointError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}"
        )
    table = torch.tensor(FP4_VALUES, dtype=torch.float32)
    values = torch.stack([table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]], dim=-1)
    exponent = scales.to(torch.int32) - 127
    values = torch.ldexp(values.flatten(-2), exponent[..., None])  # [..., G, 32]
    return values.flatten(-2).to(dtype)
