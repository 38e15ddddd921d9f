"""The engine process's side of --api-server-count N > 1: one engine, N API servers, each with
its own pair of pipes (core/child.py Link), and the supervisor's pair beside them.

Commands: the engine takes whatever has arrived on any API server's command pipe (and the
supervisor's, which sends only Shutdown) at the top of each step, as it does from one server.
Each request is renamed on its way in to `"{server}:{id}"` (its `leader_id` too), so two
servers may use the same id (a client's X-Request-Id) without meeting in the engine, and its
owner is remembered; an abort names the id as its server knows it.

Outputs: each step's outputs go to the servers that own them, renamed back, one StepOutputs
per server per step (an empty one to a server with nothing in that step, so that every server
keeps the engine's queue length for admission: server/submit.py). The step's statistics are
published once: API server 0 gets them whole and publishes them to /metrics and the stats log;
the others get the gauges alone (running, waiting, KV usage, adds seen), never the counters, so
nothing is counted twice when prometheus_client sums the servers' files.

An API server that leaves (end of file on its command pipe, or a broken reply pipe: it exited
or was killed) has its requests aborted at once and is written to no more; the engine keeps
serving the others until the supervisor sends Shutdown (or its pipe closes: it is gone).
"""

from __future__ import annotations

import logging
from collections import deque
from multiprocessing.connection import Connection, wait

import msgspec

from core.engine_messages import (
    AbortRequest,
    AddRequest,
    EngineCommand,
    SetHold,
    Shutdown,
    StepOutputs,
)
from core.request import RequestOutput
from core.stats import StepStats

log = logging.getLogger("weir.engine")

PUBLISHER = 0  # the API server that publishes the engine's statistics


def gauges(stats: StepStats) -> StepStats:
    """What every API server needs of a step's statistics: the queue (admission), the gauges."""
    return StepStats(
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        num_deferred=stats.num_deferred,
        kv_usage=stats.kv_usage,
        num_free_blocks=stats.num_free_blocks,
        num_adds_seen=stats.num_adds_seen,
    )


class Fanout:
    def __init__(
        self,
        control: tuple[Connection, Connection],
        servers: list[tuple[Connection, Connection]],
    ) -> None:
        self.control, self.control_reply = control
        self.commands = [c for c, _ in servers]
        self.replies = [r for _, r in servers]
        self.open = set(range(len(servers)))
        self.owner: dict[str, tuple[int, str]] = {}  # engine id -> (server, its id there)
        self.ready: deque = deque()  # commands read, not yet taken
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(EngineCommand).decode

    # ---- commands in ----
    def take(self, block: bool):
        """The next command from any API server or the supervisor; None when none has arrived
        (waiting for one only when `block`)."""
        while not self.ready:
            conns = [self.control] + [self.commands[i] for i in sorted(self.open)]
            readable = wait(conns, None if block else 0)
            if not readable:
                return None
            for conn in readable:
                self._read(conn)
        return self.ready.popleft()

    def _read(self, conn: Connection) -> None:
        if conn is self.control:
            try:
                cmd = self._decode(conn.recv_bytes())
            except (EOFError, OSError):
                cmd = Shutdown()  # the supervisor is gone: nobody is left to serve
            if isinstance(cmd, Shutdown):
                self.ready.append(cmd)
            return
        server = self.commands.index(conn)
        try:
            cmd = self._decode(conn.recv_bytes())
        except (EOFError, OSError):
            self._leave(server)
            return
        if isinstance(cmd, AddRequest):
            req = cmd.request
            theirs = req.request_id
            req.request_id = f"{server}:{theirs}"
            if req.leader_id is not None:
                req.leader_id = f"{server}:{req.leader_id}"
            self.owner[req.request_id] = (server, theirs)
            self.ready.append(cmd)
        elif isinstance(cmd, AbortRequest):
            ours = f"{server}:{cmd.request_id}"
            if self.owner.pop(ours, None) is not None:
                self.ready.append(AbortRequest(ours))
        elif isinstance(cmd, SetHold):
            self.ready.append(cmd)
        elif isinstance(cmd, Shutdown):
            self._leave(server)  # an API server stops the engine only by leaving

    def _leave(self, server: int) -> None:
        """An API server has gone: abort what it had running, write to it no more."""
        if server not in self.open:
            return
        self.open.discard(server)
        for conn in (self.commands[server], self.replies[server]):
            conn.close()
        mine = [ours for ours, (s, _) in self.owner.items() if s == server]
        for ours in mine:
            del self.owner[ours]
            self.ready.append(AbortRequest(ours))
        (log.warning if mine else log.info)(
            "API server %d left the engine: %d requests aborted", server, len(mine)
        )

    # ---- outputs out ----
    def publish(self, outputs: list[RequestOutput], stats: StepStats | None) -> bool:
        """One StepOutputs to each API server: its own outputs, the statistics (whole to the
        publisher, the gauges to the others). Always True: the engine serves until Shutdown."""
        mine: dict[int, list[RequestOutput]] = {s: [] for s in self.open}
        for out in outputs:
            owner = self.owner.get(out.request_id)
            if owner is None:
                continue  # aborted: its server has stopped reading it
            if out.finished:
                del self.owner[out.request_id]
            server, out.request_id = owner
            if server in mine:
                mine[server].append(out)
        few = gauges(stats) if stats is not None else None
        for server in sorted(self.open):
            step = StepOutputs(mine[server], stats if server == PUBLISHER else few)
            self._send(server, step)
        return True

    def refuse(self, out: RequestOutput) -> None:
        """An add the engine refused: its error to the server that sent it."""
        owner = self.owner.pop(out.request_id, None)
        if owner is not None:
            server, out.request_id = owner
            self._send(server, StepOutputs([out], None))

    def _send(self, server: int, msg) -> None:
        if server not in self.open:
            return
        try:
            self.replies[server].send_bytes(self._encode(msg))
        except OSError:  # it exited or was killed
            self._leave(server)

    def send_all(self, msg) -> None:
        """To the supervisor and every API server (EngineReady, EngineDied)."""
        frame = self._encode(msg)
        for conn in [self.control_reply] + [self.replies[s] for s in sorted(self.open)]:
            try:
                conn.send_bytes(frame)
            except OSError:
                pass
