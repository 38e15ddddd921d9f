"""Build an EngineCore from an EngineConfig: find and load the model, size the KV cache."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.config import EngineConfig
from core.engine_core import EngineCore
from gpu import kv_cache
from gpu.attention.backend import get_backend
from gpu.loader import eos_token_ids, load_config, load_model, resolve_dtype, resolve_model_path
from gpu.models.decoder import DecoderForCausalLM
from gpu.parallel import TensorParallel
from gpu.runner import ModelRunner

log = logging.getLogger("weir.launch")


@dataclass
class Loaded:
    core: EngineCore
    tokenizer: Any  # transformers PreTrainedTokenizerFast (chat templates, encode)
    model_path: Path
    served_names: list[str]
    max_model_len: int
    generation_defaults: dict[str, Any]
    kv_dtype: str = ""  # the KV cache's element type (--kv-cache-dtype)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load(config: EngineConfig) -> Loaded:
    """Load the model (or, with --tensor-parallel-size N, start N workers that each load their
    share: gpu/executor.py) and build the engine core over it."""
    from transformers import AutoTokenizer

    config.validate()
    path, default_name = model_path(config)
    device = resolve_device(config.device)
    hf_config = load_config(path)
    dtype = resolve_dtype(config.dtype, hf_config, device)
    kv_dtype = str(kv_cache.cache_dtype(config.kv_cache_dtype, dtype)).removeprefix("torch.")
    tokenizer = AutoTokenizer.from_pretrained(path)
    eos = eos_token_ids(path, hf_config)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    if config.tensor_parallel_size > 1:
        from gpu.executor import Executor

        runner = Executor.launch(config, path, hf_config, device, eos)
        num_blocks, max_model_len = runner.num_blocks, runner.max_model_len
        where = f"{config.tensor_parallel_size} ranks on {runner.device_names}"
    else:
        torch.manual_seed(config.seed)
        set_threads(config, hf_config, device)
        model, num_blocks = load_shard(config, path, hf_config, dtype, device)
        max_model_len = fit_model_len(config, model.spec.max_position_embeddings, num_blocks)
        runner = build_runner(config, model, num_blocks, max_model_len, dtype, device, eos)
        where = f"{device}, {torch.get_num_threads()} threads" if device.type == "cpu" else device
    core = EngineCore(
        runner,
        tokenizer.backend_tokenizer,
        num_blocks=num_blocks,
        block_size=config.block_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_model_len,
        eos_token_ids=eos,
        check_integrity=config.check_integrity,
        enable_prefix_caching=config.enable_prefix_caching,
        scheduling_policy=config.scheduling_policy,
        max_logprobs=config.max_logprobs,
    )
    log.info(
        "loaded %s on %s (%s): %d KV blocks of %d tokens (%s), max_model_len %d",
        path,
        where,
        str(dtype).removeprefix("torch."),
        num_blocks,
        config.block_size,
        kv_dtype,
        max_model_len,
    )
    defaults = generation_defaults(path, config.generation_config)
    if defaults:
        log.info("sampling defaults from the generation config: %s", defaults)
    return Loaded(
        core,
        tokenizer,
        path,
        config.served_model_name or [default_name],
        max_model_len,
        defaults,
        kv_dtype,
    )


def model_path(config: EngineConfig) -> tuple[Path, str]:
    """The model's local directory (the built-in tiny model when none is named) and its name."""
    if config.model is None:
        from gpu.tiny_model import TINY_NAME, ensure_tiny_model

        return ensure_tiny_model(), TINY_NAME
    return resolve_model_path(config.model, config.revision), config.model


def set_threads(config: EngineConfig, hf_config: Any, device: torch.device, ranks: int = 1) -> None:
    """torch's intra-op threads on CPU: --cpu-threads (0: auto), shared out among `ranks`
    processes on one machine. Process-wide: the engine is torch's only user."""
    if device.type != "cpu":
        return
    if config.cpu_threads is not None:
        threads = config.cpu_threads or auto_threads(hf_config)
    elif ranks > 1:
        threads = torch.get_num_threads()
    else:
        return
    torch.set_num_threads(max(1, threads // ranks))


def load_shard(
    config: EngineConfig,
    path: Path,
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallel | None = None,
) -> tuple[DecoderForCausalLM, int]:
    """The model (under `tp`, this rank's share of it) and how many KV blocks fit beside it."""
    model = load_model(path, hf_config, dtype, device, tp)
    num_blocks = kv_cache.num_blocks_for(
        model.local_spec,  # the KV heads this rank caches
        config.block_size,
        kv_cache.cache_dtype(config.kv_cache_dtype, dtype),
        device,
        num_kv_blocks=config.num_kv_blocks,
        kv_cache_memory=config.kv_cache_memory,
        gpu_memory_utilization=config.gpu_memory_utilization,
    )
    return model, num_blocks


def fit_model_len(config: EngineConfig, max_positions: int, num_blocks: int, rank: int = 0) -> int:
    """--max-model-len (or the model's own), cut to what the KV cache holds (said once: by
    rank 0 under tensor parallelism)."""
    capacity = num_blocks * config.block_size
    max_model_len = config.max_model_len or max_positions
    if max_model_len > capacity and rank == 0:
        log.warning(
            "max_model_len %d exceeds the KV cache (%d tokens); using %d",
            max_model_len,
            capacity,
            capacity,
        )
    return min(max_model_len, capacity)


def build_runner(
    config: EngineConfig,
    model: DecoderForCausalLM,
    num_blocks: int,
    max_model_len: int,
    dtype: torch.dtype,
    device: torch.device,
    eos: set[int],
) -> ModelRunner:
    """The KV cache of `num_blocks` blocks and the runner over it, with its CUDA graphs
    captured for contexts up to `max_model_len`."""
    kv_dtype = kv_cache.cache_dtype(config.kv_cache_dtype, dtype)
    caches = kv_cache.allocate(model.local_spec, num_blocks, config.block_size, kv_dtype, device)
    runner = ModelRunner(
        model,
        caches,
        config.block_size,
        get_backend(config.attention_backend, device),
        device,
        seed=config.seed,
    )
    if device.type == "cuda" and not config.enforce_eager and runner.backend.graph_safe:
        from gpu.cuda_graph import DecodeGraphs, default_capture_sizes

        runner.graphs = DecodeGraphs(
            model,
            caches,
            runner.backend,
            device,
            config.block_size,
            max_model_len,
            default_capture_sizes(config.max_num_seqs),
        )
        runner.graphs.capture()
    runner.eos_token_ids = eos
    return runner


# Weights a token multiplies through (per layer: Q/K/V/O and the MLP) from which every core is
# worth giving to the model rather than leaving one to the HTTP event loop.
AUTO_ALL_CORES_WEIGHTS = 4_000_000


def auto_threads(hf_config: Any) -> int:
    """--cpu-threads auto. The engine's matrix products and the event loop's HTTP work share the
    cores; which should yield depends on how big a forward is. Measured on 2 cores, servers
    alternated: a 3-layer model of 0.6M weights per token served 25-30% more tokens/s at 16 and
    64 streams with 1 torch thread than with 2; a 6-layer one of 17M, 11-23% more at 1-64
    streams with 2 (docs/benchmarks.md); a 77M one, 19% more at 16 with 2."""
    usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    cores = len(usable) if usable else os.cpu_count() or 1
    h = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    d = getattr(hf_config, "head_dim", None) or h // heads
    q, kv = heads * d, getattr(hf_config, "num_key_value_heads", heads) * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * hf_config.intermediate_size
    weights = hf_config.num_hidden_layers * per_layer
    return cores if weights >= AUTO_ALL_CORES_WEIGHTS else max(1, cores - 1)


# generation_config.json keys that become request defaults, as vLLM applies them.
_GENERATION_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def generation_defaults(model_path: Path, setting: str) -> dict[str, Any]:
    """Sampling defaults a request falls back to when it leaves a field unset."""
    if setting == "vllm":
        return {}
    folder = model_path if setting == "auto" else Path(setting).expanduser()
    file = folder / "generation_config.json"
    if not file.exists():
        if setting != "auto":
            raise ValueError(f"--generation-config: no generation_config.json in {folder}")
        return {}
    data = json.loads(file.read_text())
    return {
        ours: data[theirs]
        for theirs, ours in _GENERATION_KEYS.items()
        if data.get(theirs) is not None
    }
