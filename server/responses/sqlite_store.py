"""The responses store in an SQLite file (stdlib sqlite3, write-ahead log): stored responses,
their conversations and replayable streams survive a restart. A response that was running
when the last process died is marked incomplete when the file is opened again.

Several API servers (--api-server-count N > 1) share one file, each through its own connection
(`shared`): a write and its eviction are one transaction, counts are read from the table, and
only the supervisor marks what a dead server left running (`recover`), once, before any API
server opens the file. Each row names the API server running it (`owner`), so that another
server knows where to forward what only that one can answer (server/responses/routes.py)."""

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
    events TEXT,
    owner INTEGER
);
CREATE INDEX IF NOT EXISTS responses_by_age ON responses (created);
"""
_DONE = ",".join(f"'{s}'" for s in TERMINAL)


class SqliteStore:
    def __init__(
        self,
        path: str,
        max_entries: int,
        ttl: float | None,
        recover: bool = True,
        shared: bool = False,
    ) -> None:
        self.max_entries = max_entries
        self.ttl = ttl
        self.shared = shared
        self.lock = threading.Lock()
        # Called from worker threads (one at a time, under the lock), never two at once.
        self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)
        columns = [row[1] for row in self.db.execute("PRAGMA table_info(responses)")]
        if "owner" not in columns:  # a file written before API servers could share it
            self.db.execute("ALTER TABLE responses ADD COLUMN owner INTEGER")
        if recover:
            self._interrupted()
        self.count = self._count()

    def _count(self) -> int:
        return self.db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]

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
        if self.shared:
            with self.lock:
                return self._count()
        return self.count

    def put(self, rec: Stored) -> None:
        events = None
        if rec.events is not None:
            events = json.dumps([e.decode() for e in rec.events])
        with self.lock:
            if self.shared:
                self.db.execute("BEGIN IMMEDIATE")  # the other API servers' writes wait
            try:
                known = "SELECT 1 FROM responses WHERE id = ?"
                new = self.db.execute(known, (rec.id,)).fetchone() is None
                self.db.execute(
                    "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (
                        rec.id,
                        rec.created,
                        rec.status,
                        json.dumps(rec.response),
                        json.dumps(rec.context),
                        events,
                        rec.owner,
                    ),
                )
                self.count = self._count() if self.shared else self.count + new
                self._evict(time.time())
            except BaseException:
                if self.shared:
                    self.db.execute("ROLLBACK")
                raise
            if self.shared:
                self.db.execute("COMMIT")

    def get(self, rid: str) -> Stored | None:
        with self.lock:
            row = self.db.execute(
                "SELECT created, response, context, events, owner FROM responses WHERE id = ?",
                (rid,),
            ).fetchone()
        if row is None:
            return None
        created, response, context, events, owner = row
        rec = Stored(
            rid,
            json.loads(response),
            json.loads(context),
            [e.encode() for e in json.loads(events)] if events is not None else None,
            created,
            owner,
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
