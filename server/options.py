"""ServerOptions: the HTTP layer's settings (auth, CORS, shedding, drain, connections, logs)."""

from __future__ import annotations

import msgspec


class ServerOptions(msgspec.Struct, kw_only=True):
    api_key: str | None = None  # every /v1/*, /tokenize, /detokenize route then needs it
    allowed_origins: list[str] = msgspec.field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = msgspec.field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = msgspec.field(default_factory=lambda: ["*"])
    max_waiting_requests: int | None = None  # shed a request that would wait behind this many
    shed_status: int = 503  # or 429
    request_timeout: float | None = None  # seconds; then the request ends with "length"
    drain_timeout: float = 30.0  # seconds in-flight requests get after SIGTERM
    keep_alive_timeout: float = 75.0
    tcp_user_timeout: float = 30.0  # seconds unacknowledged data may wait: drops stalled clients
    max_body_bytes: int = 32 * 1024 * 1024
    stream_interval: int = 1  # tokens per SSE event at most waited for (first and last: at once)
    metrics_prefix: str = "weir"
    log_requests: bool = True
    log_stats: bool = True  # a throughput/queue line every stats_interval seconds while busy
    stats_interval: float = 10.0
    return_tokens_as_token_ids: bool = False  # default of the request field of that name
    reasoning_parser: str | None = None  # server/reasoning: a name, or auto (from the template)
    tool_call_parser: str = "auto"  # server/tool_parsers: a name, or auto (from the template)
    # vLLM's: a chat request's own chat_template is rendered (else refused, as vLLM refuses it)
    trust_request_chat_template: bool = False
    exit_on_engine_error: bool = True
    # The Responses API's store (server/responses): in memory, or an SQLite file; or none.
    responses_store: str | None = None
    responses_store_max_entries: int = 10_000
    responses_store_ttl: float | None = 24 * 3600.0  # seconds a finished response is kept
    disable_responses_store: bool = False
    # Embeddings (server/embeddings.py): served beside generation, or instead of it.
    enable_embeddings: bool = False
    runner: str = "generate"  # vLLM's --runner: generate, or pooling (embeddings only)
    convert: str | None = None  # vLLM's --convert: embed means --runner pooling
    pooling: str | None = None  # last, mean, cls (None: the checkpoint's, else last)
    normalize: bool = True

    @property
    def tasks(self) -> tuple[str, ...]:
        if self.runner == "pooling" or self.convert == "embed":
            return ("embed",)
        return ("generate", "embed") if self.enable_embeddings else ("generate",)

    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING), under --api-key as every /v1 route
    allow_runtime_lora_updating: bool = False

    # The engine core in a child process (its own interpreter lock), or on a thread (False).
    engine_process: bool = True
    # HTTP processes sharing the port in front of the one engine (server/supervisor.py); None:
    # chosen at start-up (server/server_count.py: 1 on CPU).
    api_server_count: int | None = None

    def validate(self) -> None:
        if self.shed_status not in (429, 503):
            raise ValueError("--shed-status must be 429 or 503")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError("--max-waiting-requests must not be negative")
        for name in (
            "request_timeout",
            "drain_timeout",
            "keep_alive_timeout",
            "tcp_user_timeout",
            "stats_interval",
        ):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if self.responses_store_max_entries < 1:
            raise ValueError("--responses-store-max-entries must be at least 1")
        if self.responses_store_ttl is not None and self.responses_store_ttl <= 0:
            raise ValueError("--responses-store-ttl must be positive")
        if self.disable_responses_store and self.responses_store:
            raise ValueError("--responses-store and --disable-responses-store contradict")
        if self.runner not in ("auto", "generate", "pooling"):
            raise ValueError("--runner must be generate or pooling")
        if self.convert not in (None, "none", "auto", "embed"):
            raise ValueError(f"--convert {self.convert!r}: weir converts to embed only")
        from core.pooling import KINDS

        if self.pooling is not None and self.pooling not in KINDS:
            raise ValueError(f"--pooling must be one of {', '.join(KINDS)}")
        if self.api_server_count is not None:
            if self.api_server_count < 1:
                raise ValueError(
                    f"--api-server-count must be at least 1, not {self.api_server_count}"
                )
            if self.api_server_count > 1 and not self.engine_process:
                raise ValueError(
                    f"--api-server-count {self.api_server_count} needs the engine in its own "
                    "process, which the API servers share: drop --no-engine-process"
                )
        if self.stream_interval < 1:
            raise ValueError("--stream-interval must be at least 1")
        if self.max_body_bytes < 1024:
            raise ValueError("--max-body-bytes must be at least 1024")
        from server.reasoning import CHOICES

        if self.reasoning_parser is not None and self.reasoning_parser not in CHOICES:
            raise ValueError(
                f"--reasoning-parser {self.reasoning_parser!r} is unknown; weir has "
                + ", ".join(CHOICES)
            )
        from server.tool_parsers import CHOICES as TOOL_CHOICES

        if self.tool_call_parser not in TOOL_CHOICES:
            raise ValueError(
                f"--tool-call-parser {self.tool_call_parser!r} is unknown; weir has "
                + ", ".join(TOOL_CHOICES)
            )
        if not self.metrics_prefix.replace("_", "").isalnum():
            raise ValueError("--metrics-prefix must be letters, digits and underscores")
