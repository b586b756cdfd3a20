"""What only the PostgreSQL store needs checking: its query plans, the `migrate` and `migrate-store`
commands as a user runs them, and that its migrations ship with the package.

The behaviour both stores share is checked on both by `test_store_contract.py` and by the end-to-end
modules marked `both_stores`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from helpers import assistant, tool, user
from memproxy.config import StorageConfig
from memproxy.messages import ROOT_HASH, Message, chain_hashes
from memproxy.store import EndpointUsage, NewResponse, SQLiteStore, Store, Summary, SummaryCall, Usage, open_store
from memproxy.store.errors import StoreUnavailable
from memproxy.store.postgres import PostgresBackend, numbered
from memproxy.store.sql import QUERIES
from memproxy.store.migrations import migrations
from stores import POSTGRES_URL, StoreUnderTest, require_postgres, store_under_test
from test_cli import run_cli
from test_store_contract import turn

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
async def postgres(tmp_path: Path) -> AsyncIterator[StoreUnderTest]:
    under_test = await store_under_test("postgres", tmp_path)
    yield under_test
    await under_test.drop()


async def conversation(store: Store, tenant: str, session_id: str, turns: int) -> None:
    """`turns` user/assistant turns, the second of each few with a tool call and its result."""
    for i in range(turns):
        session = await store.get_session(tenant, session_id)
        messages: list[Message] = [user(f"{session_id} q{i}")]
        if i % 3 == 1:
            messages += [assistant(None, [f"c{i}"]), tool(f"c{i}", f"result {i}")]
        messages.append(assistant(f"{session_id} a{i}"))
        # Each turn as a kept Responses API answer too, so that table is populated like the rest.
        kept = NewResponse(f"resp_{session_id}_{i}", {"id": f"resp_{session_id}_{i}"}, [])
        await store.record_turn(dataclasses.replace(turn(session, messages, tenant=tenant, session_id=session_id),
                                                    response=kept))


async def test_a_schema_named_with_capitals_is_the_one_used(tmp_path: Path) -> None:
    """`storage.schema` allows capitals; the schema is created quoted, so it must be searched quoted."""
    under_test = await store_under_test("postgres", tmp_path)
    under_test = dataclasses.replace(under_test, storage=dataclasses.replace(
        under_test.storage, schema="Mixed_" + (under_test.storage.schema or "")))
    try:
        store = await under_test.open()
        try:
            await store.record_turn(turn(None, [user("hi"), assistant("hello")]))
        finally:
            await store.close()
        tables = await under_test.query(
            "SELECT count(*) FROM pg_tables WHERE schemaname = ? AND tablename = 'messages'",
            under_test.storage.schema)
        assert tables == [(1,)]
        assert await under_test.query("SELECT count(*) FROM messages") == [(2,)]
    finally:
        await under_test.drop()


# --- the queries that serve a turn use indexes -----------------------------------------------------

# For each query in `QUERIES`: parameters (session 1 of the populated schema, `hashes` its first
# chained hashes) and the index its plan must use. A query added there must be added here.
def plans_expected(hashes: list[str]) -> dict[str, tuple[tuple[Any, ...], str]]:
    return {
        "get_session": (("t", "s1"), "sessions_tenant_session_id_key"),
        "matched_prefix": ((1, *hashes[:3]), "messages_active_hash"),
        "totals_at": ((1, 40), "messages_active_seq"),
        "user_positions": ((1, 40, 3), "messages_active_user"),
        "snapshot_marks": ((1, 40, 1, 40, 1, 300, 1, 300), "messages_fit_compact"),
        "active_range": ((1, 30, 50), "messages_active_seq"),
        "current_summary": ((1, 60), "summaries_session_pk_version_key"),
        "snapshot_summary": ((1, 60), "summaries_session_pk_version_key"),
        "head": ((300, 300, 300, 1.0, 40, 1, "t", "s1", 300, 300, 1.0, 30, 1, 40, 40, 30), "messages_fit_compact"),
        "newest_chat_turn": (("t", "s1"), "turns_session"),
        "message_id": (("t", "s1", 40), "messages_active_seq"),
        "chain_hash_at": ((1, 40), "messages_active_seq"),
        "supersede": (("t", "s1", 50), "messages_active_seq"),
        "kept_answers": ((1,), "responses_session"),
        "get_response": (("t", "resp_s1_3"), "responses_pkey"),
        "get_response_output": (("t", "resp_s1_3"), "responses_pkey"),
    }


def unbounded_scans(plan: list[str]) -> list[str]:
    """Plan nodes that read more than one session's rows: a Seq Scan, or an index scan whose index
    condition does not pin the session (`session_pk = ...`, or `tenant = ...` on `sessions`) or one
    row by its primary key (`id = ...`: the history cache's check of its newest message; `pk = ...`: a
    kept response's session)."""
    found = []
    for i, line in enumerate(plan):
        if "Seq Scan" in line:
            found.append(line.strip())
        elif "Index" in line and "Scan" in line and " on " in line:
            details = []
            for following in plan[i + 1:]:
                if "->" in following:
                    break
                details.append(following)
            if not any("Index Cond" in d and ("(session_pk = " in d or "(tenant = " in d or "(id = " in d
                                              or "(pk = " in d)
                       for d in details):
                found.append(line.strip())
    return found


async def test_queries_that_serve_a_turn_use_indexes_on_postgres(postgres: StoreUnderTest) -> None:
    """With sequential scans priced out, every query finds its rows through the index made for it,
    bounded by the session: serving a turn never reads a session's whole history. The plans, as
    `EXPLAIN` shows them, are in the assertion messages."""
    store = await postgres.open()
    try:
        for s in range(1, 9):
            await conversation(store, "t", f"s{s}", 25)
        for s in range(2, 9):  # summaries of other sessions, as a store holds: not this session's to read
            other = await store.get_session("t", f"s{s}")
            assert other is not None
            for version in range(3):
                [end] = await store.active_range(other, 2 * version + 1, 2 * version + 2)
                await store.save_summary(other, version, Summary(version=0, text="o", covers=end.seq + 1,
                                                                  covers_hash=end.chain_hash, tokens=5,
                                                                  replaced_tokens=20, model="small"))
        session = await store.get_session("t", "s1")
        assert session is not None and session.pk == 1
        [first] = await store.active_range(session, 1, 2)
        await store.save_summary(session, 0, Summary(version=0, text="s", covers=2, covers_hash=first.chain_hash,
                                                     tokens=5, replaced_tokens=20, model="small"))
        hashes = [m.chain_hash for m in await store.active_range(session, 0, 3)]
    finally:
        await store.close()
    expected = plans_expected(hashes)
    assert set(expected) == set(QUERIES), "a query in QUERIES is not listed here: its plan is not checked"
    await postgres.query("ANALYZE")
    conn = await _connect(postgres)
    try:
        await conn.execute("SET enable_seqscan = off")
        for name, sql in QUERIES.items():
            params, index = expected[name]
            plan = [r[0] for r in await conn.fetch("EXPLAIN " + numbered(sql.format(marks="?,?,?")), *params)]
            shown = "\n".join(plan)
            assert unbounded_scans(plan) == [], f"{name}:\n{shown}"
            assert re.search(rf"(using|Bitmap Index Scan on) {index} ", shown), f"{name} does not use {index}:\n{shown}"
    finally:
        await conn.close()


@pytest.mark.parametrize("plan_mode", ["custom", "generic"])
async def test_a_turn_on_a_long_cached_session_reads_only_what_is_new(postgres: StoreUnderTest, plan_mode: str) -> None:
    """`load` on a session of 1,200 messages whose history the cache holds: the statement that checks
    the cache and reads the rest touches a handful of rows, not the session's every message (the
    bounds of each message range are worked out once, before the range is read; a plan that
    filters every message of the session by them grows with the conversation). So with either plan
    PostgreSQL makes: one for the statement's parameters, or the generic one that a connection's
    prepared statement (asyncpg prepares every statement) switches to after five runs."""
    store = await postgres.open()
    try:
        await conversation(store, "t", "long", 450)  # 1,200 messages: a tool exchange every third turn
        session = await store.get_session("t", "long")
        assert session is not None and session.length == 1200
    finally:
        await store.close()
    await postgres.query("ANALYZE")
    [(last_id,)] = await postgres.query(
        "SELECT id FROM messages WHERE session_pk = ? AND active = 1 AND seq = ?", session.pk, session.length - 1)
    room, held = 1_000_000, (session.incarnation, session.length - 1, last_id)  # everything fits; all cached
    params = (room, room, room, *held, "t", "long", room, room, -1, -1, -1, *held[1:2], *held[1:2], 0)
    conn = await _connect(postgres)
    try:
        await conn.execute(f"SET plan_cache_mode = force_{plan_mode}_plan")
        answer = await conn.fetch(numbered(QUERIES["head"]), *params)
        await conn.execute(f"PREPARE head AS {numbered(QUERIES['head'])}")
        values = ", ".join(f"'{v}'" if isinstance(v, str) else repr(v) for v in params)
        plan = [r[0] for r in await conn.fetch(f"EXPLAIN (ANALYZE) EXECUTE head ({values})")]
    finally:
        await conn.close()
    shown = "\n".join(plan)
    assert [row[0] for row in answer] == [0], shown  # the session's row alone: every message is cached
    read = [int(rows) * int(loops) for rows, loops in re.findall(r" on messages .*rows=(\d+) loops=(\d+)", shown)]
    assert sum(read) <= 8, shown  # single-row lookups: the newest message, the marks, the cache's check
    removed = [int(n) for n in re.findall(r"Rows Removed by Filter: (\d+)", shown)]
    assert sum(removed) <= 2, shown
    assert all(int(loops) == 1 for loops in re.findall(r"loops=(\d+)", shown)), shown


async def _connect(under_test: StoreUnderTest) -> asyncpg.Connection:
    return await asyncpg.connect(POSTGRES_URL, server_settings={"search_path": under_test.storage.schema or ""})


# --- memproxy migrate ----------------------------------------------------------------------------


async def test_migrate_command_applies_every_migration_to_a_fresh_schema(
    postgres: StoreUnderTest, tmp_path: Path
) -> None:
    config = tmp_path / "memproxy.yaml"
    config.write_text(f'storage:\n  url: "{POSTGRES_URL}"\n  schema: {postgres.storage.schema}\n', encoding="utf-8")
    for _ in range(2):  # the second run finds nothing left to do
        result = run_cli("migrate", "-c", str(config))
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == f"{POSTGRES_URL}: migrated"
    ids = [row[0] for row in await postgres.query("SELECT id FROM schema_migrations ORDER BY id")]
    assert ids == [migration_id for migration_id, _ in migrations("postgres")]
    assert await postgres.query("SELECT count(*) FROM sessions") == [(0,)]


async def test_a_role_that_may_not_create_schemas_uses_the_one_made_for_it(tmp_path: Path) -> None:
    """`storage.schema` with a least-privilege role: no CREATE on the database, a schema of its own.
    The store opens in it (PostgreSQL checks `CREATE SCHEMA IF NOT EXISTS` against the database's
    privilege before it looks, so the schema is looked up first); a schema it could not create, or
    may not create tables in, is one line naming the key from every command, and nothing is made."""
    name = f"t_{uuid.uuid4().hex[:16]}"
    role, own, missing, foreign = f"{name}_role", f"{name}_own", f"{name}_missing", f"{name}_foreign"
    admin = await asyncpg.connect(POSTGRES_URL)
    try:
        await admin.execute(f'CREATE ROLE "{role}" LOGIN')
        assert not await admin.fetchval("SELECT has_database_privilege($1, current_database(), 'CREATE')", role)
        await admin.execute(f'CREATE SCHEMA "{own}" AUTHORIZATION "{role}"')
        await admin.execute(f'CREATE SCHEMA "{foreign}"')
        await admin.execute(f'GRANT USAGE ON SCHEMA "{foreign}" TO "{role}"')
        as_role = re.sub(r"//[^@/]*@|//", f"//{role}@", POSTGRES_URL, count=1)
        store = await open_store(StorageConfig(url=as_role, schema=own))
        try:
            await store.record_turn(turn(None, [user("hi"), assistant("hello")]))
        finally:
            await store.close()
        assert await admin.fetchval(f'SELECT count(*) FROM "{own}".messages') == 2

        config = tmp_path / "memproxy.yaml"
        for schema, why in [
            (missing, f'the schema "{missing}" does not exist, and this role may not create it (that needs CREATE'
                      f' on the database): create it first, e.g. CREATE SCHEMA "{missing}" AUTHORIZATION'
                      " <the role memproxy uses>"),
            (foreign, f'this role may not create tables in the schema "{foreign}" (that needs USAGE and CREATE on'
                      " it): memproxy creates and migrates its tables there"),
        ]:
            config.write_text(f'storage:\n  url: "{as_role}"\n  schema: {schema}\n', encoding="utf-8")
            for command in (["check-config"], ["migrate"], ["serve", "--port", "0"]):
                result = run_cli(*command, "-c", str(config))
                assert (result.returncode, result.stderr) == (
                    2, f"memproxy: config error: {config}: storage.schema: {why}\n"), command
        assert not await admin.fetchval("SELECT count(*) FROM pg_namespace WHERE nspname = $1", missing)
        assert not await admin.fetchval("SELECT count(*) FROM pg_tables WHERE schemaname = $1", foreign)
    finally:
        for schema in (own, foreign):
            await admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await admin.execute(f'DROP ROLE IF EXISTS "{role}"')
        await admin.close()


async def test_the_search_vector_is_the_one_0009_made_after_0012_replaces_its_function(
    postgres: StoreUnderTest,
) -> None:
    """0012 gives the search vector's function the same statement in PL/pgSQL (its plan kept for
    the connection instead of made again for every message): every text gets the vector 0009's
    SQL function gave it, and the trigger stores that vector."""
    store = await postgres.open()
    try:
        await store.record_turn(turn(None, [user("Camping at the lake, then pottery in Rome!"), assistant("Nice")]))
    finally:
        await store.close()
    [(language,)] = await postgres.query(
        "SELECT l.lanname FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang"
        " JOIN pg_namespace n ON n.oid = p.pronamespace"
        " WHERE p.proname = 'memproxy_search_vector' AND n.nspname = current_schema()")
    assert language == "plpgsql"
    version_0009 = re.search(r"CREATE FUNCTION memproxy_search_vector\(words TEXT\).*?\$\$(.*?)\$\$",
                             dict(migrations("postgres"))["0009_recall"], re.S)
    assert version_0009 is not None
    texts = ["", "k1_camping k1_at k1_the k1_lake k1_then k1_pottery k1_in k1_rome", "k1_Été k1_déjà k1_vu k2_über",
             "k1_running k1_ran k1_runs k1_42 k1_a_b nokey k1_", "k9_the k9_and k9_of"]
    for text in [*texts, None]:
        [(mine, theirs)] = await postgres.query(
            f"SELECT memproxy_search_vector(CAST(? AS TEXT)), (SELECT v FROM (SELECT CAST(? AS TEXT) AS words) w,"
            f" LATERAL ({version_0009.group(1)}) AS s (v))", text, text)
        assert mine == theirs, text
    stored = await postgres.query(
        "SELECT search = memproxy_search_vector(search_text), search IS NOT NULL FROM messages")
    assert stored == [(True, True), (True, True)]


# --- memproxy migrate-store ----------------------------------------------------------------------


async def populate(path: Path) -> None:
    """A SQLite store holding what a copy must carry: two tenants, branches (an edit), compact forms,
    summaries, metadata (with and without turns), usage with cost and full-history tokens."""
    store = await SQLiteStore.open(f"sqlite:///{path}")
    try:
        system = [{"role": "system", "content": "be brief"}]
        await store.record_turn(dataclasses.replace(
            turn(None, [user("1"), assistant("a")], tenant="t", session_id="edited", system=system),
            cost=0.25, full_tokens=40, title="the first one"))
        session = await store.get_session("t", "edited")
        await store.record_turn(turn(session, [user("2"), assistant("b")], tenant="t", session_id="edited"))
        session = await store.get_session("t", "edited")
        assert session is not None
        base_hash = chain_hashes(ROOT_HASH, [user("1"), assistant("a")])[-1]
        await store.record_turn(turn(session, [user("2 edited"), assistant("c")], base=2, base_hash=base_hash,
                                     tenant="t", session_id="edited"))
        session = await store.get_session("t", "edited")
        assert session is not None
        await store.save_summary(session, 0, Summary(version=0, text="one and a", covers=2,
                                                     covers_hash=base_hash, tokens=4, replaced_tokens=20,
                                                     model="small"))
        await store.set_metadata("t", "edited", {"owner": "ada", "tags": ["x", "ü"]})

        long_output = tool("c1", "x" * 500)
        messages = [user("q"), assistant(None, ["c1"]), long_output, assistant("done")]
        record = turn(None, messages, tenant="u", session_id="tools")
        compact = [dataclasses.replace(m, compact_body=tool("c1", "x…x"), compact_tokens=3)
                   if m.body is long_output else m for m in record.messages]
        await store.record_turn(dataclasses.replace(record, messages=compact))
        await store.set_metadata("u", "only-metadata", {"state": {"step": 3}})
        await conversation(store, "u", "long", 12)
        await store.record_turn(dataclasses.replace(
            turn(None, [user("gone"), assistant("soon")], tenant="t", session_id="deleted"), cost=0.5))
        gone = await store.get_session("t", "deleted")
        assert gone is not None
        await store.delete_session(gone)  # what it spent stays in the tenant's rollup
        await store.add_endpoint_usage(EndpointUsage("u", "embeddings", 3, prompt_tokens=40, cost=0.01))
    finally:
        await store.close()


async def exports(url: str, schema: str | None = None) -> dict[tuple[str, str], list[dict[str, Any]]]:
    store = await open_store(StorageConfig(url=url, schema=schema))
    try:
        result = {}
        for tenant, session_id in await store.tenants_sessions():
            session = await store.get_session(tenant, session_id)
            assert session is not None
            result[(tenant, session_id)] = await store.export_session(session)
        result[("rollups", "")] = [dataclasses.asdict(u) for u in (await store.tenant_rollups()).values()]
        result[("endpoints", "")] = [dataclasses.asdict(u) for u in await store.endpoint_usage(None)]
        return result
    finally:
        await store.close()


COUNT_LINE = re.compile(r"^(\w+)\s+source\s+(\d+)\s+copied\s+(\d+)\s+(\S+)$")


def copied_counts(stdout: str) -> dict[str, tuple[int, int, str]]:
    found = [COUNT_LINE.match(line) for line in stdout.splitlines()]
    return {m[1]: (int(m[2]), int(m[3]), m[4]) for m in found if m}


async def test_migrate_store_copies_sqlite_to_postgres_and_back(postgres: StoreUnderTest, tmp_path: Path) -> None:
    source, back = tmp_path / "source.db", tmp_path / "back.db"
    await populate(source)
    schema = postgres.storage.schema
    assert schema is not None
    original = await exports(f"sqlite:///{source}")
    assert sorted(original) == [("endpoints", ""), ("rollups", ""), ("t", "edited"), ("u", "long"), ("u", "only-metadata"),
                                ("u", "tools")]
    assert original[("rollups", "")] == [{"sessions": 1, "turns": 1, "prompt_tokens": 7, "completion_tokens": 3,
                                          "cost": 0.5, "context_tokens": 123, "full_tokens": 0,
                                          "summary_calls": 0}]
    # turns: 3 + 1 + 12; messages: 6 (2 superseded) + 4 + 12 turns of 2, 4 of them with a call and result
    expected = {"sessions": 4, "turns": 16, "messages": 6 + 4 + 12 * 2 + 4 * 2, "summaries": 1, "tenant_usage": 1,
                "endpoint_usage": 1}

    there = run_cli("migrate-store", "--from", f"sqlite:///{source}", "--to", POSTGRES_URL, "--to-schema", schema)
    assert there.returncode == 0, there.stderr
    assert copied_counts(there.stdout) == {table: (n, n, "ok") for table, n in expected.items()}
    assert await exports(POSTGRES_URL, schema) == original
    # The copy ends with ANALYZE of every table it wrote: the first turns are not planned blind (too
    # few rows here for autovacuum to analyse them; a table never analysed has `reltuples` -1).
    for table, n in expected.items():
        assert await postgres.query("SELECT reltuples FROM pg_class WHERE oid = to_regclass(?)", table) == [(n,)], table

    home = run_cli("migrate-store", "--from", POSTGRES_URL, "--from-schema", schema, "--to", f"sqlite:///{back}")
    assert home.returncode == 0, home.stderr
    assert copied_counts(home.stdout) == {table: (n, n, "ok") for table, n in expected.items()}
    assert await exports(f"sqlite:///{back}") == original

    # Copying into a store that already holds the sessions refuses instead of duplicating them.
    again = run_cli("migrate-store", "--from", f"sqlite:///{source}", "--to", POSTGRES_URL, "--to-schema", schema)
    assert again.returncode == 1
    assert "already holds 4 of the 4 sessions" in again.stderr
    assert await postgres.query("SELECT count(*) FROM sessions") == [(4,)]


async def test_an_interrupted_migrate_store_writes_nothing_more_until_resumed(
    postgres: StoreUnderTest, tmp_path: Path
) -> None:
    source = tmp_path / "source.db"
    await populate(source)
    original = await exports(f"sqlite:///{source}")
    schema = postgres.storage.schema
    # What an interrupted copy leaves: the usage of deleted sessions (copied first), some sessions
    # whole (each is one transaction), the rest absent.
    source_store, target = await SQLiteStore.open(f"sqlite:///{source}"), await postgres.open()
    try:
        for tenant, usage in (await source_store.tenant_rollups()).items():
            await target.add_to_rollup(tenant, usage)
        for spent in await source_store.endpoint_usage(None):
            await target.add_endpoint_usage(spent)
        for key in [("t", "edited"), ("u", "tools")]:
            await target.import_session(*key, original[key])
    finally:
        await source_store.close()
        await target.close()
    command = ("migrate-store", "--from", f"sqlite:///{source}", "--to", POSTGRES_URL, "--to-schema", str(schema))
    refused = run_cli(*command)
    assert refused.returncode == 1 and "already holds 2 of the 4 sessions" in refused.stderr
    assert "--resume" in refused.stderr
    assert await postgres.query("SELECT count(*) FROM sessions") == [(2,)]  # nothing was written

    resumed = run_cli(*command, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert copied_counts(resumed.stdout)["sessions"] == (4, 4, "ok")
    assert await exports(POSTGRES_URL, schema) == original

    # A session under the same id that is not the source's is reported, not overwritten.
    await postgres.query("UPDATE sessions SET title = 'changed' WHERE session_id = 'long'")
    checked = run_cli(*command, "--resume")
    assert checked.returncode == 1 and "u/long: the copy differs from the source" in checked.stderr


# --- packaging -----------------------------------------------------------------------------------


def test_every_migration_ships_with_the_package(tmp_path: Path) -> None:
    """A non-editable install (the Dockerfile's `pip install .`) carries both dialects' migrations."""
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "memproxy", tmp_path / "memproxy", ignore=shutil.ignore_patterns("__pycache__"))
    build = subprocess.run([sys.executable, "-c", "from setuptools import setup; setup()", "build_py",
                            "--build-lib", str(tmp_path / "lib")], cwd=tmp_path, capture_output=True, text=True,
                           timeout=120)
    assert build.returncode == 0, build.stderr
    shipped = sorted(p.relative_to(tmp_path / "lib").as_posix() for p in (tmp_path / "lib").rglob("*.sql"))
    sources = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "memproxy" / "store" / "migrations").rglob("*.sql"))
    assert shipped == sources
    assert any("/postgres/" in path for path in shipped)


async def test_a_write_waits_longer_for_a_connection_than_a_read() -> None:
    """With the pool busy, a read (a new request) is refused after `pool_timeout_ms`, while a write
    (mostly the record of an answered turn, paid for) waits up to `statement_timeout_ms`: under load
    a small pool dropped answered turns (`X-Memproxy-Stored: false`) with no fault at all."""
    await require_postgres()
    pool = await asyncpg.create_pool(POSTGRES_URL, min_size=1, max_size=1)
    assert pool is not None
    backend = PostgresBackend(pool, acquire_timeout=0.2, write_acquire_timeout=30.0)
    try:
        held = await pool.acquire()  # the pool's only connection, busy
        write = asyncio.create_task(backend.write_batch([("SELECT 1", [])], lambda outcomes: outcomes))
        with pytest.raises(StoreUnavailable):
            await backend.fetch("SELECT 1")
        assert not write.done()  # still waiting, past the read's limit
        await pool.release(held)
        assert await write == [[(1,)]]
    finally:
        await pool.close()


async def test_a_summary_call_racing_its_sessions_deletion_is_counted_with_the_tenant(
    postgres: StoreUnderTest,
) -> None:
    """A summariser call answered while another replica deletes its session: the deletion holds the
    session's row when the call is recorded. The call, paid for, goes to the tenant's usage of
    deleted sessions; inserted under the row being deleted, it failed on the foreign key instead,
    and its cost was counted nowhere."""
    store, other = await postgres.open(), await postgres.open()
    try:
        await store.record_turn(turn(None, [user("1"), assistant("a")]))
        session = await store.get_session("t", "s")
        assert session is not None
        holder = await postgres._postgres()  # holds the row as another replica's write would
        waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
        try:
            transaction = holder.transaction()
            await transaction.start()
            await holder.execute("SELECT pk FROM sessions WHERE pk = $1 FOR UPDATE", session.pk)
            deleting = asyncio.ensure_future(other.delete_session(session))
            while await holder.fetchval(waiting) < 1:
                await asyncio.sleep(0.01)  # polled: the deletion is queued on the row
            call = asyncio.ensure_future(store.record_summary_call(
                session, SummaryCall("small", 200, Usage(50, 5), 1.0, cost=0.25)))
            while await holder.fetchval(waiting) < 2:
                await asyncio.sleep(0.01)  # polled: the call's record is queued behind it
            await transaction.rollback()
            await deleting
            await call
        finally:
            await holder.close()
        deleted = await other.deleted_usage("t")
        assert (deleted.sessions, deleted.turns, deleted.summary_calls) == (1, 1, 1)
        assert (deleted.prompt_tokens, deleted.completion_tokens, deleted.cost) == (7 + 50, 3 + 5, 0.25)
    finally:
        await store.close()
        await other.close()
