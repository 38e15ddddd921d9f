"""The engine as the server's Trio thread sees it: add, abort, and one dispatch per engine step
into per-request channels.

`Engine` is that front: it validates and queues requests, registers each one's RequestChannel,
and dispatches each step's outputs and statistics (never raising on the Trio thread). Where the
engine runs is the subclass's: `EngineThread` here, an EngineCore on a dedicated thread of this
process driven by the one engine loop (core/engine_loop.py), its commands on a queue and each
step's outputs coming back through one `TrioToken.run_sync_soon`; core/engine_process.py's
EngineProcess, the same loop in a child process.
"""

from __future__ import annotations

import logging
import queue
import threading
import traceback
from collections.abc import Callable

import trio
import trio.testing

from core.engine_core import EngineCore
from core.engine_loop import EngineLoop
from core.engine_messages import AbortRequest, AddRequest, Hold, SetHold, Shutdown
from core.outputs import RequestChannel
from core.request import EngineRequest, RequestOutput
from core.sampling import InvalidParam
from core.stats import StepStats

log = logging.getLogger("weir.engine")

__all__ = ["Engine", "EngineDeadError", "EngineThread", "Hold"]


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


class Engine:
    """The front: what handlers call, on the Trio thread. Subclasses run the engine somewhere
    and implement start, alive, shutdown, _check and _submit."""

    def __init__(self, num_free_blocks: int) -> None:
        self._channels: dict[str, RequestChannel] = {}  # Trio thread only
        self._trio_token: trio.lowlevel.TrioToken | None = None
        self.error: str | None = None  # set once if the engine dies
        self.stopped = False
        # Trio-thread hooks: each step's StepStats, and the engine's death.
        self.on_stats: Callable[[StepStats], None] | None = None
        self.on_death: Callable[[str], None] | None = None
        self._adds_sent = 0  # Trio thread: requests put on the queue, ever
        self._last_stats = StepStats(num_free_blocks=num_free_blocks)

    def start(self) -> None:
        raise NotImplementedError

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    async def shutdown(self) -> None:
        raise NotImplementedError

    def _check(self, req: EngineRequest) -> None:
        """Validate against the model (raises InvalidParam)."""
        raise NotImplementedError

    def _submit(self, cmd) -> None:
        """Hand a command to the engine (synchronous and non-blocking: it runs in `finally`
        blocks of cancelled handlers too)."""
        raise NotImplementedError

    # ---- Trio thread ----
    def add(self, req: EngineRequest, channel: RequestChannel | None = None) -> RequestChannel:
        """Validate (raises InvalidParam) and queue a request; returns the channel to read.

        Passing a channel lets one handler read several requests from one place.
        """
        if not self.alive:
            raise EngineDeadError(self.error or "the engine is not running")
        self._check(req)
        if req.request_id in self._channels:
            raise InvalidParam("request_id", f"request id {req.request_id!r} is already in use")
        channel = channel if channel is not None else RequestChannel()
        self._channels[req.request_id] = channel
        self._count_add()
        self._submit(AddRequest(req))
        return channel

    def _count_add(self) -> None:
        self._adds_sent += 1

    def _adds_total(self) -> int:
        """Requests sent to the engine, ever (by every API server: core/engine_attached.py)."""
        return self._adds_sent

    @property
    def num_waiting(self) -> int:
        """Requests waiting to be scheduled: the engine's count at its last step plus those
        queued since then (exact as of that step, never an undercount)."""
        last = self._last_stats
        return last.num_waiting + self._adds_total() - last.num_adds_seen

    @property
    def last_stats(self) -> StepStats:
        return self._last_stats

    def abort(self, request_id: str) -> None:
        """Synchronous, so it is safe in a `finally` of a cancelled handler."""
        if self._channels.pop(request_id, None) is not None:
            self._submit(AbortRequest(request_id))

    # ---- test hooks ----
    def hold(self, rule: Hold) -> None:
        """Test hook: step only while `rule` allows it (see Hold), until `release()`. Takes
        effect before the engine's next step. Callable from any thread (a test's own)."""
        self._submit_from_any_thread(SetHold(rule))

    def release(self) -> None:
        self._submit_from_any_thread(SetHold(None))

    def _submit_from_any_thread(self, cmd) -> None:
        """_submit runs on the Trio thread (the engine process's writes to its pipe are not
        thread-safe): from another thread, it is run there, and this waits for it."""
        try:
            trio.lowlevel.current_trio_token()
        except RuntimeError:  # not on a Trio thread
            if self._trio_token is not None:
                trio.from_thread.run_sync(self._submit, cmd, trio_token=self._trio_token)
                return
        self._submit(cmd)

    def _dispatch(self, step: tuple[list[RequestOutput], StepStats | None]) -> None:
        # Runs on the Trio thread; an exception here would end the whole Trio run, so none escapes.
        outputs, stats = step
        try:
            if stats is not None:
                self._last_stats = stats
                if self.on_stats is not None:
                    self.on_stats(stats)
        except Exception:  # noqa: BLE001 - see above
            log.exception("publishing engine stats failed")
        try:
            for out in outputs:
                channel = self._channels.get(out.request_id)
                if channel is None:
                    continue  # aborted: the handler has gone
                channel.put(out)
                if out.finished:
                    del self._channels[out.request_id]
        except Exception:  # noqa: BLE001 - see above
            log.exception("dispatching engine outputs failed")

    def _fail_all(self, message: str) -> None:
        try:
            for rid, channel in list(self._channels.items()):
                channel.put(
                    RequestOutput(
                        request_id=rid, finished=True, finish_reason="error", error=message
                    )
                )
            self._channels.clear()
            if self.on_death is not None:
                self.on_death(message)
        except Exception:  # noqa: BLE001 - runs on the Trio thread, must not raise
            log.exception("failing in-flight requests failed")


class EngineThread(Engine):
    """The engine on a dedicated thread of this process (--no-engine-process)."""

    def __init__(self, core: EngineCore) -> None:
        super().__init__(core.kv.num_free_blocks)
        self.core = core
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        # A test hook: after each step the engine waits until every Trio task has run as far as
        # it can with that step's outputs, so how outputs merge never depends on timing.
        self.lockstep = False

    def start(self) -> None:
        self._trio_token = trio.lowlevel.current_trio_token()
        self._thread = threading.Thread(target=self._run, name="weir-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def _check(self, req: EngineRequest) -> None:
        self.core.check(req)

    def _submit(self, cmd) -> None:
        self._commands.put(cmd)

    async def shutdown(self) -> None:
        if self._thread is None:
            return
        self._commands.put(Shutdown())
        await trio.to_thread.run_sync(self._thread.join)

    # ---- engine thread ----
    def _send(self, fn, arg) -> bool:
        try:
            self._trio_token.run_sync_soon(fn, arg)
            return True
        except trio.RunFinishedError:
            return False

    def _take(self, block: bool):
        try:
            return self._commands.get(block)
        except queue.Empty:
            return None

    def _settle(self) -> None:
        """Under `lockstep`: wait until every Trio task has run as far as it can with this
        step's outputs (each handler has taken what was due and written its events), so the
        next step's outputs cannot merge into this one's for a reader that was late."""
        if not self.lockstep:
            return
        settled = threading.Event()

        async def wait_blocked() -> None:
            try:
                await trio.testing.wait_all_tasks_blocked()
            finally:
                settled.set()

        if self._send(lambda _: trio.lowlevel.spawn_system_task(wait_blocked), None):
            settled.wait()

    def _run(self) -> None:
        core = self.core
        loop = EngineLoop(
            core,
            publish=lambda outputs, stats: self._send(self._dispatch, (outputs, stats)),
            refuse=lambda out: self._send(self._dispatch, ([out], None)),
            after_step=self._settle,
        )
        try:
            loop.run(self._take)
        except BaseException as e:  # noqa: BLE001 - any death must reach every waiting client
            self.error = f"engine died: {type(e).__name__}: {e}"
            log.error("engine thread died\n%s", traceback.format_exc())
            self._send(self._fail_all, self.error)
        finally:
            self.stopped = True
            core.close()
