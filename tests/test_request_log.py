"""The request log (logger weir.requests): one line per finished request with its counts and
times, a refused request's line, none with --no-log-requests, and an aborted request's line
counting what it generated."""

from __future__ import annotations

import httpx
import pytest

from core.config import EngineConfig
from core.engine import Hold
from tests.conftest import LiveServer, wait_for
from tests.test_ops import metric


@pytest.fixture(scope="module")
def tiny(model_dir):
    return str(model_dir("qwen3"))


def test_one_log_line_per_finished_request(tiny, caplog):
    import logging

    server = LiveServer(EngineConfig(model=tiny, num_kv_blocks=64)).start()
    try:
        with caplog.at_level(logging.INFO, logger="weir.requests"):
            r = httpx.post(
                server.url + "/v1/completions",
                headers={"X-Request-Id": "log-me"},
                json={"prompt": [11, 12, 13], "max_tokens": 3, "ignore_eos": True},
            )
            assert r.status_code == 200
            assert wait_for(lambda: any("log-me" in m for m in caplog.messages))
        line = next(m for m in caplog.messages if "log-me" in m)
        # a refused request has its line too (as an access log shows it)
        with caplog.at_level(logging.INFO, logger="weir.requests"):
            bad = httpx.post(
                server.url + "/v1/completions",
                headers={"X-Request-Id": "bad-one"},
                json={"prompt": "hi", "max_tokens": -1},
            )
            assert bad.status_code == 400
            assert wait_for(lambda: any("bad-one" in m for m in caplog.messages))
        refused = next(m for m in caplog.messages if "bad-one" in m)
        assert "refused POST /v1/completions" in refused and refused.endswith(": 400")
        for part in (
            "prompt_tokens=3",
            "generated=3",
            "cached=0",
            "ttft=",
            "duration=",
            "finish=length",
        ):
            assert part in line, line
    finally:
        server.stop()
    quiet = LiveServer(EngineConfig(model=tiny, num_kv_blocks=64), log_requests=False).start()
    try:
        with caplog.at_level(logging.INFO, logger="weir.requests"):
            httpx.post(
                quiet.url + "/v1/completions",
                headers={"X-Request-Id": "silent"},
                json={"prompt": [11], "max_tokens": 1},
            )
        assert not any("silent" in m for m in caplog.messages)
    finally:
        quiet.stop()


def test_an_aborted_plain_request_logs_what_it_generated(tiny, caplog):
    """A non-streaming request whose client leaves at 40 tokens logs generated=40 (its reader,
    woken only at the end, had logged its first output's count)."""
    import logging
    import socket

    server = LiveServer(EngineConfig(model=tiny, num_kv_blocks=256)).start()
    try:
        server.engine.hold(Hold(at_output_tokens=40))
        with caplog.at_level(logging.INFO, logger="weir.requests"):
            sock = socket.create_connection(("127.0.0.1", server.port))
            body = b'{"prompt": "hi", "max_tokens": 4000, "ignore_eos": true}'
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Request-Id: left\r\n"
                b"Content-Type: application/json\r\nContent-Length: "
                + str(len(body)).encode() + b"\r\n\r\n" + body
            )  # fmt: skip
            assert wait_for(
                lambda: metric(
                    httpx.get(server.url + "/metrics").text, "weir:generation_tokens_total"
                )
                >= 40
            )
            sock.close()
            assert wait_for(lambda: any("left" in m for m in caplog.messages))
        line = next(m for m in caplog.messages if "left" in m)
        assert "generated=40 " in line and "finish=abort" in line, line
    finally:
        server.stop()
