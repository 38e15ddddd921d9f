"""weir's child processes, started one way: the engine process (core/engine_process.py), the
tensor-parallel workers (gpu/dist/worker.py) and, with --api-server-count N > 1, the API servers
(server/frontend.py) each run as `python -m MODULE CMD_FD REPLY_FD [ARGS]`.

Two one-way pipes of multiprocessing.Connection frames (msgspec msgpack inside); the parent's
environment with the repository root first on PYTHONPATH (the child imports the code its parent
runs) and its working directory. The parent's death reads as end of file on the child's command
pipe, and `watch_parent` ends a child blocked elsewhere (in a collective, a long step).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # where `core`, `gpu` and `server` import from


class Child:
    """A started child: its process, the pipe that takes its commands and the one it replies on."""

    def __init__(
        self,
        module: str,
        env: dict[str, str] | None = None,
        args: Sequence[str] = (),
        pass_fds: Sequence[int] = (),
    ) -> None:
        """`args` follow the two pipes on the command line; `pass_fds`: more descriptors the
        child inherits under the same numbers (the caller closes its own copies)."""
        cmd_read, cmd_write = os.pipe()
        reply_read, reply_write = os.pipe()
        env = dict(os.environ if env is None else env)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, str(cmd_read), str(reply_write), *args],
            pass_fds=(cmd_read, reply_write, *pass_fds),
            env=env,
        )
        os.close(cmd_read)  # the child's ends: closing ours makes its death an end of file here
        os.close(reply_write)
        self.commands = Connection(cmd_write, readable=False)
        self.replies = Connection(reply_read, writable=False)


def pipes(argv: list[str]) -> tuple[Connection, Connection]:
    """In the child: (its command pipe, its reply pipe) from `sys.argv`."""
    return Connection(int(argv[1]), writable=False), Connection(int(argv[2]), readable=False)


class Link:
    """Two one-way pipes between two processes their parent starts (an API server and the
    engine process, --api-server-count > 1): each child is handed its two ends, and the parent
    closes its copies once both have started, so either one's death is an end of file at the
    other."""

    def __init__(self) -> None:
        self.cmd_read, self.cmd_write = os.pipe()  # commands: API server -> engine
        self.reply_read, self.reply_write = os.pipe()  # replies: engine -> API server

    @property
    def engine_ends(self) -> tuple[int, int]:
        return self.cmd_read, self.reply_write

    @property
    def server_ends(self) -> tuple[int, int]:
        return self.cmd_write, self.reply_read

    def close(self) -> None:
        """The parent's copies, once both children have theirs."""
        for fd in (self.cmd_read, self.cmd_write, self.reply_read, self.reply_write):
            os.close(fd)


def linked_pipes(argv: list[str]) -> list[tuple[Connection, Connection]]:
    """In the engine process: the (command, reply) pipes of each API server named after its
    own two pipes in `sys.argv` (none with a single server)."""
    fds = [int(a) for a in argv[3:]]
    return [
        (Connection(fds[i], writable=False), Connection(fds[i + 1], readable=False))
        for i in range(0, len(fds), 2)
    ]


def watch_parent() -> None:
    """In the child: exit when the parent is gone, even from inside a call that will never
    return (a collective whose peer died, a step), where the command pipe is not read."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="weir-watch-parent", daemon=True).start()


def exit_text(code: int) -> str:
    """How a child exited, for a message: "signal N" or "code N"."""
    return f"signal {-code}" if code < 0 else f"code {code}"
