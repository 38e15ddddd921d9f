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

import msgspec
import trio
import trio.testing

from core.engine_core import EngineCore
from core.outputs import RequestChannel
from core.request import EngineRequest, RequestOutput
from core.sampling import InvalidParam
from core.stats import StepStats

log = logging.getLogger("weir.engine")

_SHUTDOWN = object()


class Hold(msgspec.Struct, frozen=True, gc=False):
    """A test hook: when the engine stops stepping, so a test decides what a request can reach
    instead of racing it. Asked before every step; a held engine still takes its commands
    (add, abort, hold, shutdown), so a held request ends only by abort or shutdown.

    `paused`: held until released. `gather`: held until this many requests are in the engine
    (once: a batch gathers, then runs as it would). `at_output_tokens`: held once the engine
    has requests and every one has written at least this many tokens."""

    paused: bool = False
    gather: int = 0
    at_output_tokens: int = 0

    def check(self, core: EngineCore) -> tuple[bool, Hold]:
        """(held now, the rule from now on)."""
        rule = self
        requests = core.requests
        if rule.gather:
            if len(requests) < rule.gather:
                return True, rule
            rule = msgspec.structs.replace(rule, gather=0)
        held = rule.paused or (
            rule.at_output_tokens > 0
            and len(requests) > 0
            and all(r.num_output_tokens >= rule.at_output_tokens for r in requests.values())
        )
        return held, rule


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
        # Test hooks (ordering made explicit, never left to timing): see hold, lockstep.
        self._hold: Hold | None = None  # engine side: the rule in force
        self.lockstep = False

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

    # ---- test hooks ----
    def hold(self, rule: Hold) -> None:
        """Test hook: step only while `rule` allows it (see Hold), until `release()`. Takes
        effect before the engine's next step. Callable from any thread (a test's own)."""
        self._submit_from_any_thread("hold", rule)

    def release(self) -> None:
        self._submit_from_any_thread("hold", None)

    def _submit_from_any_thread(self, kind, arg) -> None:
        """_submit runs on the Trio thread (the engine process's writes to its pipe are not
        thread-safe): from another thread, it is run there, and this waits for it."""
        try:
            trio.lowlevel.current_trio_token()
        except RuntimeError:  # not on a Trio thread
            if self._trio_token is not None:
                trio.from_thread.run_sync(self._submit, kind, arg, trio_token=self._trio_token)
                return
        self._submit(kind, arg)

    def _held(self) -> bool:
        if self._hold is None:
            return False
        held, self._hold = self._hold.check(self.core)
        return held

    def _settle(self) -> None:
        """Engine thread, under `lockstep`: wait until every Trio task has run as far as it can
        with this step's outputs (each handler has taken what was due and written its events),
        so the next step's outputs cannot merge into this one's for a reader that was late."""
        settled = threading.Event()

        async def wait_blocked() -> None:
            try:
                await trio.testing.wait_all_tasks_blocked()
            finally:
                settled.set()

        if self._send(lambda _: trio.lowlevel.spawn_system_task(wait_blocked), None):
            settled.wait()

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
        if kind == "hold":
            self._hold = arg
            return True
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
                # Block only when idle (or held); otherwise take whatever has arrived and step.
                cmd = self._commands.get() if not core.has_work or self._held() else None
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
                if self._held():
                    continue
                outputs = core.step()
                # One hop per step: the outputs and the step's statistics together.
                if not self._send(self._dispatch, (outputs, core.take_stats())):
                    break
                if self.lockstep:
                    self._settle()
        except BaseException as e:  # noqa: BLE001 - any death must reach every waiting client
            self.error = f"engine died: {type(e).__name__}: {e}"
            log.error("engine thread died\n%s", traceback.format_exc())
            self._send(self._fail_all, self.error)
        finally:
            self.stopped = True
            core.close()
