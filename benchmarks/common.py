"""Shared helpers for the benchmarks: the benchmark model, result files, machine description."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"

# Qwen3-shaped, ~77M parameters with the small benchmark vocabulary (hidden 768, 12 layers,
# 12 query heads, 4 KV heads, MLP 2048): big enough on CPU that compute matters.
BENCH_SHAPES = {
    "qwen3-100m": dict(
        hidden_size=768,
        num_layers=12,
        num_heads=12,
        num_kv_heads=4,
        intermediate_size=2048,
        vocab_size=2048,
        max_position_embeddings=4096,
    ),
    # Qwen3-0.6B's shape with random bf16 weights (GPU benchmarks; ~1.2 GB on disk).
    "qwen3-0.6b": dict(
        hidden_size=1024,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=3072,
        vocab_size=2048,
        model_vocab_size=151936,
        max_position_embeddings=40960,
        dtype="bfloat16",
        # Streamed text for every token (TTFT and ITL are per text event).
        zero_padding_rows=True,
    ),
    "qwen3-1layer": dict(
        hidden_size=128,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=384,
        vocab_size=2048,
        max_position_embeddings=4096,
    ),
    # The 6-layer shape of the CPU peer comparisons (hidden 512, 8 heads of 64, 2 KV heads,
    # MLP 1,408), Qwen3-shaped as Qwen3-Embedding is.
    "qwen3-6layer": dict(
        hidden_size=512,
        num_layers=6,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=1408,
        vocab_size=2048,
        max_position_embeddings=4096,
    ),
    "qwen3-3layer": dict(
        hidden_size=128,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=384,
        vocab_size=2048,
        max_position_embeddings=4096,
    ),
}

# The 6-layer Llama the CPU peer comparisons use (issues 18 and 22): the same shape, with
# `<|endoftext|>` as a second EOS since llama.cpp stops on that token whatever the model says.
BENCH_SHAPES["llama-6layer"] = dict(
    BENCH_SHAPES["qwen3-6layer"], arch="llama", extra_eos=("<|endoftext|>",)
)


def bench_model(name: str) -> str:
    """A random-weight model directory for a named benchmark shape, built once into the cache,
    or `name` itself when it is a path or hub id."""
    if name not in BENCH_SHAPES:
        return name
    from gpu.cache import cache_dir
    from gpu.tiny_model import build_tiny_model

    # the shape in the name: a changed shape builds a new directory
    digest = hashlib.sha1(json.dumps(BENCH_SHAPES[name], sort_keys=True).encode()).hexdigest()
    path = cache_dir() / f"bench-{name}-{digest[:8]}"
    if not (path / "config.json").exists():
        tmp = path.with_name(path.name + ".tmp")
        shape = dict(BENCH_SHAPES[name])
        build_tiny_model(tmp, shape.pop("arch", "qwen3"), **shape)
        tmp.rename(path)
    return str(path)


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        commit = ""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "gpu": gpu,
        "commit": commit,
        "torch": torch.__version__,
    }


def save(name: str, data: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2))
    return path
