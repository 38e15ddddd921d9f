"""`vllm serve` flags that have no weir counterpart: each is accepted and logged as not applicable,
or refused at start-up with a message naming the flag and what weir offers instead, so that a
vLLM command line either works or says plainly why not (never a bare "unrecognized arguments").
The flags weir does implement (model, dtype, max-model-len, ...) live in server/cli.py."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, NamedTuple


class Flag(NamedTuple):
    names: tuple[str, ...]
    kind: Any  # a type for argparse (int, float, str), or "bool" / "bool?" for switches
    ok: Callable[[Any], bool]  # values weir can honour
    note: str | None  # logged when an accepted value is given (None: nothing to say)
    refusal: str  # why another value cannot be honoured, and what to use instead

    @property
    def dest(self) -> str:
        return "vllm_" + self.names[0].lstrip("-").replace("-", "_")


def _always(_: Any) -> bool:
    return True


def _never(_: Any) -> bool:
    return False


def _one(value: Any) -> bool:
    return value == 1


FLAGS = (
    Flag(
        ("--trust-remote-code",),
        "bool",
        _always,
        "--trust-remote-code has no effect: weir runs no code from model repositories; the "
        "architectures it serves (Llama, Mistral, Qwen2, Qwen3) are built in",
        "",
    ),
    Flag(
        ("--pipeline-parallel-size", "-pp"),
        int,
        _one,
        None,
        "weir splits a model over devices with --tensor-parallel-size; pipeline parallelism "
        "is not offered",
    ),
    Flag(
        ("--data-parallel-size", "-dp"),
        int,
        _one,
        None,
        "run several weir processes (one per device) behind a load balancer instead",
    ),
    Flag(
        ("--distributed-executor-backend",),
        str,
        _always,
        "--distributed-executor-backend has no effect: weir's engine process drives its "
        "tensor-parallel workers itself (torch.distributed; --distributed-init-method)",
        "",
    ),
    Flag(
        ("--swap-space",),
        float,
        _always,
        "--swap-space has no effect: weir has no CPU swap; a preempted request's KV cache is "
        "recomputed when it resumes",
        "",
    ),
    Flag(
        ("--load-format",),
        str,
        lambda v: v in ("auto", "safetensors", "gguf"),
        None,
        "weir loads safetensors folders and GGUF files (--load-format auto, safetensors or "
        "gguf; a .gguf path is read as GGUF)",
    ),
    Flag(
        ("--tokenizer-mode",),
        str,
        lambda v: v in ("auto", "hf"),
        None,
        "weir uses the Hugging Face fast tokenizer (--tokenizer-mode auto or hf)",
    ),
    Flag(
        ("--download-dir",),
        str,
        _never,
        None,
        "weir downloads through huggingface_hub's cache: set HF_HOME or HF_HUB_CACHE to "
        "choose where, or pass a local directory as the model",
    ),
    Flag(
        ("--enable-chunked-prefill",),
        "bool?",
        _always,
        "--[no-]enable-chunked-prefill has no effect: weir always chunks prompts longer "
        "than --max-num-batched-tokens across steps",
        "",
    ),
    Flag(
        ("--enable-prompt-tokens-details",),
        "bool",
        _always,
        "--enable-prompt-tokens-details has no effect: usage.prompt_tokens_details."
        "cached_tokens is always sent",
        "",
    ),
    Flag(
        ("--uvicorn-log-level",),
        str,
        _always,
        "--uvicorn-log-level has no effect: weir serves with Hypercorn; --log-level sets "
        "the level of every log",
        "",
    ),
    Flag(
        ("--disable-uvicorn-access-log",),
        "bool",
        _always,
        "--disable-uvicorn-access-log has no effect: weir writes no access log, only one "
        "line per finished request (--disable-log-requests turns that off)",
        "",
    ),
    Flag(
        ("--enable-log-requests",),
        "bool",
        _always,
        "--enable-log-requests: weir logs one line per finished request by default "
        "(--disable-log-requests turns it off)",
        "",
    ),
    Flag(
        ("--ssl-certfile",),
        str,
        _never,
        None,
        "weir serves plain HTTP; terminate TLS in a proxy or load balancer in front of it",
    ),
    Flag(
        ("--ssl-keyfile",),
        str,
        _never,
        None,
        "weir serves plain HTTP; terminate TLS in a proxy or load balancer in front of it",
    ),
    Flag(
        ("--structured-outputs-backend", "--guided-decoding-backend"),
        str,
        lambda v: v in ("auto", "guidance", "llguidance"),
        None,
        "weir enforces structured outputs with llguidance (auto or guidance); xgrammar, "
        "outlines and lm-format-enforcer are not offered",
    ),
    Flag(
        ("--limit-mm-per-prompt",),
        str,
        _never,
        None,
        "weir serves text-only models; send text content parts",
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "vLLM compatibility",
        "flags of `vllm serve` with no weir counterpart: accepted and logged where they make "
        "no difference, refused at start-up (naming what weir offers) where they would",
    )
    for flag in FLAGS:
        kw: dict[str, Any] = {"dest": flag.dest, "default": None, "help": argparse.SUPPRESS}
        if flag.kind == "bool":
            kw["action"] = "store_true"
        elif flag.kind == "bool?":
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = flag.kind
        group.add_argument(*flag.names, **kw)


def check(args: argparse.Namespace) -> list[str]:
    """The notes to log for accepted flags; ValueError naming the first flag weir cannot
    honour."""
    notes = []
    for flag in FLAGS:
        value = getattr(args, flag.dest, None)
        if value is None or (flag.kind == "bool" and not value):
            continue  # not given
        if not flag.ok(value):
            shown = flag.names[0] if flag.kind in ("bool", "bool?") else f"{flag.names[0]} {value}"
            raise ValueError(f"{shown} is not supported: {flag.refusal}")
        if flag.note:
            notes.append(flag.note)
    return notes
