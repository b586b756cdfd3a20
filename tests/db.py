"""Reading what a proxy stored, from a connection of the test's own, on SQLite or PostgreSQL alike.

Tests look into the database to check what was committed, not what the proxy says. Everything here
is synchronous, so it can be called from a sync test, from an async test (while an in-process proxy
shares the test's event loop) or from a helper:

- `rows(config, sql, *params)`: the rows of one query, as tuples. Write the SQL both databases
  accept, with `?` placeholders (they become `$1, $2, ...` on PostgreSQL); avoid `? IS NULL` on an
  untyped parameter (PostgreSQL cannot guess its type) and SQLite's PRAGMAs.
- `table_rows(config, *tables)`: every row of each table, ordered by its first column, in one go.
- `execute(config, sql, *params)`: one committed write, as another process could make.
- `write_lock_held(config)`: hold the write lock another process could hold, so a proxy's write
  waits; `writes_waiting(config)` counts PostgreSQL sessions waiting on it.

`config` is a `Config` or its `StorageConfig`. SQLite is read with the stdlib `sqlite3`; PostgreSQL
with asyncpg, in `storage.schema`. PostgreSQL reads go through a connection of the tests' own kept
open for the last few schemas read, on one event loop thread: opening a connection for each read
cost ~10 ms, and a polled condition or a property test reads thousands of times. Such a connection
never holds a transaction open between reads, so each read still sees exactly what is committed.
"""

from __future__ import annotations

import asyncio
import atexit
import sqlite3
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from contextlib import closing, contextmanager
from typing import Any, TypeVar

import asyncpg

from memproxy.config import Config, StorageConfig
from memproxy.store.postgres import numbered
from memproxy.store.sqlite import sqlite_path

T = TypeVar("T")
Row = tuple[Any, ...]


def storage_of(config: Config | StorageConfig) -> StorageConfig:
    return config.storage if isinstance(config, Config) else config


def run_async(work: Callable[[], Awaitable[T]]) -> T:
    """`work()` to its end on a thread of its own with a fresh event loop (the caller's loop, if it
    has one, is left alone); its result, or its exception (a pytest skip included) re-raised."""
    outcome: list[Any] = []

    def target() -> None:
        async def main() -> T:
            return await work()

        try:
            outcome.append((True, asyncio.run(main())))
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller as it is
            outcome.append((False, exc))

    thread = threading.Thread(target=target, name="tests-db")
    thread.start()
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


async def connect(storage: StorageConfig, **options: Any) -> asyncpg.Connection:
    """A PostgreSQL connection of its own, in the store's schema."""
    settings = {"search_path": storage.schema} if storage.schema else None
    return await asyncpg.connect(storage.url, server_settings=settings, **options)


def rows(config: Config | StorageConfig, sql: str, *params: Any) -> list[Row]:
    """The rows `sql` returns, read from a new connection: what is committed, nothing else."""
    return table_query(config, [(sql, params)])[0]


def execute(config: Config | StorageConfig, sql: str, *params: Any) -> None:
    """Run one write and commit it, as another process would while a proxy runs."""
    storage = storage_of(config)
    if not storage.is_postgres:
        with closing(sqlite3.connect(sqlite_path(storage.url), timeout=10)) as db:
            db.execute(sql, params)
            db.commit()
        return

    async def write() -> None:
        conn = await connect(storage)
        try:
            await conn.execute(numbered(sql), *params)
        finally:
            await conn.close()

    run_async(write)


def table_rows(config: Config | StorageConfig, *tables: str) -> dict[str, list[Row]]:
    """Every row of each table, ordered by its first column."""
    results = table_query(config, [(f"SELECT * FROM {table} ORDER BY 1", ()) for table in tables])
    return dict(zip(tables, results))


def table_query(config: Config | StorageConfig, queries: list[tuple[str, tuple[Any, ...]]]) -> list[list[Row]]:
    """Several queries on one connection (one snapshot each)."""
    storage = storage_of(config)
    if not storage.is_postgres:
        with closing(sqlite3.connect(f"file:{sqlite_path(storage.url)}?mode=ro", uri=True)) as db:
            return [[tuple(r) for r in db.execute(sql, params)] for sql, params in queries]

    return _READER.fetch(storage, [(numbered(sql), params) for sql, params in queries])


@contextmanager
def write_lock_held(config: Config | StorageConfig, table: str = "sessions") -> Iterator[None]:
    """Hold, from another connection, the lock a proxy's write needs, as another process could:
    SQLite's write lock (`BEGIN IMMEDIATE`), or on PostgreSQL an EXCLUSIVE lock on `table`, which
    lets reads through and holds back writes to it: on `sessions` every write (they all lock a
    session's row first); on `messages` a turn's write halfway, after its `turns` row."""
    storage = storage_of(config)
    if not storage.is_postgres:
        with closing(sqlite3.connect(sqlite_path(storage.url), isolation_level=None)) as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield
            finally:
                db.execute("ROLLBACK")
        return
    with _LoopThread() as loop:
        conn: asyncpg.Connection = loop.run(connect(storage))
        try:
            loop.run(conn.execute(f"BEGIN; LOCK TABLE {table} IN EXCLUSIVE MODE"))
            yield
        finally:
            loop.run(conn.close())  # ends the transaction: the lock goes with it


@contextmanager
def opening_held(storage: StorageConfig) -> Iterator[None]:
    """Hold, from another connection, what a store opening must have, so it waits there: on SQLite
    the whole file (`BEGIN EXCLUSIVE`: not even WAL mode can be set), on PostgreSQL the advisory lock
    its migrations take for the schema (the one `memproxy.store.postgres._migrate` takes)."""
    if not storage.is_postgres:
        with closing(sqlite3.connect(sqlite_path(storage.url), isolation_level=None)) as db:
            db.execute("CREATE TABLE IF NOT EXISTS held (x)")  # an empty file has nothing to lock
            db.execute("BEGIN EXCLUSIVE")
            yield
        return
    with _LoopThread() as loop:
        conn: asyncpg.Connection = loop.run(connect(storage))
        try:
            loop.run(conn.execute("SELECT pg_advisory_lock(hashtext($1))", f"memproxy-migrate:{storage.schema}"))
            yield
        finally:
            loop.run(conn.close())  # the lock goes with the session


def writes_waiting(config: Config | StorageConfig, table: str = "sessions") -> list[int]:
    """PostgreSQL: the server processes waiting for a lock on this schema's `table`."""
    found = rows(config, f"SELECT pid FROM pg_locks WHERE NOT granted AND relation = '{table}'::regclass")
    return [int(pid) for (pid,) in found]


class _Reader:
    """Reads of PostgreSQL for every thread of the tests, on one event loop thread of its own, through
    a connection per schema kept open for the `KEEP` schemas read last."""

    KEEP = 3

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._start = threading.Lock()
        self._open: OrderedDict[tuple[str, str | None], tuple[asyncpg.Connection, asyncio.Lock]] = OrderedDict()

    def fetch(self, storage: StorageConfig, queries: list[tuple[str, tuple[Any, ...]]]) -> list[list[Row]]:
        with self._start:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="tests-db-reader", daemon=True).start()
                atexit.register(self.close)
        return asyncio.run_coroutine_threadsafe(self._fetch(storage, queries), self._loop).result(timeout=120)

    def close(self) -> None:
        """Close the connections kept open, as the tests' process exits: left to the garbage
        collector, each is reported unclosed (a `ResourceWarning` at the end of every run)."""
        assert self._loop is not None

        async def close_all() -> None:
            while self._open:
                _, (conn, lock) = self._open.popitem(last=False)
                async with lock:
                    try:
                        await conn.close(timeout=5)
                    except (OSError, asyncio.TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError):
                        conn.terminate()  # the server went away: nothing to say goodbye to

        asyncio.run_coroutine_threadsafe(close_all(), self._loop).result(timeout=30)

    async def _fetch(self, storage: StorageConfig, queries: list[tuple[str, tuple[Any, ...]]]) -> list[list[Row]]:
        for attempt in (1, 2):
            conn, lock = await self._connection(storage)
            try:
                async with lock:
                    return [[tuple(r) for r in await conn.fetch(sql, *params)] for sql, params in queries]
            except (asyncpg.InterfaceError, asyncpg.ConnectionDoesNotExistError, OSError):
                # A connection lost between reads (a test that restarts or cuts the server): the
                # statement never ran; once more on a new connection.
                self._open.pop((storage.url, storage.schema), None)
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    async def _connection(self, storage: StorageConfig) -> tuple[asyncpg.Connection, asyncio.Lock]:
        key = (storage.url, storage.schema)
        if key in self._open:
            self._open.move_to_end(key)
            return self._open[key]
        # No statement cache: a schema migrated between two reads must not meet a stale plan.
        opened = (await connect(storage, statement_cache_size=0), asyncio.Lock())
        self._open[key] = opened
        while len(self._open) > self.KEEP:
            _, (old, old_lock) = self._open.popitem(last=False)
            async with old_lock:
                await old.close()
        return opened


_READER = _Reader()


class _LoopThread:
    """An event loop on a thread, for a connection that must outlive one call (a held lock)."""

    def __enter__(self) -> _LoopThread:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tests-db-lock")
        self._thread.start()
        return self

    def run(self, work: Awaitable[T]) -> T:
        async def main() -> T:
            return await work

        return asyncio.run_coroutine_threadsafe(main(), self._loop).result(timeout=60)

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
