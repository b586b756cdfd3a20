"""The embedded default store: one SQLite file in WAL mode.

Two connections: reads go to one and see only committed data; every write is one `BEGIN IMMEDIATE`
transaction on the other, behind a lock, so a reader never sees half a turn and another process
(the CLI, a second server) waits on the busy timeout instead of failing.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import aiosqlite

from ..errors import Conflict
from .base import SessionState, StoredMessage, TurnRecord

_HASH_CHUNK = 500

# The queries that serve a turn; each is answered from an index (tests/test_store_contract.py checks
# the plans), so their cost does not grow with the length of a session's history.
QUERIES = {
    "get_session": "SELECT pk, tenant, session_id, length, head_hash, head_cum, system_prompt,"
    " history_mode, created_at, updated_at FROM sessions WHERE tenant = ? AND session_id = ?",
    "matched_prefix": "SELECT max(seq) FROM messages WHERE session_pk = ? AND active = 1"
    " AND chain_hash IN ({marks})",
    "cum_at": "SELECT cum_before FROM messages WHERE session_pk = ? AND active = 1 AND seq = ?",
    # Walks back from `seq` through one unit's tool results at most.
    "last_unit_start": "SELECT seq FROM messages WHERE session_pk = ? AND active = 1"
    " AND unit_start = 1 AND seq < ? ORDER BY seq DESC LIMIT 1",
    "first_fitting_unit_start": "SELECT seq FROM messages WHERE session_pk = ? AND active = 1"
    " AND unit_start = 1 AND cum_before >= ? AND seq >= ? ORDER BY cum_before LIMIT 1",
    "active_range": "SELECT seq, body, tokens, cum_before, unit_start, chain_hash FROM messages"
    " WHERE session_pk = ? AND active = 1 AND seq >= ? AND seq < ? ORDER BY seq",
    "message_id": "SELECT id FROM messages WHERE session_pk = ? AND active = 1 AND seq = ?",
    "supersede": "UPDATE messages SET active = 0 WHERE session_pk = ? AND active = 1 AND seq >= ?",
}


def sqlite_path(url: str) -> str:
    """`sqlite:///relative.db`, `sqlite:////abs/path.db` or `sqlite:///:memory:` to a path."""
    if not url.startswith("sqlite:///"):
        raise ValueError(f"not a sqlite URL: {url!r}")
    return url[len("sqlite:///"):]


def migrations() -> list[tuple[str, str]]:
    folder = resources.files("memproxy.store") / "migrations" / "sqlite"
    files = sorted((f for f in folder.iterdir() if f.name.endswith(".sql")), key=lambda f: f.name)
    return [(f.name.removesuffix(".sql"), f.read_text(encoding="utf-8")) for f in files]


async def _connect(path: str, busy_timeout_ms: int) -> aiosqlite.Connection:
    conn = await aiosqlite.connect(path, isolation_level=None)
    await conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
    await conn.execute("PRAGMA foreign_keys = ON")
    await conn.execute("PRAGMA synchronous = NORMAL")
    return conn


class SQLiteStore:
    def __init__(self, reader: aiosqlite.Connection, writer: aiosqlite.Connection) -> None:
        self._reader = reader
        self._writer = writer
        self._write_lock = asyncio.Lock()

    @classmethod
    async def open(cls, url: str, busy_timeout_ms: int = 5000) -> SQLiteStore:
        path = sqlite_path(url)
        if path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        writer = await _connect(path, busy_timeout_ms)
        await writer.execute("PRAGMA journal_mode = WAL")
        await _migrate(writer)
        reader = await _connect(path, busy_timeout_ms) if path != ":memory:" else writer
        return cls(reader, writer)

    async def close(self) -> None:
        if self._reader is not self._writer:
            await self._reader.close()
        await self._writer.close()

    async def ping(self) -> None:
        async with self._reader.execute("SELECT 1") as cur:
            await cur.fetchone()

    async def get_session(self, tenant: str, session_id: str) -> SessionState | None:
        async with self._reader.execute(
            QUERIES["get_session"], (tenant, session_id),
        ) as cur:
            row = await cur.fetchone()
        if row is None:
            return None
        return SessionState(
            pk=row[0], tenant=row[1], session_id=row[2], length=row[3], head_hash=row[4],
            head_cum=row[5], system=json.loads(row[6]) if row[6] else None,
            history_mode=row[7], created_at=row[8], updated_at=row[9],
        )

    async def matched_prefix(self, session: SessionState, hashes: Sequence[str]) -> int:
        best = -1
        for i in range(0, len(hashes), _HASH_CHUNK):
            chunk = list(hashes[i : i + _HASH_CHUNK])
            marks = ",".join("?" * len(chunk))
            async with self._reader.execute(
                QUERIES["matched_prefix"].format(marks=marks), (session.pk, *chunk),
            ) as cur:
                row = await cur.fetchone()
            if row is not None and row[0] is not None:
                best = max(best, int(row[0]))
        return best + 1

    async def cum_at(self, session: SessionState, seq: int) -> int:
        if seq >= session.length:
            return session.head_cum
        async with self._reader.execute(
            QUERIES["cum_at"], (session.pk, seq),
        ) as cur:
            row = await cur.fetchone()
        if row is None:
            raise LookupError(f"no active message at position {seq}")
        return int(row[0])

    async def last_unit_start(self, session: SessionState, before: int) -> int:
        async with self._reader.execute(
            QUERIES["last_unit_start"], (session.pk, before),
        ) as cur:
            row = await cur.fetchone()
        return before if row is None or row[0] is None else int(row[0])

    async def first_fitting_unit_start(
        self, session: SessionState, floor: int, min_cum_before: int
    ) -> int | None:
        async with self._reader.execute(
            QUERIES["first_fitting_unit_start"], (session.pk, min_cum_before, floor),
        ) as cur:
            row = await cur.fetchone()
        return None if row is None else int(row[0])

    async def active_range(self, session: SessionState, start: int, stop: int) -> list[StoredMessage]:
        if start >= stop:
            return []
        async with self._reader.execute(
            QUERIES["active_range"], (session.pk, start, stop),
        ) as cur:
            rows = await cur.fetchall()
        return [
            StoredMessage(seq=r[0], body=json.loads(r[1]), tokens=r[2], cum_before=r[3],
                          unit_start=bool(r[4]), chain_hash=r[5])
            for r in rows
        ]

    async def record_turn(self, turn: TurnRecord) -> None:
        async with self._write_lock:
            await self._writer.execute("BEGIN IMMEDIATE")
            try:
                await self._record(turn)
            except BaseException:
                await self._writer.execute("ROLLBACK")
                raise
            await self._writer.execute("COMMIT")

    async def _record(self, turn: TurnRecord) -> None:
        db = self._writer
        now = time.time()
        async with db.execute(
            "SELECT pk, length, head_hash FROM sessions WHERE tenant = ? AND session_id = ?",
            (turn.tenant, turn.session_id),
        ) as cur:
            row = await cur.fetchone()
        if row is None:
            if turn.expected_length != 0:
                raise Conflict("the session was deleted while this turn was in flight")
            async with db.execute(
                "INSERT INTO sessions (tenant, session_id, created_at, updated_at) VALUES (?, ?, ?, ?)",
                (turn.tenant, turn.session_id, now, now),
            ) as cur:
                pk = cur.lastrowid
        else:
            pk = row[0]
            if (row[1], row[2]) != (turn.expected_length, turn.expected_head_hash):
                raise Conflict("the session changed while this turn was in flight; retry it")
        assert pk is not None
        if turn.base < turn.expected_length:
            await db.execute(QUERIES["supersede"], (pk, turn.base))
        parent_id = await self._message_id(pk, turn.base - 1)
        async with db.execute(
            "INSERT INTO turns (session_pk, created_at, model, kind, context_tokens, prompt_tokens,"
            " completion_tokens, latency_ms) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (pk, now, turn.model, turn.kind, turn.context_tokens, turn.usage.prompt_tokens,
             turn.usage.completion_tokens, turn.latency_ms),
        ) as cur:
            turn_id = cur.lastrowid
        seq, cum, head_hash = turn.base, turn.base_cum, turn.base_hash
        for message in turn.messages:
            async with db.execute(
                "INSERT INTO messages (session_pk, turn_id, parent_id, seq, role, body, tokens,"
                " cum_before, unit_start, chain_hash, created_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (pk, turn_id, parent_id, seq, message.body.get("role"), _dumps(message.body),
                 message.tokens, cum, int(message.unit_start), message.chain_hash, now),
            ) as cur:
                parent_id = cur.lastrowid
            seq, cum, head_hash = seq + 1, cum + message.tokens, message.chain_hash
        await db.execute(
            "UPDATE sessions SET length = ?, head_hash = ?, head_cum = ?, updated_at = ?,"
            " system_prompt = coalesce(?, system_prompt), history_mode = coalesce(?, history_mode)"
            " WHERE pk = ?",
            (seq, head_hash, cum, now, _dumps(turn.system) if turn.system else None,
             turn.history_mode, pk),
        )

    async def _message_id(self, pk: int, seq: int) -> int | None:
        if seq < 0:
            return None
        async with self._writer.execute(QUERIES["message_id"], (pk, seq)) as cur:
            row = await cur.fetchone()
        return None if row is None else int(row[0])


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


async def _migrate(db: aiosqlite.Connection) -> None:
    """Apply the numbered migrations not yet recorded, each in its own write transaction, so two
    processes starting on one file at once apply each migration exactly once."""
    await db.execute(
        "CREATE TABLE IF NOT EXISTS schema_migrations (id TEXT PRIMARY KEY, applied_at REAL NOT NULL)"
    )
    for migration_id, sql in migrations():
        await db.execute("BEGIN IMMEDIATE")
        try:
            async with db.execute("SELECT 1 FROM schema_migrations WHERE id = ?", (migration_id,)) as cur:
                done = await cur.fetchone() is not None
            if not done:
                for statement in _statements(sql):
                    await db.execute(statement)
                await db.execute(
                    "INSERT INTO schema_migrations (id, applied_at) VALUES (?, ?)",
                    (migration_id, time.time()),
                )
        except BaseException:
            await db.execute("ROLLBACK")
            raise
        await db.execute("COMMIT")


def _statements(sql: str) -> list[str]:
    lines = [line for line in sql.splitlines() if not line.strip().startswith("--")]
    return [s.strip() for s in "\n".join(lines).split(";") if s.strip()]
