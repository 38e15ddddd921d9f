"""Shared fixtures: tiny random-weight models built once per session, and a live server."""

from __future__ import annotations

import os

# Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors. It is read when a
# kernel is decorated, so it must be set before anything imports gpu.cuda.kernels.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.triton_interpreter import patch_once_a_launch

    patch_once_a_launch()

# Workers of pytest-xdist on one GPU: each process's engines take a share of its memory, not 90%
# of it each (read by core.config, imported below, and by the `weir` processes tests start).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ.setdefault("WEIR_GPU_MEMORY_UTILIZATION", f"{0.6 / max(_workers, 1):.3f}")
# A CPU engine's KV cache by default (--kv-cache-memory): 128 MiB, not 1 GiB. It is zeroed (and
# faulted in) at load; the tiny models' contexts fit in 128 MiB many times over, and the suite
# starts a few hundred engines.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "0.125")

import itertools
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import trio

from core.config import EngineConfig

ARCHS = ("llama", "qwen2", "qwen3")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """model_dir(arch) -> a Hugging Face directory with random weights and a trained tokenizer."""
    from gpu.tiny_model import build_tiny_model

    built: dict[tuple, Path] = {}

    def get(arch: str = "qwen3", **kwargs) -> Path:
        key = (arch, repr(sorted(kwargs.items())))
        if key not in built:
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            built[key] = build_tiny_model(path, arch, **kwargs)
        return built[key]

    return get


@pytest.fixture(scope="session")
def lora_models(model_dir, tmp_path_factory):
    """lora_models(arch) -> (base folder, {name: adapter folder}), made once."""
    from tests.lora_adapters import ADAPTERS, make_adapter

    made = {}

    def get(arch):
        if arch not in made:
            base = model_dir(arch)
            out = tmp_path_factory.mktemp(f"lora-{arch}")
            made[arch] = (
                base,
                {
                    name: make_adapter(base, out / name, name, seed=i)
                    for i, name in enumerate(ADAPTERS)
                },
            )
        return made[arch]

    return get


def transformers_greedy(path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (no EOS stop): the reference weir's
    tokens must equal."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    for ids in prompts:
        gen = hf.generate(
            torch.tensor([ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        outs.append(gen[0, len(ids) :].tolist())
    return outs


PORTS_PER_WORKER = 1000
_ports = itertools.count()


def free_port() -> int:
    """A port nothing is bound to, from this pytest-xdist worker's own range below the kernel's
    ephemeral ports (20000 + 1000 per worker), taken in turn. The kernel's choice (binding port
    0) is free now but may be handed to another worker before this one's server binds it: the
    second server then fails to bind while its test, polling the port, is answered by the
    other worker's server (its engine stats never moving: seen once in four two-worker runs)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    base = 20000 + PORTS_PER_WORKER * (int(worker) % 12 if worker.isdigit() else 0)
    for _ in range(PORTS_PER_WORKER):
        port = base + next(_ports) % PORTS_PER_WORKER
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # bound by something else (or still in TIME_WAIT)
            return port
    raise RuntimeError(f"no free port in {base}..{base + PORTS_PER_WORKER - 1}")


class LiveServer:
    """The real app and Hypercorn on a Trio loop in a background thread, on a free port.

    The engine runs on a thread here unless `engine_process=True` is passed: starting an engine
    process per server would cost the suite minutes, and tests may reach into `engine.core`.
    The product default (its own process) is served to test_api.py's and test_engine_process.py's
    servers and to every test that runs the `weir` command."""

    def __init__(self, config: EngineConfig, **options) -> None:
        from server.app import create_app
        from server.listen import listening_socket
        from server.options import ServerOptions

        options.setdefault("engine_process", False)
        self.app = create_app(config, ServerOptions(**options))
        # Bound here, on a port the kernel picks: no other server can take it before this one
        # serves it (free_port's race, for servers in processes of their own).
        timeout = self.app.weir_state.options.tcp_user_timeout
        self._sock = listening_socket("127.0.0.1", 0, timeout)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._token: trio.lowlevel.TrioToken | None = None
        self._started = threading.Event()
        self.exit_code: int | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from server.app import serve

        async def main() -> int:
            self._token = trio.lowlevel.current_trio_token()
            self._started.set()
            return await serve(
                self.app, "127.0.0.1", self.port, handle_signals=False, sock=self._sock
            )

        try:
            self.exit_code = trio.run(main)
        finally:
            self._sock.close()  # Hypercorn served (and closed) a duplicate

    @property
    def state(self):
        return self.app.weir_state

    @property
    def engine(self):
        return self.app.weir_state.engine

    def start(self, timeout: float = 120.0) -> LiveServer:
        self._thread.start()
        self._started.wait(timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if self.state.status == "failed" or not self._thread.is_alive():
                raise RuntimeError(self.state.reason)
            time.sleep(0.05)
        raise TimeoutError("server did not become healthy")

    def wait_exit(self, timeout: float = 60.0) -> int | None:
        """Wait for the server to stop by itself; its exit code."""
        self._thread.join(timeout)
        return self.exit_code

    def stop(self) -> None:
        if self._token is not None and self._thread.is_alive():
            try:
                self._token.run_sync_soon(self.app.weir_shutdown.set)
            except trio.RunFinishedError:
                pass  # it stopped by itself between the check and the call (a failed start)
        self._thread.join(60)


def http_status(url: str) -> int | None:
    """The status of GET url, or None while nothing answers."""
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.TransportError:
        return None


def descendants(pid: int) -> dict[int, str]:
    """Every process below `pid`, with its command line."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found: dict[int, str] = {}
    todo = list(children.get(pid, []))
    while todo:
        p = todo.pop()
        try:
            found[p] = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        todo += children.get(p, [])
    return found


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def engine_process_of(pid: int) -> int:
    """The engine process a `weir serve` process started (python -m core.engine_process).
    Tests stop it (SIGSTOP) to hold every request where it is, whatever the machine's speed."""
    found = [p for p, cmd in descendants(pid).items() if "core.engine_process" in cmd]
    assert len(found) == 1, descendants(pid)
    return found[0]


def signal_pid(pid: int, sig: int) -> None:
    """os.kill, for a process that may already have exited."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def check_engine_died(server: LiveServer, lines: list[str], reason: str, exits: bool) -> None:
    """What an engine death must look like from outside: the in-flight stream (its SSE `lines`)
    ends with the error, then [DONE], never silently cut; then the server exits 1 so the
    orchestrator restarts it (`exits`), or stays up with /health and new requests at 503, and
    exits 1 when stopped."""
    assert lines[-1] == "data: [DONE]"
    assert '"error"' in lines[-2] and reason in lines[-2], lines[-2]
    if exits:
        assert server.wait_exit() == 1
        return
    health = httpx.get(server.url + "/health")
    assert health.status_code == 503 and "engine died" in health.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["message"]
    # nothing runs any more: the gauges say so (they had kept the dead engine's last values)
    text = httpx.get(server.url + "/metrics").text
    gauges = [
        line for line in text.splitlines()
        if line.startswith(("weir:num_requests_running{", "weir:kv_cache_usage_perc{"))
    ]  # fmt: skip
    assert len(gauges) == 2 and all(line.endswith(" 0.0") for line in gauges), gauges
    server.stop()  # as SIGTERM: a server whose engine died does not exit 0
    assert server.exit_code == 1


def aborted(server: LiveServer) -> float:
    """Requests the engine has finished as aborted, from /metrics (works whichever way the
    engine runs: on a thread or in its own process)."""
    text = httpx.get(server.url + "/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if "request_success_total{" in line and 'finished_reason="abort"' in line
    )


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.01) -> bool:
    """Poll until predicate() is true or the deadline passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def tiny_config(model_dir, **kw) -> EngineConfig:
    """The tiny Qwen3 served as "tiny" with the block-pool invariant checked after every step."""
    kw = {
        "served_model_name": ["tiny"],
        "max_model_len": 512,
        "num_kv_blocks": 256,
        "check_integrity": True,
        **kw,
    }
    return EngineConfig(model=str(model_dir("qwen3")), **kw)


def tools_server(model_dir, **options) -> LiveServer:
    """The tiny Qwen3 with hermes tool markup in its template (tests/test_tools.py CHATML_TOOLS)
    and the qwen3 reasoning parser: what the tool, Responses and schema tests serve."""
    from tests.test_tools import CHATML_TOOLS

    config = tiny_config(
        model_dir, max_model_len=2048, num_kv_blocks=512, chat_template=CHATML_TOOLS
    )
    return LiveServer(config, reasoning_parser="qwen3", **options).start()


def api_server(model_dir) -> LiveServer:
    """The tiny Qwen3, its engine in its own process: the product default, so every API case
    crosses the process boundary."""
    return LiveServer(tiny_config(model_dir), engine_process=True).start()


class GrammarProbe:
    """The tiny Qwen3's tokenizer and a Grammars over it: whether a constraint accepts a text,
    token by token, to its end."""

    def __init__(self, model_dir) -> None:
        from transformers import AutoTokenizer

        from core.structured import Grammars

        self.tok = AutoTokenizer.from_pretrained(model_dir("qwen3"))
        tok = self.tok
        self.grammars = Grammars(tok.backend_tokenizer.to_str(), len(tok), [tok.eos_token_id])

    def accepts(self, constraint, text: str) -> bool:
        matcher = self.grammars.start(constraint).result()
        ok = matcher.consume_tokens(self.tok.encode(text, add_special_tokens=False))
        return bool(ok) and not matcher.is_error() and matcher.is_accepting()


@pytest.fixture(scope="module")
def client(server):
    """The OpenAI SDK pointed at the module's `server` fixture."""
    import openai

    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    yield c
    c.close()


@pytest.fixture(scope="module")
def live_server(model_dir):
    server = LiveServer(
        EngineConfig(
            model=str(model_dir("qwen3")),
            served_model_name=["tiny", "tiny-alias"],
            max_model_len=512,
            num_kv_blocks=256,
            block_size=16,
            check_integrity=True,
        )
    ).start()
    yield server
    server.stop()
