"""The embedded default store: one SQLite file in WAL mode (SQLite 3.35 or newer).

Two connections: reads go to one and see only committed data; every write is one `BEGIN IMMEDIATE`
transaction on the other, behind a lock, so a reader never sees half a turn and another process
(the CLI, a second server) waits on the busy timeout instead of failing. The SQL itself is shared
with PostgreSQL (`memproxy.store.sql`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from importlib import resources
from pathlib import Path
from typing import Any

import aiosqlite

from .sql import QUERIES, Row, SQLStore

__all__ = ["QUERIES", "SQLiteStore", "migrations", "sqlite_path"]


def sqlite_path(url: str) -> str:
    """`sqlite:///relative.db`, `sqlite:////abs/path.db` or `sqlite:///:memory:` to a path."""
    if not url.startswith("sqlite:///"):
        raise ValueError(f"not a sqlite URL: {url!r}")
    return url[len("sqlite:///"):]


def migrations(dialect: str = "sqlite") -> list[tuple[str, str]]:
    """The numbered migrations of a dialect, in order: (id, SQL)."""
    folder = resources.files("memproxy.store") / "migrations" / dialect
    files = sorted((f for f in folder.iterdir() if f.name.endswith(".sql")), key=lambda f: f.name)
    return [(f.name.removesuffix(".sql"), f.read_text(encoding="utf-8")) for f in files]


def statements(sql: str) -> list[str]:
    lines = [line for line in sql.splitlines() if not line.strip().startswith("--")]
    return [s.strip() for s in "\n".join(lines).split(";") if s.strip()]


async def _connect(path: str, busy_timeout_ms: int, wal: bool = False) -> aiosqlite.Connection:
    conn = await aiosqlite.connect(path, isolation_level=None)
    pragmas = [f"busy_timeout = {int(busy_timeout_ms)}", "foreign_keys = ON", "synchronous = NORMAL"]
    for pragma in pragmas + (["journal_mode = WAL"] if wal else []):
        async with conn.execute(f"PRAGMA {pragma}") as cur:  # a pragma's cursor must be closed
            await cur.fetchall()
    return conn


class _Transaction:
    def __init__(self, conn: aiosqlite.Connection) -> None:
        self._conn = conn

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        # One trip to the connection's thread (a cursor would take three: execute, fetch, close);
        # a turn's write is a handful of these, and each trip costs the event loop a wake-up.
        return list(await self._conn.execute_fetchall(sql, params))

    async def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        async with self._conn.execute(sql, params) as cur:
            return cur.rowcount


class SQLiteBackend:
    row_lock = ""  # a write transaction holds the whole file

    def __init__(self, reader: aiosqlite.Connection, writer: aiosqlite.Connection) -> None:
        self._reader = reader
        self._writer = writer
        self._write_lock = asyncio.Lock()

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        # Executed and fetched in one step on the connection's thread: a statement left open across
        # an await would hold its read snapshot, and other reads on this connection would see it.
        return list(await self._reader.execute_fetchall(sql, params))

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[_Transaction]:
        async with self._write_lock:
            await self._writer.execute("BEGIN IMMEDIATE")
            try:
                yield _Transaction(self._writer)
            except BaseException:
                await self._writer.execute("ROLLBACK")
                raise
            await self._writer.execute("COMMIT")

    async def close(self) -> None:
        if self._reader is not self._writer:
            await self._reader.close()
        await self._writer.close()


class SQLiteStore(SQLStore):
    @classmethod
    async def open(cls, url: str, busy_timeout_ms: int = 5000) -> SQLiteStore:
        path = sqlite_path(url)
        if path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        writer = await _connect(path, busy_timeout_ms, wal=True)
        reader = await _connect(path, busy_timeout_ms) if path != ":memory:" else writer
        backend = SQLiteBackend(reader, writer)
        await _migrate(backend)
        return cls(backend)


async def _migrate(backend: SQLiteBackend) -> None:
    """Apply the numbered migrations not yet recorded, each in its own write transaction, so two
    processes starting on one file at once apply each migration exactly once."""
    async with backend.transaction() as tx:
        await tx.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations (id TEXT PRIMARY KEY, applied_at REAL NOT NULL)")
    for migration_id, sql in migrations():
        async with backend.transaction() as tx:
            if await tx.fetch("SELECT 1 FROM schema_migrations WHERE id = ?", (migration_id,)):
                continue
            for statement in statements(sql):
                await tx.execute(statement)
            await tx.execute("INSERT INTO schema_migrations (id, applied_at) VALUES (?, strftime('%s','now'))",
                             (migration_id,))
