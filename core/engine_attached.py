"""AttachedEngine: one API server's front of an engine process it shares with others
(--api-server-count N > 1).

The supervisor (server/supervisor.py) started the engine and handed this API server its own
pair of pipes to it (core/child.py Link). This is EngineProcess without the child: the same
reply task and command writes on the Trio thread, the same add, abort and dispatch
(core/engine.py), but `launch` only waits for the EngineReady the engine sends every API server,
and `shutdown` only closes this server's command pipe: the engine then aborts whatever this
server left running and writes to it no more (core/engine_fanout.py); the supervisor stops the
engine once every API server has gone.

The requests this server sends are counted in a slot of the supervisor's SharedCounts, so that
`num_waiting` (admission, --max-waiting-requests) counts every API server's requests queued
since the engine's last step, not this server's alone.
"""

from __future__ import annotations

from multiprocessing.connection import Connection

import trio

from core.config import EngineConfig
from core.engine_messages import EngineReady
from core.engine_process import EngineProcess
from core.shared_count import SharedCounts


class AttachedEngine(EngineProcess):
    def __init__(
        self, config: EngineConfig, cmd_fd: int, reply_fd: int, adds: SharedCounts | None = None
    ) -> None:
        super().__init__(config)
        self._cmd = Connection(cmd_fd, readable=False)
        self._reply = Connection(reply_fd, writable=False)
        self._adds = adds

    def launch(self) -> EngineReady:
        """Blocking: wait until the engine has loaded its model."""
        return self._await_ready()

    def process_alive(self) -> bool:
        return True  # not this process's child: its death is the end of file on the reply pipe

    def _wait(self, timeout: float) -> int | None:
        return None  # the supervisor reaps it

    def _count_add(self) -> None:
        super()._count_add()
        if self._adds is not None:
            self._adds.add()

    def _adds_total(self) -> int:
        return self._adds.total() if self._adds is not None else super()._adds_total()

    async def shutdown(self) -> None:
        """Leave the engine: what the pipe still holds is written (5 s at most), then it is
        closed."""
        self._closing = True
        if self._cmd.closed:
            return
        done = self._flush_done
        if done is not None:
            with trio.move_on_after(5):
                await done.wait()
            trio.lowlevel.notify_closing(self._cmd.fileno())  # a writer still waiting gives up
        self._cmd.close()
