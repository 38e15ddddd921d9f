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
from gpu.gguf_names import ARCHES, expert_name, hf_name, llama_unpermute_index
from gpu.models import gpt_oss
from gpu.quant.formats import BY_GGML_TYPE
from gpu.quant.tensor import BlockTensor

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


def sliding_layers(pattern: int | list, n: int) -> list[bool]:
    """Which of n layers slide, as llama.cpp reads `attention.sliding_window_pattern`: a flag
    per layer, or a period (set_swa_pattern: every p-th layer global; 0 all sliding, 1 none)."""
    if isinstance(pattern, list):
        return [bool(p) for p in pattern]
    p = int(pattern)
    return [p == 0 or i % p < p - 1 for i in range(n)]


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
        """A Hugging Face config (LlamaConfig, MixtralConfig, Phi3Config, Qwen2Config,
        Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig, Gemma2Config, Gemma3TextConfig) of the
        file's shapes."""
        from transformers import (
            Gemma2Config,
            Gemma3TextConfig,
            LlamaConfig,
            MixtralConfig,
            Phi3Config,
            Qwen2Config,
            Qwen2MoeConfig,
            Qwen3Config,
            Qwen3MoeConfig,
        )

        a = self.arch
        hidden = int(self.get(f"{a}.embedding_length"))
        heads = int(self.get(f"{a}.attention.head_count"))
        kv_heads = int(self.get(f"{a}.attention.head_count_kv", heads))
        head_dim = int(self.get(f"{a}.attention.key_length", hidden // heads))
        if int(self.get(f"{a}.attention.value_length", head_dim)) != head_dim:
            raise CheckpointError(f"{self.path.name}: key and value head sizes differ")
        embd = self.tensors["token_embd.weight"]
        vocab = int(self.get(f"{a}.vocab_size", int(embd.shape[1])))
        common = dict(
            architectures=[ARCHES[a]],
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(self.get(f"{a}.feed_forward_length", 0)),
            num_hidden_layers=int(self.get(f"{a}.block_count")),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            max_position_embeddings=int(self.get(f"{a}.context_length", 4096)),
            rms_norm_eps=float(self.get(f"{a}.attention.layer_norm_rms_epsilon")),
            rope_parameters=self._rope(head_dim),
            tie_word_embeddings="output.weight" not in self.tensors,
            bos_token_id=self.get("tokenizer.ggml.bos_token_id", None),
            eos_token_id=self._end_tokens(),
            dtype=self._dtype(),
        )
        if a == "gpt-oss":
            return gpt_oss.gguf_config(self.get, common, head_dim)
        if a == "gemma3":
            return self._gemma3(common, head_dim, Gemma3TextConfig)
        if a == "gemma2":
            return self._gemma2(common, head_dim, Gemma2Config)
        if a == "phi3":  # a window of 0: none (llama.cpp's converter writes Phi-4's so)
            window = int(self.get("phi3.attention.sliding_window", 0) or 0)
            return Phi3Config(
                **common,
                sliding_window=window or None,
                original_max_position_embeddings=self._original_context(),
            )
        if a == "qwen2":
            if head_dim != hidden // heads:
                raise CheckpointError(f"{self.path.name}: qwen2 with a head size of {head_dim}")
            return Qwen2Config(**common)
        experts = int(self.get(f"{a}.expert_count", 0) or 0)
        if a == "qwen2moe":
            if head_dim != hidden // heads:
                raise CheckpointError(f"{self.path.name}: qwen2moe with a head size of {head_dim}")
            return self._experts(common, head_dim, MixtralConfig, Qwen2MoeConfig)
        if a == "qwen3moe" or (a == "llama" and experts):
            return self._experts(common, head_dim, MixtralConfig, Qwen3MoeConfig)
        cls = LlamaConfig if a == "llama" else Qwen3Config
        return cls(**common, head_dim=head_dim)

    def _experts(self, common: dict, head_dim: int, mixtral: Any, qwen: Any) -> Any:
        """A mixture of experts as llama.cpp reads its file: a "llama" with experts is Mixtral
        (its feed_forward_length the experts' size); Qwen3-MoE's and Qwen2-MoE's experts have
        their own (`expert_feed_forward_length`), Qwen2-MoE's shared expert too
        (`expert_shared_feed_forward_length`). llama.cpp renormalizes the chosen experts'
        weights of Mixtral and Qwen3-MoE, not Qwen2-MoE's."""
        a = self.arch
        experts = int(self.get(f"{a}.expert_count"))
        used = int(self.get(f"{a}.expert_used_count"))
        if a == "llama":
            common["architectures"] = ["MixtralForCausalLM"]
            return mixtral(
                **common, head_dim=head_dim, num_local_experts=experts, num_experts_per_tok=used
            )
        sized = dict(
            num_experts=experts,
            num_experts_per_tok=used,
            moe_intermediate_size=int(self.get(f"{a}.expert_feed_forward_length")),
        )
        if a == "qwen2moe":
            shared = int(self.get(f"{a}.expert_shared_feed_forward_length"))
            return qwen(
                **common, **sized, shared_expert_intermediate_size=shared, norm_topk_prob=False
            )
        return qwen(**common, **sized, head_dim=head_dim, norm_topk_prob=True)

    def _end_tokens(self) -> int | list[int] | None:
        """The tokens that end generation, as llama.cpp reads them: EOS, and the end-of-turn
        and end-of-message tokens where the file names them (Llama 3's <|eot_id|>, <|eom_id|>)."""
        ids = []
        for key in ("eos", "eot", "eom"):
            value = self.get(f"tokenizer.ggml.{key}_token_id", None)
            if isinstance(value, int) and value not in ids:
                ids.append(value)
        return None if not ids else ids[0] if len(ids) == 1 else ids

    def _gemma3(self, common: dict, head_dim: int, cls: Any) -> Any:
        """Gemma 3 as llama.cpp reads its file: a window on all layers but every pattern-th
        (`attention.sliding_window_pattern`, 6 if absent, or one flag per layer), the sliding
        layers turning at `rope.freq_base_swa` (10,000 if absent), the attention scale derived
        as llama.cpp derives it (the file has none: 1/sqrt(hidden / heads) for the 62-layer
        27B, else 1/sqrt(head size))."""
        n, heads = common["num_hidden_layers"], common["num_attention_heads"]
        window = int(self.get("gemma3.attention.sliding_window", 0) or 0)
        sliding = sliding_layers(self.get("gemma3.attention.sliding_window_pattern", 6), n)
        full = dict(common.pop("rope_parameters"))
        local = {
            "rope_type": "default",
            "rope_theta": float(self.get("gemma3.rope.freq_base_swa", 1e4)),
        }
        return cls(
            **common,
            head_dim=head_dim,
            sliding_window=window or None,
            layer_types=[
                "sliding_attention" if s and window else "full_attention" for s in sliding
            ],
            rope_parameters={"full_attention": full, "sliding_attention": local},
            query_pre_attn_scalar=common["hidden_size"] // heads if n == 62 else head_dim,
            final_logit_softcapping=self.get("gemma3.final_logit_softcapping", None),
        )

    def _gemma2(self, common: dict, head_dim: int, cls: Any) -> Any:
        """Gemma 2 as llama.cpp reads its file: every other layer sliding (the first one), one
        rotation, its soft caps, the attention scale derived as llama.cpp derives it (the file
        has none: 1/sqrt(hidden / heads) for the 46-layer 27B, else 1/sqrt(head size))."""
        n, heads = common["num_hidden_layers"], common["num_attention_heads"]
        window = int(self.get("gemma2.attention.sliding_window", 0) or 0)
        return cls(
            **common,
            head_dim=head_dim,
            sliding_window=window or None,
            layer_types=[
                "sliding_attention" if i % 2 == 0 and window else "full_attention" for i in range(n)
            ],
            query_pre_attn_scalar=common["hidden_size"] // heads if n == 46 else head_dim,
            attn_logit_softcapping=self.get("gemma2.attn_logit_softcapping", None),
            final_logit_softcapping=self.get("gemma2.final_logit_softcapping", None),
        )

    def _original_context(self) -> int:
        a = self.arch
        fallback = self.get(f"{a}.context_length", 4096)
        return int(self.get(f"{a}.rope.scaling.original_context_length", fallback))

    def _rope(self, head_dim: int) -> dict[str, Any]:
        a = self.arch
        params: dict[str, Any] = {"rope_theta": float(self.get(f"{a}.rope.freq_base", 10000.0))}
        rotated = int(self.get(f"{a}.rope.dimension_count", head_dim))
        if rotated != head_dim:  # refused by name (gpu/models/spec.py)
            params["partial_rotary_factor"] = rotated / head_dim
        kind = self.get(f"{a}.rope.scaling.type", "none")
        if "rope_factors_long.weight" in self.tensors:  # Phi-3's LongRoPE, as two tensors
            params.update(
                rope_type="longrope",
                long_factor=self._floats("rope_factors_long.weight"),
                short_factor=self._floats("rope_factors_short.weight"),
                original_max_position_embeddings=self._original_context(),
            )
        elif kind in ("none", ""):
            params["rope_type"] = "default"
        elif kind == "linear":
            params.update(rope_type="linear", factor=float(self.get(f"{a}.rope.scaling.factor")))
        elif kind == "yarn":
            params.update(
                rope_type="yarn",
                factor=float(self.get(f"{a}.rope.scaling.factor")),
                original_max_position_embeddings=int(
                    self.get(f"{a}.rope.scaling.original_context_length")
                ),
            )
        else:
            raise CheckpointError(f"{self.path.name}: rope scaling {kind!r} is not served")
        return params

    def _floats(self, name: str) -> list[float]:
        if name not in self.tensors:
            raise CheckpointError(f"{self.path.name}: no {name} tensor")
        return np.array(self.tensors[name].data, dtype=np.float32).tolist()

    def rope_factors(self) -> torch.Tensor | None:
        """llama3-style per-frequency divisors (the rope_freqs tensor), when the file has them."""
        t = self.tensors.get("rope_freqs.weight")
        return None if t is None else torch.from_numpy(np.array(t.data, dtype=np.float32))

    def _dtype(self) -> str:
        """The checkpoint's float type, as --dtype auto and the KV cache take it: that of its
        16-bit or float32 matrices, and float16 (llama.cpp's cache) for block formats."""
        kinds = {t.tensor_type.name for t in self.tensors.values() if len(t.shape) == 2}
        if kinds <= {"BF16"}:
            return "bfloat16"
        if kinds <= {"F32"}:
            return "float32"
        return "float16"

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
                if self.arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
                    values = values - 1.0  # the file holds 1 + w; the loader adds the 1 again
                value: Any = torch.from_numpy(values).reshape(list(reversed(dims)))
                if self.arch == "llama" and target.endswith(("q_proj.weight", "k_proj.weight")):
                    h = heads if "q_proj" in target else kv_heads
                    value = value[torch.from_numpy(llama_unpermute_index(value.shape[0], h))]
            else:
                k, n = dims[0], int(np.prod(dims[1:]))
                value = BlockTensor(raw.view(np.uint8).reshape(n, -1), fmt, (n, k))
                if self.arch == "llama" and target.endswith(("q_proj.weight", "k_proj.weight")):
                    h = heads if "q_proj" in target else kv_heads
                    value = value.take_rows(llama_unpermute_index(n, h))
            stack_bias = ".mlp.experts." in target and target.endswith(".bias")  # gpt-oss's
            if len(dims) == 3 or stack_bias and len(dims) == 2:
                yield from experts(target, value, dims[-1])  # each expert's rows (or bias)
            elif target.endswith("shared_expert_gate.weight") and len(dims) == 1:
                yield target, value[None]  # Qwen2-MoE's shared gate: one row of the hidden size
            else:
                yield target, value

    # ---- tokenizer ----
    def tokenizer(self) -> Any:
        """The tokenizer the tokenizer.ggml.* entries describe (gpu/gguf_tokenizer.py: weir's own
        for byte-level BPE, transformers' for the rest), with the file's chat template."""
        from transformers import AutoTokenizer

        from gpu.gguf_tokenizer import build_byte_level, set_special_tokens

        try:
            tok = build_byte_level(self.get)
            if tok is None:
                tok = AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name)
                set_special_tokens(tok, self.get)
        except Exception as e:  # noqa: BLE001 - a tokenizer that cannot be built
            raise CheckpointError(
                f"{self.path.name}: no tokenizer from its tokenizer.ggml entries "
                f"({type(e).__name__}: {e}); give one with --tokenizer DIR"
            ) from None
        template = self.get("tokenizer.chat_template", None)
        if template:
            tok.chat_template = template
        return tok

    def close(self) -> None:
        """Drop the file's map (the tensors handed on hold their own views while they live)."""
        self.tensors = {}
        self.reader = None
