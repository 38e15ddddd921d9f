"""EngineConfig: every engine setting, filled from the CLI (server/cli.py) or by tests."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import msgspec


class CheckpointError(ValueError):
    """The model given cannot be served as it is: a truncated or corrupt file, an unsupported
    architecture, tensor type or quantization method, a tokenizer that does not fit its
    vocabulary. Start-up fails with its message and exit code 2 (bad input), not 1."""


def is_bad_input(e: BaseException) -> bool:
    """Whether an error while the model loads is the input's (the model given, its files, the
    flags against them: a ValueError, an unreadable file, a safetensors file cut short): one
    line and exit code 2, as for a bad argument, not a traceback."""
    return isinstance(e, (ValueError, OSError)) or type(e).__name__ == "SafetensorError"


# --quantization: weir's own round-to-nearest formats (gpu/quant/quantize.py); "gguf", "awq",
# "gptq", "compressed-tensors" and "modelopt" name what a checkpoint already holds (a .gguf
# path, config.json's quantization_config, ModelOpt's hf_quant_config.json).
# --kv-cache-dtype: FP8 under any model, on CPU or an FP8-capable GPU (gpu/kv_cache.py says which
# go together); fp8 is vLLM's name of fp8_e4m3
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")
QUANTIZATIONS = (
    "q8_0", "q4_0", "q4_k", "fp8", "gguf", "awq", "gptq", "compressed-tensors", "modelopt",
)  # fmt: skip
# --logprobs-mode, vLLM's: the model's own distribution or the one sampled from, as log-probs
# or logits (gpu/sampler.py).
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")


# --gpu-memory-utilization's default; WEIR_GPU_MEMORY_UTILIZATION sets it for every engine a
# process starts (several processes sharing one GPU, such as a test run over pytest-xdist).
DEFAULT_GPU_MEMORY_UTILIZATION = float(os.environ.get("WEIR_GPU_MEMORY_UTILIZATION", "0.9"))


def _kv_cache_space() -> int:
    """--kv-cache-memory's default: 1 GiB, or VLLM_CPU_KVCACHE_SPACE GiB (vLLM's variable for
    its CPU backend; a fraction is taken too, 0 or unset: the default)."""
    raw = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
    try:
        gib = float(raw or 0)
    except ValueError:
        raise ValueError(f"VLLM_CPU_KVCACHE_SPACE must be a number of GiB, got {raw!r}") from None
    if gib < 0:
        raise ValueError(f"VLLM_CPU_KVCACHE_SPACE must not be negative, got {raw!r}")
    return int(gib * (1 << 30)) if gib else 1 << 30


DEFAULT_KV_CACHE_MEMORY = _kv_cache_space()


class EngineConfig(msgspec.Struct, kw_only=True):
    model: str | None = None  # None: the built-in tiny model; a folder, a hub id or a .gguf file
    # A Hugging Face tokenizer folder to use instead of the model's own (a GGUF file's
    # tokenizer.ggml.* entries, or the folder's tokenizer files)
    tokenizer: str | None = None
    # --hf-overrides: vLLM's JSON set over the checkpoint's config (gpu/hf_overrides.py)
    hf_overrides: dict[str, Any] | None = None
    # Weights quantized at load (q8_0, q4_0, q4_k), or the method a checkpoint already holds
    # (gguf, awq, gptq: checked against it); None: as the checkpoint holds them
    quantization: str | None = None
    served_model_name: list[str] = []
    revision: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int = DEFAULT_KV_CACHE_MEMORY  # bytes of KV cache on CPU
    # The cache's elements: auto (the model's dtype), or bfloat16 / float16 under a float32
    # model (half the bytes per token: twice the context, attention reading half as much).
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    attention_backend: str = "auto"
    enforce_eager: bool = False  # no CUDA graphs for decode steps
    # Schedule and launch step N+1 while step N runs (core/engine_core.py step); None: on for a
    # CUDA device with one rank, off otherwise (on a CPU the forward runs when launched, so
    # nothing overlaps: it is for tests there).
    async_scheduling: bool | None = None
    # --speculative-config: vLLM's JSON (core/speculative.py SpeculativeConfig), as text
    speculative_config: str | None = None
    # torch intra-op threads when running on CPU; None: torch's; 0: auto, from the model's size
    # (gpu/launch.py auto_threads)
    cpu_threads: int | None = None
    # A float32 model on CPU: its products on weir's packed kernel, or oneDNN's ("onednn");
    # the layer stack as one compiled call when the model fits ("auto"), always ("fused": refuse
    # to start otherwise) or layer by layer ("modules"). For A/B benchmarks and debugging.
    cpu_matmul: str = "weir"
    cpu_forward: str = "auto"
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"  # fcfs | priority
    seed: int = 0
    chat_template: str | None = None  # a file path or the template itself
    # Sampling defaults: "auto" from the model's generation_config.json, "vllm" none, or a folder.
    generation_config: str = "auto"
    # Most log-probs (top alternatives) a request may ask for; -1: the whole vocabulary.
    max_logprobs: int = 20
    # What log-probs report (vLLM's --logprobs-mode): the model's own distribution (raw_*), or
    # the one sampled from after penalties, bias, temperature and filters (processed_*); as
    # log-probs or as logits.
    logprobs_mode: str = "raw_logprobs"
    # Most beams a beam search request (use_beam_search, n beams) may ask for.
    max_beam_width: int = 16
    check_integrity: bool = False  # assert the block pool invariant after every step (tests)
    # Tensor parallelism: the model split over this many worker processes (one per device).
    tensor_parallel_size: int = 1
    # Where the workers meet (torch.distributed's init_method): None, a free local TCP port;
    # "tcp://HOST:PORT" to rendezvous at a given address (needed across machines).
    distributed_init_method: str | None = None
    # Machines the ranks span (an equal share each), and which one this is: node 0 runs the
    # server and rank 0, the others run `weir serve ... --headless`.
    nnodes: int = 1
    node_rank: int = 0
    # LoRA adapters (core/lora.py, gpu/lora.py), vLLM's flags: served at all; adapters in one
    # step (the slots); the highest rank an adapter may have; adapters kept in host memory
    # (LRU; None: --max-loras); and the adapters served from start-up (`name=path` or vLLM's
    # JSON form); the dtype the slots hold adapters in (auto: the activations').
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: list[str] = []
    lora_dtype: str = "auto"

    def validate(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"--dtype must be auto, float32, bfloat16 or float16, not {self.dtype}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"--kv-cache-dtype {self.kv_cache_dtype} is not offered: weir's KV cache holds "
                "auto (the model's dtype), float32, bfloat16, float16, or fp8 / fp8_e4m3 / "
                "fp8_e5m2"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"--quantization {self.quantization} is not offered: weir quantizes at load to "
                "q8_0, q4_0 or q4_k (CPU) or fp8 (GPU), and serves gguf files, awq or gptq int4 "
                "checkpoints, fp8, ModelOpt FP8 and compressed-tensors checkpoints"
            )
        if self.tokenizer is not None and not Path(self.tokenizer).expanduser().is_dir():
            raise ValueError(
                f"--tokenizer {self.tokenizer}: no such folder (weir reads a local Hugging Face "
                "tokenizer folder: tokenizer.json, tokenizer_config.json)"
            )
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError("--block-size must be between 1 and 1024")
        if self.cpu_matmul not in ("weir", "onednn"):
            raise ValueError(f"--cpu-matmul must be weir or onednn, not {self.cpu_matmul}")
        if self.cpu_forward not in ("auto", "fused", "modules"):
            raise ValueError(
                f"--cpu-forward must be auto, fused or modules, not {self.cpu_forward}"
            )
        if self.cpu_threads is not None and self.cpu_threads < 0:
            raise ValueError("--cpu-threads must be positive (or auto)")
        if self.max_num_seqs < 1:
            raise ValueError("--max-num-seqs must be positive")
        if self.max_num_batched_tokens < 1:
            raise ValueError("--max-num-batched-tokens must be positive")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("--num-kv-blocks must be positive")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("--gpu-memory-utilization must be in (0, 1]")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError("--scheduling-policy must be fcfs or priority")
        if self.max_beam_width < 1:
            raise ValueError("--max-beam-width must be at least 1")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"--device {self.device!r}: one of auto, cpu, cuda, cuda:N")
        if self.max_logprobs < -1:
            raise ValueError("--max-logprobs must be -1 (no limit) or at least 0")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"--logprobs-mode must be one of {', '.join(LOGPROBS_MODES)}")
        if self.tensor_parallel_size < 1:
            raise ValueError("--tensor-parallel-size must be at least 1")
        if self.speculative_config is not None:
            from core.speculative import SpeculativeConfig

            spec = SpeculativeConfig.parse(self.speculative_config)  # a ValueError names it
            if spec.method == "draft_model" and self.tensor_parallel_size > 1:
                raise ValueError(
                    "--speculative-config draft_model runs with one rank (not with "
                    "--tensor-parallel-size)"
                )
            if self.async_scheduling:
                raise ValueError(
                    "--speculative-config runs with synchronous scheduling: drop "
                    "--async-scheduling (each step's proposals come from the last one's tokens)"
                )
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise ValueError(
                "--async-scheduling runs with one rank: the ranks of --tensor-parallel-size "
                "take each step's sampled tokens from the engine"
            )
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError("--node-rank must be between 0 and --nnodes - 1")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(
                f"--tensor-parallel-size {self.tensor_parallel_size} does not divide over "
                f"--nnodes {self.nnodes}: every node runs the same number of ranks"
            )
        if self.nnodes > 1 and not self.distributed_init_method:
            raise ValueError(
                "--nnodes needs --distributed-init-method tcp://HOST:PORT (an address of node 0 "
                "every node can reach)"
            )
        if self.max_loras < 1 or not 1 <= self.max_lora_rank <= 512:
            raise ValueError("--max-loras must be at least 1, --max-lora-rank 1 to 512")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError("--max-cpu-loras must be at least --max-loras")
        if self.lora_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"--lora-dtype must be auto, float32, bfloat16 or float16, not {self.lora_dtype!r}"
            )
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("--max-model-len must be at least 2")
