"""The supervisor: `weir serve --api-server-count N` with N > 1, N HTTP processes (API servers,
server/api_server.py) serving one port in front of one engine process, as vLLM runs them.

It is handed the port bound once (server/listen.py api_server_sockets: a SO_REUSEPORT group, one
socket per API server), makes a private run directory (server/api_server_messages.py: Prometheus'
multiprocess files, each server's Unix socket, the shared admission count, the Responses
store), starts the engine process with its own pipes and one pair per API server
(core/child.py Link, core/engine_fanout.py), then the API servers, each handed its seat. It
serves no HTTP itself; it watches:

- SIGINT/SIGTERM: every API server is told to drain (Drain); once all have exited, the engine
  is told to stop (Shutdown) and joined; exit 0. An engine still loading is killed at once. A
  second signal: every server exits at once; exit 1. The children ignore those signals, so a
  Ctrl-C or systemd's SIGTERM to the whole group is one drain.
- An API server that exits while nothing asked it to: the whole server stops, as vLLM stops
  when one of its API servers dies, never leaving a server that silently answers on some
  connections only: a log line names the server, its pid and exit status, the others drain,
  the engine stops (it has already aborted the dead server's requests); exit 1.
- The engine process exiting: each API server fails its in-flight requests and exits 1 by
  itself (with --no-exit-on-engine-error they stay up, unhealthy, and so does this process);
  exit 1. A model that fails to load: exit 2 for bad input, as with one server, else 1.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess

import msgspec
import trio

from core.child import Child, Link, exit_text
from core.config import EngineConfig
from core.engine_messages import EngineDied, EngineInit, EngineReady, EngineReply, Shutdown
from core.shared_count import SharedCounts
from server.api_server_messages import (
    ApiServerInit,
    Drain,
    Seat,
    adds_file,
    local_socket,
    metrics_dir,
    responses_file,
)
from server import run_dir
from server.listen import local_listening_socket
from server.options import ServerOptions

log = logging.getLogger("weir.server")

ENGINE_STOP_S = 10.0  # after Shutdown, before the engine is killed
DRAIN_MARGIN_S = 20.0  # past --drain-timeout, before an API server that has not exited is killed


def supervise(
    config: EngineConfig,
    options: ServerOptions,
    host: str,
    ports: list[socket.socket],
) -> int:
    """Run an API server on each of `ports` (server/listen.py api_server_sockets, bound by the
    caller) and the engine until they stop; the exit code."""
    path = run_dir.create()
    try:
        return trio.run(Supervisor(config, options, host, ports, path).run)
    finally:
        run_dir.remove(path)


async def wait_exit(proc: subprocess.Popen) -> int:
    """A child's exit status, waited for without a thread where Linux offers a pidfd."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        return await trio.to_thread.run_sync(proc.wait, abandon_on_cancel=True)
    try:
        await trio.lowlevel.wait_readable(fd)
    finally:
        trio.lowlevel.notify_closing(fd)
        os.close(fd)
    return proc.wait()


class Supervisor:
    def __init__(
        self,
        config: EngineConfig,
        options: ServerOptions,
        host: str,
        ports: list[socket.socket],
        run_dir: str,
    ) -> None:
        self.config, self.options, self.count = config, options, len(ports)
        self.host, self.ports, self.run_dir = host, ports, run_dir
        self.port = ports[0].getsockname()[1]
        self.engine: Child | None = None
        self.servers: list[Child] = []
        self.stopping = False  # the API servers were told to drain
        self.forced = False  # a second signal
        self.failure: str | None = None
        self.bad_input = False  # the model given could not be served: exit 2
        self.exit_codes: dict[int, int] = {}
        self.all_gone = trio.Event()
        self.engine_ready = False
        self.engine_died = False  # under --no-exit-on-engine-error: exit 1 when stopped
        self.stopped_loading = False  # a signal came before the engine was ready: killed

    # ---- start-up ----
    def _prepare(self) -> None:
        """The run directory's shared files, before any child starts."""
        os.mkdir(metrics_dir(self.run_dir))
        # prometheus_client reads it when imported: every API server inherits it.
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir(self.run_dir)
        SharedCounts.create(adds_file(self.run_dir), self.count)
        options = self.options
        if not options.disable_responses_store:
            from server.responses.sqlite_store import SqliteStore

            # Created, and what a killed server left running marked incomplete, once, here.
            path = options.responses_store or responses_file(self.run_dir)
            store = SqliteStore(path, options.responses_store_max_entries, None)
            store.close()

    def _start(self) -> None:
        self._prepare()
        ports = self.ports
        locals_ = [local_listening_socket(local_socket(self.run_dir, i)) for i in range(self.count)]
        links = [Link() for _ in range(self.count)]
        engine_fds = [fd for link in links for fd in link.engine_ends]
        self.engine = Child(
            "core.engine_process", args=[str(fd) for fd in engine_fds], pass_fds=engine_fds
        )
        level = logging.getLogger().getEffectiveLevel()
        encode = msgspec.msgpack.Encoder().encode
        self.engine.commands.send_bytes(encode(EngineInit(self.config, level)))
        for i, (link, sock, local) in enumerate(zip(links, ports, locals_)):
            seat = Seat(
                index=i,
                count=self.count,
                run_dir=self.run_dir,
                engine_fds=link.server_ends,
                listen_fd=sock.fileno(),
                local_fd=local.fileno(),
            )
            child = Child(
                "server.api_server",
                pass_fds=[*link.server_ends, sock.fileno(), local.fileno()],
            )
            init = ApiServerInit(
                seat=seat,
                config=self.config,
                options=self.options,
                host=self.host,
                port=self.port,
                log_level=level,
            )
            child.commands.send_bytes(encode(init))
            self.servers.append(child)
        # The children hold their own copies now: a child's death is an end of file at the
        # engine, and only the servers hold the port.
        for link in links:
            link.close()
        for sock in {id(s): s for s in ports + locals_}.values():
            sock.close()
        log.info(
            "%d API servers on http://%s:%d/v1 (pids %s), the engine process pid %d",
            self.count,
            self.host,
            self.port,
            ", ".join(str(s.proc.pid) for s in self.servers),
            self.engine.proc.pid,
        )

    # ---- stopping ----
    def _tell_servers(self) -> None:
        frame = msgspec.msgpack.encode(Drain())
        for i, child in enumerate(self.servers):
            if i in self.exit_codes:
                continue
            try:
                child.commands.send_bytes(frame)
            except OSError:
                pass  # it has just exited: its watcher says so

    def _drain(self, nursery: trio.Nursery) -> None:
        if self.stopping:
            return
        self.stopping = True
        self._tell_servers()
        nursery.start_soon(self._kill_stragglers)

    def _fail(self, reason: str, nursery: trio.Nursery) -> None:
        log.error("%s", reason)
        self.failure = self.failure or reason
        self._drain(nursery)

    async def _kill_stragglers(self) -> None:
        await trio.sleep(self.options.drain_timeout + DRAIN_MARGIN_S)
        for i, child in enumerate(self.servers):
            if i not in self.exit_codes:
                log.error("API server %d did not exit after draining: killing it", i)
                child.proc.kill()

    async def _stop_engine(self) -> None:
        engine = self.engine
        if engine.proc.poll() is None:
            try:
                engine.commands.send_bytes(msgspec.msgpack.encode(Shutdown()))
            except OSError:
                pass
            with trio.move_on_after(ENGINE_STOP_S) as waited:
                await wait_exit(engine.proc)
            if waited.cancelled_caught:
                log.warning("the engine process did not stop in %.0f s: killing it", ENGINE_STOP_S)
                engine.proc.kill()
                engine.proc.wait()

    # ---- watchers ----
    async def _watch_signals(self, nursery: trio.Nursery) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                if not self.stopping:
                    log.info("signal received: draining %d API servers", self.count)
                    self._drain(nursery)
                    if not self.engine_ready:  # it has taken nothing: no load to wait out
                        log.info("stopped while the model was loading")
                        self.stopped_loading = True
                        self.engine.proc.kill()
                elif not self.forced:
                    log.warning("second signal: exiting now")
                    self.forced = True
                    self._tell_servers()  # a second Drain: exit at once

    async def _watch_server(self, i: int, nursery: trio.Nursery) -> None:
        child = self.servers[i]
        code = await wait_exit(child.proc)
        self.exit_codes[i] = code
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(child.proc.pid)  # its live gauges leave /metrics
        if code == 2:
            self.bad_input = True
        if not self.stopping:
            self._fail(
                f"API server {i} (pid {child.proc.pid}) exited with {exit_text(code)}: stopping "
                f"the server (its in-flight requests are lost; the other API servers drain)",
                nursery,
            )
        if len(self.exit_codes) == len(self.servers):
            self.all_gone.set()

    async def _watch_engine(self, nursery: trio.Nursery) -> None:
        code = await wait_exit(self.engine.proc)
        if self.all_gone.is_set() or self.failure or self.stopped_loading:
            return  # stopped by _stop_engine or by a signal, or its failure is already told
        message = f"the engine process exited unexpectedly ({exit_text(code)})"
        if self.options.exit_on_engine_error:
            self._fail(message + ": stopping the API servers", nursery)
        else:
            self.engine_died = True
            log.error("%s; the API servers stay up, unhealthy (--no-exit-on-engine-error)", message)

    async def _read_engine(self, nursery: trio.Nursery) -> None:
        """The engine's replies to the supervisor: EngineReady, or EngineDied (loading failed,
        or the engine failed later); nothing per step."""
        replies = self.engine.replies
        decode = msgspec.msgpack.Decoder(EngineReply).decode
        while True:
            await trio.lowlevel.wait_readable(replies.fileno())
            try:
                msg = decode(replies.recv_bytes())
            except (EOFError, OSError):
                return  # _watch_engine reports it
            if isinstance(msg, EngineReady):
                self.engine_ready = True
                log.info("the engine is ready on %s", msg.device or "its device")
                if msg.device == "cpu" and self.options.api_server_count is None:
                    log.warning(
                        "%d API servers were chosen for CUDA, but the engine runs on the CPU: "
                        "pass --api-server-count 1",
                        self.count,
                    )
            elif isinstance(msg, EngineDied):
                self.bad_input = self.bad_input or msg.bad_input
                if not self.engine_ready or self.options.exit_on_engine_error:
                    self._fail(msg.message, nursery)
                else:
                    self.engine_died = True
                    log.error("%s; the API servers stay up, unhealthy", msg.message)

    # ---- the whole ----
    async def run(self) -> int:
        try:
            self._start()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_signals, nursery)
                nursery.start_soon(self._watch_engine, nursery)
                nursery.start_soon(self._read_engine, nursery)
                for i in range(self.count):
                    nursery.start_soon(self._watch_server, i, nursery)
                await self.all_gone.wait()
                await self._stop_engine()
                nursery.cancel_scope.cancel()
        finally:
            for child in [self.engine, *self.servers]:
                if child is not None and child.proc.poll() is None:
                    child.proc.kill()
                    child.proc.wait()
        if self.bad_input:
            return 2
        if self.failure or self.forced or self.engine_died or any(self.exit_codes.values()):
            return 1  # (an engine that died under --no-exit-on-engine-error: 1 when stopped)
        return 0
