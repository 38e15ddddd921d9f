"""A Hugging Face checkpoint (Llama, Phi-3, Qwen2, Qwen3, Gemma 2 and 3, Mixtral, Qwen2-MoE and
Qwen3-MoE, OLMo 2 and 3, OLMoE) written as a GGUF file with the `gguf` package's writer, each
weight in a chosen format (weir's quantizers, gpu/quant/quantize.py), the names, metadata, Q/K
row order and stacked experts as llama.cpp's convert_hf_to_gguf.py writes them, and the
tokenizer (byte-level BPE) as `tokenizer.ggml.*` entries with its chat template.

The tests serve the files this writes (tests/test_gguf.py); the benchmarks write random-weight
models of real sizes with its metadata (gpu/quant/gguf_random.py). Not a replacement for
llama.cpp's converter: no rope scaling but YaRN and Phi-3's LongRoPE, no sentencepiece
tokenizers.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import gguf
import numpy as np

from gpu.gguf_names import ARCHES as GGUF_ARCHES
from gpu.gguf_names import PERMUTED, gguf_name, llama_permute
from gpu.models import hunyuan, renames
from gpu.models.moe import STACKED, checkpoint_name, cut_stacked
from gpu.quant.formats import FORMATS
from gpu.quant.gguf_tokens import write_tokenizer
from gpu.quant.quantize import quantize

ARCHES: dict[str, str] = {}  # HF class -> GGUF architecture (the first that serves it)
for _gguf, _hf in GGUF_ARCHES.items():
    ARCHES.setdefault(_hf, _gguf)
ARCHES["MixtralForCausalLM"] = "llama"  # a Llama with experts, as llama.cpp writes it
ARCHES["Olmo3ForCausalLM"] = "olmo2"  # OLMo 2 with a window, as llama.cpp writes it


def q4_k_m(name: str, shape: tuple[int, ...]) -> str:
    """A Q4_K_M-like choice per tensor: Q6_K for the output and the V and down weights (llama.cpp
    gives half the layers' V and down Q6_K; this gives all), Q4_K for the other products, F32
    for norms and biases."""
    if len(shape) == 1 or name.endswith("ffn_gate_inp.weight"):  # llama.cpp keeps routers F32
        return "f32"
    if name == "output.weight" or name.endswith(
        ("attn_v.weight", "ffn_down.weight", "ffn_down_exps.weight")
    ):
        return "q6_k"
    return "q4_k"


def uniform(fmt: str) -> Callable[[str, tuple[int, ...]], str]:
    """Every matrix in `fmt`, norms and biases F32."""
    return lambda name, shape: "f32" if len(shape) == 1 else fmt


# llama-quantize's format for a k-quant tensor whose rows are not whole super-blocks of 256
# (Qwen2.5-0.5B's 896): its "incompatible tensor" fallbacks.
FALLBACK = {
    "q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0",
    **dict.fromkeys(
        ("q2_k", "q3_k", "iq4_xs", "iq3_xxs", "iq3_s", "iq2_xxs", "iq2_xs", "iq2_s"), "iq4_nl"
    ),
}  # fmt: skip


def fitting(fmt: str, k: int) -> str:
    """`fmt`, or the format llama.cpp falls back to for rows of k, else the nearest whose
    blocks divide them."""
    for f in (fmt, FALLBACK.get(fmt, "q8_0"), "q8_0", "f16"):
        if k % FORMATS[f].block_size == 0:
            return f
    return "f32"


def write_gguf(
    hf_dir: str | Path,
    out: str | Path,
    formats: Callable[[str, tuple[int, ...]], str] = uniform("q8_0"),
    tensors: Iterator[tuple[str, np.ndarray]] | None = None,
    rerank: str | None = None,
    pooling: str | None = None,
    arch: str | None = None,
) -> Path:
    """`hf_dir` (config.json, tokenizer.json and tokenizer_config.json, the weights) as a GGUF
    file at `out`. `tensors` replaces the checkpoint's weights (HF names, float32 arrays).
    `rerank`: a Qwen3 reranker's file as llama.cpp's converter writes one, this its prompt
    (`tokenizer.chat_template.rerank`), the LM head's "yes" and "no" rows its head
    (`cls.output`, in place of the LM head), pooling_type rank. `pooling`: an embedding
    model's pooling_type (mean, cls or last), as the converter writes it from
    sentence-transformers' files. `arch`: the file's architecture where not the config's own
    (the text model of Qwen2-VL or Qwen3-VL, "qwen2vl" or "qwen3vl", its rotation's sections
    written as llama.cpp's converter writes them)."""
    hf_dir, out = Path(hf_dir), Path(out)
    config = json.loads((hf_dir / "config.json").read_text())
    w, arch = metadata_writer(out, config, hf_dir, arch)
    yes_no = _rerank_keys(w, hf_dir, rerank) if rerank is not None else None
    if pooling is not None:
        kinds = {"mean": gguf.PoolingType.MEAN, "cls": gguf.PoolingType.CLS}
        w.add_pooling_type(kinds.get(pooling, gguf.PoolingType.LAST))
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    if tensors is None:
        tensors = _checkpoint(hf_dir)
    tensors = _weir_names(tensors, arch)
    count = config.get("num_local_experts") or config.get("num_experts") or 0
    if count:
        tensors = _stacked_experts(tensors, count)
    tie = config.get("tie_word_embeddings", arch != "llama")
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type") == "longrope":  # Phi-3's factors, as llama.cpp writes them
        for kind in ("long", "short"):
            factors = np.array(rope[f"{kind}_factor"], np.float32)
            w.add_tensor(f"rope_factors_{kind}.weight", factors)
    head = "model.embed_tokens.weight" if tie else "lm_head.weight"
    xielu: dict[str, dict[int, float]] = {}  # Apertus's: metadata arrays, as llama.cpp writes
    for name, t in tensors:
        if name.endswith("rotary_emb.inv_freq") or (tie and name == "lm_head.weight"):
            continue
        if ".mlp.act_fn." in name:
            value = float(np.asarray(t).reshape(-1)[0])
            xielu.setdefault(name.rpartition(".")[2], {})[int(name.split(".")[2])] = value
            continue
        t = np.ascontiguousarray(t, dtype=np.float32)
        if yes_no is not None and name == head:
            w.add_tensor("cls.output.weight", np.ascontiguousarray(t[yes_no]))
            if not tie:
                continue  # the converter writes the head's two rows, not the LM head
        if arch in PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
            t = llama_permute(t, heads if "q_proj" in name else kv_heads)
        if arch in ("gemma", "gemma2", "gemma3", "nemotron") and name.endswith("norm.weight"):
            t = t + 1.0  # Gemma's (Nemotron's) norms multiply by 1 + w: llama.cpp stores that
        gname = gguf_name(name, arch)
        fmt = formats(gname, t.shape)
        fmt = "f32" if t.ndim == 1 else fitting(fmt, t.shape[-1])
        if gname.endswith("ffn_gate_inp_shexp.weight"):
            fmt = "f32"  # Qwen2-MoE's shared gate, one row: llama.cpp's converter keeps it so
        f = FORMATS[fmt]
        if fmt == "f32":
            w.add_tensor(gname, t)
        else:  # an expert stack's rows quantized as one matrix's (the blocks lie within rows)
            data = quantize(t.reshape(-1, t.shape[-1]), fmt)
            data = data.reshape(*t.shape[:-1], data.shape[-1])
            qtype = gguf.GGMLQuantizationType(f.ggml_type)
            w.add_tensor(gname, data, raw_shape=data.shape, raw_dtype=qtype)
    for key, values in xielu.items():
        w.add_array(f"xielu.{key}", [values[i] for i in sorted(values)])  # (no arch prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _rerank_keys(w: gguf.GGUFWriter, hf_dir: Path, template: str) -> list[int]:
    """A reranker's metadata as llama.cpp's converter writes it; the ids of "yes" and "no"."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    ids = [tok.token_to_id(t) for t in ("yes", "no")]
    if None in ids:
        raise ValueError("gguf_write: a reranker's vocabulary has the tokens yes and no")
    w.add_pooling_type(gguf.PoolingType.RANK)
    w.add_classifier_output_labels(["yes", "no"])
    w.add_chat_template([{"name": "rerank", "template": template}])
    return ids


def _weir_names(
    tensors: Iterator[tuple[str, np.ndarray]], arch: str
) -> Iterator[tuple[str, np.ndarray]]:
    """The tensors under the names weir loads by: Mixtral's read as Qwen3-MoE's, GraniteMoE's
    stacked experts cut into each expert's (gpu/models/moe.py), the families' own names read as
    weir's (gpu/models/renames.py: GLM-4's norms as Gemma's, ...)."""
    for name, t in tensors:
        name = checkpoint_name(name)
        # (GLM-4's norms, Hunyuan's Q/K norms, StarCoder2's, Phi-2's and Apertus's names)
        name = renames.checkpoint_name(GGUF_ARCHES.get(arch, ""), name)
        if STACKED.match(name):
            yield from cut_stacked(name, t)
        else:
            yield name, t


def _stacked_experts(
    tensors: Iterator[tuple[str, np.ndarray]], count: int
) -> Iterator[tuple[str, np.ndarray]]:
    """The checkpoint's tensors with each layer's experts of a product stacked into one
    [experts, rows, columns] tensor (mlp.experts.gate_proj: gguf_names.py), as llama.cpp's
    converter stacks them (the names already weir's: _weir_names)."""
    held: dict[str, dict[int, np.ndarray]] = {}
    for name, t in tensors:
        found = re.fullmatch(r"(.*\.mlp\.experts\.)(\d+)\.(.*)", name)
        if found is None:
            yield name, t
            continue
        stacked = found[1] + found[3]
        held.setdefault(stacked, {})[int(found[2])] = t
        if len(held[stacked]) == count:
            parts = held.pop(stacked)
            yield stacked, np.stack([parts[e] for e in range(count)])
    if held:
        raise ValueError(f"gguf_write: incomplete experts {sorted(held)[:3]}")


def metadata_writer(
    out: Path, config: dict, tokenizer_dir: Path, arch: str | None = None
) -> tuple[gguf.GGUFWriter, str]:
    """A writer with `config`'s metadata and `tokenizer_dir`'s tokenizer, no tensors yet."""
    arch = arch or ARCHES.get((config.get("architectures") or [""])[0])
    if arch is None:
        raise ValueError(f"gguf_write: no GGUF architecture for {config.get('architectures')}")
    rope = config.get("rope_parameters") or {}
    local = {"rope_theta": 10000.0}
    if "full_attention" in rope:  # a rotation per layer type (Gemma 3, OLMo 3)
        local = rope.get("sliding_attention", local)
        rope = rope["full_attention"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kind = rope.get("rope_type", "default")
    if hunyuan.ntk_alpha_base(rope, head_dim) is not None:
        kind = "default"  # Hunyuan's NTK alpha: a plain rotation of a stretched base
    if config.get("rope_scaling") or kind not in (
        "default",
        "yarn",
        *["longrope"] * (arch == "phi3"),
    ):
        raise ValueError("gguf_write: rope scaling is not written but YaRN (and Phi-3's LongRoPE)")
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(out.stem)
    w.add_context_length(config.get("max_position_embeddings", 4096))
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(config.get("num_key_value_heads") or heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    base = float(rope.get("rope_theta") or config.get("rope_theta") or 10000.0)
    w.add_rope_freq_base(hunyuan.ntk_alpha_base(rope, head_dim) or base)  # (Hunyuan's stretched)
    # a layer norm's epsilon, by its config's key (StarCoder2's window is not written: llama.cpp
    # attends to the whole context)
    eps = dict.fromkeys(("command-r", "cohere2", "phi2", "stablelm"), "layer_norm_eps")
    eps |= {"nemotron": "norm_eps", "starcoder2": "norm_epsilon"}
    if arch in eps:
        w.add_layer_norm_eps(float(config[eps[arch]]))
    elif arch == "olmo":  # (its layer norms' epsilon is fixed) and its clip_qkv
        w.add_layer_norm_eps(1e-5)
        if config.get("clip_qkv"):
            w.add_clamp_kqv(float(config["clip_qkv"]))
    else:
        w.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    if arch == "stablelm":
        w.add_parallel_residual(bool(config.get("use_parallel_residual")))
    if arch in ("command-r", "cohere2"):  # Cohere's logits' factor, its window
        w.add_logit_scale(float(config["logit_scale"]))
        if config.get("sliding_window"):
            w.add_sliding_window(config["sliding_window"])
    w.add_vocab_size(config["vocab_size"])
    if kind == "yarn":  # as llama.cpp's converter writes it (llama.cpp derives the rest)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rope["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    if arch == "gemma3":
        _gemma3_keys(w, config, local, head_dim)
    if arch == "exaone4" and config.get("sliding_window"):  # as llama.cpp's converter writes it
        w.add_sliding_window(config["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in config["layer_types"]])
    if arch == "olmo2" and config.get("sliding_window"):  # OLMo 3
        _window_keys(w, config, local)
    if arch == "gemma2":
        _gemma2_keys(w, config, head_dim)
    if arch in ("qwen2vl", "qwen3vl"):  # a vision-language model's sections (one over text)
        w.add_rope_dimension_sections([head_dim // 8, head_dim * 3 // 16, head_dim * 3 // 16, 0])
    if arch == "mistral3":  # Ministral 3's YaRN and temperature, as llama.cpp's converter writes
        w.add_rope_scaling_yarn_beta_fast(float(rope["beta_fast"]))
        w.add_rope_scaling_yarn_beta_slow(float(rope["beta_slow"]))
        w.add_rope_scaling_yarn_log_mul(float(rope["mscale_all_dim"]))
        w.add_attn_temperature_scale(float(rope["llama_4_scaling_beta"]))
    if arch in ("granite", "granitemoe"):  # its four factors, as llama.cpp's converter names them
        w.add_attention_scale(float(config["attention_multiplier"]))
        w.add_embedding_scale(float(config["embedding_multiplier"]))
        w.add_residual_scale(float(config["residual_multiplier"]))
        w.add_logit_scale(float(config["logits_scaling"]))
    if arch == "phi3":  # as llama.cpp's converter writes Phi-3 (its factors are tensors)
        w.add_sliding_window(config.get("sliding_window") or 0)
        original = rope.get("original_max_position_embeddings")
        w.add_rope_scaling_orig_ctx_len(original or config.get("max_position_embeddings", 4096))
        if kind == "longrope":
            w.add_rope_scaling_attn_factors(_longrope_attention_factor(config, original))
    count = config.get("num_local_experts") or config.get("num_experts")
    if count:  # a mixture of experts (Qwen3-MoE's experts have their own size)
        w.add_expert_count(count)
        w.add_expert_used_count(config["num_experts_per_tok"])
        if config.get("moe_intermediate_size"):
            w.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if arch in ("qwen2moe", "olmoe") and config.get("norm_topk_prob"):
            # llama.cpp never renormalizes their chosen experts' weights
            raise ValueError(f"gguf_write: a {arch} file cannot say norm_topk_prob")
        if arch == "qwen2moe":
            w.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    write_tokenizer(w, tokenizer_dir, config)
    return w, arch


def _gemma3_keys(w: gguf.GGUFWriter, config: dict, local: dict, head_dim: int) -> None:
    """Gemma 3's window, its pattern (one flag per layer), the sliding layers' rotation base; its
    attention scale has no key (llama.cpp derives it), so a model whose query_pre_attn_scalar
    is not the one llama.cpp derives cannot be written."""
    n, heads = config["num_hidden_layers"], config["num_attention_heads"]
    derived = config["hidden_size"] // heads if n == 62 else head_dim
    if config.get("query_pre_attn_scalar", derived) != derived:
        raise ValueError(f"gguf_write: query_pre_attn_scalar must be {derived} in a GGUF file")
    _window_keys(w, config, local)


def _window_keys(w: gguf.GGUFWriter, config: dict, local: dict) -> None:
    """The window, its pattern (one flag per layer), the sliding layers' rotation base."""
    types = config.get("layer_types") or []
    w.add_sliding_window(config.get("sliding_window") or 0)
    w.add_sliding_window_pattern([t == "sliding_attention" for t in types])
    w.add_rope_freq_base_swa(float(local.get("rope_theta", 10000.0)))


def _gemma2_keys(w: gguf.GGUFWriter, config: dict, head_dim: int) -> None:
    """Gemma 2's window and soft caps; llama.cpp derives its layer pattern (every other layer
    sliding, the first one) and its attention scale, so a model with others cannot be
    written."""
    n, heads = config["num_hidden_layers"], config["num_attention_heads"]
    derived = config["hidden_size"] // heads if n == 46 else head_dim
    if config.get("query_pre_attn_scalar", derived) != derived:
        raise ValueError(f"gguf_write: query_pre_attn_scalar must be {derived} in a GGUF file")
    types = config.get("layer_types") or []
    pattern = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    if types and types != pattern:
        raise ValueError("gguf_write: a Gemma 2 file's layers alternate, the first one sliding")
    w.add_sliding_window(config.get("sliding_window") or 0)
    for key, add in (
        ("attn_logit_softcapping", w.add_attn_logit_softcapping),
        ("final_logit_softcapping", w.add_final_logit_softcapping),
    ):
        if config.get(key):
            add(float(config[key]))


def _longrope_attention_factor(config: dict, original: int) -> float:
    scale = config.get("max_position_embeddings", original) / original
    return math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0


def _checkpoint(hf_dir: Path) -> Iterator[tuple[str, np.ndarray]]:
    from safetensors import safe_open

    for file in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name).float().numpy()
