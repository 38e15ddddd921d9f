"""Model loading: a local directory or a hub id, config via AutoConfig, weights via safetensors."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from gpu.cpu import forward as cpu_forward, gemm as cpu_gemm, onednn as cpu_linear, norm as cpu_norm
from gpu.cpu import build as cpu_build
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


def cpu_matmul() -> str:
    """Which kernel runs the CPU float32 products: "weir" (gpu/cpu/gemm.py) or "onednn"
    (gpu/cpu/onednn.py); WEIR_CPU_MATMUL overrides the default, for A/B benchmarks."""
    choice = os.environ.get("WEIR_CPU_MATMUL", "weir")
    if choice not in ("weir", "onednn"):
        raise ValueError(f"WEIR_CPU_MATMUL must be weir or onednn, not {choice!r}")
    return choice


def load_model(
    path: Path,
    config: Any,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallel | None = None,
) -> DecoderForCausalLM:
    spec = ModelSpec.from_hf_config(config)
    with torch.device("meta"):
        model = DecoderForCausalLM(spec, tp)
    model = model.to(dtype).to_empty(device=device)
    load_weights(model, path)
    if device.type == "cuda":
        # One launch instead of three (and two) per layer. Not on CPU: there the fused gate/up
        # product measured ~5% slower per step on the 77M benchmark model, Q/K/V no faster.
        model.fuse_projections()
    elif cpu_linear.usable(dtype):
        # Q/K/V as one product: with 2 KV heads of 64 the K and V weights (512x128) are too
        # small to pack and ran on MKL, which is slow on AMD; fused they are one packed
        # 512x768 product. 6-layer Llama (hidden 512), decode step on a 2-core Zen 5: 64 rows
        # 12.7 -> 12.0 ms, 1 row 3.7 -> 3.0 ms (Q/K/V/O products 2.2 -> 1.7 ms and 0.83 ->
        # 0.57 ms). Gate/up stay apart: PackedGatedMLP applies the activation as a post-op.
        for layer in model.model.layers:
            layer.self_attn.fuse()
        # Packed weights. An untied lm_head too; a tied one stays the embedding's plain weight
        # (packing it would hold the matrix twice).
        # weir's kernel (gpu/cpu/gemm.py): 6-layer Llama, 2-core AVX-512 Xeon, engine alone,
        # alternated with oneDNN: 1 stream 258-264 vs 165-171 tok/s, 16 streams 1,355-1,504 vs
        # 1,141-1,387, 64 streams 2,078-2,195 vs 2,020-2,075 (docs/benchmarks.md).
        # oneDNN: decode step at batch 64 on the 77M benchmark model 107 -> 82 ms, its
        # prefill 14.4 -> 11.2 s against MKL (A/B in one process).
        try:
            packed = cpu_matmul() == "weir" and cpu_gemm.use_gemm(model)
        except cpu_build.BuildError as e:
            log.warning("CPU matmul kernel unavailable, using oneDNN: %s", e)
            packed = False
        if not packed:
            cpu_linear.pack_linears(model)
        # RMSNorm and Q/K norm + rotation in one pass per row: 77M benchmark model, offline
        # workload A/B in one process: see gpu/cpu/norm.py.
        cpu_norm.use_kernels(model)
        # Then, when every layer runs on those kernels, the layer stack as one compiled call.
        cpu_forward.attach(model)
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
