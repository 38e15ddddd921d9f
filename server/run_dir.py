"""The supervisor's run directory (--api-server-count N > 1): its API servers' local sockets, the
shared admission counts, the metrics files and the default Responses store, in a private
temporary folder removed when the server stops.

A server killed outright (SIGKILL, a crash, the machine's OOM killer) cannot remove its own, so
each holds a file with its supervisor's pid, and the next server to start removes the folders
whose supervisor is gone: a folder without that file, or whose process lives, is left alone.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import tempfile

log = logging.getLogger("weir.server")

PREFIX = "weir-"
PID_FILE = "supervisor.pid"


def create() -> str:
    """A new run directory (mode 0700: this user's alone), stale ones of dead servers removed."""
    sweep()
    path = tempfile.mkdtemp(prefix=PREFIX)
    with open(os.path.join(path, PID_FILE), "w") as f:
        f.write(str(os.getpid()))
    return path


def remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    return True


def sweep(root: str | None = None) -> list[str]:
    """Remove the run directories under `root` (the temporary folder) whose supervisor is no
    longer running; the paths removed."""
    removed = []
    for path in glob.glob(os.path.join(root or tempfile.gettempdir(), PREFIX + "*")):
        try:
            with open(os.path.join(path, PID_FILE)) as f:
                pid = int(f.read().strip())
        except (OSError, ValueError):
            continue  # not one of ours, or being created
        if pid != os.getpid() and not _alive(pid):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        log.info("removed %d run directories of servers no longer running", len(removed))
    return removed
