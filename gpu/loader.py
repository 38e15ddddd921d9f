"""Model loading: a local directory or a hub id, config via AutoConfig, weights via safetensors."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from gpu.models.decoder import DecoderForCausalLM
from gpu.models.rope import Rope
from gpu.models.spec import ModelSpec
from gpu.dist.parallel import TensorParallel, shard

log = logging.getLogger("weir.loader")

DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def resolve_model_path(model: str, revision: str | None = None) -> Path:
    """A local directory as is; anything else is a hub id fetched with huggingface_hub."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"model path {model!r} is not a directory")
    if model.startswith(("/", "./", "../", "~")) or model.count("/") > 1:
        raise ValueError(f"model directory {model!r} does not exist")
    from huggingface_hub import snapshot_download

    try:
        local = snapshot_download(
            model,
            revision=revision,
            allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"],
        )
    except Exception as e:  # noqa: BLE001 - re-raised with what the user needs to know
        raise ValueError(
            f"could not find model {model!r}: not a local directory, and the hub download "
            f"failed ({type(e).__name__}: {e})"
        ) from e
    return Path(local)


def load_config(path: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def resolve_dtype(dtype: str, config: Any, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}")
        return DTYPES[dtype]
    cfg = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(cfg, str):
        cfg = DTYPES.get(cfg)
    if cfg not in (torch.float32, torch.bfloat16, torch.float16):
        cfg = torch.float32
    if device.type == "cpu" and cfg == torch.float16:
        return torch.bfloat16  # half matmuls are slow or missing on CPU
    return cfg


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors weights in {path}")
    return files


def load_weights(model: DecoderForCausalLM, path: Path) -> None:
    """Every parameter from the checkpoint by name; under tensor parallelism only this rank's
    part of each tensor is read (a safetensors slice, gpu/dist/parallel.py `shard`)."""
    params = dict(model.named_parameters())
    tp = model.tp
    loaded: set[str] = set()
    files = weight_files(path)
    with tqdm(total=len(params), desc="Loading weights", unit="tensor", leave=False) as bar:
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    target = params.get(name)
                    if target is None:
                        if name == "lm_head.weight" and model.spec.tie_word_embeddings:
                            continue
                        if name.endswith("rotary_emb.inv_freq"):
                            continue
                        raise ValueError(f"unexpected weight {name!r} in {file.name}")
                    if tp is None:
                        tensor = f.get_tensor(name)
                    else:
                        tensor = shard(name, f.get_slice(name), model.spec, tp)
                    if tensor.shape != target.shape:
                        raise ValueError(
                            f"weight {name!r} has shape {tuple(tensor.shape)}, "
                            f"model expects {tuple(target.shape)}"
                        )
                    with torch.no_grad():
                        target.copy_(tensor)
                    loaded.add(name)
                    bar.update(1)
    missing = set(params) - loaded
    if missing:
        raise ValueError(f"weights missing from the checkpoint: {sorted(missing)[:5]}")


def load_model(
    path: Path,
    config: Any,
    dtype: torch.dtype,
    device: torch.device,
    backend,
    tp: TensorParallel | None = None,
) -> DecoderForCausalLM:
    """The model built on `backend` (gpu/backend.py), its weights read and prepared."""
    spec = ModelSpec.from_hf_config(config)
    with torch.device("meta"):
        model = DecoderForCausalLM(spec, backend, tp)
    model = model.to(dtype).to_empty(device=device)
    load_weights(model, path)
    model.prepare()
    model.rope = Rope(config, spec.head_dim, device)
    return model.eval()


def eos_token_ids(path: Path, config: Any) -> set[int]:
    """EOS ids from the config and from generation_config.json (which may list several)."""
    ids: set[int] = set()

    def add(v: Any) -> None:
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, list):
            ids.update(x for x in v if isinstance(x, int))

    add(getattr(config, "eos_token_id", None))
    gen = path / "generation_config.json"
    if gen.exists():
        add(json.loads(gen.read_text()).get("eos_token_id"))
    return ids
