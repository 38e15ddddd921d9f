"""Engine: the dedicated thread that owns EngineCore, fed by a command queue, answering in one hop.

Handlers on the Trio thread call `add` and `abort`; each step's outputs come back through a single
`TrioToken.run_sync_soon(dispatch, outputs)`, and dispatch puts them in per-request channels.
"""

from __future__ import annotations

import logging
import queue
import threading
import traceback

from collections.abc import Callable

import trio

from core.engine_core import EngineCore
from core.outputs import RequestChannel
from core.request import EngineRequest, RequestOutput
from core.sampling import InvalidParam
from core.stats import StepStats

log = logging.getLogger("weir.engine")

_SHUTDOWN = object()


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


class Engine:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._init_trio_side(core.kv.num_free_blocks)

    def _init_trio_side(self, num_free_blocks: int) -> None:
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._channels: dict[str, RequestChannel] = {}  # Trio thread only
        self._thread: threading.Thread | None = None
        self._trio_token: trio.lowlevel.TrioToken | None = None
        self.error: str | None = None  # set once if the engine thread dies
        self.stopped = False
        # Trio-thread hooks: each step's StepStats, and the engine's death.
        self.on_stats: Callable[[StepStats], None] | None = None
        self.on_death: Callable[[str], None] | None = None
        self._adds_sent = 0  # Trio thread: requests put on the queue, ever
        self._last_stats = StepStats(num_free_blocks=num_free_blocks)

    # ---- Trio thread ----
    def start(self) -> None:
        self._trio_token = trio.lowlevel.current_trio_token()
        self._thread = threading.Thread(target=self._run, name="weir-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

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
        self._submit("add", req)
        self._adds_sent += 1
        return channel

    def _check(self, req: EngineRequest) -> None:
        self.core.check(req)

    def _submit(self, kind, arg) -> None:
        """Hand a command to the engine (synchronous and non-blocking: it runs in `finally`
        blocks of cancelled handlers too)."""
        self._commands.put((kind, arg))

    @property
    def num_waiting(self) -> int:
        """Requests waiting to be scheduled: the engine's count at its last step plus those
        queued since then (exact as of that step, never an undercount)."""
        last = self._last_stats
        return last.num_waiting + self._adds_sent - last.num_adds_seen

    @property
    def last_stats(self) -> StepStats:
        return self._last_stats

    def abort(self, request_id: str) -> None:
        """Synchronous, so it is safe in a `finally` of a cancelled handler."""
        if self._channels.pop(request_id, None) is not None:
            self._submit("abort", request_id)

    async def shutdown(self) -> None:
        if self._thread is None:
            return
        self._commands.put((_SHUTDOWN, None))
        await trio.to_thread.run_sync(self._thread.join)

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

    # ---- engine thread ----
    def _send(self, fn, arg) -> bool:
        try:
            self._trio_token.run_sync_soon(fn, arg)
            return True
        except trio.RunFinishedError:
            return False

    def _handle(self, cmd) -> bool:
        kind, arg = cmd
        if kind is _SHUTDOWN:
            return False
        if kind == "add":
            try:
                self.core.add(arg)
            except ValueError as e:  # raced past the Trio-side check: fail just this request
                self._send(
                    self._dispatch,
                    (
                        [
                            RequestOutput(
                                request_id=arg.request_id,
                                finished=True,
                                finish_reason="error",
                                error=str(e),
                            )
                        ],
                        None,
                    ),
                )
        elif kind == "abort":
            self.core.abort(arg)
        return True

    def _run(self) -> None:
        core = self.core
        try:
            while True:
                # Block only when idle; otherwise take whatever has arrived and step.
                cmd = self._commands.get() if not core.has_work else None
                if cmd is not None and not self._handle(cmd):
                    break
                stop = False
                while True:
                    try:
                        cmd = self._commands.get_nowait()
                    except queue.Empty:
                        break
                    if not self._handle(cmd):
                        stop = True
                        break
                if stop:
                    break
                outputs = core.step()
                # One hop per step: the outputs and the step's statistics together.
                if not self._send(self._dispatch, (outputs, core.take_stats())):
                    break
        except BaseException as e:  # noqa: BLE001 - any death must reach every waiting client
            self.error = f"engine died: {type(e).__name__}: {e}"
            log.error("engine thread died\n%s", traceback.format_exc())
            self._send(self._fail_all, self.error)
        finally:
            self.stopped = True
            core.close()
