"""Stored responses: one SQLite table (the standard library's sqlite3), written once per response.

Each row is one response: its owner (a SHA-256 of the API key that created it: another key sees
nothing, as if the id did not exist), its own input items, the response object, and the id of the
response it continued. A conversation is rebuilt by walking `previous_response_id` back.

Durability: WAL journal, one transaction per write, committed before the client hears of the
response, so a `kill -9` loses nothing that was answered. Size: past `max_bytes` of stored JSON,
the oldest rows go first. Every call blocks on disk, so the async methods run it on a thread;
one lock serialises the connection.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sqlite3
import threading
from pathlib import Path

from engine.core.cache_dir import cache_dir

DEFAULT_MAX_MB = 1024
MAX_CHAIN = 10_000  # previous_response_id links followed at most

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    owner TEXT NOT NULL,
    previous_id TEXT,
    input_items TEXT NOT NULL,
    response TEXT NOT NULL,
    size INTEGER NOT NULL
)"""


def default_path() -> Path:
    return cache_dir() / "responses.sqlite3"


def owner_of(api_key: str | None) -> str:
    """What a row records of the key that wrote it: never the key itself."""
    return hashlib.sha256((api_key or "").encode()).hexdigest()


class ResponseStore:
    def __init__(self, path: str | Path, max_bytes: int):
        """`path` ":memory:" keeps responses until the process ends."""
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.path = str(path)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # WAL: a process crash loses nothing
        self._db.execute(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -------------------------------------------------------------- async face
    async def put(self, owner: str, response: dict, input_items: list[dict]) -> None:
        await asyncio.to_thread(self._put, owner, response, input_items)

    async def get(self, owner: str, response_id: str) -> dict | None:
        row = await asyncio.to_thread(self._row, owner, response_id)
        return json.loads(row[1]) if row else None

    async def input_items(self, owner: str, response_id: str) -> list[dict] | None:
        row = await asyncio.to_thread(self._row, owner, response_id)
        return json.loads(row[0]) if row else None

    async def history(self, owner: str, response_id: str) -> list[dict] | None:
        """The conversation up to and including `response_id`: each response's input items,
        then its output items, oldest first; None where the id (or a link before it) is gone."""
        return await asyncio.to_thread(self._history, owner, response_id)

    async def delete(self, owner: str, response_id: str) -> bool:
        return await asyncio.to_thread(self._delete, owner, response_id)

    # -------------------------------------------------------------- on a thread
    def _put(self, owner: str, response: dict, input_items: list[dict]) -> None:
        items_json, response_json = json.dumps(input_items), json.dumps(response)
        size = len(items_json) + len(response_json)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute(
                    "INSERT INTO responses (id, owner, previous_id, input_items, response, size) "
                    "VALUES (?, ?, ?, ?, ?, ?)", (response["id"], owner,
                                                  response.get("previous_response_id"),
                                                  items_json, response_json, size))
                self._evict()
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def _evict(self) -> None:
        total = self._db.execute("SELECT COALESCE(SUM(size), 0) FROM responses").fetchone()[0]
        if total <= self.max_bytes:
            return
        cut = None
        for seq, size in self._db.execute("SELECT seq, size FROM responses ORDER BY seq"):
            total -= size
            cut = seq
            if total <= self.max_bytes:
                break
        self._db.execute("DELETE FROM responses WHERE seq <= ?", (cut,))

    def _row(self, owner: str, response_id: str):
        with self._lock:
            return self._db.execute(
                "SELECT input_items, response, previous_id FROM responses "
                "WHERE id = ? AND owner = ?", (response_id, owner)).fetchone()

    def _history(self, owner: str, response_id: str) -> list[dict] | None:
        turns = []
        next_id = response_id
        while next_id is not None and len(turns) < MAX_CHAIN:
            row = self._row(owner, next_id)
            if row is None:
                return None
            items, response = json.loads(row[0]), json.loads(row[1])
            turns.append(items + response["output"])
            next_id = row[2]
        return [item for turn in reversed(turns) for item in turn]

    def _delete(self, owner: str, response_id: str) -> bool:
        with self._lock:
            cursor = self._db.execute("DELETE FROM responses WHERE id = ? AND owner = ?",
                                      (response_id, owner))
            return cursor.rowcount > 0
