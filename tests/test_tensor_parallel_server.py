"""`weir serve --tensor-parallel-size 2` as an operator runs it: streams served, a killed worker
fails every stream and the server (exit 1), SIGTERM to every process drains, no process left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from tests.conftest import (
    alive,
    descendants,
    engine_process_of,
    free_port,
    http_status,
    signal_pid,
    wait_for,
)


@pytest.fixture
def tp_server(model_dir, tmp_path):
    """A `weir serve -tp 2` process in a session of its own (as systemd runs a service), started
    from a working directory of its own with the model's path relative to it (the workers run
    from the repository root: the path must reach them resolved)."""
    port = free_port()
    log = open(tmp_path / "server.log", "wb")
    model = os.path.relpath(model_dir("qwen3"), tmp_path)
    assert not os.path.isabs(model) and not (Path(__file__).parent.parent / model).is_dir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "server", "serve", model, "--port", str(port)]
        + ["--device", "cpu", "--tensor-parallel-size", "2", "--num-kv-blocks", "256"]
        + ["--max-model-len", "1024", "--drain-timeout", "60"],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=tmp_path,
    )
    url = f"http://127.0.0.1:{port}"
    up = wait_for(lambda: proc.poll() is not None or http_status(url + "/health") == 200, 180)
    assert up and proc.poll() is None, (tmp_path / "server.log").read_text()
    workers = {p: c for p, c in descendants(proc.pid).items() if "gpu.dist.worker" in c}
    assert len(workers) == 2, descendants(proc.pid)
    everything = list(descendants(proc.pid))
    yield proc, url, sorted(workers), tmp_path / "server.log"
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    log.close()
    # whatever happened, nothing the server started outlives it
    assert wait_for(lambda: not any(alive(p) for p in everything), timeout=15)


def stream(url: str, max_tokens: int, on_line=None) -> list[str]:
    body = {"prompt": "the river", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    body |= {"temperature": 0, "stream_options": {"include_usage": True}}
    lines: list[str] = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line:
                lines.append(line)
                if on_line is not None:
                    on_line(len(lines))
    return lines


def test_a_killed_worker_fails_every_stream_and_the_server_exits_1(tp_server):
    proc, url, workers, log = tp_server
    # served at all: greedy text equal to the same request without streaming
    lines = stream(url, 8)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["usage"]["completion_tokens"] == 8

    def kill_rank_1(n: int) -> None:
        if n == 3:
            os.kill(workers[1], signal.SIGKILL)

    lines = stream(url, 1000, kill_rank_1)
    assert lines[-1] == "data: [DONE]"
    assert '"error"' in lines[-2] and "exited (killed by signal 9)" in lines[-2], lines[-2]
    assert proc.wait(60) == 1, log.read_text()[-3000:]


def test_sigterm_to_every_process_drains_the_streams_then_exits_0(tp_server):
    proc, url, workers, log = tp_server
    started = threading.Barrier(3)
    results: list[list[str]] = []

    def one() -> None:
        results.append(stream(url, 80, lambda n: n == 2 and started.wait(30)))

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    started.wait(30)  # both are streaming
    # The engine stopped: the streams are still in flight whatever the machine's speed.
    engine = engine_process_of(proc.pid)
    os.kill(engine, signal.SIGSTOP)
    try:
        os.killpg(proc.pid, signal.SIGTERM)  # systemd's KillMode=control-group: all at once
        assert wait_for(lambda: http_status(url + "/health") == 503, timeout=30)
    finally:
        signal_pid(engine, signal.SIGCONT)
    for t in threads:
        t.join(120)
    assert len(results) == 2
    for lines in results:
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["usage"]["completion_tokens"] == 80
    assert proc.wait(60) == 0, log.read_text()[-3000:]
    assert not any(alive(p) for p in workers)


@pytest.mark.parametrize(
    "flags,said",
    [
        (["-tp", "2", "--nnodes", "2"], "--nnodes needs --distributed-init-method"),
        (
            ["-tp", "3", "--nnodes", "2", "--distributed-init-method", "tcp://127.0.0.1:1"],
            "3 does not divide over --nnodes 2",
        ),
        (["-tp", "2", "--nnodes", "2", "--node-rank", "2"], "--node-rank must be between"),
        (
            [
                "-tp",
                "2",
                "--nnodes",
                "2",
                "--node-rank",
                "1",
                "--distributed-init-method",
                "tcp://127.0.0.1:1",
            ],
            "runs with --headless",
        ),
        (["-tp", "0"], "--tensor-parallel-size must be at least 1"),
    ],
)
def test_inconsistent_parallel_flags_are_refused_at_start(flags, said, capsys):
    from server.cli import main

    assert main(["serve", *flags]) == 2
    assert said in capsys.readouterr().err
