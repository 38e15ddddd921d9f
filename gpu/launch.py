"""Build an EngineCore from an EngineConfig: the model (here, or in tensor-parallel workers),
its KV cache and runner, the tokenizer and the request defaults."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.config import EngineConfig
from core.engine_core import EngineCore
from gpu import kv_cache
from gpu.assemble import (
    build_runner,
    fit_model_len,
    load_shard,
    model_path,
    resolve_device,
    set_threads,
)
from gpu.loader import eos_token_ids, load_config, resolve_dtype

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


def load(config: EngineConfig) -> Loaded:
    """Load the model (or, with --tensor-parallel-size N, start N workers that each load their
    share: gpu/dist/executor.py) and build the engine core over it."""
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
        from gpu.dist.executor import Executor

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
