"""An encoder checkpoint (BERT, RoBERTa, XLM-RoBERTa, MPNet: gpu/models/encoder.py; ModernBERT:
gpu/models/modernbert.py; NomicBERT and GTE: gpu/models/nomic.py; JinaBERT: gpu/models/jina.py)
read into its model, from safetensors or a GGUF file as llama.cpp's converter writes it
(gpu/gguf_encoder.py). Fused products are cut as they are read: NomicBERT's and GTE's Q/K/V in
three, GTE's up_gate_proj and JinaBERT's gated_layers in two.

Its tensors load by name as a decoder's do (gpu/loader.py `Targets`), once a classifier's
`bert.` / `roberta.` / `model.` prefix is dropped and older checkpoints' LayerNorm `gamma` /
`beta` are read as `weight` / `bias`. What no served path reads is skipped by name: pretraining
heads (`cls.`, `lm_head.`, a ModernBERT embedder's masked-LM `head.` and `decoder.`) and, in an
embedding model, BERT's pooler; any other tensor the model does not have is refused, as is a
tensor it needs that the checkpoint lacks.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from core.config import CheckpointError
from gpu.gguf_file import GgufCheckpoint, is_gguf
from gpu.loader import Targets, weight_files
from gpu.models.encoder import EncoderModel
from gpu.models.encoder_spec import EncoderSpec
from gpu.models.jina import JinaBertModel
from gpu.models.modernbert import ModernBertModel
from gpu.models.nomic import NomicBertModel
from gpu.quant.tensor import BlockTensor

# a classifier's encoder (ModernBERT's: model.)
PREFIXES = ("bert.", "roberta.", "mpnet.", "nomic_bert.", "model.", "new.")
# MPNet's attention under BERT's names (its Q/K/V/O in `attention.attn`, its norm one up)
MPNET_NAMES = {
    ".attention.attn.q.": ".attention.self.query.",
    ".attention.attn.k.": ".attention.self.key.",
    ".attention.attn.v.": ".attention.self.value.",
    ".attention.attn.o.": ".attention.output.dense.",
    ".attention.LayerNorm.": ".attention.output.LayerNorm.",
}
# NomicBERT's own layout (the hub's) under transformers 5's names (its fused Q/K/V is cut in
# three as it is read: _tensors)
NOMIC_NAMES = {
    "encoder.layers.": "layers.",
    "emb_ln.": "embeddings.LayerNorm.",
    ".attn.out_proj.": ".self_attn.o_proj.",
    ".mlp.fc11.": ".mlp.up_proj.",
    ".mlp.fc12.": ".mlp.gate_proj.",
    ".mlp.fc2.": ".mlp.down_proj.",
    ".norm1.": ".post_attention_layernorm.",
    ".norm2.": ".post_mlp_layernorm.",
}
# GTE's (the "new" remote code's) under the same names; its fused Q/K/V (weight and bias) is
# cut in three and its up_gate_proj in two (up, then gate) as they are read
GTE_NAMES = {
    "encoder.layer.": "layers.",
    ".attention.qkv_proj.": ".attn.Wqkv.",
    ".attention.q_proj.": ".self_attn.q_proj.",
    ".attention.k_proj.": ".self_attn.k_proj.",
    ".attention.v_proj.": ".self_attn.v_proj.",
    ".attention.o_proj.": ".self_attn.o_proj.",
    ".attn_ln.": ".post_attention_layernorm.",
    ".mlp_ln.": ".post_mlp_layernorm.",
}
# JinaBERT's MLP under the names of its model's (its gated_layers cut in two: gate, then up)
JINA_NAMES = {".mlp.wo.": ".mlp.down_proj."}
MODELS = {
    "modernbert": ModernBertModel,
    "nomic": NomicBertModel,
    "gte": NomicBertModel,
    "jina": JinaBertModel,
}
PRETRAINING = ("cls.", "lm_head.")  # masked-LM and next-sentence heads
BUFFERS = ("embeddings.position_ids", "embeddings.token_type_ids")  # saved by older versions


def checkpoint_name(stored: str, spec: EncoderSpec) -> str | None:
    """The model's name for the checkpoint tensor `stored`, or None: a tensor no path reads."""
    name = stored
    for prefix in PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    if name.startswith(PRETRAINING) or name in BUFFERS or ".rotary_emb." in name:
        return None  # (GTE's remote code may save its rotation's tables)
    if name.startswith("pooler.") and spec.head != "bert":
        return None  # an embedding model's pooler (only BERT's classifier reads it)
    if name.startswith(("head.", "decoder.")) and spec.family == "modernbert" and not spec.head:
        return None  # a ModernBERT embedder saved with its masked-LM head
    if spec.family == "mpnet":
        for theirs, ours in MPNET_NAMES.items():
            name = name.replace(theirs, ours)
    names = {"nomic": NOMIC_NAMES, "gte": GTE_NAMES, "jina": JINA_NAMES}.get(spec.family, {})
    for theirs, ours in names.items():
        name = name.replace(theirs, ours)
    if name.endswith(".gamma"):
        return name[: -len("gamma")] + "weight"
    if name.endswith(".beta"):
        return name[: -len("beta")] + "bias"
    return name


def load_encoder(
    path: Path, config: Any, dtype: torch.dtype, device: torch.device, backend
) -> EncoderModel | ModernBertModel | NomicBertModel | JinaBertModel:
    """The encoder built on `backend`, its weights read and prepared (in `dtype` unless the
    backend keeps them as the checkpoint holds them)."""
    spec = EncoderSpec.from_hf_config(config)
    if getattr(config, "quantization_config", None):
        raise CheckpointError(f"{spec.architecture}: quantized encoder checkpoints are not served")
    compute = backend.bind(device, dtype)
    with torch.device("meta"):
        model = MODELS.get(spec.family, EncoderModel)(spec, backend)
    model = model.to(compute).to_empty(device=device)
    targets = Targets(model)
    for name, value in _tensors(path, spec):
        if name is not None and targets.wants(name):
            if name in targets.params and isinstance(value, BlockTensor):
                value = value.dequantize()  # a 16-bit table, held by a torch module
            targets.place(name, value)
    if spec.head == "bge_m3":
        for name, value in _m3_heads(path):
            targets.place(name, value)
    targets.check_complete()
    model.prepare()
    return model.eval()


def _tensors(path: Path, spec: EncoderSpec) -> Iterator[tuple[str | None, Any]]:
    """(the model's name, or None: not read; the tensor) of a safetensors checkpoint or a GGUF
    file (gpu/gguf_file.py: its names already the model's, block formats as BlockTensors)."""
    if not is_gguf(path):
        for file in weight_files(path):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for stored in f.keys():
                    name = checkpoint_name(stored, spec)
                    if name is not None and name.endswith(".mlp.gated_layers.weight"):
                        yield from _halves(name, f.get_tensor(stored))  # (gate first)
                    elif name is None or spec.family not in ("nomic", "gte"):
                        yield name, f.get_tensor(stored)
                    elif ".attn.Wqkv." in name:  # cut in three (ModernBERT's stays whole)
                        yield from _thirds(name, f.get_tensor(stored))
                    elif name.endswith(".mlp.up_gate_proj.weight"):
                        up, gate = f.get_tensor(stored).chunk(2)  # (GTE's: up, then gate)
                        yield name.replace("up_gate_proj", "up_proj"), up
                        yield name.replace("up_gate_proj", "gate_proj"), gate
                    else:
                        yield name, f.get_tensor(stored)
        return
    ckpt = GgufCheckpoint(path)
    for name, value in ckpt.weights():
        if spec.family == "nomic" and name.endswith(".attn.Wqkv.weight"):  # cut in three
            yield from _thirds(name, value)
            continue
        if name.endswith(".mlp.gated_layers.weight"):  # (JinaBERT's: gate rows, then up)
            yield from _halves(name, value)
            continue
        rows = spec.position_rows
        if name == "embeddings.position_embeddings.weight" and value.shape[0] < rows:
            # llama.cpp's converter leaves out RoBERTa's first pad + 1 rows (never read)
            if isinstance(value, BlockTensor):
                value = value.dequantize()
            value = torch.cat([value.new_zeros(rows - value.shape[0], value.shape[1]), value])
        yield name, value
    ckpt.close()


def _thirds(name: str, value: Any) -> Iterator[tuple[str, Any]]:
    """NomicBERT's (and GTE's) fused Q/K/V (layers.N.attn.Wqkv, a weight or a bias) as its
    three products'."""
    stem, kind = name.split("attn.Wqkv.")
    n = value.shape[0] // 3
    for i, part in enumerate("qkv"):
        if isinstance(value, BlockTensor):
            rows = value.take_rows(np.arange(i * n, (i + 1) * n))
        else:
            rows = value[i * n : (i + 1) * n]
        yield f"{stem}self_attn.{part}_proj.{kind}", rows


def _halves(name: str, value: Any) -> Iterator[tuple[str, Any]]:
    """JinaBERT's gate and up product (mlp.gated_layers: gate rows, then up) as its two."""
    n = value.shape[0] // 2
    for i, part in enumerate(("gate_proj", "up_proj")):
        if isinstance(value, BlockTensor):
            rows = value.take_rows(np.arange(i * n, (i + 1) * n))
        else:
            rows = value[i * n : (i + 1) * n]
        yield name.replace("gated_layers", part), rows


def _m3_heads(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """BGE-M3's sparse and ColBERT heads, the folder's sparse_linear.pt and colbert_linear.pt
    (state dicts, read as weights only)."""
    for head in ("sparse_linear", "colbert_linear"):
        file = Path(path) / f"{head}.pt"
        if not file.exists():
            raise CheckpointError(f"BgeM3EmbeddingModel: {file.name} is not in {path}")
        state = torch.load(file, map_location="cpu", weights_only=True)
        for kind in ("weight", "bias"):
            if kind not in state:
                raise CheckpointError(f"{file.name} has no {kind}")
            yield f"{head}.{kind}", state[kind]
