"""RequestChannel: a one-slot mailbox per request that merges deltas while its reader is behind."""

from __future__ import annotations

import msgspec
import trio

from core.request import RequestOutput


def merge(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """Fold `new` into a copy of `old` (RequestOutput.merge: text concatenated, token ids
    appended, the latest counts, finish, stop and error kept)."""
    return msgspec.structs.replace(old).merge(new)


class RequestChannel:
    """Written by the engine's dispatch callback and read by the handler, both on the Trio thread.

    One handler may read several engine requests through one channel (n samples, a batch of
    prompts): it holds at most one pending output per request id, merging deltas while the reader
    is behind. The engine never waits on it; a slow reader costs memory in proportion to its
    unsent text and loses nothing.

    `interval` is how many new tokens wake the reader (each request's first output and its end
    always do): 1 streams every token, k batches them k at a time (fewer, larger SSE events), 0
    wakes only at the end (a non-streaming request needs nothing sooner).
    """

    __slots__ = ("_pending", "_event", "interval", "_started")

    def __init__(self, interval: int = 1) -> None:
        self._pending: dict[str, RequestOutput] = {}
        self._event = trio.Event()
        self.interval = interval
        self._started: set[str] = set()

    def put(self, out: RequestOutput) -> None:
        old = self._pending.get(out.request_id)
        merged = self._pending[out.request_id] = out if old is None else merge(old, out)
        if (
            merged.finished
            or out.request_id not in self._started
            or (self.interval and len(merged.new_token_ids) >= self.interval)
        ):
            self._event.set()

    def take_nowait(self) -> list[RequestOutput]:
        """Everything pending, without waiting (possibly nothing)."""
        outs = list(self._pending.values())
        self._pending.clear()
        self._started.update(o.request_id for o in outs)
        self._event = trio.Event()
        return outs

    def wake(self) -> None:
        """Wake the reader with nothing due (it looks at why itself: server/submit.py cut)."""
        self._event.set()

    async def get(self) -> list[RequestOutput]:
        """Everything pending, oldest request first; waits until something is due."""
        await self._event.wait()
        return self.take_nowait()
