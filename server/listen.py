"""The listening socket weir creates itself, and Hypercorn's configuration over it."""

from __future__ import annotations

import logging
import os
import socket

from hypercorn.config import Config as HypercornConfig

from server.options import ServerOptions


# Pending connections the kernel queues before the event loop accepts them (uvicorn's default).
BACKLOG = 2048


def listening_socket(host: str, port: int, user_timeout: float) -> socket.socket:
    """The listening socket, made here so accepted connections inherit TCP keep-alive and
    TCP_USER_TIMEOUT: a client that stays connected but stops reading (or vanishes) is dropped
    once sent data has gone unacknowledged that long, and its request is aborted."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
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


def hypercorn_config(sock: socket.socket, options: ServerOptions) -> HypercornConfig:
    hc = HypercornConfig()
    # Hypercorn takes ownership of (and closes) the descriptor it is given: give it a duplicate.
    hc.bind = [f"fd://{os.dup(sock.fileno())}"]
    # Hypercorn calls listen() again with its own backlog (100 by default): with 256 clients
    # connecting at once the accept queue overflowed and some connections were reset.
    hc.backlog = BACKLOG
    hc.keep_alive_timeout = options.keep_alive_timeout
    # weir drains first (see serve); Hypercorn's own timeout then only closes idle connections.
    hc.graceful_timeout = 5.0
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")  # through our logging config, printed once
    return hc
