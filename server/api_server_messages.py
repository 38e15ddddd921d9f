"""What crosses between the supervisor (server/supervisor.py) and each API server it starts
(server/api_server.py) with --api-server-count N > 1, and where their shared files live.

Supervisor -> API server, on the child's command pipe (core/child.py): ApiServerInit once, then
Drain (the first: drain and exit; a second: exit at once). The API servers ignore SIGINT and
SIGTERM themselves, so a Ctrl-C or systemd's SIGTERM to the whole process group is one drain,
ordered by the supervisor, not one signal per process. End of file on that pipe (the supervisor
is gone) is an exit at once.

The run directory (a private temporary folder the supervisor creates and removes):
`metrics/` (PROMETHEUS_MULTIPROC_DIR), `api-N.sock` (API server N's own socket, beside the
shared port: another API server forwards to it what only N can answer, server/responses), `adds`
(core/shared_count.py), `responses.sqlite` (the Responses store, unless --responses-store names
a file).
"""

from __future__ import annotations

import logging
import os

import msgspec

from core.config import EngineConfig
from server.options import ServerOptions


class Seat(msgspec.Struct, kw_only=True):
    """One API server's place: which of how many, and the descriptors it inherited."""

    index: int
    count: int
    run_dir: str
    engine_fds: tuple[int, int]  # its command pipe into the engine, the engine's replies
    listen_fd: int  # the port: its own socket of a SO_REUSEPORT group (or one shared socket)
    local_fd: int  # its own Unix socket, api-N.sock

    @property
    def publishes_engine_stats(self) -> bool:
        return self.index == 0  # core/engine_fanout.py PUBLISHER


class ApiServerInit(msgspec.Struct, tag="init", kw_only=True):
    seat: Seat
    config: EngineConfig
    options: ServerOptions
    host: str
    port: int
    log_level: int = logging.INFO


class Drain(msgspec.Struct, tag="drain"):
    pass


SupervisorCommand = ApiServerInit | Drain


def local_socket(run_dir: str, index: int) -> str:
    return os.path.join(run_dir, f"api-{index}.sock")


def adds_file(run_dir: str) -> str:
    return os.path.join(run_dir, "adds")


def metrics_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "metrics")


def responses_file(run_dir: str) -> str:
    return os.path.join(run_dir, "responses.sqlite")
