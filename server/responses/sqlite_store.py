"""The responses store in an SQLite file (stdlib sqlite3, write-ahead log): stored responses,
their conversations and replayable streams survive a restart. A response that was running
when the last process died is marked incomplete when the file is opened again."""

from __future__ import annotations

import json
import sqlite3
import threading
import time

from server.responses.protocol import TERMINAL
from server.responses.store import Stored

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created REAL NOT NULL,
    status TEXT NOT NULL,
    response TEXT NOT NULL,
    context TEXT NOT NULL,
    events TEXT
);
CREATE INDEX IF NOT EXISTS responses_by_age ON responses (created);
"""
_DONE = ",".join(f"'{s}'" for s in TERMINAL)


class SqliteStore:
    def __init__(self, path: str, max_entries: int, ttl: float | None) -> None:
        self.max_entries = max_entries
        self.ttl = ttl
        self.lock = threading.Lock()
        # Called from worker threads (one at a time, under the lock), never two at once.
        self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)
        self._interrupted()
        self.count = self.db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]

    def _interrupted(self) -> None:
        """Responses left running by a process that died: incomplete, reason interrupted."""
        rows = self.db.execute(
            f"SELECT id, response FROM responses WHERE status NOT IN ({_DONE})"
        ).fetchall()
        for rid, text in rows:
            response = json.loads(text)
            response["status"] = "incomplete"
            response["incomplete_details"] = {"reason": "interrupted"}
            for item in response.get("output", []):
                if item.get("status") == "in_progress":
                    item["status"] = "incomplete"
            self.db.execute(
                "UPDATE responses SET status = 'incomplete', response = ? WHERE id = ?",
                (json.dumps(response), rid),
            )

    def __len__(self) -> int:
        return self.count

    def put(self, rec: Stored) -> None:
        events = None
        if rec.events is not None:
            events = json.dumps([e.decode() for e in rec.events])
        with self.lock:
            new = self.db.execute("SELECT 1 FROM responses WHERE id = ?", (rec.id,)).fetchone()
            self.db.execute(
                "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)",
                (
                    rec.id,
                    rec.created,
                    rec.status,
                    json.dumps(rec.response),
                    json.dumps(rec.context),
                    events,
                ),
            )
            self.count += new is None
            self._evict(time.time())

    def get(self, rid: str) -> Stored | None:
        with self.lock:
            row = self.db.execute(
                "SELECT created, response, context, events FROM responses WHERE id = ?", (rid,)
            ).fetchone()
        if row is None:
            return None
        created, response, context, events = row
        rec = Stored(
            rid,
            json.loads(response),
            json.loads(context),
            [e.encode() for e in json.loads(events)] if events is not None else None,
            created,
        )
        if self.ttl is not None and time.time() - created > self.ttl and not rec.running:
            self.delete(rid)
            return None
        return rec

    def delete(self, rid: str) -> bool:
        with self.lock:
            gone = self.db.execute("DELETE FROM responses WHERE id = ?", (rid,)).rowcount
            self.count -= gone
        return gone > 0

    def _evict(self, now: float) -> None:
        if self.ttl is not None:
            self.count -= self.db.execute(
                f"DELETE FROM responses WHERE created < ? AND status IN ({_DONE})",
                (now - self.ttl,),
            ).rowcount
        over = self.count - self.max_entries
        if over > 0:
            self.count -= self.db.execute(
                "DELETE FROM responses WHERE id IN (SELECT id FROM responses "
                f"WHERE status IN ({_DONE}) ORDER BY created LIMIT ?)",
                (over,),
            ).rowcount

    def close(self) -> None:
        with self.lock:
            self.db.close()
