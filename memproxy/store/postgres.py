"""The shared store for many replicas: PostgreSQL through an asyncpg connection pool.

The SQL is the one SQLite runs (`memproxy.store.sql`); `?` placeholders become `$1, $2, ...` once per
statement text, by a scanner that leaves a `?` in a quoted literal, a quoted name or a comment
alone. Writes that must not interleave lock the session's row (`SELECT ... FOR UPDATE`), so two
replicas recording turns on one session are serialised by the database, and a turn planned against a
history that moved meanwhile goes after it (a continuation) or is refused (an edit).
Migrations run at start (and by `memproxy migrate`) under a transaction-scoped advisory lock, so
replicas starting together apply each one exactly once.

Every wait on the server is bounded (`storage.*_timeout_ms`), so a stalled server or a row another
client keeps locked fails a request with `StoreUnavailable` instead of holding it, and a pool
connection, forever; the server itself ends a write transaction a frozen replica left open, freeing
its locks. A transaction that committed stands: giving its connection back is apart from it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from functools import lru_cache
from typing import Any, TypeVar

import asyncpg

from ..config import ConfigError, StorageConfig
from .errors import translated
from .history_cache import DEFAULT_HISTORY_CACHE_BYTES
from .recall_index import DEFAULT_RECALL_CACHE_BYTES
from .migrations import fills_recall, migrations, newer_than_known, statements
from .sql import Outcome, Row, Script, SQLStore, Step, backfill_recall, run_script_async


T = TypeVar("T")
log = logging.getLogger("memproxy")


@lru_cache(maxsize=1024)
def numbered(sql: str) -> str:
    """`?` placeholders as PostgreSQL's `$1, $2, ...`. A `?` inside a quoted literal ('...', with
    `''` for a quote), a quoted name ("..."), or a comment (`--` to the line's end, `/* */`) is
    text, not a placeholder, and is left as it is."""
    out: list[str] = []
    i, n, count = 0, len(sql), 0
    while i < n:
        c = sql[i]
        if c == "?":
            count += 1
            out.append(f"${count}")
            i += 1
            continue
        if c in "'\"":
            end = sql.find(c, i + 1)
            while end != -1 and end + 1 < n and sql[end + 1] == c:  # a doubled quote is one quote
                end = sql.find(c, end + 2)
            end = n if end == -1 else end + 1
        elif sql.startswith("--", i):
            end = sql.find("\n", i)
            end = n if end == -1 else end
        elif sql.startswith("/*", i):
            end = sql.find("*/", i + 2)
            end = n if end == -1 else end + 2
        else:  # plain text up to the next character that may start something
            end = i + 1
            while end < n and sql[end] not in "?'\"-/":
                end += 1
        out.append(sql[i:end])
        i = end
    return "".join(out)


COUNT_BOUND = 100_000  # rows `row_count` counts one by one before it trusts the planner's estimate


class PostgresBackend:
    row_lock = " FOR UPDATE"
    # Until autovacuum's first ANALYZE (up to a minute after a bulk copy) the planner has no
    # statistics, and a long session's reads filter all its messages instead of taking the range
    # they need (docs/storage.md measures it).
    analyze: str | None = "ANALYZE sessions, turns, messages, summaries, tenant_usage, endpoint_usage"

    def row_count(self, table: str) -> str:
        """Exact up to `COUNT_BOUND` rows; past it the planner's estimate (`pg_class.reltuples`, kept
        by autovacuum and ANALYZE), never less than the bound: a full count visits every row
        (MVCC), which grows with the table, where this reads at most the bound."""
        return (f"(SELECT CASE WHEN n <= {COUNT_BOUND} THEN n ELSE greatest(n, (SELECT reltuples::bigint"
                f" FROM pg_class WHERE oid = to_regclass('{table}'))) END"
                f" FROM (SELECT count(*) AS n FROM (SELECT 1 FROM {table} LIMIT {COUNT_BOUND + 1}) b) c)")

    def __init__(self, pool: asyncpg.Pool, acquire_timeout: float | None = None, begin: str = "BEGIN",
                 write_acquire_timeout: float | None = None) -> None:
        """`acquire_timeout`: the longest a read waits for a connection of the pool (None: no limit);
        `write_acquire_timeout` a write's (default: the same); each statement's limit is the pool's
        `command_timeout`. `begin`: what opens a write transaction (`_begin`)."""
        self._pool = pool
        self._acquire_timeout = acquire_timeout
        self._write_acquire_timeout = write_acquire_timeout if write_acquire_timeout is not None else acquire_timeout
        self._begin = begin

    @asynccontextmanager
    async def _connection(self, acquire_timeout: float | None = None) -> AsyncIterator[asyncpg.pool.PoolConnectionProxy]:
        """A connection of the pool, given back apart from what was done on it: the release runs
        asyncpg's reset query, which fails on a connection the server dropped right after a COMMIT,
        and that must not fail a write that committed (asyncpg terminates such a connection, and the
        pool opens a new one). A connection the server dropped (a restart, a cut network) fails its
        next statement; the pool replaces it too, so the store recovers once the server is back."""
        conn = await self._pool.acquire(timeout=acquire_timeout if acquire_timeout is not None else self._acquire_timeout)
        try:
            yield conn
        except asyncio.TimeoutError:
            # asyncpg stopped waiting for a statement: a server that stalled would not answer the
            # rollback, cancel or reset either. Dropped, the connection's transaction rolls back.
            conn.terminate()
            raise
        finally:
            try:
                await self._pool.release(conn)
            except Exception as exc:  # what was done on it stands; asyncpg has terminated it
                log.warning("a store connection failed as it went back to the pool (%s); it is replaced",
                            type(exc).__name__)

    @asynccontextmanager
    async def _transaction(self) -> AsyncIterator[asyncpg.pool.PoolConnectionProxy]:
        """A connection in a transaction: committed when the block ends, rolled back if it raises
        (but on a timeout, where `_connection` drops the connection instead). A write waits longer
        for a connection than a read: most are the record of a turn whose answer is paid for, while
        a read starts a request that may as well be refused (a 503) while the pool is busy."""
        async with self._connection(self._write_acquire_timeout) as conn:
            await conn.execute(self._begin)
            try:
                yield conn
            except asyncio.TimeoutError:
                raise
            except BaseException:
                await conn.execute("ROLLBACK")
                raise
            await conn.execute("COMMIT")

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        with translated():
            async with self._connection() as conn:
                return [tuple(r) for r in await conn.fetch(numbered(sql), *params)]

    async def write(self, script: Script[T]) -> T:
        with translated():
            async with self._transaction() as conn:
                async def fetch(sql: str, params: Sequence[Any]) -> list[Row]:
                    return [tuple(r) for r in await conn.fetch(numbered(sql), *params)]

                return await run_script_async(script, fetch)

    async def write_batch(self, steps: Sequence[Step], accept: Callable[[list[Outcome]], T]) -> T:
        with translated():
            async with self._transaction() as conn:
                outcomes: list[Outcome] = []
                for sql, params in steps:
                    try:
                        outcomes.append([tuple(r) for r in await conn.fetch(numbered(sql), *params)])
                    except asyncpg.PostgresError as exc:  # the transaction is aborted: nothing more runs
                        outcomes += [exc] * (len(steps) - len(outcomes))
                        break
                return accept(outcomes)

    def hits(self, pk: int, key: str, words: Sequence[str], before: int, limit: int) -> Step:
        """The tsvector of active messages (0009_recall): the words stemmed as the index's were,
        keyed, OR'd into a tsquery, ranked by `ts_rank` (the number of matched words: no document
        frequencies, so rarer words do not count for more, as they do in SQLite's BM25)."""
        query = ("(SELECT string_agg(DISTINCT quote_literal(CAST(? AS TEXT) || '_' || l), ' | ')::tsquery"
                 " FROM unnest(CAST(? AS TEXT[])) AS w,"
                 " LATERAL unnest(coalesce(ts_lexize('english_stem', w), CAST('{}' AS TEXT[]))) AS l)")
        # The query is an uncorrelated subquery, computed once, so the GIN index can take it.
        return (f"SELECT m.session_pk, m.seq, ts_rank(m.search, {query}) FROM messages m"
                f" WHERE m.session_pk = ? AND m.active = 1 AND m.seq < ? AND m.search @@ {query}"
                " ORDER BY 3 DESC LIMIT ?", [key, list(words), pk, min(before, 2_147_483_647), key, list(words), limit])

    async def stems(self, words: Sequence[str]) -> list[tuple[str, ...]]:
        """The english stemmer's lexemes, as the search vector holds them (0009_recall)."""
        rows = await self.fetch("SELECT ts_lexize('english_stem', w) FROM unnest(CAST(? AS TEXT[]))"
                                " WITH ORDINALITY AS u (w, i) ORDER BY i", [list(words)])
        return [tuple(r[0] or ()) for r in rows]

    def postings(self, scope: Sequence[tuple[int, str, int]], words: Sequence[str]) -> Step:
        """Each word stemmed as the index's words were and keyed by each session, one GIN lookup of
        active messages a word (0009_recall). The query is an uncorrelated subquery, computed once,
        so that the index can take it. No LIMIT: under one the planner leaves the GIN index for a
        scan of the session's messages, and a GIN bitmap is built whole anyway; a word too common
        to rank by is dropped after the read (`COMMON_WORD_POSITIONS`)."""
        selects: list[str] = []
        params: list[object] = []
        keys = [key for _, key, _ in scope]
        pks = [pk for pk, _, _ in scope]
        limits = [min(max(before, 0), 2_147_483_647) for _, _, before in scope]
        for i, word in enumerate(words):
            selects.append(
                f"SELECT {i}, m.session_pk, array_agg(m.seq ORDER BY m.seq) FROM messages m"
                " WHERE m.search @@ (SELECT string_agg(quote_literal(k || '_' || l), ' | ')::tsquery"
                " FROM unnest(CAST(? AS TEXT[])) AS k,"
                " unnest(coalesce(ts_lexize('english_stem', CAST(? AS TEXT)), CAST('{}' AS TEXT[]))) AS l)"
                " AND m.active = 1 AND m.seq < (SELECT b FROM unnest(CAST(? AS BIGINT[]), CAST(? AS INTEGER[]))"
                " AS s (pk, b) WHERE s.pk = m.session_pk) GROUP BY m.session_pk")
            params += [keys, word, pks, limits]
        if not selects:
            return "SELECT 0, 0, CAST('{}' AS INTEGER[]) WHERE false", []
        return " UNION ALL ".join(selects), params

    async def close(self) -> None:
        await self._pool.close()


class PostgresStore(SQLStore):
    @classmethod
    async def open(
        cls, storage: StorageConfig, history_cache_bytes: int = DEFAULT_HISTORY_CACHE_BYTES,
        recall_cache_bytes: int = DEFAULT_RECALL_CACHE_BYTES,
    ) -> PostgresStore:
        if storage.schema:
            await _create_schema(storage.url, storage.schema)
        search_path = {"search_path": f'"{storage.schema}"'} if storage.schema else {}  # quoted: as created
        await _migrate(storage.url, search_path)
        pool = await asyncpg.create_pool(
            storage.url, min_size=storage.pool_min_size, max_size=storage.pool_max_size,
            command_timeout=_seconds(storage.statement_timeout_ms), server_settings=search_path)
        assert pool is not None
        # A write waits for a connection as long as a statement may take, at least as long as a read.
        writes = None if not storage.pool_timeout_ms or not storage.statement_timeout_ms \
            else max(storage.pool_timeout_ms, storage.statement_timeout_ms) / 1000
        backend = PostgresBackend(pool, _seconds(storage.pool_timeout_ms), _begin(storage), writes)
        return cls(backend, history_cache_bytes, recall_cache_bytes)


def _begin(storage: StorageConfig) -> str:
    """BEGIN, with the server's own limits for the transaction: the server then frees what a replica
    that froze or lost its network holds (its statement is cancelled, its lock wait ends, and a
    transaction it left idle is ended with its connection, releasing its locks). `SET LOCAL`, sent
    with the BEGIN in one round trip, ends with the transaction: nothing carries over on a pooler's
    shared server connections (PgBouncer in transaction mode, which also refuses such settings as
    startup parameters). A limit of 0 sets nothing: the server's own default applies."""
    limits = {"statement_timeout": storage.statement_timeout_ms, "lock_timeout": storage.lock_timeout_ms,
              "idle_in_transaction_session_timeout": storage.idle_in_transaction_timeout_ms}
    return "; ".join(["BEGIN", *(f"SET LOCAL {name} = {ms}" for name, ms in limits.items() if ms)])


def _seconds(ms: int) -> float | None:
    return ms / 1000 if ms else None


# Whether this role may create tables in the schema (NULL: there is none), and may create one.
_SCHEMA = ("SELECT (SELECT has_schema_privilege(oid, 'USAGE') AND has_schema_privilege(oid, 'CREATE')"
           " FROM pg_namespace WHERE nspname = $1), has_database_privilege(current_database(), 'CREATE')")


async def schema_exists(conn: asyncpg.Connection, schema: str) -> bool:
    """Whether `schema` exists, looked up without creating anything. Refused (`ConfigError`) where
    this role could not have memproxy's tables there: a missing schema it may not create (that
    needs CREATE on the database), or one it may not create tables in (USAGE and CREATE on it:
    migrations create theirs)."""
    usable, may_create = await conn.fetchrow(_SCHEMA, schema)
    if usable is None and not may_create:
        raise ConfigError("storage.schema", f'the schema "{schema}" does not exist, and this role may not create'
                          f' it (that needs CREATE on the database): create it first, e.g. CREATE SCHEMA'
                          f' "{schema}" AUTHORIZATION <the role memproxy uses>')
    if usable is False:
        raise ConfigError("storage.schema", f'this role may not create tables in the schema "{schema}" (that'
                          " needs USAGE and CREATE on it): memproxy creates and migrates its tables there")
    return usable is not None


async def _create_schema(url: str, schema: str) -> None:
    """The schema, created if missing. Looked up first: PostgreSQL checks `CREATE SCHEMA IF NOT
    EXISTS` against the database's CREATE privilege before it looks, and a role given a schema of
    its own (and nothing else) has none."""
    conn = await asyncpg.connect(url)
    try:
        if await schema_exists(conn, schema):
            return
        async with conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext($1))", f"memproxy-schema:{schema}")
            await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
    finally:
        await conn.close()


async def _migrate(url: str, search_path: dict[str, str]) -> None:
    """All pending migrations in one transaction, under an advisory lock: a replica starting while
    another migrates waits, then finds nothing left to do. On a connection of their own, without
    the pool's limits: a migration may rewrite a big table, and the wait for another replica's
    migration is as long as that takes."""
    conn = await asyncpg.connect(url, server_settings=search_path)
    try:
        async with conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext('memproxy-migrate:' || current_schema()))")
            await conn.execute("CREATE TABLE IF NOT EXISTS schema_migrations"
                               " (id TEXT PRIMARY KEY, applied_at DOUBLE PRECISION NOT NULL)")
            applied = {r[0] for r in await conn.fetch("SELECT id FROM schema_migrations")}
            newer = newer_than_known(applied, "postgres")
            if newer is not None:
                raise ConfigError("storage.url", newer)

            async def fetch(sql: str, params: Sequence[Any]) -> list[Row]:
                return [tuple(r) for r in await conn.fetch(numbered(sql), *params)]

            for migration_id, sql in migrations("postgres"):
                if migration_id in applied:
                    continue
                for statement in statements(sql):
                    await conn.execute(statement)
                if fills_recall(migration_id):
                    await run_script_async(backfill_recall(fts=False), fetch)
                await conn.execute("INSERT INTO schema_migrations (id, applied_at)"
                                   " VALUES ($1, extract(epoch from now()))", migration_id)
    except BaseException:  # a failure, or a stop signal's cancel: the connection goes at once
        conn.terminate()
        raise
    await conn.close()
