"""The shared store for many replicas: PostgreSQL through an asyncpg connection pool.

The SQL is the one SQLite runs (`memproxy.store.sql`); `?` placeholders become `$1, $2, ...` once per
statement text, by a scanner that leaves a `?` in a quoted literal, a quoted name or a comment
alone. Writes that must not interleave lock the session's row (`SELECT ... FOR UPDATE`), so two
replicas recording turns on one session are serialised by the database, and a turn planned against a
history that moved meanwhile goes after it (a continuation) or is refused (an edit).
Migrations run at start (and by `memproxy migrate`) under a transaction-scoped advisory lock, so
replicas starting together apply each one exactly once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any, TypeVar

import asyncpg

from .errors import translated
from .history_cache import DEFAULT_HISTORY_CACHE_BYTES
from .recall_index import DEFAULT_RECALL_CACHE_BYTES
from .migrations import BACKFILL_SEARCH, migrations, statements
from .sql import Outcome, Row, Script, SQLStore, Step, backfill_search, run_script_async


T = TypeVar("T")


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

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        with translated():
            return [tuple(r) for r in await self._pool.fetch(numbered(sql), *params)]


    async def write(self, script: Script[T]) -> T:
        # A connection the server dropped (a restart, a cut network) fails its next statement here;
        # the pool replaces it on the next acquire, so the store recovers once the server is back.
        with translated():
            async with self._pool.acquire() as conn, conn.transaction():
                async def fetch(sql: str, params: Sequence[Any]) -> list[Row]:
                    return [tuple(r) for r in await conn.fetch(numbered(sql), *params)]

                return await run_script_async(script, fetch)

    async def write_batch(self, steps: Sequence[Step], accept: Callable[[list[Outcome]], T]) -> T:
        with translated():
            async with self._pool.acquire() as conn, conn.transaction():
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
        cls, url: str, min_size: int = 1, max_size: int = 10, schema: str | None = None,
        history_cache_bytes: int = DEFAULT_HISTORY_CACHE_BYTES, recall_cache_bytes: int = DEFAULT_RECALL_CACHE_BYTES,
    ) -> PostgresStore:
        if schema:
            await _create_schema(url, schema)
        settings = {"search_path": f'"{schema}"'} if schema else None  # quoted: as created, case kept
        pool = await asyncpg.create_pool(url, min_size=min_size, max_size=max_size, server_settings=settings)
        assert pool is not None
        try:
            await _migrate(pool)
        except BaseException:  # a failure, or a stop signal's cancel: the connections go at once
            pool.terminate()
            raise
        return cls(PostgresBackend(pool), history_cache_bytes, recall_cache_bytes)


async def _create_schema(url: str, schema: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        async with conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext($1))", f"memproxy-schema:{schema}")
            await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
    finally:
        await conn.close()


async def _migrate(pool: asyncpg.Pool) -> None:
    """All pending migrations in one transaction, under an advisory lock: a replica starting while
    another migrates waits, then finds nothing left to do."""
    async with pool.acquire() as conn:
        async with conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext('memproxy-migrate:' || current_schema()))")
            await conn.execute("CREATE TABLE IF NOT EXISTS schema_migrations"
                               " (id TEXT PRIMARY KEY, applied_at DOUBLE PRECISION NOT NULL)")
            applied = {r[0] for r in await conn.fetch("SELECT id FROM schema_migrations")}
            for migration_id, sql in migrations("postgres"):
                if migration_id in applied:
                    continue
                for statement in statements(sql):
                    await conn.execute(statement)
                if migration_id == BACKFILL_SEARCH:
                    async def fetch(sql: str, params: Sequence[Any]) -> list[Row]:
                        return [tuple(r) for r in await conn.fetch(numbered(sql), *params)]

                    await run_script_async(backfill_search(fts=False), fetch)
                await conn.execute("INSERT INTO schema_migrations (id, applied_at)"
                                   " VALUES ($1, extract(epoch from now()))", migration_id)
