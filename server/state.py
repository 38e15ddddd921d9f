"""ServerState: what the routes share (engine, tokenizer, names), and whether it is ready."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import trio

from core.config import EngineConfig
from core.engine import Engine
from server.errors import APIError
from server.options import ServerOptions


@dataclass
class ServerState:
    config: EngineConfig
    options: ServerOptions = field(default_factory=ServerOptions)
    status: str = "loading"  # loading | ready | draining | failed | stopping
    reason: str = "loading the model"
    engine: Engine | None = None
    tokenizer: Any = None
    chat_template: str | None = None
    served_names: list[str] = field(default_factory=list)
    max_model_len: int = 0
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    token_text: Any = None  # server.logprobs.TokenText for the tokenizer
    vocab_size: int = 0  # the model's lm_head width (>= the tokenizer's vocabulary)
    reasoning_parser: str | None = None  # resolved --reasoning-parser (server/reasoning)
    tool_parser: str | None = None  # resolved --tool-call-parser (server/tool_parsers)
    # the tokenizer's special tokens (text -> id): a parser whose markup is among them
    # (Mistral's [TOOL_CALLS], Llama 3's <|python_tag|>) reads replies decoded with special
    # tokens kept, and its grammars write that markup as the token (tool_parsers.base.literal)
    special_ids: dict[str, int] = field(default_factory=dict)
    grammar_checker: Any = None  # core.structured.Grammars, built with the first constraint
    checked_constraints: OrderedDict = field(default_factory=OrderedDict)  # Constraint -> error
    metrics: Any = None  # server.metrics.Metrics, once the model is loaded
    responses: Any = None  # server.responses.registry.Runs: running and stored responses
    # and/or "embed" (--enable-embeddings, --runner); a sequence classifier's: classify, score
    tasks: tuple[str, ...] = ("generate",)
    encoder: bool = False  # the model is an encoder (BERT): it never generates
    # a classifier's activations: /classify's and /score's (core/pooling.py ModelPooling)
    activations: tuple[str, str] = ("default", "default")
    pooling_facts: Any = None  # core.pooling.ModelPooling: the model's own (token_rows reads it)
    labels: list[str] | None = None  # a sequence classifier's, by index
    score_template: str | None = None  # a reranker's prompt for its pairs (core/score_pairs.py)
    embedding: Any = None  # server.embedding_config.EmbeddingConfig, when "embed" is served
    seat: Any = None  # server.api_server_messages.Seat: one of several API servers (else None)
    inflight: set = field(default_factory=set)  # generation requests being served
    lora: Any = None  # server/lora.py LoraRegistry, with --enable-lora
    idle: trio.Event = field(default_factory=trio.Event)  # set when inflight empties

    def begin(self, request: Any) -> None:
        self.inflight.add(request)

    def end(self, request: Any) -> None:
        self.inflight.discard(request)
        if not self.inflight:
            self.idle.set()
            self.idle = trio.Event()

    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def healthy(self) -> tuple[bool, str]:
        if self.status != "ready":
            return False, self.reason
        if self.engine is None or not self.engine.alive:
            return False, (
                self.engine.error if self.engine else None
            ) or "the engine is not running"
        return True, "ok"

    def ready_engine(self) -> Engine:
        ok, reason = self.healthy
        if not ok:
            raise APIError(503, f"The server is not ready: {reason}", None, "service_unavailable")
        assert self.engine is not None
        return self.engine

    def check_task(self, task: str) -> None:
        """A 400 that says how to start the server for a task it was not started for."""
        if task in self.tasks or (task == "token_embed" and "embed" in self.tasks):
            return
        if "token_classify" in self.tasks:
            raise APIError(
                400,
                "This server serves a token classifier: /pooling with task token_classify",
                "model",
                "classification_model",
            )
        if task == "token_classify":
            raise APIError(
                400,
                "This model is not a token classifier (a *ForTokenClassification checkpoint): "
                "it does not label tokens",
                "model",
                "classification_not_supported",
            )
        if "classify" in self.tasks:
            raise APIError(
                400,
                "This server serves a sequence classifier: /classify, /score and /rerank",
                "model",
                "classification_model",
            )
        if task == "classify":
            raise APIError(
                400,
                "This model is not a sequence classifier (a *ForSequenceClassification "
                "checkpoint): it does not classify",
                "model",
                "classification_not_supported",
            )
        if task in ("embed", "token_embed"):
            raise APIError(
                400,
                "This server does not serve embeddings: start it with --enable-embeddings "
                "(generation and embeddings) or --runner pooling (embeddings only)",
                "model",
                "embeddings_not_enabled",
            )
        if self.encoder:
            raise APIError(
                400,
                "This model is an encoder (BERT-like): it serves embeddings only; it does not "
                "generate",
                "model",
                "generation_not_supported",
            )
        raise APIError(
            400,
            "This server serves embeddings only (--runner pooling / --convert embed): "
            "start it without those flags to generate",
            "model",
            "generation_not_enabled",
        )

    def model_name(self, requested: str | None) -> str:
        """The model a request names: a served name of the base model, or a LoRA adapter's
        (404 model_not_found for anything else)."""
        if requested is None or requested == "":
            return self.served_names[0]
        if requested not in self.served_names and (
            self.lora is None or requested not in self.lora.adapters
        ):
            names = [*self.served_names, *(self.lora.adapters if self.lora else ())]
            raise APIError(
                404,
                f"The model `{requested}` does not exist. Served models: {', '.join(names)}",
                "model",
                "model_not_found",
            )
        return requested

    def lora_ref(self, model: str):
        """The LoRA adapter a (checked) model name stands for, or None: the base model."""
        return self.lora.ref(model) if self.lora is not None else None
