"""The listening socket weir creates itself, and Hypercorn's configuration over it."""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from hypercorn.config import Config as HypercornConfig

from server.options import ServerOptions


# Pending connections the kernel queues before the event loop accepts them (uvicorn's default).
BACKLOG = 2048


def listening_socket(
    host: str, port: int, user_timeout: float, reuse_port: bool = False
) -> socket.socket:
    """The listening socket, made here so accepted connections inherit TCP keep-alive and
    TCP_USER_TIMEOUT: a client that stays connected but stops reading (or vanishes) is dropped
    once sent data has gone unacknowledged that long, and its request is aborted."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle = max(1, int(user_timeout / 2))
    for opt, value in (
        ("TCP_KEEPIDLE", idle),
        ("TCP_KEEPINTVL", max(1, idle // 3)),
        ("TCP_KEEPCNT", 3),
        ("TCP_USER_TIMEOUT", int(user_timeout * 1000)),
    ):
        if hasattr(socket, opt):  # Linux; elsewhere keep-alive alone
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)
    sock.bind((host, port))
    sock.listen(BACKLOG)
    sock.setblocking(False)
    return sock


def api_server_sockets(
    host: str, port: int, count: int, user_timeout: float
) -> list[socket.socket]:
    """The port, for `count` API servers, bound here once by the supervisor before any of them
    starts. On Linux each server gets its own socket of one SO_REUSEPORT group: the kernel hands
    each new connection to one of them by a hash of its addresses, so connections spread evenly
    and each server accepts from its own queue (one socket shared by all would let whichever
    server wakes first take a whole burst of connections); a port something already listens on
    is refused (unused_port), as it is to a single server. Elsewhere (SO_REUSEPORT does not
    balance) the servers share one socket."""
    if sys.platform != "linux" or not hasattr(socket, "SO_REUSEPORT"):
        return [listening_socket(host, port, user_timeout)] * count
    with port_lock(host, port):  # two weirs starting at once: the second finds the first's
        port = unused_port(host, port)
        first = listening_socket(host, port, user_timeout, reuse_port=True)
        port = first.getsockname()[1]  # port 0: the one the kernel chose, for the others too
        rest = [listening_socket(host, port, user_timeout, True) for _ in range(count - 1)]
    return [first, *rest]


def port_lock_path(host: str, port: int) -> str:
    name = f"weir.port-{os.getuid()}-{host.replace('/', '_')}-{port}.lock"
    return os.path.join(tempfile.gettempdir(), name)


@contextmanager
def port_lock(host: str, port: int) -> Iterator[None]:
    """This user's lock on `port` (none for 0, which the kernel picks afresh), held while a
    SO_REUSEPORT group checks the port and binds: without it two weirs started at the same
    moment could both find the port unused, then both bind, and share it silently (a group
    admits any socket of the same user). Only the same user can join a group, so the lock file
    is per user; it is left behind, empty, for the next start."""
    if port == 0:
        yield
        return
    fd = os.open(port_lock_path(host, port), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def unused_port(host: str, port: int) -> int:
    """`port` (or, for 0, one the kernel picks) when nothing listens on it; else OSError
    EADDRINUSE. A SO_REUSEPORT group admits any socket of the same user that asks for it: a
    second weir (or anything else) with SO_REUSEPORT on a port weir's API servers hold would
    join their group and take a share of their connections, with no error. A plain socket
    (SO_REUSEADDR alone, so connections in TIME_WAIT do not count) cannot bind a port that has
    a listener, whatever its options: bound and closed at once, it tells."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
        return probe.getsockname()[1]


def local_listening_socket(path: str) -> socket.socket:
    """An API server's own Unix socket (the supervisor's run directory is private to its
    user): the other servers forward to it; tests reach one server through it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(BACKLOG)
    sock.setblocking(False)
    return sock


def hypercorn_config(
    sock: socket.socket, options: ServerOptions, local_sock: socket.socket | None = None
) -> HypercornConfig:
    """`local_sock`: an API server's own Unix socket, served beside the port."""
    hc = HypercornConfig()
    # Hypercorn takes ownership of (and closes) the descriptor it is given: give it a duplicate.
    hc.bind = [f"fd://{os.dup(s.fileno())}" for s in (sock, local_sock) if s is not None]
    # Hypercorn calls listen() again with its own backlog (100 by default): with 256 clients
    # connecting at once the accept queue overflowed and some connections were reset.
    hc.backlog = BACKLOG
    hc.keep_alive_timeout = options.keep_alive_timeout
    # weir drains first (see serve); Hypercorn's own timeout then only closes idle connections.
    hc.graceful_timeout = 5.0
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")  # through our logging config, printed once
    return hc
