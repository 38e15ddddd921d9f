"""A server going away as operators see it: SIGTERM drains in-flight streams then exits 0, a second
signal exits at once, a client that stops reading is dropped and its request aborted."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading

import httpx
import pytest

from core.config import EngineConfig
from core.engine import Hold
from tests.conftest import (
    LiveServer,
    aborted,
    alive,
    engine_process_of,
    free_port,
    http_status,
    signal_pid,
    wait_for,
)

from tests.test_ops import metric


@pytest.fixture(scope="module")
def tiny(model_dir):
    return str(model_dir("qwen3"))


def start_process(tiny: str, *args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "server",
            "serve",
            tiny,
            "--port",
            str(port),
            "--num-kv-blocks",
            "1024",
            "--max-model-len",
            "2048",
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    assert wait_for(
        lambda: proc.poll() is not None or http_status(url + "/health") == 200, timeout=120
    )
    assert proc.poll() is None, proc.stdout.read().decode()
    return proc, url


def test_sigterm_drains_in_flight_streams_then_exits_0(tiny):
    proc, url = start_process(tiny, "--drain-timeout", "60")
    engine = engine_process_of(proc.pid)
    try:
        started = threading.Barrier(6)
        results: list[list[str]] = []

        def stream(i: int) -> None:
            body = {"prompt": f"stream {i}", "max_tokens": 600, "stream": True, "ignore_eos": True}
            lines = []
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                for n, line in enumerate(r.iter_lines()):
                    if n == 2:
                        started.wait(30)
                    if line:
                        lines.append(line)
            results.append(lines)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(5)]
        for t in threads:
            t.start()
        started.wait(30)  # all five are streaming
        # The engine stopped: the streams are still in flight whatever the machine's speed.
        os.kill(engine, signal.SIGSTOP)
        proc.send_signal(signal.SIGTERM)
        assert wait_for(lambda: http_status(url + "/health") == 503, timeout=30)
        r = httpx.post(url + "/v1/completions", json={"prompt": "late", "max_tokens": 2})
        assert r.status_code == 503
        os.kill(engine, signal.SIGCONT)
        for t in threads:
            t.join(120)
        assert len(results) == 5
        for lines in results:
            assert lines[-1] == "data: [DONE]"
            assert '"finish_reason":"length"' in lines[-2]
        assert proc.wait(60) == 0
    finally:
        signal_pid(engine, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()


def test_second_signal_exits_at_once(tiny):
    proc, url = start_process(tiny, "--drain-timeout", "120")
    engine = engine_process_of(proc.pid)
    try:

        def stream() -> None:
            body = {"prompt": "long", "max_tokens": 2000, "stream": True, "ignore_eos": True}
            try:
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                    for _ in r.iter_lines():
                        pass
            except httpx.HTTPError:
                pass

        t = threading.Thread(target=stream, daemon=True)
        t.start()
        # The stream is running once the server's own gauge says so; the engine then stops, so
        # only the second signal can end it.
        assert wait_for(
            lambda: metric(httpx.get(url + "/metrics").text, "weir:num_requests_running") == 1,
            timeout=30,
        )
        os.kill(engine, signal.SIGSTOP)
        proc.send_signal(signal.SIGTERM)
        assert wait_for(lambda: http_status(url + "/health") == 503, timeout=30)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) != 0
    finally:
        signal_pid(engine, signal.SIGCONT)  # it leaves when it reads the closed pipe
        if proc.poll() is None:
            proc.kill()
        assert wait_for(lambda: not alive(engine), timeout=30)


def test_client_that_stops_reading_is_dropped_and_aborted(tiny):
    server = LiveServer(
        EngineConfig(model=tiny, num_kv_blocks=2048, max_model_len=4096), tcp_user_timeout=1.0
    ).start()
    try:
        engine = server.engine
        # Held at 500 tokens (far more SSE than the window and the send buffer take), the
        # request can only end by the abort the dropped connection sends.
        engine.hold(Hold(at_output_tokens=500))
        aborted_before = aborted(server)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # a tiny receive window
        sock.connect(("127.0.0.1", server.port))
        body = b'{"prompt": "hi", "max_tokens": 4000, "stream": true, "ignore_eos": true}'
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
            b"application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        assert wait_for(lambda: engine.last_stats.num_running == 1, timeout=10)
        # Never read. The window closes, sent data goes unacknowledged, the kernel drops the
        # connection after TCP_USER_TIMEOUT, and the handler's cancellation aborts the request.
        assert wait_for(lambda: aborted(server) > aborted_before, timeout=30)
        assert wait_for(lambda: engine.last_stats.num_free_blocks == 2048)
        sock.close()
    finally:
        server.stop()


@pytest.mark.parametrize("servers", ["1", "2"])
def test_sigterm_while_the_model_loads_exits_0_at_once(servers):
    """The engine process is killed while it loads (it has taken nothing), instead of the server
    waiting out a load that may outlast an orchestrator's grace period. Held in loading for
    sure: the model is a hub id, the hub a socket here that accepts the download's connection
    and never answers (the signal goes once the engine has connected)."""
    hub = socket.socket()
    hub.bind(("127.0.0.1", 0))
    hub.listen()
    env = {
        **os.environ,
        "HF_ENDPOINT": f"http://127.0.0.1:{hub.getsockname()[1]}",
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_ETAG_TIMEOUT": "600",
        "HF_HUB_DOWNLOAD_TIMEOUT": "600",
    }
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "server", "serve", "someone/some-model", "--port", str(port)]
        + ["--api-server-count", servers],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        hub.settimeout(120)
        conn, _ = hub.accept()  # the engine process is downloading: it is loading
        engine = engine_process_of(proc.pid)
        # no model to list yet (it had answered 200 with an empty list)
        assert wait_for(lambda: http_status(f"http://127.0.0.1:{port}/health") == 503)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models")
        assert models.status_code == 503 and "loading" in models.json()["error"]["message"]
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
        conn.close()
    finally:
        hub.close()
        if proc.poll() is None:
            proc.kill()
    out = proc.stdout.read()
    assert code == 0, out
    assert "stopped while the model was loading" in out
    assert not alive(engine)


def test_past_the_drain_timeout_requests_end_with_a_503(tiny):
    """--drain-timeout 1 with a stream and a plain request that cannot finish (the engine is
    stopped): at the timeout each gets an answer, the stream an error event and [DONE], the
    plain one a 503 (they had been dropped without one, and the server kept running)."""
    proc, url = start_process(tiny, "--drain-timeout", "1")
    engine = engine_process_of(proc.pid)
    got: dict[str, object] = {}
    try:

        def stream() -> None:
            body = {"prompt": "long", "max_tokens": 1500, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                got["stream"] = [line for line in r.iter_lines() if line]

        def plain() -> None:
            body = {"prompt": "long", "max_tokens": 1500, "ignore_eos": True}
            got["plain"] = httpx.post(url + "/v1/completions", json=body, timeout=120)

        threads = [threading.Thread(target=f) for f in (stream, plain)]
        for t in threads:
            t.start()
        assert wait_for(
            lambda: metric(httpx.get(url + "/metrics").text, "weir:num_requests_running") == 2,
            timeout=60,
        )
        os.kill(engine, signal.SIGSTOP)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        assert got["plain"].status_code == 503
        assert "drain" in got["plain"].json()["error"]["message"]
        lines = got["stream"]
        assert lines[-1] == "data: [DONE]" and "shutting down" in lines[-2]
        os.kill(engine, signal.SIGCONT)
        assert proc.wait(60) == 0
    finally:
        signal_pid(engine, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
