"""MXFP4 (the OCP microscaling format gpt-oss's experts ship in): blocks of 32 FP4 (E2M1) values
sharing one power-of-two scale. A checkpoint's `*_blocks` hold [..., G, 16] bytes, two values a
byte (the low nibble first), and `*_scales` [..., G] bytes, each scale 2^(byte - 127) (E8M0).
Dequantized exactly: every value is a bfloat16 (and float32) number.

Held as ggml's MXFP4 blocks (`to_ggml`: GGUF's type 39, 17 bytes: the scale byte, then value i
in the low nibble of byte i and value i + 16 in its high one) and served by weir's CPU kernels
in their own 4 bits (`transcode`: each scale byte as the float16 2^(byte - 128) before the same
16 bytes, the values' codes read through the table of E2M1's values doubled, as IQ4_NL's
indices are), exactly for scale bytes 104..143, which float16 holds: every real weight's (a
block of zeros takes any scale). A weight with a block outside that range is served as Q8_0
instead (`to_q8_0`: also exact, the integers doubled up to three times past 143; rounded below
104, its values under 3e-7)."""

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


def codes_of(blocks: np.ndarray) -> np.ndarray:
    """OpenAI's [..., G, 16] bytes -> each block's 32 codes in order [..., G, 32]."""
    return np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)


def _ggml(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Codes [..., G, 32] and scales [..., G] -> ggml's MXFP4 rows [..., G * 17]."""
    out = np.empty((*codes.shape[:-1], 17), dtype=np.uint8)
    out[..., 0] = scales
    out[..., 1:] = codes[..., :16] | (codes[..., 16:] << 4)
    return out.reshape(*codes.shape[:-2], codes.shape[-2] * 17)


def to_ggml(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """OpenAI's [..., G, 16] bytes and [..., G] scales -> ggml's MXFP4 rows [..., G * 17]."""
    return _ggml(codes_of(blocks), scales)


HALF_SCALES = (104, 143)  # the scale bytes whose 2^(byte - 128) float16 holds exactly


def scale_bytes(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's MXFP4 rows -> (their blocks [N, 17], each block's scale where any of its values is
    not zero; 128 (2^0) where all are: any scale gives such a block)."""
    blocks = rows.reshape(-1, 17)
    zero = ((blocks[:, 1:] & 0x77) == 0).all(axis=1)  # codes 0 and 8: +0 and -0
    return blocks, np.where(zero, 128, blocks[:, 0])


def half_scales(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's MXFP4 rows (`transcodable`) -> (their blocks [N, 17], each block's scale
    2^(byte - 128) as float16 [N]): what the CPU and GPU kernels multiply a code's value by."""
    blocks, scales = scale_bytes(rows)
    return blocks, np.ldexp(np.float32(1.0), scales.astype(np.int32) - 128).astype(np.float16)


def transcodable(rows: np.ndarray) -> bool:
    """Whether float16 holds the scale of every block of ggml's MXFP4 rows [n, G * 17] (but
    those of blocks of zeros)."""
    _, scales = scale_bytes(rows)
    return bool(((scales >= HALF_SCALES[0]) & (scales <= HALF_SCALES[1])).all())


def transcode(rows: np.ndarray) -> np.ndarray:
    """ggml's MXFP4 rows [n, G * 17] (`transcodable`) -> the kernels' [n, G * 18]: each block's
    float16 2^(byte - 128), then its 16 bytes of codes as they were."""
    blocks, d = half_scales(rows)
    out = np.empty((len(blocks), 18), dtype=np.uint8)
    out[:, :2] = d[:, None].view(np.uint8)
    out[:, 2:] = blocks[:, 1:]
    return out.reshape(rows.shape[0], -1)


def to_q8_0(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """[..., G, 16] bytes and [..., G] scales -> Q8_0 rows [..., G * 34] (gpu/quant/formats.py:
    each block a float16 scale, then 32 int8 values), the same values where float16 holds the
    scale."""
    q = DOUBLED[codes_of(blocks)]
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


def ggml_to_q8_0(raw: np.ndarray) -> np.ndarray:
    """Rows of ggml's MXFP4 blocks ([rows, blocks * 17]: a scale byte, then value i in the low
    nibble of byte i and value i + 16 in its high nibble, ggml's values already doubled) ->
    Q8_0 rows [rows, blocks * 34], exactly as `to_q8_0` makes them."""
    blocks = raw.reshape(raw.shape[0], -1, 17)
    scales, qs = blocks[..., 0], blocks[..., 1:]
    # as OpenAI's layout (value 2j low, 2j + 1 high) so to_q8_0 reads it: values 0..31 in order
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [rows, G, 32]
    return to_q8_0(codes[..., 0::2] | (codes[..., 1::2] << 4), scales)


def _encode(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[N, 32] float32 -> (codes [N, 32], scale bytes [N]): each block over the power of two
    that brings its largest value within E2M1's 6, each value the nearest code."""
    amax = np.maximum(np.abs(blocks).max(axis=1), np.float32(2.0**-100))
    exponent = np.clip(np.ceil(np.log2(amax / 6.0)), -127, 127)
    scaled = blocks / np.exp2(exponent)[:, None]
    table = np.array(FP4_VALUES, dtype=np.float32)
    codes = np.empty(blocks.shape, dtype=np.uint8)
    for start in range(0, len(blocks), 1 << 14):  # bounds the [rows, 32, 16] temporary
        part = scaled[start : start + (1 << 14), :, None]
        codes[start : start + (1 << 14)] = np.abs(part - table).argmin(axis=2)
    return codes, (exponent + 127).astype(np.uint8)


def quantize_ggml(blocks: np.ndarray) -> np.ndarray:
    """[N, 32] float weights -> ggml's MXFP4 blocks [N, 17] (gpu/quant/quantize.py's)."""
    return _ggml(*_encode(np.asarray(blocks, dtype=np.float32)))


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., n] float -> ([..., n / 32, 16] bytes, [..., n / 32] scales), as OpenAI's files hold
    them (the low nibble first), by `_encode`. For tests and benchmarks."""
    shape = w.shape[:-1]
    codes, scales = _encode(w.float().reshape(-1, 32).numpy())
    packed = torch.from_numpy(codes[:, 0::2] | (codes[:, 1::2] << 4))
    groups = w.shape[-1] // 32
    return packed.reshape(*shape, groups, 16), torch.from_numpy(scales).reshape(*shape, groups)


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
