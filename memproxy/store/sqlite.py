"""The embedded default store: one SQLite file in WAL mode (SQLite 3.35 or newer).

Two connections, each on a thread of its own (sqlite3 blocks; the event loop must not): reads go to
one and see only committed data; writes go to the other, one transaction at a time, `BEGIN
IMMEDIATE`, so a reader never sees half a turn and another process (the CLI, a second server) waits
on the busy timeout instead of failing. A write script (`SQLStore.record_turn`) runs whole in one
trip to the writer's thread; each trip costs the event loop a wake-up. The SQL itself is shared
with PostgreSQL (`memproxy.store.sql`).
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

from .sql import QUERIES, Row, Script, SQLStore, run_script

__all__ = ["QUERIES", "SQLiteStore", "migrations", "sqlite_path"]

T = TypeVar("T")


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


class _Connection:
    """A sqlite3 connection used only from its own thread."""

    def __init__(self, path: str, busy_timeout_ms: int, wal: bool) -> None:
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memproxy-sqlite")
        self._path, self._busy, self._wal = path, busy_timeout_ms, wal
        self._conn: sqlite3.Connection | None = None
        self._closed = False

    async def call(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        if self._closed:
            raise sqlite3.ProgrammingError("the store is closed")
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._call, fn)

    def _call(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        if self._conn is None:
            conn = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False)
            pragmas = [f"busy_timeout = {int(self._busy)}", "foreign_keys = ON", "synchronous = NORMAL"]
            for pragma in pragmas + (["journal_mode = WAL"] if self._wal else []):
                conn.execute(f"PRAGMA {pragma}").fetchall()
            self._conn = conn
        return fn(self._conn)

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        return await self.call(lambda conn: conn.execute(sql, params).fetchall())

    async def close(self) -> None:
        """Close the connection and stop its thread; closing again does nothing."""
        def close(conn: sqlite3.Connection) -> None:
            conn.close()
        if self._closed:
            return
        if self._conn is not None:
            await self.call(close)
        self._closed = True
        self._thread.shutdown(wait=True)


class _Transaction:
    def __init__(self, conn: _Connection) -> None:
        self._conn = conn

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        return await self._conn.fetch(sql, params)

    async def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        return await self._conn.call(lambda conn: conn.execute(sql, params).rowcount)


def _in_transaction(script: Script[T]) -> Callable[[sqlite3.Connection], T]:
    def run(conn: sqlite3.Connection) -> T:
        conn.execute("BEGIN IMMEDIATE")
        try:
            result = run_script(script, lambda sql, params: conn.execute(sql, params).fetchall())
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
        return result
    return run


class SQLiteBackend:
    row_lock = ""  # a write transaction holds the whole file

    def __init__(self, reader: _Connection, writer: _Connection) -> None:
        self._reader = reader
        self._writer = writer
        self._write_lock = asyncio.Lock()

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        return await self._reader.fetch(sql, params)

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[_Transaction]:
        async with self._write_lock:
            await self._writer.fetch("BEGIN IMMEDIATE")
            try:
                yield _Transaction(self._writer)
            except BaseException:
                await self._writer.fetch("ROLLBACK")
                raise
            await self._writer.fetch("COMMIT")

    async def write(self, script: Script[T]) -> T:
        async with self._write_lock:
            return await self._writer.call(_in_transaction(script))

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
        writer = _Connection(path, busy_timeout_ms, wal=True)
        await writer.fetch("SELECT 1")  # opens the file (in WAL mode) before the reader does
        reader = _Connection(path, busy_timeout_ms, wal=False) if path != ":memory:" else writer
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
