"""A sentence-transformers folder's Dense modules (modules.json: Transformer, Pooling, then Dense
layers, as LaBSE's tanh projection or stella's 1,024-wide one): each a linear product with its
activation, applied to a pooled vector (and to every row of vLLM's token_embed) before
Matryoshka truncation and normalization, as sentence-transformers and vLLM apply them. Read
from the module folder's model.safetensors (or pytorch_model.bin, weights only) into float32;
an activation other than torch.nn's Identity, Tanh, ReLU, GELU, Sigmoid or SiLU is refused by
name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from core.config import CheckpointError

ACTIVATIONS = {
    "Identity": nn.Identity,
    "Tanh": nn.Tanh,
    "ReLU": nn.ReLU,
    "GELU": nn.GELU,
    "Sigmoid": nn.Sigmoid,
    "SiLU": nn.SiLU,
}


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def dense_folders(model_path: Path) -> list[Path]:
    """The folders of modules.json's Dense modules, in order (none for a GGUF file, or a folder
    without them)."""
    modules = _json(Path(model_path) / "modules.json") if Path(model_path).is_dir() else None
    if not isinstance(modules, list):
        return []
    dense = [m for m in modules if isinstance(m, dict) and str(m.get("type", "")).endswith("Dense")]
    return [Path(model_path) / str(m.get("path", "")) for m in dense]


def load_projector(model_path: Path, device: torch.device) -> nn.Sequential | None:
    """The Dense modules as one float32 projection on `device`, or None where there are none."""
    layers: list[nn.Module] = []
    for folder in dense_folders(model_path):
        config = _json(folder / "config.json") or {}
        try:
            sizes = int(config["in_features"]), int(config["out_features"])
            linear = nn.Linear(*sizes, bool(config.get("bias", True)))
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{folder}: a Dense module without its sizes") from None
        state = _weights(folder)
        try:
            linear.load_state_dict({k.removeprefix("linear."): v for k, v in state.items()})
        except RuntimeError as e:
            raise CheckpointError(f"{folder}: its weights do not fit its config ({e})") from None
        name = str(config.get("activation_function") or "torch.nn.Identity").rsplit(".", 1)[-1]
        if name not in ACTIVATIONS:
            raise CheckpointError(
                f"{folder}: the Dense module's activation_function {name!r} is not served "
                f"(torch.nn's {', '.join(ACTIVATIONS)})"
            )
        layers += [linear, ACTIVATIONS[name]()]
    if not layers:
        return None
    return nn.Sequential(*layers).float().to(device).eval()


def projected_size(model_path: Path, hidden: int) -> int:
    """The size of a vector as it leaves: the last Dense module's, else the model's."""
    folders = dense_folders(model_path)
    if not folders:
        return hidden
    return int((_json(folders[-1] / "config.json") or {}).get("out_features", hidden))


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / "model.safetensors").exists():
        from safetensors.torch import load_file

        return load_file(str(folder / "model.safetensors"))
    if (folder / "pytorch_model.bin").exists():
        return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise CheckpointError(f"{folder}: a Dense module without its weights")


class Projection:
    """What the pooler (gpu/pooler.py) puts over an embedding: `pooled` over a pooled vector,
    `tokens` over token_embed's rows (the Dense modules both; BGE-M3's ColBERT head the rows
    only)."""

    def __init__(self, pooled=None, tokens=None) -> None:
        self.pooled, self.tokens = pooled, tokens


def projection(model_path: Path, model: nn.Module, device: torch.device) -> Projection | None:
    """The model's Projection, or None where it has none."""
    dense = load_projector(model_path, device)
    colbert = getattr(model, "colbert_linear", None)
    if dense is None and colbert is None:
        return None
    return Projection(dense, colbert if colbert is not None else dense)
