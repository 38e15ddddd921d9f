"""gpt-oss (GptOssForCausalLM) as transformers computes it, where it differs from the decoder's
other models: the pieces `moe.py`, `decoder.py` and the loader take from here.

- Attention: Q/K/V and O with biases; a learned logit per head ("sinks") joins each softmax's
  sum and gives no value (the attention backends' `sinks`); every other layer sliding.
- The mixture: the router has a bias; the softmax of the top k logits weights the chosen
  experts (the renormalized softmax the mixture already computes); each expert's products have
  biases and its activation is a clamped SwiGLU, (up + 1) * gate * sigmoid(alpha * gate), gate
  clamped above at the limit and up on both sides (`swiglu`).
- The checkpoint holds each layer's experts fused: `mlp.experts.gate_up_proj` [E, hidden,
  2 * inter] (input-major, gate and up interleaved by column), `gate_up_proj_bias` [E, 2 * inter],
  `down_proj` [E, inter, hidden], `down_proj_bias` [E, hidden], and `mlp.router` for the router.
  `Experts` cuts them into each expert's gate_proj / up_proj / down_proj weights ([out, in],
  as the modules load them) and biases; OpenAI's released files hold the experts' weights
  in MXFP4 (`_blocks` and `_scales`, gpu/quant/mxfp4.py), held as ggml's MXFP4 blocks.
- The experts' gate and up run as one plain product (the backends' gated pairs know SiLU and
  GELU, not this activation), their biases kept apart and added by each row's expert
  (`prepare_experts`), so every weight format a product takes serves them.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch

from core.config import CheckpointError
from gpu.quant import mxfp4
from gpu.quant.formats import FORMATS
from gpu.quant.tensor import BlockTensor

FUSED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?$")
MXFP4_PART = re.compile(r"^(.*\.mlp\.experts\.(?:gate_up_proj|down_proj))_(blocks|scales)$")


def checkpoint_name(name: str) -> str:
    """gpt-oss's router (`mlp.router`) under the mixture's name for it (`mlp.gate`)."""
    return name.replace(".mlp.router.", ".mlp.gate.")


def is_experts_tensor(name: str) -> bool:
    return FUSED_EXPERTS.match(name) is not None or MXFP4_PART.match(name) is not None


class Experts:
    """Reads a checkpoint's fused experts tensors (`add`, as the loader meets them, in any
    order across files): each expert's tensors, named as the modules load them."""

    def __init__(self) -> None:
        self.halves: dict[str, dict[str, torch.Tensor]] = {}  # MXFP4's blocks or scales so far

    def add(self, name: str, value: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        found = MXFP4_PART.match(name)
        if found is None:
            return _cut(name, value, transposed=True)
        fused, half = found.groups()
        got = self.halves.setdefault(fused, {})
        got[half] = value
        if len(got) < 2:
            return []
        del self.halves[fused]
        # [E, out, G, 16] -> each expert's [out, in] weight in ggml's MXFP4 blocks (mxfp4.py)
        blocks, scales = got["blocks"], got["scales"]
        if blocks.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
            raise CheckpointError(f"{fused}: MXFP4 blocks {tuple(blocks.shape)} and scales "
                                  f"{tuple(scales.shape)} do not match")  # fmt: skip
        rows = mxfp4.to_ggml(blocks.numpy(), scales.numpy())
        n, k = blocks.shape[1], blocks.shape[2] * 32
        fmt = FORMATS["mxfp4"]
        return _cut(fused, [BlockTensor(rows[e], fmt, (n, k)) for e in range(len(rows))], False)

    def check_complete(self) -> None:
        for fused, got in self.halves.items():
            missing = "scales" if "blocks" in got else "blocks"
            raise CheckpointError(f"{fused}: MXFP4 {next(iter(got))} without its {missing}")


def _cut(name: str, value, transposed: bool) -> list[tuple[str, Any]]:
    """[E, ...] (a tensor, or a list of each expert's BlockTensor) -> each expert's weight [out,
    in] (`transposed`: stored [in, out], as the bf16 parameters are) or bias; gate/up's rows (or
    bias) alternate gate, up."""
    prefix, kind, bias = FUSED_EXPERTS.match(name).groups()
    out = []
    for e in range(len(value)):
        t = value[e].t() if transposed and not bias else value[e]
        what = "bias" if bias else "weight"
        if kind == "down_proj":
            out.append((f"{prefix}.{e}.down_proj.{what}", _rows(t, None)))
            continue
        out.append((f"{prefix}.{e}.gate_proj.{what}", _rows(t, 0)))
        out.append((f"{prefix}.{e}.up_proj.{what}", _rows(t, 1)))
    return out


def _rows(t, start: int | None):
    """Every row of `t` (start None), or every other one from `start`, as its own copy."""
    if isinstance(t, BlockTensor):
        return t if start is None else t.take_rows(np.arange(start, t.shape[0], 2))
    return (t if start is None else t[start::2]).contiguous()


def prepare_experts(backend, experts) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert's gate and up as one plain product (gate's outputs first) and down as one, in
    the backend's form; their biases apart: (gate/up's [E, 2 inter], down's [E, hidden])."""
    gate_up, down = [], []
    for expert in experts:
        (wg, bg), (wu, bu), (wd, bd) = (
            expert.gate_proj.take(),
            expert.up_proj.take(),
            expert.down_proj.take(),
        )
        expert.gate_up = backend.prepare_stacked([(wg, None), (wu, None)])
        expert.down = backend.prepare_linear(wd, None)
        del expert.gate_proj, expert.up_proj, expert.down_proj
        gate_up.append(torch.cat([bg, bu]))
        down.append(bd)
    # where the activations are, in their dtype (the checkpoint's biases are read on the CPU)
    return backend.dense(torch.stack(gate_up)), backend.dense(torch.stack(down))


def swiglu(h: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's activation of [rows, 2 inter] (gate's half first, then up's)."""
    gate, up = h.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def experts_forward(moe, rows: torch.Tensor, experts: torch.Tensor, used, sizes) -> torch.Tensor:
    """The chosen experts' outputs for `rows` (ordered by expert; `experts`: each row's)."""
    b = moe.backend
    gate_up_bias, down_bias = moe.expert_biases
    h = b.experts(rows, [moe.experts[i].gate_up for i in used], sizes, gated=False)
    h = swiglu(h + gate_up_bias.index_select(0, experts), *moe.swiglu)
    y = b.experts(h, [moe.experts[i].down for i in used], sizes, gated=False)
    return y + down_bias.index_select(0, experts)


def gguf_config(get, common: dict, head_dim: int):
    """A GptOssConfig as llama.cpp reads a `gpt-oss` GGUF file (gpu/gguf_file.py: `get` reads its
    metadata, `common` the fields every architecture shares): the experts' size and count, the
    window on every other layer from the first, YaRN's betas; the activation's limit and alpha
    are llama.cpp's constants, transformers' defaults (7.0, 1.702)."""
    from transformers import GptOssConfig

    a = "gpt-oss"
    n = common["num_hidden_layers"]
    window = int(get(f"{a}.attention.sliding_window", 0) or 0)
    rope = dict(common.pop("rope_parameters"))
    if rope.get("rope_type") == "yarn":  # as gpt-oss's own config: the ramp's ends not rounded
        rope.update(
            beta_fast=float(get(f"{a}.rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(get(f"{a}.rope.scaling.yarn_beta_slow", 1.0)),
            truncate=False,
        )
    common["intermediate_size"] = int(get(f"{a}.expert_feed_forward_length"))
    return GptOssConfig(
        **common,
        head_dim=head_dim,
        rope_parameters=rope,
        num_local_experts=int(get(f"{a}.expert_count")),
        num_experts_per_tok=int(get(f"{a}.expert_used_count")),
        sliding_window=window or None,
        layer_types=[
            "sliding_attention" if i % 2 == 0 and window else "full_attention" for i in range(n)
        ],
    )
