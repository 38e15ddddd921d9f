"""Every flag of `weir serve`: the argument parser (server/cli.py turns what it parses into the
engine's and the server's settings)."""

from __future__ import annotations

import argparse
import os

from core.config import DEFAULT_GPU_MEMORY_UTILIZATION, DEFAULT_KV_CACHE_MEMORY, LOGPROBS_MODES
from server import vllm_flags
from server.chat_flags import add_arguments as chat_flags
from server.embedding_config import add_arguments as embedding_flags
from server.lora import add_arguments as lora_flags
from server.responses.flags import add_arguments as responses_flags


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weir", description="OpenAI-compatible LLM server")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve a model over the OpenAI API")
    s.add_argument(
        "model",
        nargs="?",
        default=None,
        help="local Hugging Face directory or hub id (default: the built-in tiny model)",
    )
    s.add_argument(
        "--model",
        dest="model_flag",
        default=None,
        help="the model, as vLLM's --model (same as the positional MODEL)",
    )
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=port_number, default=8000)
    s.add_argument(
        "--served-model-name",
        nargs="+",
        default=[],
        help="name(s) clients use for the model (default: the MODEL argument)",
    )
    s.add_argument("--revision", default=None, help="hub revision")
    s.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16", "half", "float"],
        help="auto: the checkpoint's; half and float are vLLM's names for float16 and float32",
    )
    s.add_argument(
        "--quantization",
        "-q",
        default=None,
        help="q8_0, q4_0, q4_k: quantize the weights at load (round to nearest, GGUF's block "
        "formats, weir's CPU kernels); fp8: quantize them at load to FP8 with a scale per "
        "output row (GPUs with FP8 arithmetic); gguf, awq, gptq, fp8, compressed-tensors, "
        "modelopt: what the checkpoint already holds (implied by a .gguf path, config.json's "
        "quantization_config or ModelOpt's hf_quant_config.json)",
    )
    s.add_argument(
        "--tokenizer",
        default=None,
        help="a Hugging Face tokenizer folder to use instead of the model's own (a GGUF file's "
        "tokenizer.ggml.* entries, or the model folder's tokenizer files)",
    )
    s.add_argument(
        "--hf-overrides",
        default=None,
        help="vLLM's: JSON set over the model's config.json, e.g. a reranker's "
        '{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": '
        '["no", "yes"], "is_original_qwen3_reranker": true}',
    )
    s.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    s.add_argument(
        "--max-model-len",
        type=human_int,
        default=None,
        help="context length; as in vLLM also 8k (8,000), 8K (8,192), 1.5m, 1M",
    )
    s.add_argument("--max-num-seqs", type=int, default=256)
    s.add_argument("--max-num-batched-tokens", type=int, default=2048)
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="KV cache blocks (default: from --kv-cache-memory or memory utilization)",
    )
    s.add_argument(
        "--kv-cache-memory",
        type=int,
        default=DEFAULT_KV_CACHE_MEMORY,
        help="bytes of KV cache on CPU (default 1 GiB, or VLLM_CPU_KVCACHE_SPACE GiB)",
    )
    s.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="the KV cache's elements: auto (the model's dtype), float32, bfloat16, float16, or "
        "fp8 (= fp8_e4m3: 3 bits of mantissa, +-448 at a scale of 1, as vLLM's default) / "
        "fp8_e5m2 (2 bits), on CPU or a GPU of compute capability 8.9+; a 16-bit cache under a "
        "float32 model holds twice the tokens and attention reads half the bytes, an FP8 one "
        "(any model) half a 16-bit one's "
        "(outputs can differ from a full cache's)",
    )
    s.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=DEFAULT_GPU_MEMORY_UTILIZATION,
        help="this server's share of the GPU's memory, KV cache included (other processes' use "
        "does not count against it); default 0.9, or WEIR_GPU_MEMORY_UTILIZATION",
    )
    s.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "cpu", "torch", "triton"],
        help="auto: triton on CUDA; on CPU the compiled cpu kernel (built with the host's g++; "
        "torch when it cannot be built). torch is the reference; triton on CPU needs "
        "TRITON_INTERPRET=1",
    )
    s.add_argument(
        "--cpu-threads",
        default="auto",
        help="torch threads for the model on CPU; auto: every core this process may use for a "
        "model of 4M or more weights per token, else one left to the HTTP event loop",
    )
    s.add_argument(
        "--cpu-matmul",
        default="weir",
        choices=["weir", "onednn"],
        help="a float32 model on CPU: its products on weir's packed kernel, or on "
        "oneDNN-prepacked weights (for A/B measurements)",
    )
    s.add_argument(
        "--cpu-forward",
        default="auto",
        choices=["auto", "fused", "modules"],
        help="a float32 model on CPU: auto runs the layer stack as one compiled call when the "
        "model fits it (else layer by layer, saying why); fused refuses to start otherwise; "
        "modules always goes layer by layer",
    )
    s.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run every step eagerly (on CUDA, decode steps are otherwise replayed as CUDA "
        "graphs captured at startup for batch sizes 1, 2, 4, 8, 16, ... up to --max-num-seqs)",
    )
    s.add_argument(
        "--speculative-config",
        default=None,
        help='vLLM\'s JSON, e.g. {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4}: several tokens a step for a request whose next tokens repeat '
        "earlier ones, verified by the model (the same outputs); disable_by_batch_size turns it "
        "off for steps with more running requests",
    )
    s.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule and launch each step while the one before it runs, so the host's work "
        "overlaps the GPU's (default: on for CUDA with one rank; outputs are the same)",
    )
    s.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV of shared prompt prefixes (on by default)",
    )
    lora_flags(s)
    s.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=["fcfs", "priority"],
        help="priority: lower request `priority` runs first and is preempted last",
    )
    s.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="split the model over this many worker processes, one per device (cuda:0..N-1, "
        "or CPU), joined by torch.distributed (NCCL on GPUs, gloo on CPU)",
    )
    s.add_argument(
        "--distributed-init-method",
        default=None,
        help="where the tensor-parallel workers meet (torch.distributed init_method, e.g. "
        "tcp://10.0.0.1:29500); default: a free port on this machine",
    )
    s.add_argument(
        "--nnodes",
        type=int,
        default=1,
        help="machines the tensor-parallel ranks span (each runs an equal share)",
    )
    s.add_argument(
        "--node-rank",
        type=int,
        default=0,
        help="this machine's place among --nnodes (0: the server)",
    )
    s.add_argument(
        "--headless",
        action="store_true",
        help="run this node's tensor-parallel ranks only, no server (a machine other than "
        "node 0; it stops when node 0 does)",
    )
    s.add_argument("--seed", type=int, default=0)
    s.add_argument(
        "--generation-config",
        default="auto",
        help="request defaults: auto (the model's generation_config.json), vllm (none) "
        "or a folder holding a generation_config.json",
    )
    s.add_argument(
        "--max-logprobs",
        type=int,
        default=20,
        help="most log-probs a request may ask for (logprobs, top_logprobs, prompt_logprobs); "
        "-1: the whole vocabulary",
    )
    s.add_argument(
        "--logprobs-mode",
        choices=LOGPROBS_MODES,
        default="raw_logprobs",
        help="what log-probs report, as vLLM's: raw_* the model's own distribution (whatever "
        "the temperature, penalties, bias or filters), processed_* the one sampled from; "
        "*_logits the logits instead of log-probs",
    )
    s.add_argument(
        "--max-beam-width",
        type=int,
        default=16,
        help="most beams a beam search request (use_beam_search, n beams) may ask for",
    )
    s.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="write log-prob tokens as token_id:N (a request's return_tokens_as_token_ids "
        "overrides it)",
    )
    s.add_argument(
        "--max-body-bytes",
        type=int,
        default=32 * 1024 * 1024,
        help="largest request body accepted (413 above it)",
    )
    o = s.add_argument_group("operations")
    o.add_argument(
        "--api-key",
        default=os.environ.get("WEIR_API_KEY"),
        help="require `Authorization: Bearer KEY` on /v1/*, /tokenize, /detokenize "
        "(default: $WEIR_API_KEY)",
    )
    o.add_argument("--allowed-origins", nargs="+", default=["*"], help="CORS origins")
    o.add_argument("--allowed-methods", nargs="+", default=["*"], help="CORS methods")
    o.add_argument("--allowed-headers", nargs="+", default=["*"], help="CORS headers")
    o.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="refuse a request that would wait behind this many others (0: one that would "
        "wait at all, with every seat of --max-num-seqs taken)",
    )
    o.add_argument(
        "--shed-status",
        type=int,
        default=503,
        choices=[503, 429],
        help="status for refused requests (with Retry-After)",
    )
    o.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds a request may run; then it ends with finish_reason length",
    )
    o.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM/SIGINT",
    )
    o.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=75.0,
        help="idle keep-alive seconds (above common load-balancer idle timeouts)",
    )
    o.add_argument(
        "--tcp-user-timeout",
        type=float,
        default=30.0,
        help="seconds sent data may go unacknowledged before a stalled client is "
        "dropped and its request aborted",
    )
    o.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="send an SSE event every N tokens (the first and last at once): fewer, "
        "larger writes when serving many streams",
    )
    o.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine core in its own process (as vLLM does), so HTTP work and the "
        "engine do not share one interpreter lock; --no-engine-process runs it on a thread "
        "of the server process",
    )
    o.add_argument(
        "--api-server-count",
        "-asc",
        type=int,
        default=None,
        help="HTTP processes serving the port in front of the one engine process (vLLM's "
        "flag); default: 1 on CPU, on CUDA min(4, cores // 4)",
    )
    o.add_argument(
        "--metrics-prefix",
        default="weir",
        help="metric name prefix; `vllm` makes vLLM dashboards work unchanged",
    )
    o.add_argument(
        "--disable-log-requests", action="store_true", help="no log line per finished request"
    )
    o.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="no periodic stats line (throughput, queue, KV cache) in the log",
    )
    o.add_argument(
        "--stats-interval",
        type=float,
        default=10.0,
        help="seconds between stats lines while the engine has work",
    )
    o.add_argument(
        "--exit-on-engine-error",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="exit non-zero when the engine dies (default), or stay up, unhealthy",
    )
    chat_flags(s)
    responses_flags(s)
    embedding_flags(s)
    s.add_argument(
        "--log-level",
        default="info",
        type=str.lower,
        choices=["debug", "info", "warning", "error", "critical"],
        help="the server's logging threshold (as vLLM's --uvicorn-log-level names them)",
    )
    vllm_flags.add_arguments(s)
    return parser


def port_number(value: str) -> int:
    """A TCP port, 0..65535 (0: any free one)."""
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port (0..65535)")
    return port


def human_int(value: str) -> int:
    """An integer, or vLLM's readable form: k/m/g thousands, K/M/G powers of 1,024 (8k, 1.5M)."""
    scales = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = value.strip()
    try:
        if text and text[-1] in scales:
            return int(float(text[:-1]) * scales[text[-1]])
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a number of tokens (e.g. 4096, 8k, 32K)"
        ) from None
