"""GLM (GlmForCausalLM: glm-4-9b-chat-hf, GLM-Edge) and GLM-4 (Glm4ForCausalLM: GLM-4-9B-0414,
GLM-Z1), where they differ from Llama, and where weir computes each difference:

- Q/K/V have biases and O none (spec.NO_O_BIAS); gate and up are one tensor, `gate_up_proj`,
  cut at load as Phi-3's is (gpu/fused_weights.py).
- Half of each head (partial_rotary_factor) turns, by adjacent pairs: Q/K heads reordered at
  load (gpu/models/partial_rope.py, `interleaved`) for the kernels' rotation by halves.
- GLM-4's layer normalizes each block's output before its residual add, and the MLP's input:
  Gemma's sandwich (gpu/models/gemma.py; its norm weights plain, not 1 + w), whose norms GLM-4
  names otherwise: `checkpoint_name` reads them as the sandwich's.
"""

from __future__ import annotations

import re

# GLM-4's norm -> the sandwich layer's: after attention, before the MLP, after the MLP (GLM-4's
# post_attention_layernorm is the MLP's input norm, as in Llama; its name is taken last)
_NORMS = {
    "post_self_attn_layernorm": "post_attention_layernorm",
    "post_attention_layernorm": "pre_feedforward_layernorm",
    "post_mlp_layernorm": "post_feedforward_layernorm",
}
_NORM = re.compile(r"\.(" + "|".join(_NORMS) + r")\.")


def checkpoint_name(name: str) -> str:
    """A GLM-4 checkpoint tensor's name as weir's modules load it."""
    return _NORM.sub(lambda m: f".{_NORMS[m.group(1)]}.", name, count=1)
