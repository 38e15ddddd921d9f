"""`weir serve --api-server-count 2`, started as operators start it: two HTTP processes on one port
in front of one engine process. Every route answers from each API server (reached on its own
Unix socket, so which one answers is never left to chance), streams on the shared port spread
over both, /metrics sums both, Responses state and cancellation work across them, the admission
limit holds for the whole server, a killed API server stops the whole server cleanly, SIGTERM
drains both. Order is made explicit by stopping the engine process (SIGSTOP), never by sleeps."""

from __future__ import annotations

import glob
import os
import re
import signal
import struct
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from server import cli, server_count
from server.options import ServerOptions
from tests.conftest import (
    alive,
    engine_process_of,
    free_port,
    signal_pid,
    wait_for,
)
from tests.test_ops import metric


def total(client: httpx.Client, name: str, **labels) -> float:
    """A metric's value summed over its samples (0 before it has any)."""
    try:
        return metric(client.get("/metrics").text, name, **labels)
    except AssertionError:
        return 0.0

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}  # the clients of `cluster` send it themselves


class Cluster:
    """A supervisor process, its run directory and a client for each API server's socket."""

    def __init__(self, tiny: str, tmp: Path, *flags: str, key: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tmp = tmp
        self.log = tmp / "server.log"
        env = dict(os.environ, TMPDIR=str(tmp))  # the run directory is made under it
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "server",
                    "serve",
                    tiny,
                    "--port",
                    str(self.port),
                    "--num-kv-blocks",
                    "1024",
                    "--max-model-len",
                    "2048",
                    "--api-server-count",
                    "2",
                    *flags,
                    *(["--api-key", key] if key else []),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        assert wait_for(lambda: len(glob.glob(str(tmp / "weir-*" / "api-1.sock"))) == 1, 120)
        self.run_dir = Path(glob.glob(str(tmp / "weir-*"))[0])
        self.clients = [
            httpx.Client(
                transport=httpx.HTTPTransport(uds=str(self.run_dir / f"api-{i}.sock")),
                base_url="http://weir",
                timeout=60,
                headers={"Authorization": f"Bearer {key}"} if key else None,
            )
            for i in range(2)
        ]
        assert wait_for(
            lambda: self.proc.poll() is not None or all(self._healthy(c) for c in self.clients),
            timeout=120,
        ), self.text()
        assert self.proc.poll() is None, self.text()
        self.engine = engine_process_of(self.proc.pid)

    @staticmethod
    def _healthy(client: httpx.Client) -> bool:
        try:
            return client.get("/health").status_code == 200
        except httpx.TransportError:
            return False

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def api_server_pids(self) -> list[int]:
        """Index order, from the supervisor's start-up line."""
        found = re.search(r"API servers on \S+ \(pids ([\d, ]+)\)", self.text())
        return [int(p) for p in found.group(1).split(", ")]

    def adds_sent(self) -> int:
        """Requests the API servers have sent the engine (core/shared_count.py's file)."""
        data = (self.run_dir / "adds").read_bytes()
        return sum(struct.unpack(f"{len(data) // 8}q", data))

    def close(self) -> None:
        signal_pid(self.engine, signal.SIGCONT)
        for c in self.clients:
            c.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def gone(cluster: Cluster, pids: list[int]) -> bool:
    return not any(alive(p) for p in pids) and not cluster.run_dir.exists()


@pytest.fixture(scope="module")
def tiny(model_dir):
    return str(model_dir("qwen3"))


@pytest.fixture(scope="module")
def cluster(tiny, tmp_path_factory):
    c = Cluster(tiny, tmp_path_factory.mktemp("api"), "--enable-embeddings", key=KEY)
    yield c
    c.close()


def test_every_route_answers_from_every_api_server(cluster):
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


def test_admission_limit_holds_for_the_whole_server_and_a_killed_api_server_stops_it(
    tiny, tmp_path
):
    c = Cluster(tiny, tmp_path, "--max-waiting-requests", "2")
    pids = [c.engine, *c.api_server_pids()]
    try:
        os.kill(c.engine, signal.SIGSTOP)  # nothing leaves the queue
        results: dict[int, list[str]] = {}

        def stream(i: int) -> None:
            body = {"prompt": f"wait {i}", "max_tokens": 5, "ignore_eos": True, "stream": True}
            try:
                with c.clients[i].stream("POST", "/v1/completions", json=body) as r:
                    results[i] = [line for line in r.iter_lines() if line]
            except httpx.HTTPError as e:
                results[i] = [f"cut: {type(e).__name__}"]

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        # One request waits behind each API server: two in all, the limit.
        assert wait_for(lambda: c.adds_sent() == 2, timeout=30)
        for client in c.clients:
            r = client.post("/v1/completions", json={"prompt": "one more", "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
            assert r.headers["retry-after"] == "1"
        # API server 0 dies: the whole server stops, API server 1 draining what it holds.
        os.kill(pids[1], signal.SIGKILL)
        assert wait_for(lambda: "exited with signal 9" in c.text(), timeout=30), c.text()
        assert wait_for(lambda: c.clients[1].get("/health").status_code == 503, timeout=30)
        os.kill(c.engine, signal.SIGCONT)
        for t in threads:
            t.join(60)
        assert results[0][-1].startswith("cut")  # its server is gone
        assert results[1][-1] == "data: [DONE]" and '"finish_reason":"length"' in results[1][-2]
        assert c.proc.wait(60) == 1
        log = c.text()
        assert f"API server 0 (pid {pids[1]}) exited with signal 9: stopping the server" in log
        assert "API server 0 left the engine: 1 requests aborted" in log
        assert wait_for(lambda: gone(c, pids), timeout=30)
    finally:
        c.close()


def test_sigterm_drains_every_api_server_then_exits_0(tiny, tmp_path):
    c = Cluster(tiny, tmp_path, "--drain-timeout", "60")
    pids = [c.engine, *c.api_server_pids()]
    try:
        started = threading.Barrier(3)
        results: dict[int, list[str]] = {}

        def stream(i: int) -> None:
            body = {"prompt": f"drain {i}", "max_tokens": 300, "ignore_eos": True, "stream": True}
            lines = []
            with c.clients[i].stream("POST", "/v1/completions", json=body) as r:
                for n, line in enumerate(r.iter_lines()):
                    if n == 2:
                        started.wait(30)
                    if line:
                        lines.append(line)
            results[i] = lines

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        started.wait(30)  # one stream on each API server
        os.kill(c.engine, signal.SIGSTOP)  # they stay in flight whatever the machine's speed
        c.proc.send_signal(signal.SIGTERM)
        for client in c.clients:
            assert wait_for(lambda: client.get("/health").status_code == 503, timeout=30)
            late = client.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
            assert late.status_code == 503
        os.kill(c.engine, signal.SIGCONT)
        for t in threads:
            t.join(120)
        for i in range(2):
            assert results[i][-1] == "data: [DONE]"
            assert '"finish_reason":"length"' in results[i][-2]
        assert c.proc.wait(60) == 0
        assert wait_for(lambda: gone(c, pids), timeout=30)
    finally:
        c.close()


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--api-server-count", "0"], "--api-server-count must be at least 1"),
        (["-asc", "-2"], "--api-server-count must be at least 1"),
        (["--api-server-count", "2", "--no-engine-process"], "drop --no-engine-process"),
        (["--api-server-count", "2", "--headless"], "--headless runs no server"),
    ],
)
def test_bad_counts_are_refused_naming_the_flag(flags, says, capsys, tmp_path):
    assert cli.main(["serve", str(tmp_path), *flags]) == 2
    assert says in capsys.readouterr().err


def test_the_count_defaults_to_one_on_cpu_and_to_the_cores_on_cuda(monkeypatch):
    from core.config import EngineConfig

    def count(device: str, cores: int, cuda: bool, **options) -> int:
        monkeypatch.setattr(server_count, "cores", lambda: cores)
        monkeypatch.setattr(server_count, "torch_built_for_cuda", lambda: cuda)
        monkeypatch.setattr(server_count, "nvidia_gpu_visible", lambda: cuda)
        return server_count.api_server_count(EngineConfig(device=device), ServerOptions(**options))

    assert count("auto", 16, cuda=False) == 1
    assert count("cpu", 16, cuda=True) == 1
    assert count("auto", 16, cuda=True) == 4
    assert count("cuda:0", 8, cuda=False) == 2
    assert count("auto", 64, cuda=True) == 4
    assert count("auto", 2, cuda=True) == 1
    assert count("auto", 16, cuda=True, engine_process=False) == 1
    assert count("auto", 2, cuda=False, api_server_count=3) == 3


def test_a_model_that_cannot_load_stops_every_api_server_with_code_2(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "server",
            "serve",
            str(tmp_path / "missing"),
            "--port",
            str(free_port()),
            "--api-server-count",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, TMPDIR=str(tmp_path)),
    )
    assert proc.returncode == 2  # bad input, as with one server
    assert "does not exist" in proc.stderr
    assert not glob.glob(str(tmp_path / "weir-*"))  # the run directory is gone
