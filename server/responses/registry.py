"""The responses a server knows: those running (in memory, whatever the store) and those stored
(store.py, sqlite_store.py). Routes and runs reach the store only through here; SQLite calls
run on a worker thread so the event loop never waits on the disk."""

from __future__ import annotations

import logging
from typing import Any

import trio

from server.errors import APIError
from server.responses.run import Run
from server.responses.sqlite_store import SqliteStore
from server.responses.store import MemoryStore, Stored

log = logging.getLogger("weir.responses")


class Runs:
    def __init__(self, store: MemoryStore | SqliteStore | None) -> None:
        self.store = store
        self.live: dict[str, Run] = {}
        self.lock = trio.Lock()  # one store call at a time from the event loop

    @classmethod
    def from_options(cls, options: Any) -> Runs:
        if options.disable_responses_store:
            return cls(None)
        ttl = options.responses_store_ttl
        if options.responses_store:
            return cls(
                SqliteStore(options.responses_store, options.responses_store_max_entries, ttl)
            )
        return cls(MemoryStore(options.responses_store_max_entries, ttl))

    async def _call(self, fn, *args):
        if isinstance(self.store, SqliteStore):
            async with self.lock:
                return await trio.to_thread.run_sync(fn, *args)
        return fn(*args)

    # ---------------------------------------------------------------- writes
    def start(self, run: Run) -> None:
        self.live[run.id] = run

    async def save(self, run: Run) -> None:
        """A stored response's current state; a finished run leaves the live set."""
        if self.store is not None and run.response.store:
            try:
                await self._call(self.store.put, run.stored())
            except Exception:  # noqa: BLE001 - the response itself was served
                log.exception("could not store response %s", run.id)
        if run.done.is_set():
            self.live.pop(run.id, None)

    def save_now(self, run: Run) -> None:
        """Synchronously, from the `finally` of a cancelled request."""
        if self.store is not None and run.response.store:
            try:
                self.store.put(run.stored())
            except Exception:  # noqa: BLE001
                log.exception("could not store response %s", run.id)
        self.live.pop(run.id, None)

    async def delete(self, rid: str) -> bool:
        if rid in self.live:
            raise APIError(
                400,
                f"Response {rid} is still {self.live[rid].response.status}; cancel it first "
                "(only background responses can be cancelled)",
                "response_id",
            )
        return self.store is not None and await self._call(self.store.delete, rid)

    # ---------------------------------------------------------------- reads
    async def find(self, rid: str) -> Run | Stored | None:
        run = self.live.get(rid)
        if run is not None:
            return run
        if self.store is None:
            return None
        return await self._call(self.store.get, rid)

    async def get(self, rid: str, param: str = "response_id") -> Run | Stored:
        found = await self.find(rid)
        if found is None:
            why = (
                " (this server keeps no responses: --disable-responses-store)"
                if self.store is None
                else ""
            )
            raise APIError(
                404 if param == "response_id" else 400,
                f"Response with id {rid!r} not found{why}",
                param,
                "response_not_found" if param == "response_id" else "previous_response_not_found",
            )
        return found

    async def conversation(self, rid: str) -> list[dict[str, Any]]:
        """previous_response_id: the items it read, then its output."""
        found = await self.get(rid, "previous_response_id")
        if isinstance(found, Run):
            raise APIError(
                400,
                f"previous_response_id {rid!r} is still {found.response.status}; wait for it "
                "to finish",
                "previous_response_id",
            )
        return found.context + found.response["output"]

    # ---------------------------------------------------------------- shutdown
    def interrupt(self) -> list[Run]:
        """Background runs still going when the drain ends: stopped, marked incomplete."""
        stopped = [run for run in self.live.values() if run.log is not None]
        for run in stopped:
            run.stop("interrupted")
        return stopped

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
