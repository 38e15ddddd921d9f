"""Random-weight GGUF files of real sizes, written straight in block formats for the benchmarks
(and the tests of what reads them): random blocks of a trained model's weight sizes, never a
float weight or a quantizer, with gpu/quant/gguf_write.py's metadata and tokenizer."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import gguf
import numpy as np

from gpu.quant.formats import FORMATS
from gpu.quant.gguf_write import fitting, metadata_writer, q4_k_m
from gpu.quant.iq_grids import GRIDS, table


def shapes(config: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    """GGUF names and (numpy-order) shapes of a Llama-shaped model's tensors."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    d = config.get("head_dim") or h // heads
    yield "token_embd.weight", (config["vocab_size"], h)
    for i in range(config["num_hidden_layers"]):
        yield f"blk.{i}.attn_norm.weight", (h,)
        yield f"blk.{i}.ffn_norm.weight", (h,)
        yield f"blk.{i}.attn_q.weight", (heads * d, h)
        yield f"blk.{i}.attn_k.weight", (kv * d, h)
        yield f"blk.{i}.attn_v.weight", (kv * d, h)
        yield f"blk.{i}.attn_output.weight", (h, heads * d)
        yield f"blk.{i}.ffn_gate.weight", (inter, h)
        yield f"blk.{i}.ffn_up.weight", (inter, h)
        yield f"blk.{i}.ffn_down.weight", (h, inter)
    yield "output_norm.weight", (h,)
    if not config.get("tie_word_embeddings", False):
        yield "output.weight", (config["vocab_size"], h)


def random_blocks(fmt: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[n, row_bytes] of random blocks in `fmt` whose weights are of the size of a trained
    model's (|w| up to about 0.1): random integers, small fixed scales. Fast: a benchmark's
    8B-shaped file is written without any float weights or quantizing."""
    f = FORMATS[fmt]
    blocks = rng.integers(0, 256, size=(n * k // f.block_size, f.block_bytes), dtype=np.uint8)

    def f16(offset: int, value: float) -> None:
        blocks[:, offset : offset + 2] = (
            np.full(len(blocks), value, np.float16).view(np.uint8)[:, None].reshape(-1, 2)
        )

    if fmt in ("q8_0", "q4_0", "q5_0"):
        f16(0, 0.1 / {"q8_0": 127, "q4_0": 8, "q5_0": 16}[fmt])
    elif fmt in ("q4_1", "q5_1"):
        f16(0, 0.1 / (15 if fmt == "q4_1" else 31))
        f16(2, -0.05)
    elif fmt in ("q4_k", "q5_k"):
        f16(0, 0.1 / 63 / (15 if fmt == "q4_k" else 31))
        f16(2, 0.05 / 63)
    elif fmt == "q3_k":
        f16(108, 0.1 / 4 / 32)
    elif fmt == "q2_k":
        f16(80, 0.1 / 3 / 15)
        f16(82, 0.05 / 15)
    elif fmt in ("iq4_nl", "iq4_xs"):
        f16(0, 0.1 / 127 / (1 if fmt == "iq4_nl" else 32))
    elif fmt == "q6_k":
        blocks[:, 192:208] = rng.integers(1, 64, size=(len(blocks), 16), dtype=np.uint8)
        f16(208, 0.1 / 63 / 32)
    elif fmt in GRIDS:  # d first; the largest weight d unit 31 top
        f16(0, 0.1 / (GRIDS[fmt].unit * 31 * float(table(fmt)[2][-1])))
    else:
        raise ValueError(f"random_blocks: {fmt} is not a block format")
    return blocks.reshape(n, f.row_bytes(k))


def write_random_gguf(
    out: str | Path,
    config: dict,
    tokenizer_dir: str | Path,
    formats: Callable[[str, tuple[int, ...]], str] = q4_k_m,
    seed: int = 0,
) -> Path:
    """A random-weight GGUF of `config`'s shape (a Llama) written straight in block formats,
    one tensor at a time (an 8B-shaped Q4_K_M file needs no more memory than its largest
    tensor), with `tokenizer_dir`'s tokenizer (padded with unused tokens to the vocabulary)."""
    out = Path(out)
    config = {"architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5, **config}
    w, _ = metadata_writer(out, config, Path(tokenizer_dir))
    plan = []
    for name, shape in shapes(config):
        fmt = "f32" if len(shape) == 1 else fitting(formats(name, shape), shape[-1])
        f = FORMATS[fmt]
        if fmt == "f32":
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * shape[0])
        else:
            rows = (shape[0], f.row_bytes(shape[1]))
            qtype = gguf.GGMLQuantizationType(f.ggml_type)
            w.add_tensor_info(name, rows, np.dtype(np.uint8), rows[0] * rows[1], raw_dtype=qtype)
        plan.append((fmt, shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for fmt, shape in plan:
        if fmt == "f32":
            w.write_tensor_data(np.ones(shape, dtype=np.float32))
        else:
            w.write_tensor_data(random_blocks(fmt, shape[0], shape[1], rng))
    w.close()
    return out
