"""Granite 4.0's transformer-only models (GraniteMoeHybridForCausalLM whose layers are all
attention and which has no experts: granite-4.0-micro, -1b, -350m): Granite 3's layer (its four
factors: gpu/models/spec_families.py), its MLP under the name `shared_mlp` with gate and up one
tensor (`input_linear`, gate's rows first) and down as `output_linear`. `checkpoint_name` reads
them as the decoder's (gate and up then cut as Phi-3's are: gpu/fused_weights.py). A checkpoint
with Mamba layers or experts is refused by name (spec_families.granite4)."""

from __future__ import annotations

_MLP = ((".shared_mlp.input_linear.", ".mlp.gate_up_proj."),
        (".shared_mlp.output_linear.", ".mlp.down_proj."))  # fmt: skip


def checkpoint_name(name: str) -> str:
    for old, new in _MLP:
        name = name.replace(old, new)
    return name
