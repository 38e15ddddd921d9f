"""The QuartTrio app factory and `serve`: Hypercorn on Trio over a socket weir creates itself,
the engine started in the lifespan, auth and CORS in front of the routes, graceful drain."""

from __future__ import annotations

import hmac
import logging
import signal
import socket
from collections.abc import Awaitable, Callable

import trio
from hypercorn.trio import serve as hypercorn_serve
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from core.config import EngineConfig
from server.classify import bp as classify_bp
from server.embeddings import bp as embeddings_bp
from server.pooling import bp as pooling_bp
from server.scores import bp as scores_bp
from server.engine_start import load_engine
from server.errors import APIError, error_response
from server.generate import bp as generate_bp
from server.invocations import bp as invocations_bp
from server.responses.routes import bp as responses_bp
from server.responses.registry import Runs
from server.api_server_messages import Seat
from server.options import ServerOptions
from server.routes import bp
from server.state import ServerState
from server.listen import hypercorn_config, listening_socket

log = logging.getLogger("weir.server")
request_log = logging.getLogger("weir.requests")

PROTECTED_PREFIXES = (
    *("/v1/", "/v2/", "/tokenize", "/detokenize", "/classify", "/score", "/rerank", "/pooling"),
    "/invocations",
)


def create_app(
    config: EngineConfig, options: ServerOptions | None = None, seat: Seat | None = None
) -> QuartTrio:
    """The app; `seat`: this process is one of several API servers (server/api_server.py)."""
    options = options or ServerOptions()
    options.validate()
    app = QuartTrio("weir")
    app.config["RESPONSE_TIMEOUT"] = None  # streams end when generation ends, not on a clock
    app.config["MAX_CONTENT_LENGTH"] = options.max_body_bytes
    st = ServerState(config=config, options=options, seat=seat)
    app.weir_state = st
    app.weir_shutdown = trio.Event()
    app.weir_failed = None
    app.weir_bad_input = False  # start-up failed on the model given: exit code 2
    app.register_blueprint(bp)
    app.register_blueprint(generate_bp)
    app.register_blueprint(responses_bp)
    app.register_blueprint(embeddings_bp)
    app.register_blueprint(pooling_bp)
    app.register_blueprint(classify_bp)
    app.register_blueprint(scores_bp)
    app.register_blueprint(invocations_bp)
    st.tasks = options.tasks
    st.responses = Runs.from_options(options, seat)

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
                # The body is never read: the connection closes after the answer. Kept open,
                # Hypercorn sometimes left the client's next request on it unanswered.
                return error_response(
                    401,
                    "Missing or invalid API key: send `Authorization: Bearer <key>`",
                    None,
                    "invalid_api_key",
                    headers={"Connection": "close"},
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
        if seat is not None:  # which API server answered (tests, and operators reading logs)
            response.headers["X-Weir-Api-Server"] = str(seat.index)
        probe = request.path in ("/health", "/ping")  # a balancer's, every few seconds
        if response.status_code >= 400 and options.log_requests and not probe:
            # refused or failed before any generation (a served request logs its own line):
            # what an access log shows, for 400s, 401s, 404s and shedding alike
            request_log.info(
                "refused %s %s%s: %d",
                request.method,
                request.path,
                f" ({rid})" if rid else "",
                response.status_code,
            )
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
        app.nursery.start_soon(load_engine, app, st)

    @app.after_serving
    async def _stop() -> None:
        if st.status != "failed":  # keep the reason a failed start gives
            st.status, st.reason = "stopping", "shutting down"
        if st.engine is not None:
            await st.engine.shutdown()
        st.responses.close()

    return app


async def serve(
    app: QuartTrio,
    host: str,
    port: int,
    *,
    task_status=trio.TASK_STATUS_IGNORED,
    handle_signals: bool = True,
    sock: socket.socket | None = None,
    local_sock: socket.socket | None = None,
    stop_orders: Callable[[Callable[[str], bool]], Awaitable[None]] | None = None,
) -> int:
    """Serve until SIGINT/SIGTERM or `app.weir_shutdown`; then drain. Returns the exit code.

    Drain: /health turns 503 and new generation requests get 503 at once; in-flight requests run
    to completion for up to --drain-timeout; then Hypercorn stops. A second signal exits at once.

    An API server of several (server/api_server.py) serves `sock` (the port) and `local_sock`
    (its own Unix socket) and hears `stop_orders` instead of signals: an async function given
    `stop(what)`, which it calls for each order (True: the second, nothing more to hear).
    """
    st: ServerState = app.weir_state
    options = st.options
    shutdown: trio.Event = app.weir_shutdown
    force = trio.Event()
    sock = sock or listening_socket(host, port, options.tcp_user_timeout)
    hc = hypercorn_config(sock, options, local_sock)
    stop_http = trio.Event()
    signal_scope = trio.CancelScope()

    def stop(what: str) -> bool:
        if shutdown.is_set():
            log.warning("second %s: exiting now", what)
            force.set()
            return True
        log.info("%s received: draining", what)
        shutdown.set()
        return False

    async def watch_signals(stop: Callable[[str], bool]) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                if stop("signal"):
                    return

    watch = stop_orders or (watch_signals if handle_signals else None)

    async def watch_orders() -> None:
        with signal_scope:
            await watch(stop)

    try:
        async with trio.open_nursery() as nursery:
            if watch is not None:
                nursery.start_soon(watch_orders)
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
                    log.warning(
                        "drain timeout: %d requests still in flight, ended with a 503",
                        len(st.inflight),
                    )
                    for sub in [s for s in st.inflight if not s.background]:
                        sub.cut(
                            "The server is shutting down: this request did not finish within "
                            f"its drain time ({options.drain_timeout:g} s)"
                        )
                    # their handlers answer (a 503, or an error event ending the stream) at once;
                    # background responses are stopped below, stored as incomplete
                    with trio.move_on_after(2):
                        while any(not s.background for s in st.inflight):
                            await trio.sleep(0.01)
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
        if local_sock is not None:
            local_sock.close()
    if force.is_set():
        return 1
    if app.weir_failed:
        return 2 if app.weir_bad_input else 1
    return 0
