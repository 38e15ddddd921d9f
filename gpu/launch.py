"""Build an EngineCore from an EngineConfig: the model (here, or in tensor-parallel workers),
its KV cache and runner, the tokenizer and the request defaults."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch

from core.config import CheckpointError, EngineConfig
from core.engine_core import EngineCore
from core.pooling import KINDS, ModelPooling, model_activations
from core.speculative import SpeculativeConfig
from gpu import gguf_tokenizer, kv_cache, kv_scales
from gpu.cache import cache_dir
from gpu.draft import DraftModel, load_draft
from gpu.assemble import (
    build_runner,
    fit_model_len,
    load_shard,
    model_path,
    resident_weights,
    resolve_device,
    served_positions,
    set_threads,
    speculative_config,
)
from gpu.gguf_file import GgufCheckpoint, is_gguf
from gpu.loader import eos_token_ids, int4_scheme, load_config, resolve_dtype
from gpu.st_dense import projected_size, projection
from gpu.models.encoder_spec import PER_TOKEN_HEADS, EncoderSpec, encoder_architecture

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
    tokenizer_path: str = ""  # the Hugging Face tokenizer folder the server loads
    weight_bytes: dict[str, int] | None = None  # resident weight bytes by format
    kv_cache_bytes: int = 0
    device: str = ""  # where the model runs: cpu, cuda (the device's type)
    lora_base: Any = None  # core/lora.py LoraBase: the shapes an adapter must fit (--enable-lora)
    labels: list[str] | None = None  # a sequence classifier's, by index (None: a causal LM)
    score_template: str | None = None  # a reranker's prompt for its pairs (core/score_pairs.py)
    pooling: ModelPooling | None = None  # the model's own pooling facts (a GGUF file's kind)


def resolve_async(config: EngineConfig, device: torch.device) -> bool:
    """--async-scheduling, or by default on for a CUDA device with one rank."""
    if config.async_scheduling is not None:
        return config.async_scheduling
    return (
        device.type == "cuda"
        and config.tensor_parallel_size == 1
        and config.speculative_config is None
    )


def load_draft_of(config: EngineConfig, dtype: torch.dtype, device: torch.device, hf_config):
    """The draft model of a draft_model speculative config (gpu/draft.py), else None."""
    if not config.speculative_config:
        return None
    spec = SpeculativeConfig.parse(config.speculative_config)
    if spec.method != "draft_model":
        return None
    return load_draft(config, spec.model, dtype, device, hf_config)


def load(config: EngineConfig) -> Loaded:
    """Load the model (or, with --tensor-parallel-size N, start N workers that each load their
    share: gpu/dist/executor.py) and build the engine core over it."""
    config.validate()
    path, default_name = model_path(config)
    device = resolve_device(config.device)
    hf_config = load_config(path, config.hf_overrides, config.tokenizer)
    check_quantization(config, path, hf_config)
    check_encoder(config, hf_config)
    pooling = model_pooling(hf_config)
    dtype = resolve_dtype(config.dtype, hf_config, device)
    kv_t = kv_cache.cache_dtype(config.kv_cache_dtype, dtype, device)  # refused before loading
    kv_dtype = config.kv_cache_dtype  # as given (vLLM's cache_config_info); auto by its dtype
    if kv_dtype == "auto":
        kv_dtype = kv_cache.dtype_name(kv_t)
    tokenizer, tokenizer_path = load_tokenizer(config, path, hf_config)
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
        draft = load_draft_of(config, dtype, device, hf_config)
        model, num_blocks = load_shard(config, path, hf_config, dtype, device, draft=draft)
        positions = served_positions(path, model.spec.max_position_embeddings)
        if draft is not None:
            positions = min(positions, draft.spec.max_position_embeddings)
        max_model_len = fit_model_len(config, positions, num_blocks)
        runner = build_runner(config, model, num_blocks, max_model_len, dtype, device, eos)
        runner.projector = projection(path, model, device)
        if draft is not None:
            caches = kv_cache.allocate(
                draft.local_spec, num_blocks, config.block_size, kv_t, device
            )
            kv_scales.use(draft, kv_t in kv_cache.FP8)
            runner.draft = DraftModel(draft, caches, config.block_size, device)
            if runner.graphs is not None:
                runner.draft.capture_graphs(
                    max_model_len,
                    runner.graphs.sizes,
                    runner.verify_graphs.sizes if runner.verify_graphs else [],
                    speculative_config(config, device).num_speculative_tokens,
                )
        where = f"{device}, {torch.get_num_threads()} threads" if device.type == "cpu" else device
    size = projected_size(path, pooling.hidden_size)  # (the vectors' size: Dense modules')
    pooling = msgspec.structs.replace(pooling, hidden_size=size)
    core = EngineCore(
        runner,
        tokenizer.backend_tokenizer,
        num_blocks=num_blocks,
        block_size=config.block_size,
        max_num_seqs=config.max_num_seqs,
        # an encoder runs each input whole: a step holds the longest
        max_num_batched_tokens=max(
            config.max_num_batched_tokens, max_model_len if runner.pooling_only else 0
        ),
        max_model_len=max_model_len,
        eos_token_ids=eos,
        check_integrity=config.check_integrity,
        enable_prefix_caching=config.enable_prefix_caching,
        scheduling_policy=config.scheduling_policy,
        max_logprobs=config.max_logprobs,
        max_beam_width=config.max_beam_width,
        max_loras=config.max_loras if config.enable_lora else 0,
        async_scheduling=resolve_async(config, device),
        speculative=speculative_config(config, device),
    )
    weights = resident_weights(model) if config.tensor_parallel_size == 1 else {}
    kv_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in runner.kv_caches) if weights else 0
    cache = f"KV cache {num_blocks} blocks of {config.block_size} tokens ({kv_dtype}, "
    cache += f"{kv_bytes / 1e9:.2f} GB)"
    if runner.pooling_only:
        cache = "an encoder: no KV cache, each input whole in a step"
    log.info(
        "loaded %s on %s: weights %s; %s, max_model_len %d",
        path,
        where,
        ", ".join(f"{GB(b)} {fmt}" for fmt, b in sorted(weights.items())) or "(in the workers)",
        cache,
        max_model_len,
    )
    lora_base = None
    if config.enable_lora:
        from gpu.lora import base_of
        from gpu.models.spec import ModelSpec

        lora_base = base_of(ModelSpec.from_hf_config(hf_config))
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
        tokenizer_path,
        weights,
        kv_bytes,
        device.type,
        lora_base,
        classifier_labels(hf_config, runner.num_labels),
        getattr(hf_config, "weir_rerank_template", None),  # a GGUF reranker's (gguf_config.py)
        pooling,
    )


def model_pooling(hf_config: Any) -> ModelPooling:
    """The model's own pooling facts: a GGUF file's pooling_type (or JinaBERT's config's
    emb_pooler); an encoder pools its CLS row unless its folder says otherwise (as vLLM's BERT
    and XLM-RoBERTa embedders do); a
    classifier's activations (core/pooling.py model_activations: one that is not served is
    refused here, before anything is served)."""
    encoder = encoder_architecture(hf_config) is not None
    own = getattr(hf_config, "emb_pooler", None)  # (JinaBERT's config names its pooling)
    kind = getattr(hf_config, "weir_pooling", None) or (own if own in KINDS else None)
    kind = kind or ("cls" if encoder else None)
    try:
        acts = model_activations(hf_config.to_dict() if hasattr(hf_config, "to_dict") else {})
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    # (an encoder's size as its spec reads it: nomic's own config names it n_embd)
    spec = EncoderSpec.from_hf_config(hf_config) if encoder else None
    hidden = spec.hidden_size if spec is not None else hf_config.hidden_size
    per_token = spec is not None and spec.head in PER_TOKEN_HEADS
    if spec is not None and spec.head == "bge_m3":  # (embeds; its sparse weights: ReLU'd)
        specials = (int(hf_config.bos_token_id), int(hf_config.eos_token_id))
        return ModelPooling(kind, int(hidden), encoder, "relu", m3_specials=specials)
    return ModelPooling(kind, int(hidden), encoder, *acts, per_token=per_token)


def check_encoder(config: EngineConfig, hf_config: Any) -> None:
    """What an encoder (BERT, XLM-RoBERTa: gpu/models/encoder.py) is not served with, refused
    by name before anything loads."""
    arch = encoder_architecture(hf_config)
    if arch is None:
        return
    for flag, on in (
        ("--tensor-parallel-size", config.tensor_parallel_size > 1),
        ("--enable-lora", config.enable_lora),
        ("--speculative-config", bool(config.speculative_config)),
    ):
        if on:
            raise CheckpointError(f"{flag}: {arch} (an encoder) is not served with it")


def classifier_labels(hf_config: Any, n: int) -> list[str] | None:
    """A sequence classifier's `n` label names (its config's id2label, LABEL_i where it names
    none), or None for a causal LM (n = 0)."""
    if not n:
        return None
    names = {int(k): str(v) for k, v in (getattr(hf_config, "id2label", None) or {}).items()}
    return [names.get(i, f"LABEL_{i}") for i in range(n)]


def GB(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def check_quantization(config: EngineConfig, path: Path, hf_config: Any) -> None:
    """--quantization against what the checkpoint holds: gguf names a .gguf file; awq, gptq,
    compressed-tensors and modelopt a checkpoint whose quantization config says so (served as
    repacked blocks or FP8: gpu/quant/int4.py, gpu/quant/compressed.py, gpu/quant/fp8.py); any
    other method there is refused, naming it. Run once, in the engine's process (the ranks do
    not repeat it): what a checkpoint means that weir does not reproduce is said here."""
    scheme = int4_scheme(path, hf_config)  # refuses other methods, bits, group sizes, layouts
    method = scheme.method if scheme else None
    if getattr(scheme, "int_activations", False):
        log.warning(
            "%s: the checkpoint means int8 activations; weir multiplies its integer weights by "
            "16-bit activations (weir's CPU kernels: int8 per 32 inputs)",
            path,
        )
    q = config.quantization
    if q == "gguf" and not is_gguf(path):
        raise CheckpointError(f"--quantization gguf: {path} is not a .gguf file")
    if q in ("awq", "gptq", "compressed-tensors", "modelopt") and method != q:
        raise CheckpointError(f"--quantization {q}: {path} has no {q} quantization_config")
    if q == "fp8" and (method not in (None, "fp8") or is_gguf(path)):
        raise CheckpointError(f"--quantization fp8: {path.name} is already quantized")
    if q in ("q8_0", "q4_0", "q4_k") and method is not None:
        raise CheckpointError(f"--quantization {q}: {path.name} is already quantized ({method})")
    if q in ("q8_0", "q4_0", "q4_k") and is_gguf(path):
        raise CheckpointError(f"--quantization {q}: {path.name} is already quantized (GGUF)")


def load_tokenizer(config: EngineConfig, path: Path, hf_config: Any) -> tuple[Any, str]:
    """The tokenizer (--tokenizer's folder, a GGUF file's own entries, or the model folder's
    files) and the folder the server loads it from (a GGUF file's, converted once and saved in
    weir's cache). One with more tokens than the model has embedding rows is refused."""
    from transformers import AutoTokenizer

    if config.tokenizer is not None:
        folder = Path(config.tokenizer).expanduser()
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    elif is_gguf(path):
        stat = path.stat()
        key = hashlib.sha256(
            f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{gguf_tokenizer.VERSION}".encode()
        )
        folder = cache_dir() / "tokenizers" / f"{path.stem}-{key.hexdigest()[:12]}"
        if (folder / "tokenizer.json").exists():
            tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
        else:
            tokenizer = GgufCheckpoint(path).tokenizer()
            tokenizer.save_pretrained(folder)
    else:
        folder = path
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        except (OSError, ValueError) as e:
            raise CheckpointError(
                f"{path}: no tokenizer ({e}); give one with --tokenizer"
            ) from None
    if len(tokenizer) > hf_config.vocab_size:
        raise CheckpointError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary has "
            f"{hf_config.vocab_size} rows: they do not belong together"
        )
    return tokenizer, str(folder)


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
