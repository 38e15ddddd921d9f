"""The QuartTrio app factory and `serve`: Hypercorn on Trio over a socket weir creates itself,
the engine started in the lifespan, auth and CORS in front of the routes, graceful drain."""

from __future__ import annotations

import gc
import hmac
import logging
import signal
import socket
from pathlib import Path
from typing import Any, NamedTuple

import trio
from hypercorn.trio import serve as hypercorn_serve
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from core.config import CheckpointError, EngineConfig
from core.engine import EngineThread
from core.engine_process import EngineProcess
from core.stats import StepStats
from server import reasoning, tool_parsers
from server import embedding_config
from server.chat import load_template
from server.embeddings import bp as embeddings_bp
from server.errors import APIError, error_response
from server.generate import bp as generate_bp
from server.responses.routes import bp as responses_bp
from server.responses.registry import Runs
from server.logprobs import TokenText
from server.metrics import CacheInfo, Memory, Metrics
from server.options import ServerOptions
from server.routes import bp
from server.state import ServerState
from server.listen import hypercorn_config, listening_socket
from server.lora import LoraRegistry
from core.lora import LoraError
from server.stats_log import StatsLog

log = logging.getLogger("weir.server")

PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


def create_app(config: EngineConfig, options: ServerOptions | None = None) -> QuartTrio:
    options = options or ServerOptions()
    options.validate()
    app = QuartTrio("weir")
    app.config["RESPONSE_TIMEOUT"] = None  # streams end when generation ends, not on a clock
    app.config["MAX_CONTENT_LENGTH"] = options.max_body_bytes
    st = ServerState(config=config, options=options)
    app.weir_state = st
    app.weir_shutdown = trio.Event()
    app.weir_failed = None
    app.weir_bad_input = False  # start-up failed on the model given: exit code 2
    app.register_blueprint(bp)
    app.register_blueprint(generate_bp)
    app.register_blueprint(responses_bp)
    app.register_blueprint(embeddings_bp)
    st.tasks = options.tasks
    st.responses = Runs.from_options(options)

    def origin_allowed(origin: str) -> bool:
        return "*" in options.allowed_origins or origin in options.allowed_origins

    @app.before_request
    async def _cors_and_auth() -> Response | None:
        origin = request.headers.get("Origin")
        if (
            request.method == "OPTIONS"
            and origin
            and request.headers.get("Access-Control-Request-Method")
        ):
            # CORS preflight: answered before auth (browsers send it without credentials).
            if not origin_allowed(origin):
                return error_response(403, f"origin {origin} is not allowed", None, "cors")
            asked = request.headers.get("Access-Control-Request-Headers", "")
            return Response(
                b"",
                status=204,
                headers={
                    "Access-Control-Allow-Origin": origin,
                    "Access-Control-Allow-Methods": ", ".join(
                        ["GET", "POST", "DELETE", "OPTIONS"]
                        if "*" in options.allowed_methods
                        else options.allowed_methods
                    ),
                    "Access-Control-Allow-Headers": asked
                    if "*" in options.allowed_headers
                    else ", ".join(options.allowed_headers),
                    "Access-Control-Max-Age": "600",
                    "Vary": "Origin",
                },
            )
        if options.api_key and request.path.startswith(PROTECTED_PREFIXES):
            given = request.headers.get("Authorization", "")
            expected = f"Bearer {options.api_key}"
            if not hmac.compare_digest(given.encode(), expected.encode()):
                return error_response(
                    401,
                    "Missing or invalid API key: send `Authorization: Bearer <key>`",
                    None,
                    "invalid_api_key",
                )
        return None

    @app.after_request
    async def _headers(response: Response) -> Response:
        rid = request.headers.get("X-Request-Id")
        if rid and len(rid) <= 256 and rid.isprintable():
            response.headers["X-Request-Id"] = rid
        origin = request.headers.get("Origin")
        if origin and origin_allowed(origin):
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Vary"] = "Origin"
        return response

    @app.errorhandler(APIError)
    async def _api_error(e: APIError) -> Response:
        return error_response(e.status, e.message, e.param, e.code, e.headers)

    @app.errorhandler(HTTPException)
    async def _http_error(e: HTTPException) -> Response:
        return error_response(e.code or 500, e.description or e.name, None, None)

    @app.errorhandler(Exception)
    async def _unexpected(e: Exception) -> Response:
        log.exception("unhandled error")
        return error_response(500, f"Internal server error: {type(e).__name__}", None, None)

    @app.before_serving
    async def _start() -> None:
        app.nursery.start_soon(_load_engine, app, st)

    @app.after_serving
    async def _stop() -> None:
        if st.status != "failed":  # keep the reason a failed start gives
            st.status, st.reason = "stopping", "shutting down"
        if st.engine is not None:
            await st.engine.shutdown()
        st.responses.close()

    return app


def _fail(app: QuartTrio, st: ServerState, reason: str) -> None:
    st.status, st.reason = "failed", reason
    app.weir_failed = reason
    app.weir_shutdown.set()


async def _load_engine(app: QuartTrio, st: ServerState) -> None:
    try:
        st.chat_template = load_template(st.config.chat_template)
        if st.options.engine_process:
            engine = EngineProcess(st.config)
            try:
                loaded = await trio.to_thread.run_sync(_launch, engine)
            except BaseException:
                await engine.shutdown()  # no child may outlive a failed start
                raise
        else:
            loaded = await trio.to_thread.run_sync(_load, st.config)
            engine = EngineThread(loaded.core)
            loaded = _Frontend(
                loaded.tokenizer,
                loaded.served_names,
                loaded.max_model_len,
                loaded.generation_defaults,
                loaded.core.kv.num_blocks,
                loaded.kv_dtype,
                loaded.core.runner.vocab_size,
                str(loaded.model_path),
                loaded.weight_bytes or {},
                loaded.kv_cache_bytes,
                loaded.lora_base,
            )
        lora = None
        if st.config.enable_lora:  # --lora-modules, checked before anything is served
            lora = LoraRegistry(loaded.lora_base, st.config.max_lora_rank)
            try:
                lora.load_modules(st.config.lora_modules)
            except (LoraError, ValueError) as e:
                await engine.shutdown()
                raise CheckpointError(f"--lora-modules: {e}") from None
        cache = CacheInfo(
            st.config.block_size,
            loaded.num_blocks,
            st.config.enable_prefix_caching,
            loaded.kv_dtype,
            st.config.gpu_memory_utilization,
            loaded.num_blocks * st.config.block_size,
            loaded.num_blocks * st.config.block_size / loaded.max_model_len,
        )
        metrics = Metrics(
            st.options.metrics_prefix,
            loaded.served_names[0],
            loaded.max_model_len,
            cache,
            Memory(loaded.weight_bytes, loaded.kv_cache_bytes, loaded.kv_dtype),
            st.config.max_loras if st.config.enable_lora else None,
        )
        engine.on_stats = metrics.publish
        if st.options.log_stats:
            stats_log = StatsLog()

            def on_stats(s: StepStats) -> None:
                metrics.publish(s)
                stats_log.observe(s)

            engine.on_stats = on_stats
            app.nursery.start_soon(stats_log.run, st.options.stats_interval)

        def died(message: str) -> None:
            log.error("%s", message)
            if st.options.exit_on_engine_error:
                # In-flight requests already got the error; exit so the orchestrator restarts us.
                _fail(app, st, message)

        engine.on_death = died
        engine.start()
    except CheckpointError as e:  # the model given: exit code 2, as for any bad argument
        log.error("could not load the model: %s", e)
        app.weir_bad_input = True
        _fail(app, st, str(e) if str(e).startswith("loading failed") else f"loading failed: {e}")
        return
    except Exception as e:  # noqa: BLE001 - reported, and the server shuts itself down
        log.exception("could not load the model")
        _fail(app, st, f"loading failed: {type(e).__name__}: {e}")
        return
    st.engine = engine
    st.metrics = metrics
    st.lora = lora
    st.tokenizer = loaded.tokenizer
    st.served_names = loaded.served_names
    st.max_model_len = loaded.max_model_len
    st.generation_defaults = loaded.generation_defaults
    st.token_text = TokenText(loaded.tokenizer)
    st.vocab_size = loaded.vocab_size
    if "embed" in st.tasks:
        st.embedding = embedding_config.resolve(
            Path(loaded.model_path), st.options.pooling, st.options.normalize
        )
        log.info(
            "embeddings: %s pooling%s", st.embedding.kind, ", normalized" * st.embedding.normalize
        )
    template = st.chat_template or getattr(loaded.tokenizer, "chat_template", None)
    st.reasoning_parser = reasoning.resolve(st.options.reasoning_parser, template)
    st.tool_parser = tool_parsers.resolve(st.options.tool_call_parser, template)
    if st.tool_parser is not None:
        log.info("tool-call parser: %s", st.tool_parser)
    if st.options.reasoning_parser is not None:
        log.info(
            "reasoning parser: %s", st.reasoning_parser or "none (the template has no <think>)"
        )
    # What start-up made (torch, transformers, the model, the tokenizer) lives as long as the
    # process: out of the collector's reach, a full collection while serving walks only what
    # serving made (a full collection of start-up's objects stalled every stream: figures in
    # docs/benchmarks.md).
    gc.freeze()
    if st.status == "loading":
        st.status, st.reason = "ready", "ok"
    log.info("serving %s", ", ".join(st.served_names))


def _load(config: EngineConfig):
    from gpu import openmp

    openmp.prepare(config)  # before torch is imported (gpu/openmp.py)
    from gpu.launch import load  # the only place the server reaches into gpu/

    return load(config)


class _Frontend(NamedTuple):
    """What the server needs of a model the engine process loaded."""

    tokenizer: Any
    served_names: list[str]
    max_model_len: int
    generation_defaults: dict[str, Any]
    num_blocks: int
    kv_dtype: str
    vocab_size: int
    model_path: str
    weight_bytes: dict[str, int]
    kv_cache_bytes: int
    lora_base: Any = None


def _launch(engine: EngineProcess) -> _Frontend:
    """Start the engine process, wait for its model, then load the tokenizer from the same
    (already resolved or downloaded) directory for chat templates and prompts."""
    from transformers import AutoTokenizer

    info = engine.launch()
    return _Frontend(
        AutoTokenizer.from_pretrained(info.tokenizer_path or info.model_path),
        info.served_names,
        info.max_model_len,
        info.generation_defaults,
        info.num_blocks,
        info.kv_dtype,
        info.vocab_size,
        info.model_path,
        info.weight_bytes,
        info.kv_cache_bytes,
        info.lora_base,
    )


async def serve(
    app: QuartTrio,
    host: str,
    port: int,
    *,
    task_status=trio.TASK_STATUS_IGNORED,
    handle_signals: bool = True,
    sock: socket.socket | None = None,
) -> int:
    """Serve until SIGINT/SIGTERM or `app.weir_shutdown`; then drain. Returns the exit code.

    Drain: /health turns 503 and new generation requests get 503 at once; in-flight requests run
    to completion for up to --drain-timeout; then Hypercorn stops. A second signal exits at once.
    """
    st: ServerState = app.weir_state
    options = st.options
    shutdown: trio.Event = app.weir_shutdown
    force = trio.Event()
    sock = sock or listening_socket(host, port, options.tcp_user_timeout)
    hc = hypercorn_config(sock, options)
    stop_http = trio.Event()
    signal_scope = trio.CancelScope()

    async def watch_signals() -> None:
        with signal_scope, trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                if shutdown.is_set():
                    log.warning("second signal: exiting now")
                    force.set()
                    return
                log.info("signal received: draining")
                shutdown.set()

    try:
        async with trio.open_nursery() as nursery:
            if handle_signals:
                nursery.start_soon(watch_signals)
            await nursery.start(
                lambda task_status: hypercorn_serve(
                    app, hc, shutdown_trigger=stop_http.wait, task_status=task_status
                )
            )
            task_status.started()
            await shutdown.wait()
            if st.status in ("ready", "loading"):
                st.status, st.reason = "draining", "draining: the server is shutting down"
            async with trio.open_nursery() as drain:

                async def wait_force() -> None:
                    await force.wait()
                    drain.cancel_scope.cancel()

                drain.start_soon(wait_force)
                with trio.move_on_after(options.drain_timeout):
                    while st.inflight:
                        await st.idle.wait()
                if st.inflight:
                    log.warning("drain timeout: %d requests still in flight", len(st.inflight))
                drain.cancel_scope.cancel()
            # Background responses still running are stopped and stored as incomplete.
            with trio.move_on_after(5):
                for run in st.responses.interrupt():
                    await run.saved.wait()
            if force.is_set():
                nursery.cancel_scope.cancel()
            stop_http.set()
            signal_scope.cancel()
            nursery.cancel_scope.deadline = trio.current_time() + hc.graceful_timeout + 5
    finally:
        sock.close()
    if force.is_set():
        return 1
    if app.weir_failed:
        return 2 if app.weir_bad_input else 1
    return 0
