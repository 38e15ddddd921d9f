"""Where responses are kept for GET, input_items and previous_response_id: bounded in memory by
default (--responses-store-max-entries, a TTL), or in an SQLite file (--responses-store PATH)
that survives a restart. Eviction takes the oldest first and never a response still running."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from server.responses.protocol import TERMINAL


@dataclass
class Stored:
    id: str
    response: dict[str, Any]  # the response object as JSON-ready builtins
    context: list[dict[str, Any]]  # every item the model read: earlier turns, then this input
    events: list[bytes] | None = None  # the stream, kept for replay (background responses)
    created: float = field(default_factory=time.time)
    owner: int | None = None  # the API server running it (--api-server-count > 1)

    @property
    def status(self) -> str:
        return self.response["status"]

    @property
    def running(self) -> bool:
        return self.status not in TERMINAL


class MemoryStore:
    """Insertion order is age order: a response updated in place keeps its place."""

    def __init__(self, max_entries: int, ttl: float | None) -> None:
        self.max_entries = max_entries
        self.ttl = ttl
        self.items: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self.items)

    def _expired(self, rec: Stored, now: float) -> bool:
        return self.ttl is not None and now - rec.created > self.ttl and not rec.running

    def put(self, rec: Stored) -> None:
        self.items[rec.id] = rec
        self._evict(time.time())

    def get(self, rid: str) -> Stored | None:
        rec = self.items.get(rid)
        if rec is not None and self._expired(rec, time.time()):
            del self.items[rid]
            return None
        return rec

    def delete(self, rid: str) -> bool:
        return self.items.pop(rid, None) is not None

    def _evict(self, now: float) -> None:
        over = len(self.items) - self.max_entries
        doomed = []
        for rid, rec in self.items.items():  # oldest first
            expired = self._expired(rec, now)
            if over <= len(doomed) and not expired:
                break
            if not rec.running:
                doomed.append(rid)
        for rid in doomed:
            del self.items[rid]

    def close(self) -> None:
        pass
