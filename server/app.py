"""The QuartTrio app factory and `serve`: Hypercorn on Trio, the engine started in the lifespan."""

from __future__ import annotations

import logging
import signal

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from core.config import EngineConfig
from core.engine import Engine
from server.chat import load_template
from server.errors import APIError, error_response
from server.generate import bp as generate_bp
from server.logprobs import TokenText
from server.routes import bp
from server.state import ServerState

log = logging.getLogger("weir.server")


def create_app(config: EngineConfig, max_body_bytes: int = 32 * 1024 * 1024) -> QuartTrio:
    app = QuartTrio("weir")
    app.config["RESPONSE_TIMEOUT"] = None  # streams end when generation ends, not on a clock
    app.config["MAX_CONTENT_LENGTH"] = max_body_bytes
    st = ServerState(config=config)
    app.weir_state = st
    app.register_blueprint(bp)
    app.register_blueprint(generate_bp)

    @app.after_request
    async def _echo_request_id(response: Response) -> Response:
        rid = request.headers.get("X-Request-Id")
        if rid and len(rid) <= 256 and rid.isprintable():
            response.headers["X-Request-Id"] = rid
        return response

    @app.errorhandler(APIError)
    async def _api_error(e: APIError) -> Response:
        return error_response(e.status, e.message, e.param, e.code)

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
        st.status, st.reason = "stopping", "shutting down"
        if st.engine is not None:
            await st.engine.shutdown()

    return app


async def _load_engine(app: QuartTrio, st: ServerState) -> None:
    try:
        st.chat_template = load_template(st.config.chat_template)
        loaded = await trio.to_thread.run_sync(_load, st.config)
        engine = Engine(loaded.core)
        engine.start()
    except Exception as e:  # noqa: BLE001 - reported, and the server shuts itself down
        log.exception("could not load the model")
        st.status, st.reason = "failed", f"loading failed: {type(e).__name__}: {e}"
        app.weir_failed = st.reason
        shutdown = getattr(app, "weir_shutdown", None)
        if shutdown is not None:
            shutdown.set()
        return
    st.engine = engine
    st.tokenizer = loaded.tokenizer
    st.served_names = loaded.served_names
    st.max_model_len = loaded.max_model_len
    st.generation_defaults = loaded.generation_defaults
    st.token_text = TokenText(loaded.tokenizer)
    st.status, st.reason = "ready", "ok"
    log.info("serving %s", ", ".join(st.served_names))


def _load(config: EngineConfig):
    from gpu.launch import load  # the only place the server reaches into gpu/

    return load(config)


def hypercorn_config(host: str, port: int) -> HypercornConfig:
    hc = HypercornConfig()
    hc.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    hc.keep_alive_timeout = 75  # above common load-balancer idle timeouts
    hc.graceful_timeout = 30  # hypercorn's 3 s default cuts streams on shutdown
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")  # through our logging config, printed once
    return hc


async def serve(app: QuartTrio, host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED,
                handle_signals: bool = True) -> int:
    """Serve until SIGINT/SIGTERM (or `app.weir_shutdown` is set). Returns an exit code."""
    shutdown = trio.Event()
    app.weir_shutdown = shutdown
    app.weir_failed = None
    signal_scope = trio.CancelScope()

    async def watch_signals() -> None:
        with signal_scope, trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                log.info("shutting down")
                shutdown.set()
                return

    async with trio.open_nursery() as nursery:
        if handle_signals:
            nursery.start_soon(watch_signals)
        await nursery.start(
            lambda task_status: hypercorn_serve(
                app, hypercorn_config(host, port), shutdown_trigger=shutdown.wait,
                task_status=task_status)
        )
        task_status.started()
        await shutdown.wait()
        signal_scope.cancel()
        # Hypercorn finishes in-flight responses within its graceful timeout; this is the backstop.
        nursery.cancel_scope.deadline = trio.current_time() + 35
    return 1 if app.weir_failed else 0
