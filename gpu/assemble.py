"""One rank's model, KV cache and runner, assembled from an EngineConfig (in the engine
process, or in a tensor-parallel worker): the device, the threads, the model's folder."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from core.config import CheckpointError, EngineConfig
from core.speculative import SpeculativeConfig, auto_batch_limit
from gpu import kv_cache, kv_scales
from gpu.attention.select import get_backend
from gpu.backend import TorchBackend
from gpu.dist.parallel import TensorParallel
from gpu.encoder_loader import load_encoder
from gpu.loader import load_model, resolve_model_path
from gpu.models.decoder import DecoderForCausalLM
from gpu.models.encoder_spec import encoder_architecture
from gpu.models.moe import mixtures_on_device
from gpu.runner import ModelRunner

log = logging.getLogger("weir.launch")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: this machine has no CUDA device torch can use")
    return torch.device(name)


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


def choose_backend(
    config: EngineConfig, device: torch.device, dtype: torch.dtype, encoder: bool = False
):
    """What the model's layers run on (gpu/backend.py), chosen once: on CUDA torch's products
    (Q/K/V and gate/up each one) with the work between them in Triton kernels
    (gpu/cuda/backend.py); on CPU weir's compiled kernels (float32, 16-bit and block-format
    weights; an `encoder`'s float32 products, all of them prefills, on oneDNN's), or, where
    they cannot be built here, oneDNN's products for a float32 model and torch's ops for any
    other."""
    from gpu.cpu import onednn

    attention = get_backend(config.attention_backend, device)
    quantize = config.quantization if config.quantization in ("q8_0", "q4_0", "q4_k") else None
    if device.type == "cuda":
        fp8_ok = torch.cuda.get_device_capability(device) >= (8, 9)
        if config.quantization == "fp8" and not fp8_ok:
            raise CheckpointError(
                "--quantization fp8 needs a GPU with FP8 arithmetic (compute capability 8.9 or "
                f"later: Ada, Hopper); this one is {torch.cuda.get_device_capability(device)}"
            )
        if quantize:
            raise CheckpointError(
                f"--quantization {quantize}: weir quantizes at load for its CPU kernels; on a "
                "GPU it serves 4-bit checkpoints as they are (AWQ, GPTQ, GGUF Q4_0/Q4_1)"
            )
        from gpu.cuda.backend import CudaBackend

        return CudaBackend(
            attention, quantize_fp8=config.quantization == "fp8", fp8_products=fp8_ok
        )
    if config.quantization == "fp8":
        raise CheckpointError(
            "--quantization fp8: FP8 products run on GPUs; on a CPU weir's kernels take "
            "--quantization q8_0 (8-bit blocks)"
        )
    from gpu.cpu import build as cpu_build
    from gpu.cpu.backend import CpuBackend, OneDnnBackend

    try:
        return CpuBackend(
            attention,
            config.cpu_matmul,
            config.cpu_forward,
            keep_dtype=config.dtype == "auto",
            quantization=quantize,
            lora=config.enable_lora,
            prefill=encoder and config.cpu_matmul == "weir",
        )
    except cpu_build.BuildError as e:
        if config.cpu_forward == "fused" or quantize:
            flag = f"--quantization {quantize}" if quantize else "--cpu-forward fused"
            raise CheckpointError(f"{flag}: weir's CPU kernels cannot be built: {e}") from None
        if onednn.usable(dtype):
            log.warning("weir's CPU kernels cannot be built (%s): oneDNN products, torch ops", e)
            return OneDnnBackend(attention, lora=config.enable_lora)
        log.warning("weir's CPU kernels cannot be built (%s): torch's ops", e)
        return TorchBackend(attention, fuse=False, name="cpu, torch")


def load_shard(
    config: EngineConfig,
    path: Path,
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallel | None = None,
    draft: DecoderForCausalLM | None = None,
) -> tuple[DecoderForCausalLM, int]:
    """The model (under `tp`, this rank's share of it) and how many KV blocks fit beside it
    (with a draft model, already loaded: blocks that hold both models' K/V)."""
    if encoder_architecture(hf_config) is not None:  # no KV cache (gpu/models/encoder.py)
        backend = choose_backend(config, device, dtype, encoder=True)
        model = load_encoder(path, hf_config, dtype, device, backend)
        positions = served_positions(path, model.spec.max_position_embeddings)
        return model, encoder_blocks(config, positions)
    backend = choose_backend(config, device, dtype)
    model = load_model(path, hf_config, dtype, device, backend, tp)
    kv_dtype = kv_cache.cache_dtype(config.kv_cache_dtype, dtype, device)
    extra = kv_cache.bytes_per_block(draft.spec, config.block_size, kv_dtype) if draft else 0
    num_blocks = kv_cache.num_blocks_for(
        model.local_spec,  # the KV heads this rank caches
        config.block_size,
        kv_dtype,
        device,
        num_kv_blocks=config.num_kv_blocks,
        kv_cache_memory=config.kv_cache_memory,
        gpu_memory_utilization=config.gpu_memory_utilization,
        extra_block_bytes=extra,
    )
    return model, num_blocks


def encoder_blocks(config: EngineConfig, positions: int) -> int:
    """An encoder's blocks: it caches nothing, so they only count what may run at once, a
    whole input of the longest length in every seat (--num-kv-blocks, where given)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    longest = min(config.max_model_len or positions, positions)
    return config.max_num_seqs * -(-longest // config.block_size)


def served_positions(path: Path, positions: int) -> int:
    """The model's positions, cut to sentence-transformers' `max_seq_length` where its folder
    names one (sentence_bert_config.json: the length the model is used at; all-MiniLM-L6-v2's
    256 of its 512), as vLLM cuts them."""
    file = path / "sentence_bert_config.json"
    try:
        length = json.loads(file.read_text()).get("max_seq_length") if file.is_file() else None
    except (OSError, ValueError, AttributeError):
        length = None
    return min(positions, length) if isinstance(length, int) and length > 0 else positions


def fit_model_len(config: EngineConfig, max_positions: int, num_blocks: int, rank: int = 0) -> int:
    """--max-model-len (or the model's own positions, cut to what the KV cache holds: said
    once, by rank 0 under tensor parallelism); an explicit one the cache cannot hold is
    refused."""
    capacity = num_blocks * config.block_size
    if (
        config.max_model_len
        and config.max_model_len > max_positions
        and os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN") != "1"
    ):
        raise CheckpointError(
            f"--max-model-len {config.max_model_len} is more than the model's "
            f"{max_positions} positions (max_position_embeddings, rope scaling included): past "
            "them it was never trained; VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 allows it (as in vLLM)"
        )
    if config.max_model_len and config.max_model_len > capacity:
        # asked for explicitly: refused, as vLLM refuses it (a silent cut surprised users)
        raise CheckpointError(
            f"--max-model-len {config.max_model_len} is more than the KV cache holds "
            f"({num_blocks} blocks of {config.block_size}: {capacity} tokens): give the cache "
            "more memory (--kv-cache-memory, --num-kv-blocks, --gpu-memory-utilization) or "
            "lower --max-model-len"
        )
    max_model_len = config.max_model_len or max_positions
    if max_model_len > capacity and rank == 0:
        log.warning(
            "max_model_len %d exceeds the KV cache (%d tokens); using %d",
            max_model_len,
            capacity,
            capacity,
        )
    return min(max_model_len, capacity)


def speculative_config(config: EngineConfig, device: torch.device) -> SpeculativeConfig | None:
    """--speculative-config, its batch limit resolved for the device when left out."""
    if not config.speculative_config:
        return None
    spec = SpeculativeConfig.parse(config.speculative_config)
    if spec.disable_by_batch_size is None:
        spec.disable_by_batch_size = auto_batch_limit(spec.num_speculative_tokens, device.type)
    return spec


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
    captured for contexts up to `max_model_len` (LongRoPE's factors chosen for it)."""
    if model.pooling_only:  # an encoder: no cache, no graphs (it never decodes)
        return ModelRunner(model, [], config.block_size, device, config.seed)
    model.rope.fit_context(max_model_len)
    kv_dtype = kv_cache.cache_dtype(config.kv_cache_dtype, dtype, device)
    caches = kv_cache.allocate(model.local_spec, num_blocks, config.block_size, kv_dtype, device)
    kv_scales.use(model, kv_dtype in kv_cache.FP8)  # before any graph captures the layers
    runner = ModelRunner(
        model, caches, config.block_size, device, config.seed, config.logprobs_mode
    )
    if config.enable_lora:
        from gpu.lora import LoraSlots

        model.lora = runner.lora = LoraSlots(
            model,
            config.max_loras,
            config.max_lora_rank,
            config.max_cpu_loras or config.max_loras,
            config.lora_dtype,
        )
    graphs = device.type == "cuda" and not config.enforce_eager
    if graphs and not mixtures_on_device(model):  # a routing read back by the host (moe.py)
        log.info("a mixture of experts whose experts are not stacked runs eagerly: no CUDA graphs")
        graphs = False
    if graphs and model.backend.attention.graph_safe:
        from gpu.cuda.graphs import DecodeGraphs, default_capture_sizes

        runner.graphs = DecodeGraphs(
            model,
            caches,
            device,
            config.block_size,
            max_model_len,
            default_capture_sizes(config.max_num_seqs),
        )
        runner.graphs.capture()
        spec = speculative_config(config, device)
        if spec is not None:  # verification steps: every row k+1 tokens
            from gpu.cuda.verify_graphs import VerifyGraphs

            limit = min(config.max_num_seqs, spec.disable_by_batch_size)
            runner.verify_graphs = VerifyGraphs(
                model,
                caches,
                device,
                config.block_size,
                max_model_len,
                default_capture_sizes(max(limit, 1)),
                query_len=spec.num_speculative_tokens + 1,
            )
            runner.verify_graphs.capture()
    runner.eos_token_ids = eos
    return runner


def resident_weights(model: DecoderForCausalLM) -> dict[str, int]:
    """Bytes of weights the model holds in memory, by format (f32, bf16, q4_k, ...): what weir's
    CPU backend packed, or every tensor the modules hold on other backends."""
    counted = getattr(model.backend, "resident", None)
    out: dict[str, int] = dict(counted or {})
    seen: set[int] = set()

    def walk(v: Any, small: bool) -> None:
        if isinstance(v, torch.Tensor):
            if v.data_ptr() in seen or v.device.type == "meta":
                return
            seen.add(v.data_ptr())
            names = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
            key = names.get(v.dtype, str(v.dtype).removeprefix("torch."))
            if small or counted is None:
                out[key] = out.get(key, 0) + v.numel() * v.element_size()
        elif isinstance(v, tuple | list):
            for x in v:
                walk(x, small)
        elif hasattr(v, "format_bytes"):  # a weight in a backend's own form (4-bit on a GPU)
            fmt, n = v.format_bytes()
            out[fmt] = out.get(fmt, 0) + n

    for p in model.parameters():
        walk(p, True)  # norms (and, on torch backends, everything else)
    if counted is None:
        for mod in model.modules():
            for attr in ("w", "qkv", "o", "gate_up", "down"):
                walk(getattr(mod, attr, None), False)
    return {k: v for k, v in out.items() if v}


# Weights a token multiplies through (per layer: Q/K/V/O and the MLP) from which every core is
# worth giving to the model rather than leaving one to the HTTP event loop.
AUTO_ALL_CORES_WEIGHTS = 4_000_000


def auto_threads(hf_config: Any) -> int:
    """--cpu-threads auto. The engine's matrix products and the event loop's HTTP work share the
    cores; which should yield depends on how big a forward is: below AUTO_ALL_CORES_WEIGHTS a
    model served more with one core left to the event loop, above it with every core
    (figures: docs/benchmarks.md, "Figures moved out of the code")."""
    usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    cores = len(usable) if usable else os.cpu_count() or 1
    h = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    d = getattr(hf_config, "head_dim", None) or h // heads
    q, kv = heads * d, getattr(hf_config, "num_key_value_heads", heads) * d
    mlp = hf_config.intermediate_size
    if getattr(hf_config, "num_experts_per_tok", 0):  # a mixture of experts: those a token runs
        mlp = getattr(hf_config, "moe_intermediate_size", mlp) * hf_config.num_experts_per_tok
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * mlp
    weights = hf_config.num_hidden_layers * per_layer
    return cores if weights >= AUTO_ALL_CORES_WEIGHTS else max(1, cores - 1)
