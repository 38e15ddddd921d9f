"""GGUF's names for a decoder's tensors (as llama.cpp's convert_hf_to_gguf.py writes them) and the
Hugging Face names weir's modules load by, both ways; and llama.cpp's order of Llama's Q/K rows."""

from __future__ import annotations

import numpy as np

# The GGUF architectures weir serves -> the Hugging Face class (gpu/models/spec.py ARCHITECTURES)
ARCHES = {
    "llama": "LlamaForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

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
}
# Phi-3's fused layers (gpu/fused_weights.py): Q/K/V as one tensor, gate and up as llama.cpp's
# ffn_up of twice the rows
FUSED_NAMES = {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER_HF = {v: k for k, v in LAYER_NAMES.items()}
_FUSED_HF = {v: k for k, v in FUSED_NAMES.items()}
_TOP_HF = {v: k for k, v in TOP_NAMES.items()}


def gguf_name(hf_name: str) -> str:
    """model.layers.3.mlp.up_proj.weight -> blk.3.ffn_up.weight."""
    stem, _, kind = hf_name.rpartition(".")
    if stem in TOP_NAMES:
        return f"{TOP_NAMES[stem]}.{kind}"
    parts = stem.split(".")
    layer = ".".join(parts[3:])
    if parts[:2] == ["model", "layers"] and layer in {**LAYER_NAMES, **FUSED_NAMES}:
        return f"blk.{parts[2]}.{LAYER_NAMES.get(layer) or FUSED_NAMES[layer]}.{kind}"
    raise ValueError(f"no GGUF name for {hf_name!r}")


def hf_name(name: str, fused: bool = False) -> str | None:
    """blk.3.ffn_up.weight -> model.layers.3.mlp.up_proj.weight (`fused`, Phi-3's file:
    mlp.gate_up_proj; attn_qkv -> self_attn.qkv_proj); None for a tensor weir has no module
    for."""
    stem, _, kind = name.rpartition(".")
    if stem in _TOP_HF:
        return f"{_TOP_HF[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    layer = (_FUSED_HF.get(parts[2]) if fused else None) or _LAYER_HF.get(parts[2])
    return None if layer is None else f"model.layers.{parts[1]}.{layer}.{kind}"


def llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """Llama's Q/K rows reordered as llama.cpp's converter does (its rotation pairs adjacent
    elements; Hugging Face's pairs the two halves of each head)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def llama_unpermute_index(rows: int, heads: int) -> np.ndarray:
    """The row order that undoes llama_permute: hf = gguf[index]."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)
