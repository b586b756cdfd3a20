"""The embedded default store: one SQLite file in WAL mode (SQLite 3.35 or newer).

Every write is a script (`memproxy.store.sql`) run whole as one `BEGIN IMMEDIATE` transaction, so a
reader never sees half a turn. A turn's write is small (a few rows, some tens of B-tree pages) and,
in WAL mode with `synchronous = NORMAL`, its commit appends to the log without waiting for the disk:
about 0.2 ms. So a write runs on the event loop's own connection when the file is free, where a trip
to a thread and back would cost the loop as much again, and waiting for the thread under load far
more. It never waits there: that connection has no busy timeout, so when another process (the CLI,
a second server) holds the write lock, `BEGIN` fails at once and the same script goes to the writer
thread, which waits on the busy timeout instead. Checkpoints, which do wait for the disk, never run
on the loop: its connection does not checkpoint on commit; after every `_CHECKPOINT_EVERY` writes it
made, a third connection, on its own thread, checkpoints the log by a policy that never waits for a
reader (`checkpoint_log`), so no write ever queues behind an outside reader (a backup, a `sqlite3`
shell, `memproxy sessions` on the same file).

Reads see only committed data. The indexed reads that serve a turn (`Backend.lookup`) are answered
on the event loop's connection too: a few B-tree pages each, some tens of microseconds. A WAL reader
takes no lock a writer holds; should it ever find the file busy (another process rebuilding the WAL
index after a crash), it fails at once and the read goes to the reader's thread, which waits there.
Every other read (listings, usage, exports, long ranges: as long as the data) goes to that thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import sqlite3
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from .errors import translated
from .migrations import migrations, statements
from .sql import QUERIES, Row, Script, SQLStore, run_script

__all__ = ["QUERIES", "SQLiteStore", "migrations", "sqlite_path"]

T = TypeVar("T")
log = logging.getLogger("memproxy.store")


def sqlite_path(url: str) -> str:
    """`sqlite:///relative.db`, `sqlite:////abs/path.db` or `sqlite:///:memory:` to a path."""
    if not url.startswith("sqlite:///"):
        raise ValueError(f"not a sqlite URL: {url!r}")
    return url[len("sqlite:///"):]


_CHECKPOINT_EVERY = 64  # writes on the loop's connection between two checkpoints
_TRUNCATE_AT_FRAMES = 1024  # a log this long (4 MiB at 4 KiB pages; a turn writes ~14) is started afresh
_Call = tuple[Callable[[sqlite3.Connection], Any], asyncio.AbstractEventLoop, asyncio.Future[Any]]


class _Connection:
    """A sqlite3 connection used only from its own thread, which runs the calls queued to it in turn.

    A call runs once queued, even if its caller is cancelled meanwhile (a write is one whole
    transaction: it commits or not as a whole); the caller only stops waiting. The thread hands each
    result straight to the caller's loop: a ThreadPoolExecutor's futures cost every trip some 25 µs
    more, and a turn waits for one trip (its write).
    """

    def __init__(self, path: str, busy_timeout_ms: int, wal: bool) -> None:
        self._path, self._busy, self._wal = path, busy_timeout_ms, wal
        self._conn: sqlite3.Connection | None = None
        self._closed = False
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="memproxy-sqlite", daemon=True)
        self._thread.start()

    async def call(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        if self._closed:
            raise sqlite3.ProgrammingError("the store is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._calls.put((fn, loop, future))
        return await future

    def _serve(self) -> None:
        while (queued := self._calls.get()) is not None:
            fn, loop, future = queued
            try:
                outcome: tuple[Any, BaseException | None] = (self._call(fn), None)
            except BaseException as exc:  # the caller's to handle
                outcome = (None, exc)
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is waiting
                loop.call_soon_threadsafe(_settle, future, *outcome)

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
        self._calls.put(None)
        self._thread.join()


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _in_transaction(script: Script[T]) -> Callable[[sqlite3.Connection], T]:
    def run(conn: sqlite3.Connection) -> T:
        conn.execute("BEGIN IMMEDIATE")
        return _finish(conn, script)
    return run


def _finish(conn: sqlite3.Connection, script: Script[T]) -> T:
    """Run `script` in the transaction `conn` has begun, and commit it (or roll it back)."""
    try:
        result = run_script(script, lambda sql, params: conn.execute(sql, params).fetchall())
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
    return result


def checkpoint_log(conn: sqlite3.Connection) -> tuple[int, int]:
    """The checkpoint policy, on a connection with no busy timeout: it never waits for anyone.
    Returns the log's length in frames and how many of them are now in the database.

    A PASSIVE checkpoint copies every frame no reader still needs, without locking writers out and
    without waiting for readers. It cannot, alone, bound the log: under a steady stream of writes the
    log never gets copied to its very end at a moment when the next write would start it afresh, so
    it grows without bound (190 MB measured). So once the log is long and every frame of it is
    copied, a TRUNCATE checkpoint copies the few frames written since and empties the file. TRUNCATE
    (and RESTART) waits for readers on the log: with no busy timeout it gives up at once instead
    (`busy` = 1), and a write that finds the write lock it holds goes to the writer thread for the
    moment it takes. An outside reader holding an old snapshot keeps the frames it needs in the log,
    as SQLite must; the first checkpoint after it lets go copies them and empties the log.
    """
    _, frames, copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    if frames >= _TRUNCATE_AT_FRAMES and copied == frames:
        busy, frames, copied = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        if not busy:
            return 0, 0
    return int(frames), int(copied)


def _busy(exc: sqlite3.OperationalError) -> bool:
    return exc.sqlite_errorcode & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


class SQLiteBackend:
    row_lock = ""  # a write transaction holds the whole file

    def __init__(self, reader: _Connection, writer: _Connection, local: sqlite3.Connection | None,
                 checkpointer: _Connection | None = None) -> None:
        self._reader = reader
        self._writer = writer
        self._local = local  # on the loop's thread; None for `:memory:`, where one connection holds it all
        self._local_writes = 0
        # No busy timeout; runs `checkpoint_log` while writes go on (one checkpoint at a time).
        self._checkpointer = checkpointer
        self._checkpointing: asyncio.Task[None] | None = None

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        with translated():
            return await self._reader.fetch(sql, params)

    async def lookup(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        with translated():
            return await self._lookup(sql, params)

    async def _lookup(self, sql: str, params: Sequence[Any]) -> list[Row]:
        if self._local is not None:
            try:
                return self._local.execute(sql, params).fetchall()
            except sqlite3.OperationalError as exc:
                if not _busy(exc):
                    raise
        return await self._reader.fetch(sql, params)  # busy: the reader's thread waits, not the loop

    async def write(self, script: Script[T]) -> T:
        """A file locked past the busy timeout, a full disk, a read-only file: `StoreUnavailable`."""
        with translated():
            return await self._write(script)

    async def _write(self, script: Script[T]) -> T:
        if self._local is not None:
            try:
                self._local.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as exc:
                if not _busy(exc):
                    raise
            else:  # the write lock is ours: in WAL mode nothing after this waits for another process
                result = _finish(self._local, script)
                self._local_writes += 1
                if self._local_writes % _CHECKPOINT_EVERY == 0 and self._checkpointer is not None and (
                        self._checkpointing is None or self._checkpointing.done()):
                    self._checkpointing = asyncio.get_running_loop().create_task(
                        self._checkpoint(self._checkpointer))
                return result
        return await self._writer.call(_in_transaction(script))  # busy: the writer's thread waits

    @staticmethod
    async def _checkpoint(checkpointer: _Connection) -> None:
        try:
            await checkpointer.call(checkpoint_log)
        except sqlite3.Error as exc:  # the next one tries again
            log.warning("sqlite checkpoint failed: %s", type(exc).__name__)

    async def close(self) -> None:
        if self._checkpointing is not None:
            await self._checkpointing
        if self._local is not None:
            self._local.close()
            self._local = None
        if self._checkpointer is not None:
            await self._checkpointer.close()
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
        in_memory = path == ":memory:"
        reader = writer if in_memory else _Connection(path, busy_timeout_ms, wal=False)
        checkpointer = None if in_memory else _Connection(path, 0, wal=False)
        backend = SQLiteBackend(reader, writer, None if in_memory else _local(path), checkpointer)
        await _migrate(backend)
        return cls(backend)


def _local(path: str) -> sqlite3.Connection:
    """The event loop's connection: never waiting on a busy file, never checkpointing on commit."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    for pragma in ("busy_timeout = 0", "foreign_keys = ON", "synchronous = NORMAL", "wal_autocheckpoint = 0"):
        conn.execute(f"PRAGMA {pragma}").fetchall()
    return conn


async def _migrate(backend: SQLiteBackend) -> None:
    """Apply the numbered migrations not yet recorded, each in its own write transaction, so two
    processes starting on one file at once apply each migration exactly once."""
    await backend.write(_statements(
        ["CREATE TABLE IF NOT EXISTS schema_migrations (id TEXT PRIMARY KEY, applied_at REAL NOT NULL)"]))
    for migration_id, sql in migrations():
        await backend.write(_migration(migration_id, sql))


def _migration(migration_id: str, sql: str) -> Script[None]:
    if (yield "SELECT 1 FROM schema_migrations WHERE id = ?", (migration_id,)):
        return
    yield from _statements(statements(sql))
    yield "INSERT INTO schema_migrations (id, applied_at) VALUES (?, strftime('%s','now'))", (migration_id,)


def _statements(sqls: list[str]) -> Script[None]:
    for sql in sqls:
        yield sql, ()
