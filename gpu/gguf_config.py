"""A GGUF file's metadata read as llama.cpp reads it, into the Hugging Face config of the model
it holds (gpu/gguf_file.py opens the file; the architectures weir serves: gpu/gguf_names.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
from gguf import PoolingType

from core.config import CheckpointError
from gpu.gguf_encoder import ENCODER_ARCHES, encoder_config
from gpu.gguf_families import FAMILIES, sliding_layers
from gpu.gguf_names import ARCHES
from gpu.models import gpt_oss


# llama.cpp's classification head (a reranker's): [labels, hidden]
RANK_HEAD = "cls.output.weight"
# the GGUF architectures of decoders (the others, encoders: gpu/gguf_encoder.py)
DECODERS = tuple(a for a in ARCHES if a not in ENCODER_ARCHES)


class HfConfigOf:
    """The config of an open GGUF file (`ckpt`: its `get`, `tensors`, `arch` and `path`)."""

    def __init__(self, ckpt: Any) -> None:
        self.get = ckpt.get
        self.tensors = ckpt.tensors
        self.arch = ckpt.arch
        self.path = ckpt.path

    def config(self) -> Any:
        """A Hugging Face config of the file's shapes: a decoder's (`decoder`), or a reranker's
        made of it (`reranker`) where the file has a classification head. `weir_pooling`: the
        pooling kind the file names (`pooling_type`: mean, cls or last; None for none, or a
        reranker's rank), the embedding default (server/embedding_config.py)."""
        kinds = {1: "mean", 2: "cls", 3: "last"}
        pooling = kinds.get(int(self.get(f"{self.arch}.pooling_type", 0) or 0))
        if self.arch not in DECODERS:  # an encoder (its classification head is its own)
            config = encoder_config(self)
            config.weir_pooling = pooling
            return config
        config = self.decoder()
        config.weir_pooling = pooling
        return self.reranker(config) if RANK_HEAD in self.tensors else config

    def reranker(self, config: Any) -> Any:
        """A Qwen3 reranker as llama.cpp's converter writes one: `pooling_type` rank, its head
        `cls.output` the LM head's "yes" and "no" rows, labelled so, whose softmax llama.cpp
        serves as the score. Served as a one-label Qwen3ForSequenceClassification whose logit is
        "yes" less "no" (gguf_file.py `weights` takes the difference): its sigmoid is the same
        P(yes). A head of any other model or kind is refused by name."""
        a, head = self.arch, self.tensors[RANK_HEAD]
        labels = list(self.get(f"{a}.classifier.output_labels", None) or [])
        pooling = int(self.get(f"{a}.pooling_type", 0) or 0)
        rows = int(head.shape[1]) if len(head.shape) == 2 else 1
        if a != "qwen3" or pooling != int(PoolingType.RANK) or labels != ["yes", "no"] or rows != 2:
            raise CheckpointError(
                f"{self.path.name}: a classification head ({RANK_HEAD}) is served for Qwen3 "
                "rerankers (pooling_type rank, labels yes and no); this file's is "
                f"{a}'s, pooling_type {pooling}, {rows} rows, labels {labels}"
            )
        config.architectures = ["Qwen3ForSequenceClassification"]
        config.num_labels = 1
        config.id2label, config.label2id = {0: "yes"}, {"yes": 0}
        # its prompt (llama.cpp's), {query} and {document} filled per pair (core/score_pairs.py)
        config.weir_rerank_template = self.get("tokenizer.chat_template.rerank", None)
        return config

    def decoder(self) -> Any:
        """A Hugging Face config (LlamaConfig, MixtralConfig, Phi3Config, Qwen2Config,
        Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig, Gemma2Config, Gemma3TextConfig, GptOssConfig,
        Olmo2Config, Olmo3Config, OlmoeConfig) of the file's decoder."""
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
            rms_norm_eps=float(  # (Cohere's files: a layer norm's epsilon)
                self.get(f"{a}.attention.layer_norm_rms_epsilon", None)
                or self.get(f"{a}.attention.layer_norm_epsilon")
            ),
            rope_parameters=self._rope(head_dim),
            tie_word_embeddings="output.weight" not in self.tensors,
            bos_token_id=self.get("tokenizer.ggml.bos_token_id", None),
            eos_token_id=self._end_tokens(),
            dtype=self._dtype(),
        )
        if a == "gpt-oss":
            return gpt_oss.gguf_config(self.get, common, head_dim)
        if a in ("olmo2", "olmoe"):
            return self._olmo(common, head_dim)
        if a in FAMILIES:  # the families of gpu/gguf_families.py
            return FAMILIES[a](self, common, head_dim)
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
        if a in ("qwen2", "qwen2vl"):
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

    def _olmo(self, common: dict, head_dim: int) -> Any:
        """OLMo 2, OLMo 3 and OLMoE as llama.cpp reads their files: heads of hidden / heads
        (their Q/K norms span all heads); an "olmo2" file with a window is OLMo 3 (converted as
        OLMo 2 with `attention.sliding_window` and a pattern: every 4th layer global if absent),
        whose sliding layers turn without the file's rope scaling, at `rope.freq_base_swa` if
        given, else the global layers' base; OLMoE's chosen experts' weights never renormalized."""
        from transformers import Olmo2Config, Olmo3Config, OlmoeConfig

        a, n = self.arch, common["num_hidden_layers"]
        if head_dim != common["hidden_size"] // common["num_attention_heads"]:
            raise CheckpointError(f"{self.path.name}: {a} with a head size of {head_dim}")
        if a == "olmoe":
            return OlmoeConfig(
                **common,
                num_experts=int(self.get("olmoe.expert_count")),
                num_experts_per_tok=int(self.get("olmoe.expert_used_count")),
                norm_topk_prob=False,
            )
        window = int(self.get("olmo2.attention.sliding_window", 0) or 0)
        if not window:
            return Olmo2Config(**common)
        sliding = sliding_layers(self.get("olmo2.attention.sliding_window_pattern", 4), n)
        full = common.pop("rope_parameters")
        base = float(self.get("olmo2.rope.freq_base_swa", full["rope_theta"]))
        common["architectures"] = ["Olmo3ForCausalLM"]
        return Olmo3Config(
            **common,
            sliding_window=window,
            layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
            rope_parameters={
                "full_attention": full,
                "sliding_attention": {"rope_type": "default", "rope_theta": base},
            },
        )

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

    def _dtype(self) -> str:
        """The checkpoint's float type, as --dtype auto and the KV cache take it: that of its
        16-bit or float32 matrices, and float16 (llama.cpp's cache) for block formats."""
        kinds = {t.tensor_type.name for t in self.tensors.values() if len(t.shape) == 2}
        if kinds <= {"BF16"}:
            return "bfloat16"
        if kinds <= {"F32"}:
            return "float32"
        return "float16"
