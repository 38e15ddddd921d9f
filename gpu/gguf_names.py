"""GGUF's names for a decoder's tensors (as llama.cpp's convert_hf_to_gguf.py writes them) and the
Hugging Face names weir's modules load by, both ways; and llama.cpp's order of Llama's Q/K rows."""

from __future__ import annotations

import numpy as np

# The GGUF architectures weir serves -> the Hugging Face class (gpu/models/spec.py ARCHITECTURES)
ARCHES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

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
TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER_HF = {v: k for k, v in LAYER_NAMES.items()}
_TOP_HF = {v: k for k, v in TOP_NAMES.items()}


def gguf_name(hf_name: str) -> str:
    """model.layers.3.mlp.up_proj.weight -> blk.3.ffn_up.weight."""
    stem, _, kind = hf_name.rpartition(".")
    if stem in TOP_NAMES:
        return f"{TOP_NAMES[stem]}.{kind}"
    parts = stem.split(".")
    if parts[:2] == ["model", "layers"] and ".".join(parts[3:]) in LAYER_NAMES:
        return f"blk.{parts[2]}.{LAYER_NAMES['.'.join(parts[3:])]}.{kind}"
    raise ValueError(f"no GGUF name for {hf_name!r}")


def hf_name(name: str) -> str | None:
    """blk.3.ffn_up.weight -> model.layers.3.mlp.up_proj.weight; None for a tensor weir has no
    module for."""
    stem, _, kind = name.rpartition(".")
    if stem in _TOP_HF:
        return f"{_TOP_HF[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_HF:
        return f"model.layers.{parts[1]}.{_LAYER_HF[parts[2]]}.{kind}"
    return None


def llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """Llama's Q/K rows reordered as llama.cpp's converter does (its rotation pairs adjacent
    elements; Hugging Face's pairs the two halves of each head)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def llama_unpermute_index(rows: int, heads: int) -> np.ndarray:
    """The row order that undoes llama_permute: hf = gguf[index]."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)
