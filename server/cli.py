"""The `weir` command: `weir serve [MODEL] --host --port ...` (also `python -m server serve`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from functools import partial

import trio

from core.config import EngineConfig
from server import vllm_flags
from server.chat import load_template
from server.flags import build_parser

__all__ = ["build_parser", "config_from_args", "main", "options_from_args"]


def cpu_threads(value: str) -> int:
    """--cpu-threads: a number, or auto (0: chosen from the model's size when it is loaded,
    gpu/assemble.py auto_threads)."""
    if value == "auto":
        return 0
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"--cpu-threads must be a number or auto, not {value!r}") from None
    if n < 1:
        raise ValueError("--cpu-threads must be positive")
    return n


def json_object(flag: str, text: str | None) -> dict | None:
    """A flag's JSON object (None: not given)."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{flag}: not JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, not {text!r}")
    return value


DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def model_arg(args: argparse.Namespace) -> str | None:
    if args.model and args.model_flag and args.model != args.model_flag:
        raise ValueError(
            f"weir: the model is given twice ({args.model!r} and --model {args.model_flag!r})"
        )
    return args.model or args.model_flag


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=model_arg(args),
        served_model_name=args.served_model_name,
        revision=args.revision,
        dtype=DTYPE_ALIASES.get(args.dtype, args.dtype),
        quantization=None if args.quantization in (None, "none", "None") else args.quantization,
        tokenizer=args.tokenizer,
        hf_overrides=json_object("--hf-overrides", args.hf_overrides),
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=args.kv_cache_memory,
        kv_cache_dtype=DTYPE_ALIASES.get(args.kv_cache_dtype, args.kv_cache_dtype),
        gpu_memory_utilization=args.gpu_memory_utilization,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        speculative_config=args.speculative_config,
        cpu_threads=cpu_threads(args.cpu_threads),
        cpu_matmul=args.cpu_matmul,
        cpu_forward=args.cpu_forward,
        enable_prefix_caching=args.enable_prefix_caching,
        scheduling_policy=args.scheduling_policy,
        seed=args.seed,
        chat_template=args.chat_template,
        generation_config=args.generation_config,
        max_logprobs=args.max_logprobs,
        logprobs_mode=args.logprobs_mode,
        max_beam_width=args.max_beam_width,
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_init_method=args.distributed_init_method,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        lora_modules=args.lora_modules,
        lora_dtype=args.lora_dtype,
    )


def options_from_args(args: argparse.Namespace):
    """ServerOptions from the flags of the same names, and the three that are spelt otherwise."""
    from server.options import ServerOptions

    given = vars(args)
    fields = {name: given[name] for name in ServerOptions.__struct_fields__ if name in given}
    fields.update(
        api_key=args.api_key or None,
        log_requests=not args.disable_log_requests,
        log_stats=not args.disable_log_stats,
    )
    return ServerOptions(**fields)


def keep_torch_out() -> None:
    """For a process that serves HTTP and never runs a model (the engine is a child process):
    transformers imports torch for its tokenizers whenever torch is installed, about 200 MB
    resident and a second of start-up. A None entry makes torch unavailable here, which
    transformers, when imported, would announce as "PyTorch was not found": filtered."""
    sys.modules["torch"] = None  # type: ignore[assignment]
    logging.getLogger("transformers").addFilter(
        lambda record: "PyTorch was not found" not in record.getMessage()
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = config_from_args(args)
        options = options_from_args(args)
        notes = vllm_flags.check(args)
        config.validate()
        options.validate()
        load_template(config.chat_template)
    except ValueError as e:
        print(f"weir: {e}", file=sys.stderr)
        return 2
    for note in notes:
        logging.getLogger("weir.server").info("%s", note)
    if args.headless:
        if options.api_server_count not in (None, 1):
            print("weir: --headless runs no server: drop --api-server-count", file=sys.stderr)
            return 2
        from gpu.dist.node import run_headless  # the ranks of another machine: no server here

        return run_headless(config)
    if config.node_rank != 0:
        print("weir: a node other than 0 runs with --headless", file=sys.stderr)
        return 2
    if options.engine_process and "torch" not in sys.modules:
        keep_torch_out()
    from server.listen import api_server_sockets, listening_socket
    from server.server_count import api_server_count

    try:
        count = api_server_count(config, options)
    except ValueError as e:
        print(f"weir: {e}", file=sys.stderr)
        return 2
    try:  # the port first: one in use is a line and exit code 1, before any model loads
        if count > 1:
            ports = api_server_sockets(args.host, args.port, count, options.tcp_user_timeout)
        else:
            ports = [listening_socket(args.host, args.port, options.tcp_user_timeout)]
    except OSError as e:
        print(f"weir: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    if count > 1:  # N HTTP processes in front of one engine process
        from server.supervisor import supervise

        return supervise(config, options, args.host, ports)
    from server.app import create_app, serve

    app = create_app(config, options)
    port = ports[0].getsockname()[1]
    logging.getLogger("weir.server").info("listening on http://%s:%d/v1", args.host, port)
    return trio.run(partial(serve, app, args.host, port, sock=ports[0]))


if __name__ == "__main__":
    sys.exit(main())
