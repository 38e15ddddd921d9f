"""Hunyuan's dense models (HunYuanDenseV1ForCausalLM: Hunyuan-0.5B to -7B-Instruct), where they
differ from Llama, and where weir computes each difference:

- Q and K are normalized per head *after* their rotation (`query_layernorm`, `key_layernorm`):
  spec.qk_norm_after_rope, in decoder.Attention and in the one-call CPU stack (forward.cpp).
  (A norm's weight does not commute with the rotation, so the order matters.)
- The rotation's base is stretched by NTK's alpha: rope_theta * alpha ** (d / (d - 2)) for a
  head of d, fixed (the checkpoints call it "dynamic"; transformers gives it a kind of its own);
  `ntk_alpha_base`, read by gpu/models/rope.py. llama.cpp's converter writes the stretched base.
- `checkpoint_name` reads the norms' names as the decoder's q_norm and k_norm.
"""

from __future__ import annotations

from typing import Any

_NORMS = ((".self_attn.query_layernorm.", ".self_attn.q_norm."),
          (".self_attn.key_layernorm.", ".self_attn.k_norm."))  # fmt: skip


def checkpoint_name(name: str) -> str:
    for old, new in _NORMS:
        name = name.replace(old, new)
    return name


def ntk_alpha_base(params: dict[str, Any], head_dim: int) -> float | None:
    """The stretched base of a "dynamic" rotation with an alpha (None: not Hunyuan's kind)."""
    if params.get("rope_type") != "dynamic" or not params.get("alpha"):
        return None
    return float(params["rope_theta"]) * float(params["alpha"]) ** (head_dim / (head_dim - 2))
