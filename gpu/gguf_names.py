"""GGUF's names for a decoder's tensors (as llama.cpp's convert_hf_to_gguf.py writes them) and the
Hugging Face names weir's modules load by, both ways; and llama.cpp's order of Llama's Q/K rows."""

from __future__ import annotations

import numpy as np

# The GGUF architectures weir serves -> the Hugging Face class (gpu/models/spec.py ARCHITECTURES)
ARCHES = {
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    # the text model of Qwen2-VL and Qwen2.5-VL, and of Qwen3-VL (llama.cpp's mmproj file holds
    # the vision tower): over text their sectioned rotation is Qwen2's and Qwen3's
    "qwen2vl": "Qwen2ForCausalLM",
    "qwen3vl": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
    "olmo2": "Olmo2ForCausalLM",  # an "olmo2" file with a window is OLMo 3 (gpu/gguf_file.py)
    "olmoe": "OlmoeForCausalLM",
    "granite": "GraniteForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "glm4": "Glm4ForCausalLM",  # (its Q/K rows as the checkpoint's: llama.cpp turns adjacent pairs)
    "ernie4_5": "Ernie4_5ForCausalLM",  # (so too)
    # Ministral 3, and Mistral 3's text model (a file without attention.temperature_scale: its
    # Mistral Small 3.x, served as Mistral)
    "mistral3": "Ministral3ForCausalLM",
    "exaone4": "Exaone4ForCausalLM",
    # Cohere's (its Q/K rows as the checkpoint's: llama.cpp turns adjacent pairs; one norm a layer)
    "seed_oss": "SeedOssForCausalLM",  # (its Q/K rows as the checkpoint's)
    "command-r": "CohereForCausalLM",
    "cohere2": "Cohere2ForCausalLM",
    # (its Q/K rows as the checkpoint's; the rotation's base stretched by alpha already)
    "hunyuan-dense": "HunYuanDenseV1ForCausalLM",
    "arcee": "ArceeForCausalLM",  # (Llama's file, ffn_up and ffn_down alone)
    # (its Q/K rows as the checkpoint's: llama.cpp turns halves; its norms' 1 + w and biases)
    "nemotron": "NemotronForCausalLM",
    "starcoder2": "Starcoder2ForCausalLM",  # (its Q/K rows as the checkpoint's; no window)
    "phi2": "PhiForCausalLM",  # (so too; its LM head's bias: output.bias)
    "stablelm": "StableLmForCausalLM",  # (its Q/K rows as the checkpoint's)
    # (so too; its xIELU's parameters as metadata arrays: gpu/gguf_file.py)
    "apertus": "ApertusForCausalLM",
    "olmo": "OlmoForCausalLM",  # (no norm tensors: its norms have no weights)
    # an encoder (gpu/models/encoder.py): BERT, or XLM-RoBERTa / RoBERTa by its vocabulary
    # (gpu/gguf_config.py `encoder`)
    "bert": "BertModel",
    "modern-bert": "ModernBertModel",
    "nomic-bert": "NomicBertModel",  # (nomic-embed-text's: Ollama's own embedder)
    "jina-bert-v2": "JinaBertModel",  # (jina-embeddings-v2's: gpu/models/jina.py)
}
# A "llama" file with experts is a Mixtral (llama.cpp's converter writes it so).
# The architectures whose Q/K rows llama.cpp's converter reorders (its LlamaModel's and its
# subclasses': llama_permute)
PERMUTED = ("llama", "granite", "granitemoe", "smollm3", "mistral3", "arcee", "olmo")

# HF module names (under model.layers.N.) -> GGUF's (under blk.N.)
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    # a mixture of experts (gpu/models/moe.py): its router, and each product's experts as one
    # 3-D tensor [experts, rows, columns] (mlp.experts.gate_proj: weir's name for that stack)
    "mlp.gate": "ffn_gate_inp",
    "mlp.experts.gate_proj": "ffn_gate_exps",
    "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps",
    # Qwen2-MoE's shared expert and its gate (a vector of the hidden size in llama.cpp's files)
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
}
# Phi-3's fused layers (gpu/fused_weights.py): Q/K/V as one tensor, gate and up as llama.cpp's
# ffn_up of twice the rows
FUSED_NAMES = {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
# Gemma 3's norms (gpu/models/gemma.py): after attention, and before and after the MLP
SANDWICH_NAMES = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_NAMES = {  # an architecture's layer names where they are not Llama's
    "phi3": {**LAYER_NAMES, **FUSED_NAMES, "mlp.up_proj": None, "mlp.gate_proj": None},
    "gemma2": {**LAYER_NAMES, **SANDWICH_NAMES},
    "gemma3": {**LAYER_NAMES, **SANDWICH_NAMES},
    # GLM-4: Gemma's sandwich (gpu/models/glm.py), gate and up one tensor as Phi-3's
    "glm4": {
        **LAYER_NAMES,
        **SANDWICH_NAMES,
        **FUSED_NAMES,
        "self_attn.qkv_proj": None,
        "mlp.up_proj": None,
        "mlp.gate_proj": None,
    },
    # gpt-oss (gpu/models/gpt_oss.py): its norm before the mixture, its sinks (a vector per
    # layer, `attn_sinks.weight` in the file), each expert stack's biases [experts, rows]
    # OLMo 2 and 3: norms after attention and after the MLP, none before them
    "olmo2": {
        **LAYER_NAMES,
        "input_layernorm": None,
        "post_attention_layernorm": "post_attention_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    },
    # Seed-OSS: its MLP's input norm under the name llama.cpp's converter maps it to
    "seed_oss": {**LAYER_NAMES, "post_attention_layernorm": "post_attention_norm"},
    "exaone4": {  # OLMo 2's layer
        **LAYER_NAMES,
        "input_layernorm": None,
        "post_attention_layernorm": "post_attention_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    },
    "gpt-oss": {
        **LAYER_NAMES,
        "post_attention_layernorm": "post_attention_norm",
        "self_attn.sinks": "attn_sinks",
    },
}
TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_TOP_HF = {v: k for k, v in TOP_NAMES.items()}
# An encoder's (llama.cpp's "bert"): GGUF's names -> transformers' (under encoder.layer.N.)
ENCODER_TOP = {
    "token_embd": "embeddings.word_embeddings",
    "position_embd": "embeddings.position_embeddings",
    "token_types": "embeddings.token_type_embeddings",
    "token_embd_norm": "embeddings.LayerNorm",
    # a RoBERTa-family classifier's head (a reranker's: bge-reranker): dense, tanh, out_proj
    "cls": "classifier.dense",
    "cls.output": "classifier.out_proj",
}
# ModernBERT's (llama.cpp's "modern-bert"), under layers.N.; its classifier's head as `cls`
# (dense), `cls.norm` and `cls.output`
MODERNBERT_TOP = {
    "token_embd": "embeddings.tok_embeddings",
    "token_embd_norm": "embeddings.norm",
    "output_norm": "final_norm",
    "cls": "head.dense",
    "cls.norm": "head.norm",
    "cls.output": "classifier",
}
MODERNBERT_LAYER = {
    "attn_norm": "attn_norm",
    "attn_qkv": "attn.Wqkv",
    "attn_output": "attn.Wo",
    "ffn_norm": "mlp_norm",
    "ffn_up": "mlp.Wi",
    "ffn_down": "mlp.Wo",
}
# NomicBERT's (llama.cpp's "nomic-bert"), under layers.N.; its fused Q/K/V under nomic's own
# name, which gpu/encoder_loader.py cuts in three
NOMIC_TOP = {
    "token_embd": "embeddings.word_embeddings",
    "token_types": "embeddings.token_type_embeddings",
    "token_embd_norm": "embeddings.LayerNorm",
}
NOMIC_LAYER = {
    "attn_qkv": "attn.Wqkv",
    "attn_output": "self_attn.o_proj",
    "attn_output_norm": "post_attention_layernorm",
    "ffn_up": "mlp.up_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_down": "mlp.down_proj",
    "layer_output_norm": "post_mlp_layernorm",
}
ENCODER_LAYER = {
    "attn_q": "attention.self.query",
    "attn_k": "attention.self.key",
    "attn_v": "attention.self.value",
    "attn_output": "attention.output.dense",
    "attn_output_norm": "attention.output.LayerNorm",
    "ffn_up": "intermediate.dense",
    "ffn_down": "output.dense",
    "layer_output_norm": "output.LayerNorm",
}


# JinaBERT's (llama.cpp's "jina-bert-v2"), under encoder.layer.N.: BERT's attention; its fused
# gate and up product (ffn_up, gate rows first) under the checkpoint's own name, which
# gpu/encoder_loader.py cuts in two
JINA_LAYER = {
    **ENCODER_LAYER,
    "ffn_up": "mlp.gated_layers",
    "ffn_down": "mlp.down_proj",
    "layer_output_norm": "mlp.layernorm",
}


def _layer_names(arch: str) -> dict[str, str]:
    names = _NAMES.get(arch, LAYER_NAMES)
    return {k: v for k, v in names.items() if v is not None}


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    """model.layers.3.mlp.up_proj.weight -> blk.3.ffn_up.weight (Phi-3's fused layers and
    Gemma 3's norms by their own names)."""
    stem, _, kind = hf_name.rpartition(".")
    if stem in TOP_NAMES:
        return f"{TOP_NAMES[stem]}.{kind}"
    parts = stem.split(".")
    names = _layer_names(arch)
    if parts[:2] == ["model", "layers"] and ".".join(parts[3:]) in names:
        return f"blk.{parts[2]}.{names['.'.join(parts[3:])]}.{kind}"
    raise ValueError(f"no GGUF name for {hf_name!r}")


def hf_name(name: str, arch: str = "llama") -> str | None:
    """blk.3.ffn_up.weight -> model.layers.3.mlp.up_proj.weight (a Phi-3 file's ffn_up:
    mlp.gate_up_proj; an encoder's: encoder.layer.3.intermediate.dense.weight); None for a
    tensor weir has no module for."""
    stem, _, kind = name.rpartition(".")
    if arch in ("bert", "modern-bert", "nomic-bert", "jina-bert-v2"):
        top, layers, under = (ENCODER_TOP, ENCODER_LAYER, "encoder.layer")
        if arch == "jina-bert-v2":
            layers = JINA_LAYER
        if arch == "modern-bert":
            top, layers, under = (MODERNBERT_TOP, MODERNBERT_LAYER, "layers")
        if arch == "nomic-bert":
            top, layers, under = (NOMIC_TOP, NOMIC_LAYER, "layers")
        parts = stem.split(".")
        if stem in top:
            return f"{top[stem]}.{kind}"
        layer = layers.get(parts[-1]) if len(parts) == 3 and parts[0] == "blk" else None
        return f"{under}.{parts[1]}.{layer}.{kind}" if layer and parts[1].isdigit() else None
    if stem in _TOP_HF:
        return f"{_TOP_HF[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3].isdigit():
        # an early Mixtral file's experts, one tensor each (blk.0.ffn_gate.3), as llama.cpp
        # still reads them
        proj = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
        if parts[2] in proj:
            return f"model.layers.{parts[1]}.mlp.experts.{parts[3]}.{proj[parts[2]]}.{kind}"
        return None
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    layer = {v: k for k, v in _layer_names(arch).items()}.get(parts[2])
    if layer == "self_attn.sinks":  # a parameter of its own, not a module's weight
        return f"model.layers.{parts[1]}.{layer}"
    return None if layer is None else f"model.layers.{parts[1]}.{layer}.{kind}"


def expert_name(stacked: str, expert: int) -> str:
    """One expert's name in a stack's: model.layers.3.mlp.experts.up_proj.weight, 5 ->
    model.layers.3.mlp.experts.5.up_proj.weight."""
    return stacked.replace(".mlp.experts.", f".mlp.experts.{expert}.")


def llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """Llama's Q/K rows reordered as llama.cpp's converter does (its rotation pairs adjacent
    elements; Hugging Face's pairs the two halves of each head)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def llama_unpermute_index(rows: int, heads: int) -> np.ndarray:
    """The row order that undoes llama_permute: hf = gguf[index]."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)
