"""One API server of several (--api-server-count N > 1): `python -m server.api_server CMD_FD
REPLY_FD`, started by the supervisor (server/supervisor.py) as weir starts every child
(core/child.py).

It is the same app as a single server (server/app.py create_app, serve) with a seat
(server/api_server_messages.py): its engine is the supervisor's, reached through its own pair of
pipes (core/engine_attached.py); it serves the shared port on the socket the supervisor bound,
and its own Unix socket beside it; it drains when the supervisor says Drain (a second Drain:
exit at once), not on signals, which it ignores (a Ctrl-C reaches the whole process group: the
supervisor alone decides); and it exits at once when the supervisor is gone (end of file on its
command pipe, or `watch_parent`).
"""

from __future__ import annotations

import functools
import logging
import signal
import socket
import sys
from collections.abc import Callable

import msgspec
import trio

from core.child import pipes, watch_parent
from server.api_server_messages import ApiServerInit, Drain, SupervisorCommand
from server.cli import keep_torch_out

log = logging.getLogger("weir.server")


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    watch_parent()
    commands, _ = pipes(sys.argv)
    decode = msgspec.msgpack.Decoder(SupervisorCommand).decode
    try:
        init = decode(commands.recv_bytes())
    except EOFError:
        return 1
    if not isinstance(init, ApiServerInit):
        raise SystemExit(f"an API server expected ApiServerInit, got {type(init).__name__}")
    seat = init.seat
    logging.basicConfig(
        level=init.log_level,
        format=f"%(asctime)s %(levelname)s %(name)s[api {seat.index}]: %(message)s",
    )
    keep_torch_out()  # no model runs here
    from server.app import create_app, serve

    app = create_app(init.config, init.options, seat)

    async def supervisor_orders(stop: Callable[[str], bool]) -> None:
        fd = commands.fileno()
        while True:
            await trio.lowlevel.wait_readable(fd)
            try:
                order = decode(commands.recv_bytes())
            except EOFError:
                log.error("the supervisor is gone: exiting")
                while not stop("end of the supervisor"):
                    pass
                return
            if isinstance(order, Drain) and stop("drain order"):
                return

    return trio.run(
        functools.partial(
            serve,
            app,
            init.host,
            init.port,
            sock=socket.socket(fileno=seat.listen_fd),
            local_sock=socket.socket(fileno=seat.local_fd),
            stop_orders=supervisor_orders,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
