"""Running weir in production: metrics, health, auth and CORS, load shedding, request timeouts,
graceful drain on SIGTERM, and clients that stop reading."""

from __future__ import annotations

import gc
import os
import re
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from core.config import EngineConfig
from core.engine import Hold
from tests.conftest import (
    LiveServer,
    http_status,
    wait_for,
)

USER = [{"role": "user", "content": "Tell me about the river"}]


def metric(text: str, name: str, **labels) -> float:
    """The value of one sample in Prometheus text format."""
    total = 0.0
    found = False
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        m = re.match(r"([^{ ]+)(?:\{([^}]*)\})? (\S+)", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
            found = True
    assert found, f"no sample {name} {labels}"
    return total


@pytest.fixture(scope="module")
def tiny(model_dir):
    return str(model_dir("qwen3"))


def test_metrics_count_a_known_workload(tiny):
    server = LiveServer(
        EngineConfig(model=tiny, served_model_name=["m"], num_kv_blocks=128),
        metrics_prefix="vllm",
        engine_process=True,  # the default: statistics cross the process boundary every step
    ).start()
    try:
        url = server.url
        prompts = [[11, 12, 13], [14, 15, 16, 17, 18], [19] * 9]
        for ids in prompts:
            r = httpx.post(
                url + "/v1/completions",
                json={"prompt": ids, "max_tokens": 6, "ignore_eos": True, "temperature": 0},
            )
            assert r.json()["usage"]["completion_tokens"] == 6
        text = httpx.get(url + "/metrics").text
        assert 'model_name="m"' in text
        assert metric(text, "vllm:prompt_tokens_total") == sum(map(len, prompts))
        assert metric(text, "vllm:generation_tokens_total") == 18
        assert metric(text, "vllm:request_success_total", finished_reason="length") == 3
        for h in (
            "time_to_first_token_seconds",
            "e2e_request_latency_seconds",
            "request_queue_time_seconds",
            "request_prefill_time_seconds",
            "request_decode_time_seconds",
            "request_prompt_tokens",
            "request_generation_tokens",
        ):
            assert metric(text, f"vllm:{h}_count") == 3, h
        assert metric(text, "vllm:request_generation_tokens_sum") == 18
        assert metric(text, "vllm:inter_token_latency_seconds_count") == 15
        assert metric(text, "vllm:iteration_tokens_total_sum") == sum(map(len, prompts)) + 15
        assert metric(text, "vllm:prefix_cache_queries_total") >= sum(map(len, prompts))
        for g in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            assert metric(text, f"vllm:{g}") == 0

        # Streams cancelled mid-way: running, waiting and KV usage go back to 0. Held once
        # each has 32 tokens, they can only end by their aborts.
        server.engine.hold(Hold(at_output_tokens=32))

        def cancel_mid_stream(i: int) -> None:
            body = {"messages": USER, "max_tokens": 400, "stream": True, "ignore_eos": True}
            body["logprobs"] = True  # every output an event, even one that adds no text yet
            with httpx.stream("POST", url + "/v1/chat/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and '"logprobs":{' in line:
                        break  # the first tokens read, the rest not

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(cancel_mid_stream, range(4)))

        def settled() -> bool:
            t = httpx.get(url + "/metrics").text
            return all(
                metric(t, f"vllm:{g}") == 0
                for g in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
            )

        assert wait_for(settled)
        text = httpx.get(url + "/metrics").text
        assert metric(text, "vllm:request_success_total", finished_reason="abort") == 4
    finally:
        server.stop()


def test_health_is_503_while_loading(tiny, monkeypatch):
    import server.engine_start as start

    release = threading.Event()
    real = start._load

    def slow_load(config):
        release.wait(60)
        return real(config)

    monkeypatch.setattr(start, "_load", slow_load)
    server = LiveServer(EngineConfig(model=tiny, num_kv_blocks=32))
    server._thread.start()
    try:
        assert wait_for(lambda: http_status(server.url + "/health") == 503)
        r = httpx.get(server.url + "/health")
        assert "loading" in r.json()["error"]["message"]
        assert httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}).status_code == 503
        frozen = gc.get_freeze_count()
        release.set()
        assert wait_for(lambda: http_status(server.url + "/health") == 200)
        # Ready means start-up's objects were moved out of the garbage collector's reach.
        assert gc.get_freeze_count() > frozen
    finally:
        release.set()
        server.stop()


def test_auth_and_cors(tiny):
    server = LiveServer(
        EngineConfig(model=tiny, served_model_name=["m"], num_kv_blocks=32),
        api_key="sekrit",
        allowed_origins=["https://app.example"],
    ).start()
    try:
        url = server.url
        protected = [
            ("GET", "/v1/models", None),
            ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
            ("POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 1}),
            ("POST", "/tokenize", {"prompt": "hi"}),
            ("POST", "/detokenize", {"tokens": [5]}),
            ("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 1}),
            ("POST", "/invocations", {"prompt": "hi", "max_tokens": 1}),
        ]
        for method, path, body in protected:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
                r = httpx.request(method, url + path, json=body, headers=headers)
                assert r.status_code == 401, (path, headers)
                assert r.json()["error"]["code"] == "invalid_api_key"
            r = httpx.request(
                method, url + path, json=body, headers={"Authorization": "Bearer sekrit"}
            )
            assert r.status_code == 200, (path, r.text)
        # the pooling routes (this server generates: with the key, a 400 naming the model)
        for path in ("/pooling", "/classify", "/score", "/rerank", "/v1/embeddings"):
            body = {"input": "hi", "text_1": "a", "text_2": "b", "query": "a", "documents": ["b"]}
            assert httpx.post(url + path, json=body).status_code == 401, path
            r = httpx.post(url + path, json=body, headers={"Authorization": "Bearer sekrit"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "model", (path, r.text)
        for path in ("/health", "/ping", "/metrics", "/version"):
            assert httpx.get(url + path).status_code == 200, path
        pre = httpx.options(
            url + "/v1/chat/completions",
            headers={
                "Origin": "https://app.example",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            },
        )
        assert pre.status_code == 204
        assert pre.headers["Access-Control-Allow-Origin"] == "https://app.example"
        assert "authorization" in pre.headers["Access-Control-Allow-Headers"]
        bad = httpx.options(
            url + "/v1/chat/completions",
            headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
        )
        assert bad.status_code == 403
        r = httpx.get(
            url + "/v1/models",
            headers={"Authorization": "Bearer sekrit", "Origin": "https://app.example"},
        )
        assert r.headers["Access-Control-Allow-Origin"] == "https://app.example"
    finally:
        server.stop()


def test_load_shedding_refuses_the_excess_at_once(tiny):
    server = LiveServer(
        EngineConfig(model=tiny, num_kv_blocks=256, max_num_seqs=2),
        max_waiting_requests=2,
        shed_status=429,
    ).start()
    try:

        def ask(i: int):
            t = time.monotonic()
            r = httpx.post(
                server.url + "/v1/completions",
                timeout=120,
                json={
                    "prompt": f"request {i}",
                    "max_tokens": 256,
                    "ignore_eos": True,
                    "temperature": 0,
                },
            )
            return r, time.monotonic() - t

        with ThreadPoolExecutor(20) as pool:
            # Two requests fill both running slots first (gathered, then held after their first
            # token: on a fast engine the first could otherwise finish before the second came);
            # then the engine is paused and a burst of 18 arrives: two may wait, the rest must
            # be refused, all while the engine has not stepped again (refusals never wait).
            server.engine.hold(Hold(gather=2, at_output_tokens=1))
            first = [pool.submit(ask, i) for i in range(2)]
            assert wait_for(lambda: server.engine.last_stats.num_running == 2)
            server.engine.hold(Hold(paused=True))
            burst = [pool.submit(ask, i) for i in range(2, 20)]
            assert wait_for(lambda: sum(f.done() for f in burst) == 16)
            refused_while_paused = [f.result()[0] for f in burst if f.done()]
            server.engine.release()
            results = [f.result() for f in first + burst]
        ok = [r for r, _ in results if r.status_code == 200]
        shed = [r for r, _ in results if r.status_code != 200]
        assert len(ok) == 4 and len(shed) == 16, [r.status_code for r, _ in results]
        assert all(r.status_code == 429 for r in refused_while_paused)
        for r in ok:
            assert r.json()["usage"]["completion_tokens"] == 256
        for r in shed:
            assert r.status_code == 429 and r.headers["Retry-After"] == "1"
            assert r.json()["error"]["code"] == "overloaded"
        assert httpx.get(server.url + "/health").status_code == 200
    finally:
        server.stop()


def test_request_timeout_ends_with_length_and_frees_blocks(tiny):
    server = LiveServer(
        EngineConfig(model=tiny, num_kv_blocks=1024, max_model_len=4096), request_timeout=0.5
    ).start()
    try:
        # Held at 5 tokens, the request can only end by its timeout.
        server.engine.hold(Hold(at_output_tokens=5))
        r = httpx.post(
            server.url + "/v1/completions",
            timeout=60,
            json={"prompt": "hi", "max_tokens": 4000, "ignore_eos": True},
        )
        c = r.json()["choices"][0]
        assert r.status_code == 200 and c["finish_reason"] == "length"
        assert r.json()["usage"]["completion_tokens"] == 5
        engine = server.engine
        assert wait_for(lambda: engine.last_stats.num_free_blocks == 1024)
    finally:
        server.stop()


def test_stream_interval_batches_tokens_per_event(tiny):
    server = LiveServer(EngineConfig(model=tiny, num_kv_blocks=64), stream_interval=4).start()
    # Lockstep: the engine steps again only once the handler has taken what was due, so how
    # many tokens an event carries is decided by the interval alone, never by a late reader.
    server.engine.lockstep = True
    try:
        body = {
            "messages": USER,
            "max_tokens": 21,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": True,
        }
        full = httpx.post(server.url + "/v1/chat/completions", json=body).json()
        import json as _json

        with httpx.stream(
            "POST", server.url + "/v1/chat/completions", json={**body, "stream": True}
        ) as r:
            events = [
                _json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")
            ]
        per_event = [
            len(e["choices"][0]["logprobs"]["content"])
            for e in events
            if e["choices"] and e["choices"][0].get("logprobs")
        ]
        # The first token wakes the reader at once; then every 4th; the end wakes it too.
        assert per_event == [1, 4, 4, 4, 4, 4], per_event
        text = "".join(
            e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]
        )
        assert text == full["choices"][0]["message"]["content"]
    finally:
        server.stop()


def test_listen_backlog_is_not_shrunk_by_hypercorn(tiny):
    """Hypercorn re-listens on the socket it is given, with its own backlog (100) unless told
    otherwise; 256 clients connecting at once then overflowed the accept queue and were reset."""
    import shutil

    from server.listen import BACKLOG, hypercorn_config, listening_socket
    from server.options import ServerOptions

    sock = listening_socket("127.0.0.1", 0, 30.0)
    try:
        hc = hypercorn_config(sock, ServerOptions())
        assert hc.backlog == BACKLOG >= 1024
        os.close(int(hc.bind[0].removeprefix("fd://")))  # the duplicate made for Hypercorn
    finally:
        sock.close()
    if shutil.which("ss") is None:
        return  # the kernel's view below needs iproute2's ss; the config check above stands
    server = LiveServer(EngineConfig(model=tiny, num_kv_blocks=32)).start()
    try:
        # For a listening socket, ss reports the backlog in the Send-Q column.
        out = subprocess.run(
            ["ss", "-ltnH", f"sport = :{server.port}"], capture_output=True, text=True
        ).stdout.split()
        assert out and out[0] == "LISTEN" and int(out[2]) == BACKLOG, out
    finally:
        server.stop()
