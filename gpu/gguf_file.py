"""A GGUF file as a checkpoint, read with the `gguf` package (the format's own library): the
model's configuration from its metadata, its tensors under the Hugging Face names weir's modules
load by, and its tokenizer from the `tokenizer.ggml.*` entries.

Every tensor is checked when the file is opened: a type weir's kernels do not take, a tensor whose
bytes run past the end of the file, a missing metadata key or an architecture weir does not serve
is a CheckpointError naming it (start-up fails with exit code 2). Block-format tensors are handed
on as BlockTensors over the file's memory map: nothing is dequantized, and the CPU backend repacks
each into its kernels' panels straight from the map.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from core.config import CheckpointError
from gpu.gguf_names import ARCHES, PERMUTED, expert_name, hf_name, llama_unpermute_index
from gpu.gguf_config import DECODERS, RANK_HEAD, HfConfigOf
from gpu.quant.formats import BY_GGML_TYPE
from gpu.quant.tensor import BlockTensor

# the files whose norm weights llama.cpp's converter stores as 1 + w (the loader adds the 1)
GEMMA_NORMS = ("gemma", "gemma2", "gemma3", "nemotron")

log = logging.getLogger("weir.gguf")

SERVED_TYPES = (
    "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, "
    "IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S, MXFP4 (gpt-oss's experts)"
)
_REQUIRED = object()


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".gguf"


# tensors of the rotation, not of a layer: llama3-style divisors, Phi-3's LongRoPE factors
ROTATION_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def experts(stacked: str, value: Any, count: int) -> Iterator[tuple[str, Any]]:
    """(name, weight) of each expert in a 3-D tensor of `count` (llama.cpp's ffn_*_exps): a
    float tensor's slices [rows, columns], or a BlockTensor's rows in place (nothing copied)."""
    for e in range(count):
        if isinstance(value, BlockTensor):
            n = value.shape[0] // count
            rows = value.rows[e * n : (e + 1) * n]
            yield expert_name(stacked, e), BlockTensor(rows, value.fmt, (n, value.shape[1]))
        else:
            yield expert_name(stacked, e), value[e]


class GgufCheckpoint:
    def __init__(self, path: Path) -> None:
        import gguf

        self.path = path
        name = path.name
        try:
            self.reader = gguf.GGUFReader(path, "r")
        except Exception as e:  # noqa: BLE001 - any parse failure is a bad file
            raise CheckpointError(
                f"{name}: not a readable GGUF file ({type(e).__name__}: {e})"
            ) from None
        self.arch = self.get("general.architecture")
        if self.arch not in ARCHES:
            raise CheckpointError(
                f"{name}: architecture {self.arch!r} is not served; weir serves GGUF "
                f"{', '.join(ARCHES)}"
            )
        size = path.stat().st_size
        self.tensors = {}
        for t in self.reader.tensors:
            if int(t.tensor_type) not in BY_GGML_TYPE:
                raise CheckpointError(
                    f"{name}: tensor {t.name} has type {t.tensor_type.name}; weir serves "
                    f"{SERVED_TYPES}"
                )
            if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
                raise CheckpointError(f"{name}: tensor {t.name} runs past the end of the file")
            self.tensors[t.name] = t
        if "token_embd.weight" not in self.tensors:
            raise CheckpointError(f"{name}: no token_embd.weight tensor")

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            if default is _REQUIRED:
                raise CheckpointError(f"{self.path.name}: metadata key {key} is missing")
            return default
        return field.contents()

    # ---- configuration ----
    def config(self) -> Any:
        """A Hugging Face config of the file's shapes (gpu/gguf_config.py)."""
        return HfConfigOf(self).config()

    def rope_factors(self) -> torch.Tensor | None:
        """llama3-style per-frequency divisors (the rope_freqs tensor), when the file has them."""
        t = self.tensors.get("rope_freqs.weight")
        return None if t is None else torch.from_numpy(np.array(t.data, dtype=np.float32))

    # ---- tensors ----
    def weights(self) -> Iterator[tuple[str, Any]]:
        """(HF name, value) for every tensor: float32 tensors for F32 (and 16-bit vectors),
        BlockTensors over the file's map for matrices in F16, BF16 and the block formats."""
        import gguf

        heads = int(self.get(f"{self.arch}.attention.head_count"))
        kv_heads = int(self.get(f"{self.arch}.attention.head_count_kv", heads))
        for name, t in self.tensors.items():
            if name in ROTATION_TENSORS:
                continue  # read by rope_factors and _rope
            if name == RANK_HEAD and self.arch in DECODERS:  # a Qwen3 reranker's "yes", "no" rows
                yes, no = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(
                    np.float32
                )
                yield "score.weight", torch.from_numpy(yes - no)[None]
                continue
            target = hf_name(name, self.arch)
            if target is None:
                raise CheckpointError(f"{self.path.name}: tensor {name} has no place in the model")
            dims = [int(d) for d in t.shape]  # ggml's order: the row length first
            raw = np.asarray(t.data)
            fmt = BY_GGML_TYPE[int(t.tensor_type)]
            if fmt.quantized and len(dims) == 1:
                raise CheckpointError(f"{self.path.name}: vector {name} in {fmt.name}")
            if len(dims) == 1 or fmt.name == "f32" or target.endswith("bias"):  # float32
                values = gguf.quants.dequantize(raw, t.tensor_type).astype(np.float32)
                if self.arch in GEMMA_NORMS and name.endswith("norm.weight"):
                    values = values - 1.0  # the file holds 1 + w; the loader adds the 1 again
                value: Any = torch.from_numpy(values).reshape(list(reversed(dims)))
                if self.arch in PERMUTED and target.endswith(("q_proj.weight", "k_proj.weight")):
                    h = heads if "q_proj" in target else kv_heads
                    value = value[torch.from_numpy(llama_unpermute_index(value.shape[0], h))]
            else:
                k, n = dims[0], int(np.prod(dims[1:]))
                value = BlockTensor(raw.view(np.uint8).reshape(n, -1), fmt, (n, k))
                if self.arch in PERMUTED and target.endswith(("q_proj.weight", "k_proj.weight")):
                    h = heads if "q_proj" in target else kv_heads
                    value = value.take_rows(llama_unpermute_index(n, h))
            stack_bias = ".mlp.experts." in target and target.endswith(".bias")  # gpt-oss's
            if len(dims) == 3 or stack_bias and len(dims) == 2:
                yield from experts(target, value, dims[-1])  # each expert's rows (or bias)
            elif target.endswith("shared_expert_gate.weight") and len(dims) == 1:
                yield target, value[None]  # Qwen2-MoE's shared gate: one row of the hidden size
            else:
                yield target, value
        if self.arch == "apertus":  # its xIELU parameters: metadata, a value a layer
            yield from self._xielu()

    def _xielu(self) -> Iterator[tuple[str, Any]]:
        """Apertus's xIELU parameters as its checkpoint holds them (llama.cpp's converter writes
        each as an array of a value a layer, `xielu.*` with no architecture prefix, as stored:
        before the softplus)."""
        n = int(self.get(f"{self.arch}.block_count"))
        for key, shape in (("alpha_p", [1]), ("alpha_n", [1]), ("beta", []), ("eps", [])):
            values = np.asarray(self.get(f"xielu.{key}"), np.float32).reshape(-1)
            if values.size != n:
                raise CheckpointError(f"{self.path.name}: xielu.{key} of {values.size}, not {n}")
            for i in range(n):
                value = torch.tensor(values[i], dtype=torch.float32).reshape(shape)
                yield f"model.layers.{i}.mlp.act_fn.{key}", value

    # ---- tokenizer ----
    def tokenizer(self) -> Any:
        """The tokenizer the tokenizer.ggml.* entries describe (gpu/gguf_tokenizer.py: weir's own
        for byte-level BPE, transformers' for the rest), with the file's chat template."""
        from transformers import AutoTokenizer

        from gpu.gguf_tokenizer import (
            bert_pairs,
            build_byte_level,
            build_unigram,
            build_wordpiece,
            set_special_tokens,
        )

        try:
            tok = None
            for build in (build_byte_level, build_wordpiece, build_unigram):
                tok = build(self.get) if tok is None else tok
            if tok is None:
                tok = AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name)
                set_special_tokens(tok, self.get)
        except Exception as e:  # noqa: BLE001 - a tokenizer that cannot be built
            raise CheckpointError(
                f"{self.path.name}: no tokenizer from its tokenizer.ggml entries "
                f"({type(e).__name__}: {e}); give one with --tokenizer DIR"
            ) from None
        if self.arch == "modern-bert":  # its [CLS] and [SEP] are the file's BOS and EOS
            bert_pairs(tok)
        template = self.get("tokenizer.chat_template", None)
        if template:
            tok.chat_template = template
        return tok

    def close(self) -> None:
        """Drop the file's map (the tensors handed on hold their own views while they live)."""
        self.tensors = {}
        self.reader = None
