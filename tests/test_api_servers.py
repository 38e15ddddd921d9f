"""`weir serve --api-server-count 2`, as operators start it: two HTTP processes on one port in
front of one engine process. Every route answers from each API server (reached on its own Unix
socket), streams on the shared port spread over both, /metrics sums both and counts the engine
once, Responses state and cancellation work across them. Order is made explicit by stopping the
engine process (SIGSTOP), never by sleeps. Starting, stopping and failing:
tests/test_api_server_lifecycle.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from tests.api_cluster import Cluster, total
from tests.conftest import wait_for

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}  # the clients of `cluster` send it themselves


@pytest.fixture(scope="module")
def tiny(model_dir):
    return str(model_dir("qwen3"))


@pytest.fixture(scope="module")
def cluster(tiny, tmp_path_factory):
    c = Cluster(tiny, tmp_path_factory.mktemp("api"), "--enable-embeddings", key=KEY)
    yield c
    c.close()


def test_every_route_answers_from_every_api_server(cluster):
    # before any request: the engine's gauges are there, at zero (they had been absent until
    # the first step with several API servers: alerts on them saw no data)
    for client in cluster.clients:
        text = client.get("/metrics").text
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            assert f"weir:{name}{{" in text, name
    for i, client in enumerate(cluster.clients):
        here = str(i)

        def ok(r: httpx.Response) -> httpx.Response:
            assert r.status_code == 200, r.text
            assert r.headers["x-weir-api-server"] == here
            return r

        assert ok(client.get("/v1/models")).json()["data"][0]["id"]
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        got = ok(client.post("/v1/chat/completions", json=chat)).json()
        assert got["usage"]["completion_tokens"] >= 1
        with client.stream(
            "POST", "/v1/chat/completions", json={**chat, "stream": True}
        ) as r:
            assert r.headers["x-weir-api-server"] == here
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        done = ok(client.post("/v1/completions", json={"prompt": "a b", "max_tokens": 3}))
        assert done.json()["choices"][0]["finish_reason"] in ("stop", "length")
        vec = ok(client.post("/v1/embeddings", json={"input": ["a river"]})).json()
        assert len(vec["data"][0]["embedding"]) > 0
        ids = ok(client.post("/tokenize", json={"prompt": "a river"})).json()
        text = ok(client.post("/detokenize", json={"tokens": ids["tokens"]}))
        assert "river" in text.json()["prompt"]
        resp = ok(client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 4}))
        assert resp.json()["status"] in ("completed", "incomplete")
        ok(client.get("/health"))
        ok(client.get("/version"))
        assert "weir:num_requests_running" in ok(client.get("/metrics")).text
        # --api-key holds on every API server.
        wrong = {"Authorization": "Bearer wrong"}
        refused = client.get("/v1/models", headers=wrong)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        denied = client.post("/v1/completions", json={"prompt": "x"}, headers=wrong)
        assert denied.status_code == 401


def test_streams_on_the_shared_port_spread_over_both_api_servers(cluster):
    # The port is a SO_REUSEPORT group: the kernel picks a server by a hash of each
    # connection's addresses, so 40 connections all landing on one server has probability
    # 2**-39: both serve, and every stream is whole.
    results: list[tuple[str, list[str]]] = []

    def stream(i: int) -> None:
        body = {
            "prompt": f"stream {i}",
            "max_tokens": 6,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.stream(
            "POST", cluster.url + "/v1/completions", json=body, headers=AUTH, timeout=120
        ) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line]
            results.append((r.headers["x-weir-api-server"], lines))

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 40
    assert {server for server, _ in results} == {"0", "1"}
    for _, lines in results:
        assert lines[-1] == "data: [DONE]"
        assert '"finish_reason":"length"' in lines[-3]
        assert '"completion_tokens":6' in lines[-2]  # the usage chunk


def test_metrics_sum_the_api_servers_and_count_the_engine_once(cluster):
    def sample(client: httpx.Client) -> tuple[float, float, float]:
        return (
            total(client, "weir:request_success_total"),
            total(client, "weir:generation_tokens_total"),
            total(client, "weir:request_params_n_count"),  # observed by each API server
        )

    before = sample(cluster.clients[0])
    for i, client in enumerate(cluster.clients):
        for _ in range(3 + i):  # 3 through API server 0, 4 through API server 1
            body = {"prompt": "count me", "max_tokens": 5, "ignore_eos": True}
            assert client.post("/v1/completions", json=body).status_code == 200
    # The last step's statistics reach API server 0 on their own frame: wait for them.
    want = (before[0] + 7, before[1] + 35, before[2] + 7)
    assert wait_for(lambda: sample(cluster.clients[0]) == want, timeout=30), (
        sample(cluster.clients[0]),
        want,
    )
    assert sample(cluster.clients[1]) == want  # either server reads every server's files


def test_responses_state_and_cancel_work_across_api_servers(cluster):
    first, second = cluster.clients
    aborted_before = total(first, "weir:request_success_total", finished_reason="abort")
    os.kill(cluster.engine, signal.SIGSTOP)  # the response stays running until cancelled
    try:
        body = {"input": "a long story", "background": True, "max_output_tokens": 200}
        created = first.post("/v1/responses", json=body).json()
        rid = created["id"]
        assert created["status"] == "queued"
        # Only API server 0 holds its state so far: API server 1 asks it.
        seen = second.get(f"/v1/responses/{rid}")
        assert seen.status_code == 200 and seen.headers["x-weir-forwarded-to"] == "0"
        assert seen.json()["status"] in ("queued", "in_progress")
        with second.stream("GET", f"/v1/responses/{rid}?stream=true") as live:
            assert live.headers["x-weir-forwarded-to"] == "0"
            for line in live.iter_lines():
                if line.startswith("event: response.in_progress"):
                    break  # live, as a stream from API server 0 itself
        refused = second.delete(f"/v1/responses/{rid}")
        assert refused.status_code == 400 and "cancel it first" in refused.text
        follow_up = {"input": "more", "previous_response_id": rid}
        assert second.post("/v1/responses", json=follow_up).status_code == 400
        cancelled = second.post(f"/v1/responses/{rid}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    finally:
        os.kill(cluster.engine, signal.SIGCONT)
    for client in (first, second):
        assert client.get(f"/v1/responses/{rid}").json()["status"] == "cancelled"
    # The cancel reached the engine: its request ended as aborted (counted at the next step).
    assert first.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    assert wait_for(
        lambda: total(first, "weir:request_success_total", finished_reason="abort")
        == aborted_before + 1,
        timeout=30,
    )
    # A stored response made through one API server continues, lists and deletes through the
    # other.
    made = second.post("/v1/responses", json={"input": "hello", "max_output_tokens": 4})
    rid = made.json()["id"]
    again = first.post(
        "/v1/responses",
        json={"input": "and then?", "previous_response_id": rid, "max_output_tokens": 4},
    )
    assert again.status_code == 200, again.text
    items = first.get(f"/v1/responses/{again.json()['id']}/input_items").json()
    assert len(items["data"]) == 3  # hello, its reply, and then?
    assert first.delete(f"/v1/responses/{rid}").status_code == 200
    assert second.get(f"/v1/responses/{rid}").status_code == 404


def test_lora_info_keeps_one_live_series_with_several_api_servers(tmp_path):
    # prometheus_client's multiprocess mode (every API server's files) cannot remove a series:
    # lora_requests_info had kept a series for every set of adapters ever seen, each with a
    # pid label, and warned at each change. The current one is now the only one above 0.
    script = (
        "import sys, warnings\n"
        "warnings.simplefilter('error')\n"
        "from core.stats import StepStats\n"
        "from server.metrics import Metrics\n"
        "m = Metrics('weir', 'base', 64, multiprocess=True, max_loras=2)\n"
        "for running in (['a'], [], ['b']):\n"
        "    m.publish(StepStats(lora_running=running))\n"
        "sys.stdout.write(m.render()[0].decode())\n"
    )
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    series = {}
    for line in done.stdout.splitlines():
        if line.startswith("weir:lora_requests_info{"):
            labels, value = line.rsplit(" ", 1)
            assert "pid=" not in labels
            series[labels.split('running_lora_adapters="')[1].split('"')[0]] = float(value)
    assert set(series) == {"a", "", "b"}
    assert series["b"] > 0 and series["a"] == series[""] == 0
