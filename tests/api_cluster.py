"""A `weir serve --api-server-count 2` process for tests (tests/test_api_servers.py,
tests/test_api_server_lifecycle.py): the supervisor, its run directory found under the TMPDIR
it is given, a client for each API server's own Unix socket (so which server answers is never
left to chance), and what the tests read of it."""

from __future__ import annotations

import glob
import os
import re
import signal
import struct
import subprocess
import sys
from pathlib import Path

import httpx

from tests.conftest import alive, engine_process_of, free_port, signal_pid, wait_for
from tests.test_ops import metric


def total(client: httpx.Client, name: str, **labels) -> float:
    """A metric's value summed over its samples (0 before it has any)."""
    try:
        return metric(client.get("/metrics").text, name, **labels)
    except AssertionError:
        return 0.0


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
