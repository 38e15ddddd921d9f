"""weir's child processes, started one way: the engine process (core/engine_process.py) and the
tensor-parallel workers (gpu/dist/worker.py) each run as `python -m MODULE CMD_FD REPLY_FD`.

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
from multiprocessing.connection import Connection
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # where `core`, `gpu` and `server` import from


class Child:
    """A started child: its process, the pipe that takes its commands and the one it replies on."""

    def __init__(self, module: str, env: dict[str, str] | None = None) -> None:
        cmd_read, cmd_write = os.pipe()
        reply_read, reply_write = os.pipe()
        env = dict(os.environ if env is None else env)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, str(cmd_read), str(reply_write)],
            pass_fds=(cmd_read, reply_write),
            env=env,
        )
        os.close(cmd_read)  # the child's ends: closing ours makes its death an end of file here
        os.close(reply_write)
        self.commands = Connection(cmd_write, readable=False)
        self.replies = Connection(reply_read, writable=False)


def pipes(argv: list[str]) -> tuple[Connection, Connection]:
    """In the child: (its command pipe, its reply pipe) from `sys.argv`."""
    return Connection(int(argv[1]), writable=False), Connection(int(argv[2]), readable=False)


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
