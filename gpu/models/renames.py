"""The architectures whose checkpoints name some tensors otherwise than weir's modules, and how
the loader reads each name (gpu/loader.py): GLM-4's norms, Hunyuan's Q/K norms, Granite 4's
shared_mlp, StarCoder2's MLP. (Mixtral's and GraniteMoE's experts are gpu/models/moe.py's
checkpoint_name, read for every architecture.)"""

from __future__ import annotations

from gpu.models import glm, granite, hunyuan

def starcoder2(name: str) -> str:
    """StarCoder2's MLP: c_fc and c_proj, weir's up_proj and down_proj."""
    return name.replace(".mlp.c_fc.", ".mlp.up_proj.").replace(".mlp.c_proj.", ".mlp.down_proj.")


RENAMES = {
    "Glm4ForCausalLM": glm.checkpoint_name,
    "HunYuanDenseV1ForCausalLM": hunyuan.checkpoint_name,
    "GraniteMoeHybridForCausalLM": granite.checkpoint_name,
    "Starcoder2ForCausalLM": starcoder2,
}


def checkpoint_name(architecture: str, name: str) -> str:
    """A checkpoint tensor's name as weir's modules of `architecture` load it."""
    rename = RENAMES.get(architecture)
    return name if rename is None else rename(name)
