"""The responses a server knows: those running (in memory, whatever the store) and those stored
(store.py, sqlite_store.py). Routes and runs reach the store only through here; SQLite calls
run on a worker thread so the event loop never waits on the disk.

Several API servers (--api-server-count N > 1) share one SQLite store (the supervisor's file in
its run directory, or --responses-store's): each response is stored as soon as it starts,
naming the server running it, and what only that server can answer (a running response's
state and stream, its cancellation) is forwarded to it (`elsewhere`, server/forward.py)."""

from __future__ import annotations

import logging
from typing import Any

import trio

from server.api_server_messages import Seat, responses_file
from server.errors import APIError
from server.responses.run import Run
from server.responses.sqlite_store import SqliteStore
from server.responses.store import MemoryStore, Stored

log = logging.getLogger("weir.responses")


class Runs:
    def __init__(self, store: MemoryStore | SqliteStore | None, seat: Seat | None = None) -> None:
        self.store = store
        self.live: dict[str, Run] = {}
        self.lock = trio.Lock()  # one store call at a time from the event loop
        self.seat = seat  # one of several API servers sharing the store

    @classmethod
    def from_options(cls, options: Any, seat: Seat | None = None) -> Runs:
        if options.disable_responses_store:
            return cls(None)
        ttl = options.responses_store_ttl
        if seat is not None:
            path = options.responses_store or responses_file(seat.run_dir)
            limit = options.responses_store_max_entries
            return cls(SqliteStore(path, limit, ttl, recover=False, shared=True), seat)
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

    @property
    def shared(self) -> bool:
        """The store is shared with other API servers: a response is stored when it starts."""
        return self.seat is not None and self.store is not None

    def elsewhere(self, found: Run | Stored) -> int | None:
        """The API server running `found`, when that is another one than this."""
        if not isinstance(found, Stored) or self.seat is None or not found.running:
            return None
        return found.owner if found.owner not in (None, self.seat.index) else None

    def _stored(self, run: Run) -> Stored:
        rec = run.stored()
        rec.owner = self.seat.index if self.seat is not None else None
        return rec

    # ---------------------------------------------------------------- writes
    def start(self, run: Run) -> None:
        self.live[run.id] = run

    async def save(self, run: Run) -> None:
        """A stored response's current state; a finished run leaves the live set."""
        if self.store is not None and run.response.store:
            try:
                await self._call(self.store.put, self._stored(run))
            except Exception:  # noqa: BLE001 - the response itself was served
                log.exception("could not store response %s", run.id)
        if run.done.is_set():
            self.live.pop(run.id, None)

    def save_now(self, run: Run) -> None:
        """Synchronously, from the `finally` of a cancelled request."""
        if self.store is not None and run.response.store:
            try:
                self.store.put(self._stored(run))
            except Exception:  # noqa: BLE001
                log.exception("could not store response %s", run.id)
        self.live.pop(run.id, None)

    async def delete(self, rid: str) -> bool:
        running = self.live.get(rid)
        status = running.response.status if running is not None else None
        if status is None and self.shared:  # running on another API server?
            rec = await self._call(self.store.get, rid)
            status = rec.status if rec is not None and rec.running else None
        if status is not None:
            raise APIError(
                400,
                f"Response {rid} is still {status}; cancel it first "
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
        status = found.response.status if isinstance(found, Run) else found.status
        if isinstance(found, Run) or found.running:  # here, or on another API server
            raise APIError(
                400,
                f"previous_response_id {rid!r} is still {status}; wait for it to finish",
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
