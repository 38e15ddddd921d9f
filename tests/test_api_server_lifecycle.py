"""`weir serve --api-server-count 2` starting, stopping and failing: the admission limit holds for
the whole server, a killed API server stops the whole server cleanly, SIGTERM drains both API
servers, an engine that died under --no-exit-on-engine-error exits 1 when stopped, a model that
cannot load stops them all, bad counts are refused, and the default count.
Order is made explicit by stopping the engine process (SIGSTOP), never by sleeps."""

from __future__ import annotations

import errno
import fcntl
import glob
import os
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from server import cli, listen, server_count
from server.options import ServerOptions
from tests.api_cluster import Cluster, gone
from tests.conftest import free_port, wait_for


@pytest.fixture(scope="module")
def tiny(model_dir):
    return str(model_dir("qwen3"))


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


def test_an_engine_that_died_under_no_exit_on_engine_error_exits_1_when_stopped(tiny, tmp_path):
    """The API servers stay up, unhealthy, after the engine dies; stopped (SIGTERM), the server
    exits 1, not 0: it did not end well."""
    c = Cluster(tiny, tmp_path, "--no-exit-on-engine-error")
    pids = [c.engine, *c.api_server_pids()]
    try:
        os.kill(c.engine, signal.SIGKILL)
        for client in c.clients:
            assert wait_for(lambda: client.get("/health").status_code == 503, timeout=30)
        assert c.proc.poll() is None  # still up
        c.proc.send_signal(signal.SIGTERM)
        assert c.proc.wait(60) == 1
        assert wait_for(lambda: gone(c, pids), timeout=30)
    finally:
        c.close()


def test_a_follower_through_another_api_server_is_drained_with_what_it_follows(tiny, tmp_path):
    # A background response runs on API server 0; a client follows its stream through API
    # server 1 (forwarded). On SIGTERM, server 0 drains the response to its deadline (8 s: past
    # Hypercorn's 5 s grace, so that the old behaviour would show); server 1,
    # with nothing of its own in flight, had stopped at once and cut the follower after
    # Hypercorn's 5 s grace. Now its relay is in flight too: the follower gets the last event.
    c = Cluster(tiny, tmp_path, "--drain-timeout", "8")
    pids = [c.engine, *c.api_server_pids()]
    try:
        first, second = c.clients
        os.kill(c.engine, signal.SIGSTOP)  # the response runs until the drain's deadline
        body = {"input": "a long story", "background": True, "max_output_tokens": 200}
        rid = first.post("/v1/responses", json=body).json()["id"]
        events: list[str] = []

        def follow() -> None:
            try:
                with second.stream("GET", f"/v1/responses/{rid}?stream=true") as r:
                    assert r.headers["x-weir-forwarded-to"] == "0"
                    events.extend(x for x in r.iter_lines() if x.startswith("event: "))
            except httpx.HTTPError as e:
                events.append(f"cut: {type(e).__name__}")

        follower = threading.Thread(target=follow)
        follower.start()
        assert wait_for(lambda: "event: response.in_progress" in events, timeout=30)
        c.proc.send_signal(signal.SIGTERM)
        follower.join(90)
        assert events[-1] == "event: response.incomplete", events  # interrupted by the drain
        os.kill(c.engine, signal.SIGCONT)
        assert c.proc.wait(60) == 0
        assert wait_for(lambda: gone(c, pids), timeout=30)
    finally:
        c.close()


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--api-server-count", "0"], "--api-server-count must be at least 1"),
        (["-asc", "-2"], "--api-server-count must be at least 1"),
        (["-asc", "100000"], "--api-server-count 100000 is more than"),
        (["--api-server-count", "2", "--no-engine-process"], "drop --no-engine-process"),
        (["--api-server-count", "2", "--headless"], "--headless runs no server"),
        (
            ["-asc", "2", "--enable-lora", "--allow-runtime-lora-updating"],
            "--api-server-count 2 with --allow-runtime-lora-updating",
        ),
    ],
)
def test_bad_counts_are_refused_naming_the_flag(flags, says, capsys, tmp_path):
    assert cli.main(["serve", str(tmp_path), *flags]) == 2
    assert says in capsys.readouterr().err


def test_a_port_another_server_listens_on_is_refused(capsys, tmp_path):
    # The API servers' SO_REUSEPORT group would admit a second weir's sockets on its port (they
    # would take a share of its connections, silently): refused as for one server, exit 1.
    held = listen.api_server_sockets("127.0.0.1", 0, 2, 30.0)
    port = held[0].getsockname()[1]
    try:
        with pytest.raises(OSError) as refused:
            listen.api_server_sockets("127.0.0.1", port, 2, 30.0)
        assert refused.value.errno == errno.EADDRINUSE
        argv = ["serve", str(tmp_path), "--port", str(port), "--api-server-count", "2"]
        assert cli.main(argv) == 1
        assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in (
            capsys.readouterr().err
        )
    finally:
        for sock in held:
            sock.close()
    # Closed, the port is free again.
    for sock in listen.api_server_sockets("127.0.0.1", port, 2, 30.0):
        sock.close()


def test_two_starts_at_once_cannot_both_take_the_port(monkeypatch):
    # Each found the port unused, then both bound it: one SO_REUSEPORT group of two weirs. The
    # check and the binds now happen under this user's lock on the port.
    port = free_port()
    path = listen.port_lock_path("127.0.0.1", port)

    def locked() -> bool:
        fd = os.open(path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    steps = []
    probe, bind = listen.unused_port, listen.listening_socket
    monkeypatch.setattr(listen, "unused_port", lambda *a: steps.append(locked()) or probe(*a))
    monkeypatch.setattr(
        listen, "listening_socket", lambda *a, **k: steps.append(locked()) or bind(*a, **k)
    )
    for sock in listen.api_server_sockets("127.0.0.1", port, 2, 30.0):
        sock.close()
    assert steps == [True, True, True] and not locked()  # probe, two binds; then released
    monkeypatch.undo()
    # A start that comes while another holds the lock waits for it, then finds its sockets.
    result: list = []

    def second() -> None:
        try:
            result.append(listen.api_server_sockets("127.0.0.1", port, 2, 30.0))
        except OSError as e:
            result.append(e)

    with listen.port_lock("127.0.0.1", port):
        late = threading.Thread(target=second)
        late.start()
        first = [listen.listening_socket("127.0.0.1", port, 30.0, True) for _ in range(2)]
    late.join(60)
    try:
        assert isinstance(result[0], OSError) and result[0].errno == errno.EADDRINUSE, result
    finally:
        for sock in first:
            sock.close()


def test_the_count_defaults_to_one_on_cpu_and_to_the_cores_on_cuda(monkeypatch):
    from core.config import EngineConfig

    def count(device: str, cores: int, cuda: bool, lora: bool = False, **options) -> int:
        monkeypatch.setattr(server_count, "cores", lambda: cores)
        monkeypatch.setattr(server_count, "torch_built_for_cuda", lambda: cuda)
        monkeypatch.setattr(server_count, "nvidia_gpu_visible", lambda: cuda)
        config = EngineConfig(device=device, enable_lora=lora)
        return server_count.api_server_count(config, ServerOptions(**options))

    assert count("auto", 16, cuda=False) == 1
    assert count("cpu", 16, cuda=True) == 1
    assert count("auto", 16, cuda=True) == 4
    assert count("cuda:0", 8, cuda=False) == 2
    assert count("auto", 64, cuda=True) == 4
    assert count("auto", 2, cuda=True) == 1
    assert count("auto", 16, cuda=True, engine_process=False) == 1
    assert count("auto", 2, cuda=False, api_server_count=3) == 3
    assert count("auto", 2, cuda=False, api_server_count=4) == 4
    assert count("auto", 16, cuda=True, api_server_count=16) == 16
    # Adapters loaded at runtime are known to the API server that loaded them alone: one.
    runtime = {"allow_runtime_lora_updating": True}
    assert count("auto", 16, cuda=True, lora=True, **runtime) == 1
    assert count("auto", 16, cuda=True, lora=True) == 4  # --lora-modules: every server loads them
    assert count("auto", 16, cuda=True, **runtime) == 4  # no LoRA: nothing to update
    with pytest.raises(ValueError, match="--api-server-count 2 with --allow-runtime-lora"):
        count("auto", 16, cuda=True, lora=True, api_server_count=2, **runtime)
    for cores, too_many in ((2, 5), (16, 17)):
        with pytest.raises(ValueError, match=f"--api-server-count {too_many} is more than"):
            count("auto", cores, cuda=False, api_server_count=too_many)


def test_torch_built_for_cuda_is_read_with_torch_kept_out(monkeypatch, tmp_path):
    """The CLI keeps torch out of the HTTP processes (sys.modules["torch"] = None) before it
    counts them: torch's version file is still read from sys.path, CUDA's version or None."""
    from server.cli import keep_torch_out

    for cuda, built in (("'13.0'", True), ("None", False)):
        root = tmp_path / cuda.strip("'")
        (root / "torch").mkdir(parents=True)
        (root / "torch" / "__init__.py").write_text("")
        version = f"__version__ = '2.11.0'\ncuda: Optional[str] = {cuda}\nhip = None\n"
        (root / "torch" / "version.py").write_text(version)
        with monkeypatch.context() as m:
            m.syspath_prepend(str(root))
            m.setitem(sys.modules, "torch", sys.modules.get("torch"))
            keep_torch_out()
            assert sys.modules["torch"] is None
            assert server_count.torch_built_for_cuda() is built


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


def test_run_directories_of_killed_servers_are_swept_at_the_next_start(tmp_path):
    """A server killed outright leaves its run directory; the next start removes those whose
    supervisor is gone, and leaves a live one's, and any folder without weir's pid file."""
    from server import run_dir

    dead = subprocess.Popen(["true"])
    dead.wait()
    for name, pid in (("weir-dead", dead.pid), ("weir-live", os.getppid()), ("weir-other", None)):
        (tmp_path / name).mkdir()
        if pid is not None:
            (tmp_path / name / run_dir.PID_FILE).write_text(str(pid))
    assert run_dir.sweep(str(tmp_path)) == [str(tmp_path / "weir-dead")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weir-live", "weir-other"]


def test_a_gpu_is_seen_in_the_drivers_list_or_as_its_device_file(monkeypatch, tmp_path):
    """/proc/driver/nvidia/gpus lists the GPUs; a sandbox that shows no such list still has
    /dev/nvidia0 (the control and memory files alone are no GPU); CUDA_VISIBLE_DEVICES=""
    hides them."""
    proc, dev = tmp_path / "gpus", tmp_path / "dev"
    dev.mkdir()
    monkeypatch.setattr(server_count, "DRIVER_GPUS", proc)
    monkeypatch.setattr(server_count, "DEVICES", dev)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    (dev / "nvidiactl").touch()
    (dev / "nvidia-uvm").touch()
    assert not server_count.nvidia_gpu_visible()
    (dev / "nvidia0").touch()
    assert server_count.nvidia_gpu_visible()
    (dev / "nvidia0").unlink()
    (proc / "0000:00:06.0").mkdir(parents=True)
    assert server_count.nvidia_gpu_visible()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not server_count.nvidia_gpu_visible()
