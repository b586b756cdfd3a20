"""The SQLite driver (issue 13, item 3): aiosqlite connections, one writer, nothing on the event loop.

What the store contract (tests/test_store_contract.py) cannot see from outside: which thread runs
each SQLite call, that every write is one transaction with no other write inside it, that a write
whose caller gives up still commits whole, that a script failing halfway leaves nothing, and the
PostgreSQL placeholder numbering that a literal must not break.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import AsyncIterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from memproxy.messages import ROOT_HASH, chain_hashes, starts_unit
from memproxy.store import NewMessage, SQLiteStore, StoreUnavailable, Totals, TurnRecord, Usage, UsageTotals
from memproxy.store.postgres import numbered
from memproxy.store.sql import Script
from memproxy.store.sqlite import _CHECKPOINT_EVERY
from stores import StoreUnderTest, store_under_test


def turn(session_id: str, *texts: str) -> TurnRecord:
    """A first turn of a new session: the given messages, user and assistant in turn."""
    messages: list[Any] = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(texts)]
    hashes = chain_hashes(ROOT_HASH, messages)
    return TurnRecord(
        tenant="t", session_id=session_id, expected_length=0, expected_head_hash="", base=0,
        base_totals=Totals(0, 0), base_hash=ROOT_HASH,
        messages=[NewMessage(m, 10, starts_unit(m), h) for m, h in zip(messages, hashes)],
        system=None, model="small", kind="test", context_tokens=1, latency_ms=1.0, usage=Usage(1, 1))


@pytest.fixture
async def under_test(tmp_path: Path) -> StoreUnderTest:
    return await store_under_test("sqlite", tmp_path)


@pytest.fixture
async def store(under_test: StoreUnderTest) -> AsyncIterator[SQLiteStore]:
    opened = await under_test.open()
    assert isinstance(opened, SQLiteStore)
    yield opened
    await opened.close()


def connections(store: SQLiteStore) -> dict[str, Any]:
    backend: Any = getattr(store, "_db")
    return {"writer": backend._writer, "lookups": backend._lookups, "reader": backend._reader,
            "checkpointer": backend._checkpointer}


async def test_no_sqlite_call_runs_on_the_event_loops_thread(store: SQLiteStore) -> None:
    """Every statement of a turn's reads and writes, the long reads and a checkpoint runs on a
    connection's own thread; no hand-written driver thread is left."""
    threads: dict[str, set[int]] = {}
    for name, conn in connections(store).items():
        await conn.set_trace_callback(lambda _sql, name=name: threads.setdefault(name, set()).add(threading.get_ident()))
    for k in range(_CHECKPOINT_EVERY):  # enough writes for one checkpoint
        await store.record_turn(turn(f"s{k}", "q", "a"))
    session = await store.get_session("t", "s0")
    assert session is not None
    assert [m.body["content"] for m in await store.active_range(session, 0, 2)] == ["q", "a"]
    assert (await store.usage("t")).sessions == _CHECKPOINT_EVERY
    backend: Any = getattr(store, "_db")
    assert backend._checkpointing is not None
    await backend._checkpointing
    assert set(threads) == {"writer", "lookups", "reader", "checkpointer"}
    loop_thread = threading.get_ident()
    assert all(loop_thread not in idents for idents in threads.values()), threads
    assert len(set.union(*threads.values())) == 4  # one thread a connection
    assert not [t for t in threading.enumerate() if t.name == "memproxy-sqlite"]


async def test_each_write_is_one_transaction_and_writes_never_interleave(store: SQLiteStore) -> None:
    """Ten turns written at once: the writer runs each as BEGIN IMMEDIATE ... COMMIT, one after
    another, with no statement of another write in between."""
    traced: list[str] = []
    await connections(store)["writer"].set_trace_callback(traced.append)
    await asyncio.gather(*(store.record_turn(turn(f"s{k}", f"q{k}", f"a{k}")) for k in range(10)))
    await connections(store)["writer"].set_trace_callback(None)
    transactions: list[list[str]] = []
    for sql in traced:
        if sql.startswith("BEGIN"):
            assert sql == "BEGIN IMMEDIATE"
            assert not transactions or transactions[-1][-1] == "COMMIT", "a write began inside another"
            transactions.append([sql])
        else:
            assert transactions and transactions[-1][-1] != "COMMIT", f"a statement outside a write: {sql[:40]}"
            transactions[-1].append(sql)
    assert len(transactions) == 10 and all(t[-1] == "COMMIT" for t in transactions)
    # Every turn was written whole, once: its two messages inside its own transaction.
    assert sorted(sum(1 for sql in t if "INSERT INTO messages" in sql) for t in transactions) == [2] * 10


async def test_a_write_whose_caller_is_cancelled_still_commits_whole(
    under_test: StoreUnderTest, tmp_path: Path
) -> None:
    """Another process holds the write lock, so the turn's write waits on the writer's thread; its
    caller gives up meanwhile. Once the file is free the write lands whole, and closing the store
    waits for it."""
    store = await under_test.open()
    try:
        async with under_test.uncommitted("INSERT INTO tenant_usage (tenant, sessions, turns, summary_calls,"
                                          " prompt_tokens, completion_tokens, context_tokens, full_tokens)"
                                          " VALUES ('other', 0, 0, 0, 0, 0, 0, 0)"):
            recording = asyncio.create_task(store.record_turn(turn("s", "q", "a")))
            done, _ = await asyncio.wait([recording], timeout=0.2)
            assert not done  # waiting for the other process
            recording.cancel()
            with pytest.raises(asyncio.CancelledError):
                await recording
    finally:
        await store.close()  # waits for the write under way
    rows = await under_test.query("SELECT m.seq, m.role FROM messages m JOIN sessions s ON s.pk = m.session_pk"
                                  " WHERE s.session_id = 's' ORDER BY m.seq")
    assert rows == [(0, "user"), (1, "assistant")]


async def test_a_script_failing_halfway_leaves_nothing_and_the_next_write_lands(
    store: SQLiteStore, under_test: StoreUnderTest
) -> None:
    backend: Any = getattr(store, "_db")
    usage = UsageTotals(sessions=1, turns=1, summary_calls=0, prompt_tokens=1, completion_tokens=1, cost=None,
                        context_tokens=1, full_tokens=1)

    def fails_after_a_write() -> Script[None]:
        yield ("INSERT INTO tenant_usage (tenant, sessions, turns, summary_calls, prompt_tokens,"
               " completion_tokens, context_tokens, full_tokens) VALUES ('x', 1, 1, 0, 1, 1, 1, 1)"), ()
        raise ValueError("the script's own failure")

    def fails_in_the_database() -> Script[None]:
        yield "UPDATE sessions SET updated_at = 0", ()
        yield "INSERT INTO no_such_table VALUES (1)", ()

    with pytest.raises(ValueError):  # the script's own error, as it is
        await backend.write(fails_after_a_write())
    with pytest.raises(StoreUnavailable):  # the database's, translated
        await backend.write(fails_in_the_database())
    assert await under_test.query("SELECT tenant FROM tenant_usage") == []
    await store.add_to_rollup("y", usage)  # a write that begins with an INSERT, after two rolled back
    await store.record_turn(turn("s", "q", "a"))
    assert await under_test.query("SELECT tenant FROM tenant_usage") == [("y",)]
    assert await under_test.query("SELECT length FROM sessions") == [(2,)]


async def test_an_in_memory_store_keeps_what_it_is_given() -> None:
    store = await SQLiteStore.open("sqlite:///:memory:")
    try:
        await asyncio.gather(*(store.record_turn(turn(f"s{k}", "q", "a")) for k in range(5)))
        session = await store.get_session("t", "s3")
        assert session is not None and session.length == 2
        assert (await store.usage(None)).sessions == 5
    finally:
        await store.close()


async def test_a_closed_store_fails_as_unavailable(under_test: StoreUnderTest) -> None:
    store = await under_test.open()
    await store.close()
    await store.close()  # closing again does nothing
    with pytest.raises(StoreUnavailable):
        await store.get_session("t", "s")
    with pytest.raises(StoreUnavailable):
        await store.record_turn(turn("s", "q", "a"))


async def test_a_file_that_cannot_be_opened_fails_as_unavailable_and_leaves_no_thread(tmp_path: Path) -> None:
    """Not a database: the writer connects, its first pragma fails; it is closed again, so its
    thread (aiosqlite's are not daemons) cannot keep the process alive."""
    def workers() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if "_connection_worker_thread" in t.name}

    before = workers()
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not a database file, not even close" * 100)
    with pytest.raises(StoreUnavailable):
        await SQLiteStore.open(f"sqlite:///{garbage}")
    deadline = asyncio.get_running_loop().time() + 5
    while workers() - before and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)  # a thread told to stop ends on its own: poll until it has
    assert not workers() - before


async def test_the_checkpointer_has_no_busy_timeout_and_the_writer_the_configured_one(tmp_path: Path) -> None:
    store = await SQLiteStore.open(f"sqlite:///{tmp_path / 'b.db'}", busy_timeout_ms=1234)
    try:
        found = {}
        for name, conn in connections(store).items():
            [(found[name],)] = await conn.execute_fetchall("PRAGMA busy_timeout")
        [(found["autocheckpoint"],)] = await connections(store)["writer"].execute_fetchall("PRAGMA wal_autocheckpoint")
    finally:
        await store.close()
    assert found == {"writer": 1234, "lookups": 1234, "reader": 1234, "checkpointer": 0, "autocheckpoint": 0}
    with closing(sqlite3.connect(tmp_path / "b.db")) as db:
        assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)


@pytest.mark.parametrize(("sql", "expected"), [
    ("SELECT ? , ?", "SELECT $1 , $2"),
    ("SELECT '?', ? WHERE x = 'it''s ?' AND y = ?", "SELECT '?', $1 WHERE x = 'it''s ?' AND y = $2"),
    ('SELECT "odd?name", ? FROM t', 'SELECT "odd?name", $1 FROM t'),
    ("SELECT ? -- why?\n, ?", "SELECT $1 -- why?\n, $2"),
    ("SELECT /* ? */ ? - ? / ?", "SELECT /* ? */ $1 - $2 / $3"),
    ("SELECT '' || ?", "SELECT '' || $1"),
    ("SELECT 'no end ?", "SELECT 'no end ?"),
])
def test_postgres_numbers_placeholders_but_not_a_question_mark_in_a_literal(sql: str, expected: str) -> None:
    assert numbered(sql) == expected
