"""MXFP4 (the OCP microscaling format gpt-oss's experts ship in): blocks of 32 FP4 (E2M1) values
sharing one power-of-two scale. A checkpoint's `*_blocks` hold [..., G, 16] bytes, two values a
byte (the low nibble first), and `*_scales` [..., G] bytes, each scale 2^(byte - 127) (E8M0).
Dequantized exactly: every value is a bfloat16 (and float32) number.

Served on weir's kernels as Q8_0 (`to_q8_0`), also exactly: twice an E2M1 value is an integer
of at most 12, so a block is 32 int8 values over the scale 2^(byte - 128), which float16 holds
for scale bytes 104..143 (and up to 146, the integers doubled up to three times): every real
weight's. A block outside that range is rounded (its values then below 3e-7 or above 3e6).
Q8_0 reads 34 bytes a block where MXFP4 reads 17, and half of bfloat16's 64."""

from __future__ import annotations

import numpy as np
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


DOUBLED = np.array([2 * v for v in FP4_VALUES], dtype=np.int8)  # exact integers


def to_q8_0(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """[..., G, 16] bytes and [..., G] scales -> Q8_0 rows [..., G * 34] (gpu/quant/formats.py:
    each block a float16 scale, then 32 int8 values), the same values where float16 holds the
    scale."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    q = DOUBLED[codes]
    exponent = scales.astype(np.int32) - 128
    outside = (exponent < -24) | (exponent > 15)  # past float16's scales: the integers move
    if outside.any():
        clamped = np.clip(exponent, -24, 15)
        shift = (exponent - clamped)[..., None].astype(np.float32)
        q = np.clip(np.round(q * np.exp2(shift)), -127, 127).astype(np.int8)
        exponent = clamped
    d = np.ldexp(np.float32(1.0), exponent).astype(np.float16)
    out = np.empty((*blocks.shape[:-1], 34), dtype=np.uint8)
    out[..., :2] = d[..., None].view(np.uint8)
    out[..., 2:] = q.view(np.uint8)
    return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * 34)


GGML_MXFP4 = 39  # ggml's type id: blocks of 17 bytes, the scale byte then 16 of nibbles


def ggml_to_q8_0(raw: np.ndarray) -> np.ndarray:
    """Rows of ggml's MXFP4 blocks ([rows, blocks * 17]: a scale byte, then value i in the low
    nibble of byte i and value i + 16 in its high nibble, ggml's values already doubled) ->
    Q8_0 rows [rows, blocks * 34], exactly as `to_q8_0` makes them."""
    blocks = raw.reshape(raw.shape[0], -1, 17)
    scales, qs = blocks[..., 0], blocks[..., 1:]
    # as OpenAI's layout (value 2j low, 2j + 1 high) so to_q8_0 reads it: values 0..31 in order
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [rows, G, 32]
    return to_q8_0(codes[..., 0::2] | (codes[..., 1::2] << 4), scales)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., n] float -> ([..., n / 32, 16] bytes, [..., n / 32] scales), as OpenAI's files hold
    them: each block of 32 over the power of two that brings its largest value within E2M1's
    6, each value the nearest code (the low nibble first). For tests and benchmarks."""
    blocks = w.float().reshape(*w.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1).clamp(min=2.0**-100)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = blocks / torch.exp2(exponent)[..., None]
    codes = torch.empty(scaled.shape, dtype=torch.uint8)
    table = torch.tensor(FP4_VALUES)
    for i in range(len(scaled)):  # one leading row at a time: [.., 32, 16] stays small
        codes[i] = (scaled[i][..., None] - table).abs().argmin(-1).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (exponent + 127).to(torch.uint8)


def write_folder(src, dst) -> None:
    """A copy of the Hugging Face gpt-oss folder `src` (its experts' weights as parameters) with
    the experts in MXFP4 as OpenAI's files hold them (`*_blocks` [E, out, in / 32, 16] and
    `*_scales`, quantization_config mxfp4). For tests and benchmarks."""
    import json
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst)
    tensors = {}
    for file in sorted(src.glob("*.safetensors")):
        (dst / file.name).unlink()
        tensors = load_file(file)
        out = {}
        for name, t in tensors.items():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                out[name + "_blocks"], out[name + "_scales"] = quantize(t.transpose(1, 2))
            else:
                out[name] = t
        save_file(out, dst / file.name, metadata={"format": "pt"})
    index = dst / "model.safetensors.index.json"
    if index.exists():  # the shards' index names the new tensors
        data = json.loads(index.read_text())
        fixed = {}
        for name, file in data["weight_map"].items():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                fixed[name + "_blocks"] = fixed[name + "_scales"] = file
            else:
                fixed[name] = file
        data["weight_map"] = fixed
        index.write_text(json.dumps(data))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (dst / "config.json").write_text(json.dumps(config))
