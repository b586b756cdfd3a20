"""The embedded default store: one SQLite file in WAL mode (SQLite 3.35 or newer), through aiosqlite.

aiosqlite gives each connection a thread of its own and runs the calls queued to it there, in order;
nothing of SQLite runs on the event loop's thread. Each call is a trip to that thread and back (some
60 µs here, against a few µs for the indexed read itself), and under load each answer waits its turn
on the busy loop, so the store is written to make few of them: every read is one `execute_fetchall`,
and a write sends its statements together where none needs another's answer (`Backend.write_batch`).

Three connections, each with its own thread:
- the writer, for every write, one transaction at a time. A turn's write is a batch: its statements,
  the check of their outcomes and the commit run in one trip, as one call on the writer's thread
  (`_commit_batches`), so a transaction never waits on the event loop between its statements. An
  idle writer gets the batch from the caller's own task at once (`_now`); batches that queue while
  it is busy share one transaction and one commit (`_commit_group`), so under load a turn waits for
  the writer once, not once per turn ahead of it. The connection is in Python's implicit
  transaction mode (`isolation_level = "IMMEDIATE"`), so no statement of a write ever commits on its
  own: a batch's first statement begins the transaction, a script sends `BEGIN IMMEDIATE` with its
  first statement, and if that `BEGIN` fails (another process held the file past the busy timeout)
  whatever began is rolled back. In WAL mode with `synchronous = NORMAL` a commit appends to the log
  without waiting for the disk.
- the reader, for every read: it sees committed data only, and waits on its own thread for a busy
  file.
- the checkpointer, with no busy timeout: the writer does not checkpoint on commit; at least
  `_CHECKPOINT_EVERY` writes apart the checkpointer copies the log into the database by a policy that
  never waits for a reader (`checkpoint_log`), so no write ever queues behind an outside reader (a
  backup, a `sqlite3` shell, `memproxy sessions` on the same file).

`:memory:` is one connection for everything: a second would open a second, empty database.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
import sqlite3
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

import aiosqlite

from ..config import ConfigError
from .base import COMMON_WORD_POSITIONS
from .errors import translated
from .history_cache import DEFAULT_HISTORY_CACHE_BYTES
from .recall_index import DEFAULT_RECALL_CACHE_BYTES
from .migrations import fills_recall, migrations, newer_than_known, statements
from .sql import QUERIES, Outcome, Row, Script, SQLStore, Step, backfill_recall, run_script_async

__all__ = ["QUERIES", "SQLiteStore", "checkpoint_log", "migrations", "sqlite_path"]

T = TypeVar("T")
log = logging.getLogger("memproxy.store")
_WORD = re.compile(r"[^\W_]+")  # a word as `memproxy.searchtext` makes them: nothing FTS5's syntax reads
# aiosqlite logs every call with its parameters (stored content, metadata values) at DEBUG: even a
# server debugging at DEBUG level must never write those.
logging.getLogger("aiosqlite").setLevel(logging.WARNING)

_READ_POSITIONS = COMMON_WORD_POSITIONS + 1  # one more than a word may have, to tell it is too common


def sqlite_path(url: str) -> str:
    """`sqlite:///relative.db`, `sqlite:////abs/path.db` or `sqlite:///:memory:` to a path."""
    if not url.startswith("sqlite:///"):
        raise ValueError(f"not a sqlite URL: {url!r}")
    return url[len("sqlite:///"):]


_CHECKPOINT_EVERY = 64  # writes between the starts of two checkpoints, at least
_TRUNCATE_AT_FRAMES = 1024  # a log this long (4 MiB at 4 KiB pages; a turn writes ~14) is started afresh


async def checkpoint_log(conn: aiosqlite.Connection) -> tuple[int, int]:
    """The checkpoint policy, on a connection with no busy timeout: it never waits for anyone.
    Returns the log's length in frames and how many of them are now in the database.

    A PASSIVE checkpoint copies every frame no reader still needs, without locking writers out and
    without waiting for readers. It cannot, alone, bound the log: under a steady stream of writes the
    log never gets copied to its very end at a moment when the next write would start it afresh, so
    it grows without bound (190 MB measured). So once the log is long and every frame of it is
    copied, a TRUNCATE checkpoint copies the few frames written since and empties the file. TRUNCATE
    (and RESTART) waits for readers on the log: with no busy timeout it gives up at once instead
    (`busy` = 1), and a write that finds the write lock it holds waits the moment it takes on the
    writer's thread. An outside reader holding an old snapshot keeps the frames it needs in the log,
    as SQLite must; the first checkpoint after it lets go copies them and empties the log.
    """
    [(_, frames, copied)] = await conn.execute_fetchall("PRAGMA wal_checkpoint(PASSIVE)")
    if frames >= _TRUNCATE_AT_FRAMES and copied == frames:
        [(busy, frames, copied)] = await conn.execute_fetchall("PRAGMA wal_checkpoint(TRUNCATE)")
        if not busy:
            return 0, 0
    return int(frames), int(copied)


def _create_private(path: str) -> None:
    """Create the database file, if there is none, readable and writable by its owner alone: it holds
    every conversation, and SQLite makes its `-wal` and `-shm` files with the file's own permissions
    (the process umask alone would leave them readable by every local user, as it usually is). An
    existing file keeps the permissions it has: its operator chose them. An empty file is an empty
    database to SQLite. Where it cannot be created, SQLite's own opening says why."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except OSError:  # there already, or a path SQLite will refuse in its own words
        pass


async def _connect(path: str, busy_timeout_ms: int, *pragmas: str, wal: bool = False) -> aiosqlite.Connection:
    """A connection set up with `pragmas` (and WAL mode), its busy timeout set last. Until then a
    pragma that finds the file locked (another process migrating it, a `BEGIN EXCLUSIVE` elsewhere)
    is retried here, on the event loop, until the busy timeout: SQLite's own busy handler would wait
    on the connection's thread, where a stop signal's cancel cannot reach it (`sqlite3_interrupt`
    does not end that wait), and closing the connection would then wait out the whole timeout."""
    conn = await _opened(path)
    try:
        await conn.execute_fetchall("PRAGMA busy_timeout = 0")  # Python's default is five seconds
        deadline = asyncio.get_running_loop().time() + busy_timeout_ms / 1000
        setup = ["foreign_keys = ON", "synchronous = NORMAL", *pragmas, *(["journal_mode = WAL"] if wal else [])]
        for pragma in setup:
            await _until_unlocked(conn, f"PRAGMA {pragma}", deadline)
        await conn.execute_fetchall(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
    except BaseException:
        await conn.close()  # else its thread outlives the loop that waits for it
        raise
    return conn


async def _opened(path: str) -> aiosqlite.Connection:
    """`aiosqlite.connect`, carried to its end even when cancelled (a stop signal while the store
    opens), then closed. aiosqlite stops a connect cut short without waiting for its thread, whose
    late answer then finds the event loop closed and prints a traceback at exit."""
    # Implicit transactions: a data-changing statement always runs inside one (see the module's note).
    opening = asyncio.ensure_future(aiosqlite.connect(path, isolation_level="IMMEDIATE"))
    try:
        return await asyncio.shield(opening)
    except asyncio.CancelledError:
        await asyncio.wait([opening])
        if not opening.cancelled() and opening.exception() is None:
            await opening.result().close()
        raise


async def _until_unlocked(conn: aiosqlite.Connection, sql: str, deadline: float) -> None:
    """Run `sql` on a connection with no busy timeout, again while the file is locked, until `deadline`."""
    loop = asyncio.get_running_loop()
    pause = 0.005
    while True:
        try:
            await conn.execute_fetchall(sql)
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or loop.time() + pause > deadline:
                raise
        await asyncio.sleep(pause)  # a retry's backoff, not a wait for an event: nothing announces the lock's end
        pause = min(pause * 2, 0.1)


# The full-text index's tokenizer, as migration 0009_recall creates it (a test holds them equal).
FTS_TOKENIZER = "porter unicode61 remove_diacritics 2 tokenchars '_'"
_PROBE_KEY = "0" * 12 + "_"  # a session key's shape: the stemmer sees `key_word` as the index holds it


class _Stemmer:
    """The index's own tokenizer, asked directly: an in-memory FTS5 table with the same tokenizer,
    each word written as a row and read back from its vocabulary within the same transaction, which
    is then rolled back (a commit, and deleting the rows, took 40% of a probe). Stems are exactly
    the store's, whatever SQLite's porter stemmer does; microseconds a word, in this thread (no I/O)."""

    def __init__(self) -> None:
        self._db = sqlite3.connect(":memory:", check_same_thread=False)
        self._db.execute(f'CREATE VIRTUAL TABLE probe USING fts5(words, tokenize = "{FTS_TOKENIZER}")')
        self._db.execute("CREATE VIRTUAL TABLE probe_terms USING fts5vocab(probe, instance)")

    def stems(self, words: Sequence[str]) -> list[tuple[str, ...]]:
        out: list[list[str]] = [[] for _ in words]
        try:
            self._db.executemany("INSERT INTO probe (rowid, words) VALUES (?, ?)",  # opens the transaction
                                 [(i, _PROBE_KEY + word) for i, word in enumerate(words)])
            for doc, term in self._db.execute("SELECT doc, term FROM probe_terms ORDER BY doc, offset"):
                if term.startswith(_PROBE_KEY):  # a word the tokenizer splits: its first piece is keyed
                    out[doc].append(term[len(_PROBE_KEY):])
        finally:
            self._db.rollback()
        return [tuple(stems) for stems in out]

    def close(self) -> None:
        self._db.close()


class SQLiteBackend:
    row_lock = ""  # a write transaction holds the whole file
    # SQLite plans without statistics unless ANALYZE has run, and memproxy's statements are written
    # for those plans: gathering some could only change them.
    analyze: str | None = None

    def __init__(self, writer: aiosqlite.Connection, reader: aiosqlite.Connection,
                 checkpointer: aiosqlite.Connection | None = None, path: str | None = None) -> None:
        self._path = path
        self._file = _identity(path) if path is not None else None  # the file the connections opened
        self._writer = writer
        self._reader = reader
        self._write_lock = asyncio.Lock()  # one transaction at a time on the writer
        self._queued: list[_Write] = []  # writes waiting for the writer, in order
        self._draining: asyncio.Task[None] | None = None  # the one task running them
        self._in_flight = 0  # batches handed to the writer's thread by their callers (`_now`)
        self._writes = 0
        self._checkpointer = checkpointer  # None for `:memory:`
        self._checkpointing: asyncio.Task[None] | None = None
        self._closed = False
        self._stemmer = _Stemmer()

    def row_count(self, table: str) -> str:
        # SQLite counts by scanning the table's smallest index: 4-5 ms for a million messages
        # (measured here), on the reader connection.
        return f"(SELECT count(*) FROM {table})"

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        with translated():
            self._check_open()
            self._check_file()
            return list(await self._reader.execute_fetchall(sql, params))

    def hits(self, pk: int, key: str, words: Sequence[str], before: int, limit: int) -> Step:
        """FTS5, ranked by BM25 (`bm25()` is lower-is-better: the score is its negation); the
        session and the positions before `before` are a range of the index's rowids (0009_recall)."""
        match = " OR ".join(f'"{key}_{word}"' for word in words if _WORD.fullmatch(word))
        low = pk << 32
        return ("SELECT rowid >> 32, rowid & 4294967295, -bm25(messages_fts) FROM messages_fts"
                " WHERE messages_fts MATCH ? AND rowid >= ? AND rowid < ? ORDER BY bm25(messages_fts) LIMIT ?",
                [match or '""', low, low + min(max(before, 0), 1 << 32), limit])

    async def stems(self, words: Sequence[str]) -> list[tuple[str, ...]]:
        return self._stemmer.stems(words)

    def postings(self, scope: Sequence[tuple[int, str, int]], words: Sequence[str]) -> Step:
        """FTS5 matches over the sessions' rowid ranges (0009_recall): each session's words are
        keyed, so a word's document list holds just those sessions' messages. One session (the
        default scope) aggregates each word's positions in a scalar subquery, which costs a third
        of grouping them."""
        indexed = [(i, word) for i, word in enumerate(words) if _WORD.fullmatch(word)]
        if not indexed:
            return "SELECT 0, 0, '' WHERE 0", []
        bounds = [(pk << 32, (pk << 32) + min(max(before, 0), 1 << 32)) for pk, _, before in scope]
        if len(scope) == 1:
            (pk, key, _), (low, high) = scope[0], bounds[0]
            return (" UNION ALL ".join(f"SELECT {i}, {pk}, (SELECT group_concat(r) FROM (SELECT rowid - {low} AS r"
                                       " FROM messages_fts WHERE messages_fts MATCH ? AND rowid >= ? AND rowid < ?"
                                       f" LIMIT {_READ_POSITIONS}))" for i, _ in indexed),
                    [v for _, word in indexed for v in (f'"{key}_{word}"', low, high)])
        ranges = " OR ".join(["(rowid >= ? AND rowid < ?)"] * len(scope))
        selects = [f"SELECT * FROM (SELECT {i} AS i, rowid >> 32 AS pk, rowid & 4294967295 AS seq FROM messages_fts"
                   f" WHERE messages_fts MATCH ? AND ({ranges}) LIMIT {_READ_POSITIONS})" for i, _ in indexed]
        params = [v for _, word in indexed
                  for v in (" OR ".join(f'"{key}_{word}"' for _, key, _ in scope), *(b for r in bounds for b in r))]
        return f"SELECT i, pk, group_concat(seq) FROM ({' UNION ALL '.join(selects)}) GROUP BY i, pk", params

    def _check_open(self) -> None:
        if self._closed:  # as sqlite3 says it, not as aiosqlite does (a ValueError)
            raise sqlite3.ProgrammingError("the store is closed")

    def _check_file(self) -> None:
        """The database file is still the one the connections opened. Deleted, or replaced (a backup
        moved over it), the connections go on with the old file, and a turn written there is gone
        at the next start: refused instead (a 503, `X-Memproxy-Stored: false`, `/readyz` not ready),
        until memproxy is restarted on the file now at the path. A stat, a few microseconds."""
        if self._path is not None and _identity(self._path) != self._file:
            raise sqlite3.OperationalError("the database file was deleted or replaced while memproxy ran")

    async def write(self, script: Script[T]) -> T:
        """A file locked past the busy timeout, a full disk, a read-only file: `StoreUnavailable`."""
        return cast(T, await self._queue(_Write(script, None, None)))

    async def write_batch(self, steps: Sequence[Step], accept: Callable[[list[Outcome]], T]) -> T:
        """Batches queued together share one transaction and one commit (`_commit_group`): under
        load, a turn's write waits for the writer once, not once per turn queued before it."""
        return cast(T, await self._queue(_Write(None, steps, accept)))

    async def _queue(self, write: _Write) -> Any:
        """Queue a write for the one task that runs them, and wait for its outcome. It runs to its
        commit or rollback even if the caller stops waiting (a client gone): a write is whole or
        absent, and the writer is never left inside a transaction."""
        with translated():
            self._check_open()
            self._check_file()
            if write.steps is not None and not self._queued and not self._write_lock.locked() \
                    and not self._in_flight:
                return await self._now(write)
            loop = asyncio.get_running_loop()
            write.done = loop.create_future()
            write.done.add_done_callback(_retrieved)
            self._queued.append(write)
            if self._draining is None or self._draining.done():
                self._draining = loop.create_task(self._drain())
            return await asyncio.shield(write.done)

    async def _now(self, write: _Write) -> Any:
        """A batch for an idle writer, handed to its thread from the caller's task: a task of its own
        would first wait for its turn on the event loop, behind whatever is ready before it (after
        an upstream answer: litellm's logging, half a millisecond measured here), while the writer's
        thread sat idle. The call runs whole on that thread even if the caller stops waiting; writes
        that come meanwhile queue behind it (`_in_flight`), on the thread as in `_queued`."""
        self._in_flight += 1
        try:
            [(result, error)] = await _on_thread(self._writer, _commit_batches, [write.batch()])
        finally:
            self._in_flight -= 1
            self._wrote(1)
        if error is not None:
            raise error
        return result

    async def _drain(self) -> None:
        """Run the queued writes in order: a script alone, the batches queued next to one another
        together."""
        while self._queued:
            first = self._queued[0]
            group = [first] if first.script is not None else list(
                itertools.takewhile(lambda w: w.script is None, self._queued))
            del self._queued[:len(group)]
            async with self._write_lock:
                try:
                    if first.script is not None:
                        _settle(first, await self._run_script(first.script), None)
                    else:
                        await self._commit_group(group)
                except Exception as exc:  # the caller's to handle; none is left unanswered
                    await self._writer.rollback()  # a no-op if nothing began (or a commit ended it)
                    for write in group:
                        _settle(write, None, exc)
            self._wrote(len(group))

    async def _run_script(self, script: Script[T]) -> T:
        """A script's first statement goes with the `BEGIN`, each next one when the last is answered."""
        begun = False

        async def fetch(sql: str, params: Sequence[Any]) -> list[Row]:
            nonlocal begun
            if begun:
                return list(await self._writer.execute_fetchall(sql, params))
            begun = True
            begin, rows = await self._send([("BEGIN IMMEDIATE", ()), (sql, params)])
            _rows(begin)
            return _rows(rows)

        result = await run_script_async(script, fetch)
        await self._writer.commit()
        return result

    async def _commit_group(self, group: list[_Write]) -> None:
        """Run the batches in one transaction and one trip, and commit them together if each accepts
        its outcomes (`_commit_batches`)."""
        batches = [write.batch() for write in group]
        for write, (result, error) in zip(group, await _on_thread(self._writer, _commit_batches, batches)):
            _settle(write, result, error)

    def _wrote(self, count: int) -> None:
        self._writes += count  # since the last checkpoint began; one may take as long as hundreds of writes
        if self._writes >= _CHECKPOINT_EVERY and self._checkpointer is not None and (
                self._checkpointing is None or self._checkpointing.done()):
            self._writes = 0
            self._checkpointing = asyncio.get_running_loop().create_task(self._checkpoint(self._checkpointer))

    async def _send(self, steps: Sequence[Step]) -> list[Outcome]:
        """Queue `steps` on the writer's thread all at once, in order (tasks start in the order they
        are made), and wait for all of them: one trip. Each answered with its rows or its error."""
        outcomes = await asyncio.gather(*(self._writer.execute_fetchall(sql, params) for sql, params in steps),
                                        return_exceptions=True)
        return [o if isinstance(o, BaseException) else list(o) for o in outcomes]

    async def _checkpoint(self, checkpointer: aiosqlite.Connection) -> None:
        """Copy the log into the database while writes go on; once it is long, empty it between two
        writes: under steady writes a checkpoint running beside them never finds the log copied to
        its very end, so the log would only grow. Writes wait for that second step alone, which has
        the few frames written since the first to copy."""
        try:
            [(_, frames, _)] = await checkpointer.execute_fetchall("PRAGMA wal_checkpoint(PASSIVE)")
            if frames >= _TRUNCATE_AT_FRAMES:
                async with self._write_lock:
                    await checkpoint_log(checkpointer)
        except sqlite3.Error as exc:  # the next one tries again
            log.warning("sqlite checkpoint failed: %s", type(exc).__name__)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._draining is not None:
            await asyncio.wait([self._draining])
        if self._checkpointing is not None:
            await self._checkpointing
        for conn in {id(c): c for c in (self._checkpointer, self._reader, self._writer) if c}.values():
            await conn.close()
        self._stemmer.close()


@dataclass
class _Write:
    """A write waiting for the writer: a script, or a batch with what accepts its outcomes."""

    script: Script[Any] | None
    steps: Sequence[Step] | None
    accept: Callable[[list[Outcome]], Any] | None
    done: asyncio.Future[Any] = field(init=False)

    def batch(self) -> Batch:
        assert self.steps is not None and self.accept is not None, "a script, not a batch"
        return self.steps, self.accept


Batch = tuple[Sequence[Step], Callable[[list[Outcome]], Any]]
Settled = tuple[Any, BaseException | None]  # a batch's result, or the error it gets


def _commit_batches(conn: sqlite3.Connection, batches: list[Batch]) -> list[Settled]:
    """On the writer's thread: run the batches in one transaction, `accept` each one's outcomes, and
    commit once all are accepted; nothing is committed before. A batch refused (its `accept` raises)
    gets its error, the transaction is rolled back and the others run again without it (one is
    refused at most rounds). A statement that fails ends its round there: SQLite may have rolled the
    whole transaction back (a full disk does), so the batches after it would run outside it; they
    are judged in the next round, but for a write lock not had (`_locked_out`): each round would
    wait the busy timeout again, so all get that error at once. A failed commit is rolled back, and
    each batch left gets its error."""
    settled: dict[int, Settled] = {}
    pending = list(range(len(batches)))
    try:
        while pending:
            results: list[tuple[int, Any]] = []
            unjudged: list[int] = []
            for n, i in enumerate(pending):
                steps, accept = batches[i]
                outcomes = _executed(conn, steps)
                try:
                    results.append((i, accept(outcomes)))
                except Exception as exc:  # the caller's to handle
                    settled[i] = (None, exc)
                    failure = outcomes[-1] if outcomes else None
                    if isinstance(failure, sqlite3.OperationalError) and _locked_out(failure):
                        # The write lock not had within the busy timeout: another round would wait
                        # as long again for each batch left. They all get the same answer now.
                        settled.update((j, (None, failure)) for j in pending[n + 1:])
                        conn.rollback()
                        return [settled[j] for j in range(len(batches))]
                    if outcomes and isinstance(outcomes[-1], BaseException):
                        unjudged = pending[n + 1:]
                        break
            if len(results) == len(pending):
                conn.commit()
                settled.update((i, (result, None)) for i, result in results)
                break
            conn.rollback()
            pending = [i for i, _ in results] + unjudged
    except Exception as exc:  # a failed commit (a full disk, an I/O error)
        conn.rollback()
        settled.update((i, (None, exc)) for i in pending if i not in settled)
    return [settled[i] for i in range(len(batches))]


def _identity(path: str) -> tuple[int, int] | None:
    """Which file is at `path` (device and inode); None where there is none."""
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return None
    return found.st_dev, found.st_ino


def _locked_out(error: sqlite3.OperationalError) -> bool:
    """Whether a statement failed for want of the write lock (another process held it past the
    busy timeout)."""
    return getattr(error, "sqlite_errorcode", None) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


def _executed(conn: sqlite3.Connection, steps: Sequence[Step]) -> list[Outcome]:
    """Each step's rows, up to the first that fails: it and every step after it carry its error."""
    outcomes: list[Outcome] = []
    for sql, params in steps:
        try:
            outcomes.append(conn.execute(sql, params).fetchall())
        except Exception as exc:  # the batch's `accept` sees it
            return outcomes + [exc] * (len(steps) - len(outcomes))
    return outcomes


async def _on_thread(conn: aiosqlite.Connection, function: Callable[..., T], *args: Any) -> T:
    """`function(connection, *args)` on `conn`'s own thread, after the calls queued before it, with
    the `sqlite3` connection. aiosqlite has no public call for it; its own methods each do exactly
    this (`_execute`), one statement a trip."""
    return cast(T, await conn._execute(function, conn._conn, *args))  # type: ignore[no-untyped-call]


def _settle(write: _Write, result: Any, error: BaseException | None) -> None:
    if write.done.done():
        return
    if error is not None:
        write.done.set_exception(error)
    else:
        write.done.set_result(result)


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()  # a caller that stopped waiting has no use for it


def _rows(outcome: Outcome) -> list[Row]:
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


class SQLiteStore(SQLStore):
    @classmethod
    async def open(cls, url: str, busy_timeout_ms: int = 5000,
                   history_cache_bytes: int = DEFAULT_HISTORY_CACHE_BYTES,
                   recall_cache_bytes: int = DEFAULT_RECALL_CACHE_BYTES) -> SQLiteStore:
        path = sqlite_path(url)
        if path == ":memory:":
            conn = await _connect(path, busy_timeout_ms)
            backend = SQLiteBackend(conn, conn)
        else:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            _create_private(path)
            # The writer opens the file first, in WAL mode; it never checkpoints on commit.
            async with AsyncExitStack() as opening:  # until all three are open, a failure closes the others
                writer = await _connect(path, busy_timeout_ms, "wal_autocheckpoint = 0", wal=True)
                opening.push_async_callback(writer.close)
                reader = await _connect(path, busy_timeout_ms)
                opening.push_async_callback(reader.close)
                checkpointer = await _connect(path, 0)
                opening.pop_all()
            backend = SQLiteBackend(writer, reader, checkpointer, path)
        # Whatever stops the opening (a failure, a stop signal's cancel while migrating) closes what
        # opened: each connection's thread would otherwise keep the process alive.
        try:
            await _migrate(backend)
        except BaseException:
            await backend.close()
            raise
        return cls(backend, history_cache_bytes, recall_cache_bytes)


async def _migrate(backend: SQLiteBackend) -> None:
    """Apply the numbered migrations not yet recorded, each in its own write transaction, so two
    processes starting on one file at once apply each migration exactly once."""
    await backend.write(_statements(
        ["CREATE TABLE IF NOT EXISTS schema_migrations (id TEXT PRIMARY KEY, applied_at REAL NOT NULL)"]))
    newer = newer_than_known({str(r[0]) for r in await backend.fetch("SELECT id FROM schema_migrations")}, "sqlite")
    if newer is not None:
        raise ConfigError("storage.url", newer)
    for migration_id, sql in migrations():
        await backend.write(_migration(migration_id, sql))


def _migration(migration_id: str, sql: str) -> Script[None]:
    if (yield "SELECT 1 FROM schema_migrations WHERE id = ?", (migration_id,)):
        return
    yield from _statements(statements(sql))
    if fills_recall(migration_id):
        # The columns `0009_recall` as first released lacked (SQLite has no ADD COLUMN IF NOT EXISTS).
        columns = {str(row[1]) for row in (yield "PRAGMA table_info(messages)", ())}
        yield from _statements([f"ALTER TABLE messages ADD COLUMN {name} {kind}" for name, kind in
                                (("recall_text", "TEXT"), ("recall_tokens", "INTEGER")) if name not in columns])
        yield from backfill_recall(fts=True)
    yield "INSERT INTO schema_migrations (id, applied_at) VALUES (?, strftime('%s','now'))", (migration_id,)


def _statements(sqls: list[str]) -> Script[None]:
    for sql in sqls:
        yield sql, ()
