"""The server with its engine core in a child process (--engine-process): same answers as the
in-thread engine, requests checked before they cross, aborts and deaths handled, no orphans."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading

import httpx
import pytest
import trio

from core.config import EngineConfig
from core.engine import Hold
from core.engine_process import EngineProcess
from tests.conftest import (
    LiveServer,
    aborted,
    check_engine_died,
    descendants,
    http_status,
    wait_for,
)

MESSAGES = [{"role": "user", "content": "Say hello to the river café 🌊"}]


def config(model_dir, **kw) -> EngineConfig:
    base = dict(
        model=str(model_dir("qwen3")),
        served_model_name=["tiny"],
        max_model_len=512,
        num_kv_blocks=256,
        block_size=16,
        check_integrity=True,
    )
    base.update(kw)
    return EngineConfig(**base)


@pytest.fixture(scope="module")
def proc_server(model_dir):
    server = LiveServer(config(model_dir), engine_process=True).start()
    assert server.engine.core is None and server.engine.process_alive()
    yield server
    server.stop()
    proc = server.engine._child.proc
    # Shut down by message, not killed: it exits by itself with 0.
    assert proc.poll() == 0


def complete(url: str, prompt, stream: bool, **kw) -> tuple[str, list[str]]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0, **kw}
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"], []
    body["stream"] = True
    pieces = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        for choice in json.loads(line[6:])["choices"]:
            pieces.append(choice["text"])
    return "".join(pieces), lines


def test_same_greedy_text_as_the_in_thread_engine(proc_server, model_dir):
    thread_server = LiveServer(config(model_dir), engine_process=False).start()
    try:
        assert thread_server.engine.core is not None  # really on a thread
        prompts = ["the river", "a café by the water 🌊", [5, 6, 7, 8, 9]]
        for prompt in prompts:
            want, _ = complete(thread_server.url, prompt, stream=False, ignore_eos=True)
            got, _ = complete(proc_server.url, prompt, stream=False, ignore_eos=True)
            streamed, lines = complete(proc_server.url, prompt, stream=True, ignore_eos=True)
            # Events, then [DONE]: a reader behind the engine (24 tokens of the tiny model take
            # ~12 ms) gets deltas merged, down to one event on a busy machine; that a long
            # stream comes as many events is checked under load below.
            assert got == want == streamed and len(lines) >= 2
    finally:
        thread_server.stop()


def test_requests_are_checked_before_they_reach_the_engine(proc_server):
    url = proc_server.url + "/v1/completions"
    r = httpx.post(url, json={"model": "tiny", "prompt": [1, 10**6], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(url, json={"model": "tiny", "prompt": "hi " * 600, "max_tokens": 2})
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    r = httpx.post(url, json={"model": "tiny", "prompt": "hi", "max_tokens": 5000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert http_status(proc_server.url + "/health") == 200


def test_concurrent_streams_all_complete_and_a_disconnect_frees_blocks(proc_server):
    engine = proc_server.engine
    results: dict[int, str] = {}
    aborted_before = aborted(proc_server)
    # Held once every request in it has 30 tokens: the 24-token ones finish, the long one can
    # only end by the abort its disconnect sends.
    engine.hold(Hold(at_output_tokens=30))

    def ask(i: int) -> None:
        results[i], _ = complete(proc_server.url, f"request {i} " * (1 + i % 3), stream=True)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    body = {"model": "tiny", "prompt": "long", "max_tokens": 400, "stream": True}
    body |= {"ignore_eos": True, "logprobs": 0}  # every output an event, text or not
    with httpx.stream("POST", proc_server.url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # some of the stream read (its outputs may come merged), the rest not
    for t in threads:
        t.join(60)
    assert len(results) == 12
    for i, text in results.items():  # streamed under load == asked alone, not streamed
        assert text == complete(proc_server.url, f"request {i} " * (1 + i % 3), False)[0]
    # Closing the connection aborted the long request in the engine process: all blocks back.
    assert wait_for(lambda: aborted(proc_server) == aborted_before + 1)
    assert wait_for(
        lambda: engine.last_stats.num_free_blocks == 256 and not engine.last_stats.num_running
    )
    engine.release()


def stream_signalling_the_engine(server: LiveServer, sig: int, max_tokens: int) -> list[str]:
    """Stream a completion and send `sig` to the engine process after the first SSE line, while
    the engine is held (at 2 tokens): the request cannot have finished before the signal. With
    log-probs every output is an event, even one whose tokens add no text yet."""
    body = {"model": "tiny", "prompt": "hi", "max_tokens": max_tokens, "stream": True}
    body["logprobs"] = 0
    body.update(ignore_eos=True, stream_options={"include_usage": True})
    lines = []
    server.engine.hold(Hold(at_output_tokens=2))
    try:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line:
                    continue  # (the blank line after an event: the signal is sent once)
                lines.append(line)
                if len(lines) == 1:
                    os.kill(server.engine.pid, sig)
                    release(server)
    finally:
        release(server)
    return lines


def release(server: LiveServer) -> None:
    """The engine's hold lifted, unless the server has stopped already: a killed engine takes
    a server that exits on engine errors down with it, at a moment no test controls (its Trio
    run may end before or after this call)."""
    with contextlib.suppress(trio.RunFinishedError):
        server.engine.release()


def test_the_engine_process_ignores_sigterm_so_the_server_can_drain(proc_server):
    # systemd's default KillMode sends SIGTERM to every process of the service at once: the
    # engine must keep serving until the server, draining, tells it to stop.
    lines = stream_signalling_the_engine(proc_server, signal.SIGTERM, 60)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["usage"]["completion_tokens"] == 60
    assert proc_server.engine.process_alive()
    assert proc_server.engine.alive and http_status(proc_server.url + "/health") == 200


@pytest.mark.parametrize("exit_on_error", [True, False])
def test_a_killed_engine_process_fails_requests_and_health(model_dir, exit_on_error):
    server = LiveServer(
        config(model_dir), engine_process=True, exit_on_engine_error=exit_on_error
    ).start()
    try:
        lines = stream_signalling_the_engine(server, signal.SIGKILL, 400)
        check_engine_died(server, lines, "engine process exited", exit_on_error)
    finally:
        server.stop()


def engine_children() -> int:
    """Engine processes of this test process (python -m core.engine_process), running."""
    return sum("core.engine_process" in cmd for cmd in descendants(os.getpid()).values())


def test_a_model_that_fails_to_load_fails_startup_and_leaves_no_process(tmp_path):
    before = engine_children()
    server = LiveServer(EngineConfig(model=str(tmp_path / "missing")), engine_process=True)
    with pytest.raises(RuntimeError, match="loading failed"):
        server.start(timeout=120)
    server.stop()
    assert server.state.status == "failed"
    assert engine_children() == before


def test_a_server_that_exits_without_shutdown_takes_its_engine_process_along(model_dir):
    # The engine ignores SIGTERM: weir's exit hook closes the command pipe, so the engine
    # leaves (and it would anyway: it watches its parent).
    model = str(model_dir("qwen3"))
    code = (
        "from core.config import EngineConfig\n"
        "from core.engine_process import EngineProcess\n"
        f"engine = EngineProcess(EngineConfig(model={model!r}, num_kv_blocks=32))\n"
        "engine.launch()\n"
        "print(engine.pid, flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    pid = int(done.stdout.split()[-1])
    assert wait_for(lambda: not os.path.exists(f"/proc/{pid}"), timeout=10)


def test_a_stop_before_the_process_starts_keeps_it_from_starting(model_dir):
    """SIGTERM in a server's first seconds (still importing, no engine process yet): launch()
    then refuses to start one, instead of loading the whole model first."""
    engine = EngineProcess(EngineConfig(model=str(model_dir("qwen3")), num_kv_blocks=32))
    engine.kill_loading()
    with pytest.raises(RuntimeError, match="stopped before"):
        engine.launch()
    assert engine._child is None
