"""What crosses between the server and its engine, named by what each carries: the commands
into the engine (the same objects whether the engine runs on a thread or in a process of its
own) and, from an engine process, its start-up and each step.

Into the engine: EngineInit (an engine process's first frame), AddRequest, AbortRequest, SetHold
(a test hook: Hold), Shutdown. Out of an engine process: EngineReady once the
model is loaded (what the server needs to check requests and build prompts), then StepOutputs per
step, or EngineDied with the reason.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from core.config import EngineConfig
from core.lora import LoraBase
from core.pooling import ModelPooling
from core.request import EngineRequest, RequestOutput
from core.stats import StepStats


class EngineInit(msgspec.Struct, tag="init", gc=False):
    config: EngineConfig
    log_level: int = logging.INFO


class AddRequest(msgspec.Struct, tag="add", gc=False):
    request: EngineRequest


class AbortRequest(msgspec.Struct, tag="abort", gc=False):
    request_id: str


class Hold(msgspec.Struct, frozen=True, gc=False):
    """A test hook: when the engine stops stepping, so a test decides what a request can reach
    instead of racing it. Asked before every step; a held engine still takes its commands
    (add, abort, hold, shutdown), so a held request ends only by abort or shutdown.

    `paused`: held until released. `gather`: held until this many requests are in the engine
    (once: a batch gathers, then runs as it would). `at_output_tokens`: held once the engine
    has requests and every one has written at least this many tokens."""

    paused: bool = False
    gather: int = 0
    at_output_tokens: int = 0

    def check(self, core: Any) -> tuple[bool, Hold]:
        """(held now, the rule from now on)."""
        rule = self
        requests = core.requests
        if rule.gather:
            if len(requests) < rule.gather:
                return True, rule
            rule = msgspec.structs.replace(rule, gather=0)
        held = rule.paused or (
            rule.at_output_tokens > 0
            and len(requests) > 0
            and all(r.num_output_tokens >= rule.at_output_tokens for r in requests.values())
        )
        return held, rule


class SetHold(msgspec.Struct, tag="hold", gc=False):
    rule: Hold | None  # None: step freely again


class Shutdown(msgspec.Struct, tag="shutdown", gc=False):
    pass


class EngineReady(msgspec.Struct, tag="ready", gc=False):
    model_path: str
    served_names: list[str]
    max_model_len: int
    vocab_size: int
    num_free_blocks: int
    generation_defaults: dict[str, Any]
    num_blocks: int = 0
    kv_dtype: str = ""
    tokenizer_path: str = ""  # the Hugging Face tokenizer folder (a GGUF file's, converted)
    weight_bytes: dict[str, int] = {}  # resident weight bytes by format
    kv_cache_bytes: int = 0
    device: str = ""  # cpu, cuda: where the model runs
    lora_base: LoraBase | None = None  # the shapes an adapter must fit, with --enable-lora
    block_size: int = 16
    eos_token_ids: list[int] = []  # banned with the stop tokens before a request's min_tokens
    labels: list[str] | None = None  # a sequence classifier's, by index (None: a causal LM)
    score_template: str | None = None  # a reranker's prompt for its pairs (core/score_pairs.py)
    pooling: ModelPooling | None = None  # the model's own pooling facts (a GGUF file's kind)


class StepOutputs(msgspec.Struct, tag="step", gc=False):
    outputs: list[RequestOutput]
    stats: StepStats | None


class EngineDied(msgspec.Struct, tag="died", gc=False):
    message: str
    bad_input: bool = False  # loading failed on the model given (core.config.CheckpointError)


EngineCommand = EngineInit | AddRequest | AbortRequest | SetHold | Shutdown
EngineReply = EngineReady | StepOutputs | EngineDied
