"""The one engine loop: take the commands that have arrived, step, publish, again.

`serve` is the loop itself, run by every engine-side driver: the engine thread (core/engine.py),
the engine process (core/engine_process.py), the offline LLM (weir/llm.py) and, with no step of
its own (each command is a step to run), a tensor-parallel worker (gpu/dist/worker.py).
`EngineLoop` is what it runs over an EngineCore: the commands the front sends (add, abort,
hold, shutdown: core/engine_messages.py) and one step with its published outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from core.engine_core import EngineCore
from core.engine_messages import AbortRequest, AddRequest, Hold, SetHold, Shutdown
from core.request import RequestOutput
from core.stats import StepStats


def serve(
    take: Callable[[bool], Any],
    handle: Callable[[Any], bool],
    step: Callable[[], bool] | None = None,
    waits: Callable[[], bool] = lambda: True,
    until_idle: bool = False,
) -> None:
    """Until `handle` or `step` returns False: take every command that has arrived (`take(block)`
    gives one, or None when there is none; it blocks only while `waits()`: nothing to step),
    hand each to `handle`, then run `step` once. `until_idle`: return instead of blocking."""
    while True:
        block = waits()
        cmd = take(block and not until_idle)
        if cmd is None and block and until_idle:
            return
        while cmd is not None:
            if not handle(cmd):
                return
            cmd = take(False)
        if step is not None and not step():
            return


class EngineLoop:
    """An EngineCore driven by commands. `publish(outputs, stats)` sends a step's outputs and
    statistics to the front (False: nobody is left to hear them, the loop ends); `refuse(out)`
    sends the error of an add the core refused (it raced past the front's own check)."""

    def __init__(
        self,
        core: EngineCore,
        publish: Callable[[list[RequestOutput], StepStats], bool],
        refuse: Callable[[RequestOutput], None],
        after_step: Callable[[], None] | None = None,
    ) -> None:
        self.core = core
        self.publish = publish
        self.refuse = refuse
        self.after_step = after_step  # a test hook (core/engine.py lockstep)
        self.hold: Hold | None = None

    def handle(self, cmd) -> bool:
        """Apply one command; False for Shutdown."""
        if isinstance(cmd, AddRequest):
            try:
                self.core.add(cmd.request)
            except ValueError as e:
                rid = cmd.request.request_id
                out = RequestOutput(rid, finished=True, finish_reason="error", error=str(e))
                self.refuse(out)
        elif isinstance(cmd, AbortRequest):
            self.core.abort(cmd.request_id)
        elif isinstance(cmd, SetHold):
            self.hold = cmd.rule
        elif isinstance(cmd, Shutdown):
            return False
        else:
            raise TypeError(f"unknown engine command {type(cmd).__name__}")
        return True

    def held(self) -> bool:
        if self.hold is None:
            return False
        held, self.hold = self.hold.check(self.core)
        return held

    def step(self) -> bool:
        if self.held():
            return True
        core = self.core
        # One hop per step: the outputs and the step's statistics together.
        if not self.publish(core.step(), core.take_stats()):
            return False
        if self.after_step is not None:
            self.after_step()
        return True

    def waits(self) -> bool:
        """Nothing to step: wait for a command (held counts as nothing to step)."""
        return not self.core.has_work or self.held()

    def run(self, take: Callable[[bool], Any], until_idle: bool = False) -> None:
        serve(take, self.handle, self.step, self.waits, until_idle)
