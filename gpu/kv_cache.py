"""The paged KV cache: sizing it from the flags and allocating one K and one V tensor per layer."""

from __future__ import annotations

import gc
import logging

import torch

from gpu.models.spec import ModelSpec

log = logging.getLogger("weir.kv_cache")


KV_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8_e5m2": torch.float8_e5m2,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8": torch.float8_e4m3fn,  # vLLM's name of E4M3
}
FP8 = (torch.float8_e5m2, torch.float8_e4m3fn)
E4M3_MAX = 448.0  # E4M3 writes saturate here (vLLM's, at its default scale of 1)


def cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """--kv-cache-dtype for a model of `model_dtype`: auto is the model's own; a float32 model
    may keep a 16-bit cache, and any model an FP8 one (E5M2 or E4M3, at a scale of 1 or the
    checkpoint's: gpu/kv_scales.py; the attention kernels widen it as they read): on CPU, or on
    a GPU that converts FP8 (compute capability 8.9 or later). A cache wider than the model, or
    16-bit of the other kind, is refused."""
    if name == "auto":
        return model_dtype
    dtype = KV_DTYPES[name]
    if dtype in FP8:
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        if capability is not None and capability < (8, 9):
            raise ValueError(
                f"--kv-cache-dtype {name} on a GPU needs FP8 conversions (compute capability "
                f"8.9 or later: Ada, Hopper); this one is {capability}"
            )
        return dtype
    if dtype != model_dtype and model_dtype != torch.float32:
        model = str(model_dtype).removeprefix("torch.")
        raise ValueError(
            f"--kv-cache-dtype {name} under a {model} model: the cache is the model's dtype "
            "(auto), bfloat16 / float16 under a float32 model, or fp8 / fp8_e4m3 / fp8_e5m2"
        )
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """A model's dtype by its --kv-cache-dtype name (auto's, as /metrics and the log give it)."""
    return next(name for name, d in KV_DTYPES.items() if d == dtype)


def bytes_per_block(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * elem


def num_blocks_for(
    spec: ModelSpec,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    num_kv_blocks: int | None,
    kv_cache_memory: int,
    gpu_memory_utilization: float,
    extra_block_bytes: int = 0,
) -> int:
    """`extra_block_bytes`: what else each block holds (a draft model's K/V)."""
    if num_kv_blocks is not None:
        return num_kv_blocks
    per_block = bytes_per_block(spec, block_size, dtype) + extra_block_bytes
    if device.type == "cuda":
        # What earlier engines of this process left (a model loaded again, engines one after
        # another in one process) is neither this engine's nor free until collected.
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        # This process's share of the GPU less what it already holds (weights, warm-up
        # activations), as vLLM means the fraction: memory other processes hold does not count
        # against it, so two servers at 0.45 share one GPU; never more than is free; a tenth kept
        # back for the forward pass's activations.
        own = torch.cuda.memory_reserved(device)
        budget = int(min(gpu_memory_utilization * total - own, free) * 0.9)
    else:
        budget = kv_cache_memory
    n = budget // per_block
    if n < 1:
        raise ValueError(
            f"no room for the KV cache: one block needs {per_block} bytes, the budget is {budget}"
            " (--gpu-memory-utilization, --kv-cache-memory or --num-kv-blocks set it)"
        )
    return n


def allocate(
    spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    return [
        (_zeros(shape, dtype, device), _zeros(shape, dtype, device)) for _ in range(spec.num_layers)
    ]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeroed, not empty: padded reads of unused slots must never meet NaN garbage. On a CPU
    whose backend loaded weir's kernels, in memory advised for huge pages as the packed weights
    are (gpu/cpu/csrc/huge_pages.h): every decode step reads the sequences' K/V whole."""
    if device.type == "cpu":
        from gpu.cpu import build as cpu_build

        ops = cpu_build.loaded()
        if ops is not None:
            return ops.huge_zeros(list(shape), dtype)
    return torch.zeros(shape, dtype=dtype, device=device)
