"""The architectures whose checkpoints name some tensors otherwise than weir's modules, and how
the loader reads each name (gpu/loader.py): GLM-4's norms, Hunyuan's Q/K norms, Granite 4's
shared_mlp, StarCoder2's MLP, Phi-2's products and final norm, Apertus's norms. (Mixtral's and
GraniteMoE's experts are gpu/models/moe.py's checkpoint_name, read for every architecture.)"""

from __future__ import annotations

from gpu.models import glm, granite, hunyuan

def starcoder2(name: str) -> str:
    """StarCoder2's MLP: c_fc and c_proj, weir's up_proj and down_proj."""
    return name.replace(".mlp.c_fc.", ".mlp.up_proj.").replace(".mlp.c_proj.", ".mlp.down_proj.")


def phi(name: str) -> str:
    """Phi-2's: dense, fc1, fc2 and final_layernorm, weir's o_proj, up, down and norm."""
    name = name.replace(".self_attn.dense.", ".self_attn.o_proj.")
    name = name.replace(".mlp.fc1.", ".mlp.up_proj.").replace(".mlp.fc2.", ".mlp.down_proj.")
    return name.replace("model.final_layernorm.", "model.norm.")


def apertus(name: str) -> str:
    """Apertus's norms: attention_layernorm and feedforward_layernorm, weir's input and
    post-attention norms."""
    name = name.replace(".attention_layernorm.", ".input_layernorm.")
    return name.replace(".feedforward_layernorm.", ".post_attention_layernorm.")


RENAMES = {
    "Glm4ForCausalLM": glm.checkpoint_name,
    "HunYuanDenseV1ForCausalLM": hunyuan.checkpoint_name,
    "GraniteMoeHybridForCausalLM": granite.checkpoint_name,
    "Starcoder2ForCausalLM": starcoder2,
    "PhiForCausalLM": phi,
    "ApertusForCausalLM": apertus,
}


def checkpoint_name(architecture: str, name: str) -> str:
    """A checkpoint tensor's name as weir's modules of `architecture` load it."""
    rename = RENAMES.get(architecture)
    return name if rename is None else rename(name)
