"""The embedded default store: one SQLite file in WAL mode (SQLite 3.35 or newer), through aiosqlite.

Each aiosqlite connection owns a thread that runs its calls in turn, so nothing of SQLite runs on the
event loop: it only queues a statement and is woken with its rows.

- **One writer** makes every write. A write is a script (`memproxy.store.sql`) run as one
  `BEGIN IMMEDIATE` transaction, statement by statement, and writes take turns on an asyncio lock, so
  a reader never sees half a turn and no two scripts interleave. The writer waits for another
  process holding the file (the CLI, a second server) on its own thread, for the busy timeout. A
  write, once started, runs to its end even if its caller is cancelled: it commits or rolls back as a
  whole, and the caller only stops waiting. In WAL mode with `synchronous = NORMAL` a commit appends
  to the log without waiting for the disk, and the writer never checkpoints on commit
  (`wal_autocheckpoint = 0`).
- **Two readers** see committed data only: one answers the indexed lookups that serve a turn
  (`Backend.lookup`: a few B-tree pages each), the other every read as long as its data (listings,
  usage, exports), so an export never delays a turn. A WAL reader takes no lock a writer holds.
- **A checkpointer**, with no busy timeout, copies the log back into the database every
  `_CHECKPOINT_EVERY` writes by a policy that never waits for a reader (`checkpoint_log`), so no
  write ever queues behind an outside reader (a backup, a `sqlite3` shell, `memproxy sessions`).

`:memory:` is one database per connection, so there one connection does it all, reads included,
and a read waits for a write in progress rather than see it half done.

A trip to a connection's thread and back costs some tens of microseconds idle, far more when the
loop is busy (each result waits for the loop's next turn), so the store makes few: one per statement
(`execute_fetchall`; the statement cache keeps each text prepared), the writer's BEGIN folded into
the first statement. A script is not run whole on the writer's thread: aiosqlite has no public call
for that, and measured through its private one it was slower still, the script's Python then
contending for the GIL with the loop.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import aiosqlite

from .errors import translated
from .migrations import migrations, statements
from .sql import QUERIES, Row, Script, SQLStore, run_script, run_script_async

__all__ = ["QUERIES", "SQLiteStore", "checkpoint_log", "sqlite_path"]

T = TypeVar("T")
log = logging.getLogger("memproxy.store")

_CHECKPOINT_EVERY = 64  # writes between two checkpoints
_TRUNCATE_AT_FRAMES = 1024  # a log this long (4 MiB at 4 KiB pages; a turn writes ~14) is started afresh
_CACHED_STATEMENTS = 256  # prepared statements kept per connection: every text the store runs, and then some


# Statements before which Python's sqlite3 begins a transaction itself when none is open and the
# connection has an `isolation_level` (its "legacy" transaction control): the writer's is IMMEDIATE.
_BEGINS_ITSELF = ("INSERT", "UPDATE", "DELETE", "REPLACE")


def sqlite_path(url: str) -> str:
    """`sqlite:///relative.db`, `sqlite:////abs/path.db` or `sqlite:///:memory:` to a path."""
    if not url.startswith("sqlite:///"):
        raise ValueError(f"not a sqlite URL: {url!r}")
    return url[len("sqlite:///"):]


_PASSIVE = "PRAGMA wal_checkpoint(PASSIVE)"
_TRUNCATE = "PRAGMA wal_checkpoint(TRUNCATE)"


def _checkpoint_policy() -> Script[tuple[int, int]]:
    [(_, frames, copied)] = yield _PASSIVE, ()
    if frames >= _TRUNCATE_AT_FRAMES and copied == frames:
        [(busy, frames, copied)] = yield _TRUNCATE, ()
        if not busy:
            return 0, 0
    return int(frames), int(copied)


def checkpoint_log(conn: sqlite3.Connection) -> tuple[int, int]:
    """The checkpoint policy, on a connection with no busy timeout: it never waits for anyone.
    Returns the log's length in frames and how many of them are now in the database.

    A PASSIVE checkpoint copies every frame no reader still needs, without locking writers out and
    without waiting for readers. It cannot, alone, bound the log: under a steady stream of writes the
    log never gets copied to its very end at a moment when the next write would start it afresh, so
    it grows without bound (190 MB measured). So once the log is long and every frame of it is
    copied, a TRUNCATE checkpoint copies the few frames written since and empties the file. TRUNCATE
    (and RESTART) waits for readers on the log: with no busy timeout it gives up at once instead
    (`busy` = 1); when it goes ahead it holds the write lock for the moment it takes, which the
    writer, on its own thread, waits out. An outside reader holding an old snapshot keeps the frames
    it needs in the log, as SQLite must; the first checkpoint after it lets go copies them and
    empties the log. The store runs the same policy on its aiosqlite checkpointer (`_checkpoint`).
    """
    return run_script(_checkpoint_policy(), lambda sql, params: conn.execute(sql, params).fetchall())


async def _connect(path: str, pragmas: Sequence[str], writer: bool = False) -> aiosqlite.Connection:
    """An aiosqlite connection. Readers run in autocommit mode, each read its own snapshot; the
    writer begins a transaction before a first statement that writes (`_BEGINS_ITSELF`)."""
    conn = await aiosqlite.connect(path, isolation_level="IMMEDIATE" if writer else None,
                                   cached_statements=_CACHED_STATEMENTS)
    try:
        for pragma in pragmas:
            await conn.execute_fetchall(f"PRAGMA {pragma}")
    except BaseException:
        await conn.close()
        raise
    return conn


async def _fetch(conn: aiosqlite.Connection, sql: str, params: Sequence[Any]) -> list[Row]:
    # `execute_fetchall` is one trip: the statement and its rows (`fetchall` builds a list).
    return cast(list[Row], await conn.execute_fetchall(sql, params))


class SQLiteBackend:
    row_lock = ""  # a write transaction holds the whole file

    def __init__(self, writer: aiosqlite.Connection, lookups: aiosqlite.Connection | None = None,
                 reader: aiosqlite.Connection | None = None,
                 checkpointer: aiosqlite.Connection | None = None) -> None:
        """Without readers (`:memory:`), the writer answers reads too, between writes."""
        self._writer = writer
        self._lookups = lookups or writer
        self._reader = reader or writer
        self._shared = lookups is None  # reads must not see a write half done on the same connection
        self._checkpointer = checkpointer  # no busy timeout; one checkpoint at a time
        self._checkpointing: asyncio.Task[None] | None = None
        self._write_lock = asyncio.Lock()
        self._writes = 0
        self._unsure = False  # a rollback failed: begin the next write explicitly
        self._in_flight: set[asyncio.Task[Any]] = set()
        self._closed = False

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        with translated():
            return await self._read(self._reader, sql, params)

    async def lookup(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        with translated():
            return await self._read(self._lookups, sql, params)

    async def _read(self, conn: aiosqlite.Connection, sql: str, params: Sequence[Any]) -> list[Row]:
        self._check_open()
        if self._shared:
            async with self._write_lock:
                return await _fetch(conn, sql, params)
        return await _fetch(conn, sql, params)

    async def write(self, script: Script[T]) -> T:
        """A file locked past the busy timeout, a full disk, a read-only file: `StoreUnavailable`.
        Runs to its end even if the caller is cancelled meanwhile."""
        with translated():
            self._check_open()
            task = asyncio.get_running_loop().create_task(self._write(script))
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)
            return await asyncio.shield(task)

    async def _write(self, script: Script[T]) -> T:
        writer = self._writer
        async with self._write_lock:
            try:
                step = next(script)
                # A first statement that writes begins the transaction itself, in the same trip (the
                # writer's `isolation_level`); any other (a locking read, DDL) needs its own BEGIN.
                if self._unsure or not step[0].lstrip()[:7].upper().startswith(_BEGINS_ITSELF):
                    await _fetch(writer, "BEGIN IMMEDIATE", ())  # waits, on its thread, for other processes
                while True:
                    rows = await _fetch(writer, *step)
                    try:
                        step = script.send(rows)
                    except StopIteration as done:
                        result: T = done.value
                        break
                await _fetch(writer, "COMMIT", ())
                self._unsure = False
            except StopIteration as done:  # a script with no statement at all
                return cast(T, done.value)
            except BaseException:
                # Nothing to undo if the script failed before its first statement, or SQLite rolled
                # back already (a full disk); the error worth raising is the first.
                try:
                    await _fetch(writer, "ROLLBACK", ())
                except sqlite3.Error:
                    # Should a transaction still be open, the next write's own BEGIN fails rather
                    # than let an implicit one join it.
                    self._unsure = True
                raise
        self._writes += 1
        if self._writes % _CHECKPOINT_EVERY == 0 and self._checkpointer is not None and (
                self._checkpointing is None or self._checkpointing.done()):
            self._checkpointing = asyncio.get_running_loop().create_task(self._checkpoint(self._checkpointer))
        return result

    async def _checkpoint(self, checkpointer: aiosqlite.Connection) -> None:
        """`checkpoint_log`'s policy. Its TRUNCATE needs the write lock, which this process's writer
        holds across the trips of each write: it is tried between two writes (they wait the moment
        it takes), so only another process can make it give up."""
        async def fetch(sql: str, params: Sequence[Any]) -> list[Row]:
            if sql != _TRUNCATE:
                return await _fetch(checkpointer, sql, params)
            async with self._write_lock:
                return await _fetch(checkpointer, sql, params)

        try:
            await run_script_async(_checkpoint_policy(), fetch)
        except sqlite3.Error as exc:  # the next one tries again
            log.warning("sqlite checkpoint failed: %s", type(exc).__name__)

    def _check_open(self) -> None:
        if self._closed:
            raise sqlite3.ProgrammingError("the store is closed")

    async def close(self) -> None:
        """Let the writes under way finish, then close every connection; closing again does nothing."""
        if self._closed:
            return
        self._closed = True
        if self._in_flight:
            await asyncio.wait(set(self._in_flight))
        if self._checkpointing is not None:
            await self._checkpointing
        for conn in dict.fromkeys((self._checkpointer, self._lookups, self._reader, self._writer)):
            if conn is not None:
                await conn.close()


class SQLiteStore(SQLStore):
    @classmethod
    async def open(cls, url: str, busy_timeout_ms: int = 5000) -> SQLiteStore:
        path = sqlite_path(url)
        # aiosqlite logs every call at DEBUG with its parameters: stored content and metadata values,
        # which memproxy never logs.
        logging.getLogger("aiosqlite").setLevel(logging.WARNING)
        with translated():
            backend = await _open_backend(path, int(busy_timeout_ms))
        try:
            await _migrate(backend)
        except BaseException:
            await backend.close()
            raise
        return cls(backend)


async def _open_backend(path: str, busy_timeout_ms: int) -> SQLiteBackend:
    """The writer first (it puts the file in WAL mode), then the readers and the checkpointer."""
    if path == ":memory:":
        return SQLiteBackend(await _connect(path, ["foreign_keys = ON"], writer=True))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    opened: list[aiosqlite.Connection] = []
    try:
        opened.append(await _connect(path, [f"busy_timeout = {busy_timeout_ms}", "foreign_keys = ON",
                                            "synchronous = NORMAL", "journal_mode = WAL", "wal_autocheckpoint = 0"],
                                    writer=True))
        for _ in range(2):  # the turn's lookups, and every other read
            opened.append(await _connect(path, [f"busy_timeout = {busy_timeout_ms}", "query_only = ON"]))
        opened.append(await _connect(path, ["busy_timeout = 0"]))
    except BaseException:
        for conn in opened:
            await conn.close()
        raise
    return SQLiteBackend(*opened)


async def _migrate(backend: SQLiteBackend) -> None:
    """Apply the numbered migrations not yet recorded, each in its own write transaction, so two
    processes starting on one file at once apply each migration exactly once."""
    await backend.write(_statements(
        ["CREATE TABLE IF NOT EXISTS schema_migrations (id TEXT PRIMARY KEY, applied_at REAL NOT NULL)"]))
    for migration_id, sql in migrations("sqlite"):
        await backend.write(_migration(migration_id, sql))


def _migration(migration_id: str, sql: str) -> Script[None]:
    if (yield "SELECT 1 FROM schema_migrations WHERE id = ?", (migration_id,)):
        return
    yield from _statements(statements(sql))
    yield "INSERT INTO schema_migrations (id, applied_at) VALUES (?, strftime('%s','now'))", (migration_id,)


def _statements(sqls: list[str]) -> Script[None]:
    for sql in sqls:
        yield sql, ()
