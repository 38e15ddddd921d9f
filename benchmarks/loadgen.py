"""An OpenAI streaming load generator (usable against any server by URL), and helpers to start
and stop a server process for a benchmark."""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx
import msgspec
import trio

WORDS = (
    "the river flows over stone and under the bridge while people walk along the bank "
    "talking about water weather work and the long day"
).split()


def prompts(n: int, words: tuple[int, int] = (8, 40), seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(*words))) for _ in range(n)]


@dataclass
class Result:
    ttft: float | None = None
    e2e: float = 0.0
    tokens: int = 0
    prompt_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str | None = None
    api_server: str | None = None  # weir's X-Weir-Api-Server: which HTTP process answered


class _Chunked:
    """HTTP/1.1 chunked transfer decoding, fed the raw bytes as they come."""

    def __init__(self) -> None:
        self.buf = b""
        self.left = 0  # bytes of the current chunk not yet passed on
        self.crlf = False  # the CRLF after a chunk's data still to skip
        self.done = False

    def feed(self, data: bytes) -> bytes:
        self.buf += data
        out = []
        while not self.done:
            if self.left:
                take = self.buf[: self.left]
                out.append(take)
                self.left -= len(take)
                self.buf = self.buf[len(take) :]
                if self.left:
                    break
                self.crlf = True
            if self.crlf:
                if len(self.buf) < 2:
                    break
                self.buf, self.crlf = self.buf[2:], False
            end = self.buf.find(b"\r\n")
            if end < 0:
                break
            size = int(self.buf[:end].split(b";")[0], 16)
            self.buf = self.buf[end + 2 :]
            if size == 0:
                self.done = True
            self.left = size
        return b"".join(out)


async def one_request(
    url: str, model: str, prompt: str, max_tokens: int, extra: dict | None = None
) -> Result:
    """One streaming chat completion with only standard OpenAI fields (and `extra`, e.g.
    ignore_eos, which weir, vLLM and llama-server all take); tokens from usage.

    HTTP/1.1 straight on a trio socket (one connection per request), SSE lines split from the
    bytes and decoded with msgspec: on a 2-core box the client shares the cores with the server
    it measures, and httpx's stack of iterators took a third of a core at 64 streams."""
    body = msgspec.json.encode(
        {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            **(extra or {}),
        }
    )
    hostport = url.split("://", 1)[-1].split("/", 1)[0]
    host, _, port = hostport.rpartition(":")
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {hostport}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Accept: text/event-stream\r\nConnection: close\r\n\r\n"
    )
    res = Result()
    t0 = time.perf_counter()
    last = None
    try:
        with trio.fail_after(600):
            stream = await trio.open_tcp_stream(host, int(port))
            async with stream:
                await stream.send_all(head.encode() + body)
                raw, headers = b"", None
                while headers is None:
                    data = await stream.receive_some(65536)
                    if not data:
                        raise ConnectionError("closed before the response headers")
                    raw += data
                    if b"\r\n\r\n" in raw:
                        headers, raw = raw.split(b"\r\n\r\n", 1)
                status = int(headers.split(b" ", 2)[1])
                served = re.search(rb"(?im)^x-weir-api-server: *(\S+)", headers)
                res.api_server = served.group(1).decode() if served else None
                chunked = _Chunked() if b"chunked" in headers.lower() else None
                if status != 200:
                    res.error = f"HTTP {status}"
                    return res
                text = b""
                while True:
                    text += chunked.feed(raw) if chunked else raw
                    *lines, text = text.split(b"\n")
                    for line in lines:
                        if not line.startswith(b"data: "):
                            continue
                        data = line[6:].rstrip(b"\r")
                        if data == b"[DONE]":
                            return res
                        obj = msgspec.json.decode(data)
                        if "error" in obj:
                            res.error = str(obj["error"])[:200]
                        if obj.get("usage"):
                            res.tokens = obj["usage"]["completion_tokens"]
                            res.prompt_tokens = obj["usage"].get("prompt_tokens") or 0
                        for ch in obj.get("choices") or []:
                            if (ch.get("delta") or {}).get("content"):
                                now = time.perf_counter()
                                if res.ttft is None:
                                    res.ttft = now - t0
                                else:
                                    res.itl.append(now - last)
                                last = now
                    if chunked is not None and chunked.done:
                        return res
                    raw = await stream.receive_some(65536)
                    if not raw:
                        return res
    except (OSError, ValueError, trio.TooSlowError, msgspec.DecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        res.e2e = time.perf_counter() - t0
    return res


async def run_level(
    url: str,
    model: str,
    texts: list[str],
    concurrency: int,
    max_tokens: int,
    extra: dict | None = None,
) -> tuple[list[Result], float]:
    results: list[Result] = []
    limit = trio.Semaphore(concurrency)
    t0 = time.perf_counter()

    async def worker(text: str) -> None:
        async with limit:
            results.append(await one_request(url, model, text, max_tokens, extra))

    async with trio.open_nursery() as nursery:
        for text in texts:
            nursery.start_soon(worker, text)
    return results, time.perf_counter() - t0


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarize(results: list[Result], wall: float) -> dict:
    ok = [r for r in results if r.error is None]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [(r.e2e - r.ttft) / (r.tokens - 1) for r in ok if r.ttft is not None and r.tokens > 1]
    itl = [g for r in ok for g in r.itl]
    tokens = sum(r.tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    ms = lambda v: None if v is None else v * 1e3  # noqa: E731
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "output_tokens": tokens,
        "prompt_tokens": prompt_tokens,
        "wall_s": wall,
        "output_tok_s": tokens / wall if wall else 0.0,
        "ttft_p50_ms": ms(pct(ttft, 0.5)),
        "ttft_p99_ms": ms(pct(ttft, 0.99)),
        "tpot_p50_ms": ms(pct(tpot, 0.5)),
        "tpot_p99_ms": ms(pct(tpot, 0.99)),
        "itl_p50_ms": ms(pct(itl, 0.5)),
        "itl_p99_ms": ms(pct(itl, 0.99)),
        "first_error": next((r.error for r in results if r.error), None),
        "mean_tokens": statistics.mean(r.tokens for r in ok) if ok else 0,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env() -> dict[str, str]:
    """This environment less what weir put in it to run an engine here (OMP_WAIT_POLICY, see
    gpu/openmp.py): a peer's OpenMP threads must run as they would on their own, and a weir
    server sets its own."""
    env = dict(os.environ)
    openmp = sys.modules.get("gpu.openmp")
    if openmp is not None and openmp.SET_HERE:
        env.pop("OMP_WAIT_POLICY", None)
    return env


class ServerProcess:
    """A server started as a subprocess, waited on until /health answers 200."""

    def __init__(self, argv: list[str], port: int, log_path: str) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            argv,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**clean_env(), "PYTHONUNBUFFERED": "1"},
        )

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode}; see {self.log.name}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready; see {self.log.name}")

    def cpu_seconds(self, tree: bool = True) -> float:
        """User + system CPU time so far of the server process and every process under it (an
        engine process, multiprocessing's resource tracker), from Linux /proc; with
        tree=False, of the server process alone (the HTTP side, when the engine has its own)."""
        if not tree:
            fields = open(f"/proc/{self.proc.pid}/stat").read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        total, todo = 0, [self.proc.pid]
        while todo:
            pid = todo.pop()
            try:
                fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])
                for task in os.listdir(f"/proc/{pid}/task"):
                    children = open(f"/proc/{pid}/task/{task}/children").read().split()
                    todo.extend(int(c) for c in children)
            except (FileNotFoundError, ProcessLookupError):
                continue  # exited meanwhile
        return total / os.sysconf("SC_CLK_TCK")

    def _tree(self) -> list[tuple[bytes, int, bool]]:
        """(command line, CPU ticks so far, under the engine process) of each process of the
        server's tree: the engine is the process run as `core.engine_process` with everything
        under it (tensor-parallel ranks)."""
        found, todo = [], [(self.proc.pid, False)]
        while todo:
            pid, in_engine = todo.pop()
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read()
                in_engine = in_engine or b"core.engine_process" in cmd
                fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
                found.append((cmd, int(fields[11]) + int(fields[12]), in_engine))
                for task in os.listdir(f"/proc/{pid}/task"):
                    children = open(f"/proc/{pid}/task/{task}/children").read().split()
                    todo.extend((int(c), in_engine) for c in children)
            except (FileNotFoundError, ProcessLookupError):
                continue  # exited meanwhile
        return found

    def cpu_split(self) -> tuple[float, float]:
        """(the HTTP side's CPU seconds, the engine's) so far; the HTTP side is every process
        but the engine's (the server, or the supervisor and its API servers)."""
        tick = os.sysconf("SC_CLK_TCK")
        tree = self._tree()
        engine = sum(ticks for _, ticks, in_engine in tree if in_engine)
        return (sum(ticks for _, ticks, _ in tree) - engine) / tick, engine / tick

    def api_servers(self) -> int:
        """weir's HTTP processes: its API servers, or the one server process."""
        return max(1, sum(b"server.api_server" in cmd for cmd, _, _ in self._tree()))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def weir_argv(model: str, port: int, *extra: str, launcher: str = "server") -> list[str]:
    return [
        sys.executable,
        "-m",
        launcher,
        "serve",
        model,
        "--port",
        str(port),
        "--disable-log-requests",
        "--max-num-seqs",
        "256",
        *extra,
    ]
