"""The contract every Store backend keeps, run against each backend (SQLite and PostgreSQL).

Writes are checked from a second, independent store on the same database, so what is asserted is
what was committed, not what one connection happens to see.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import closing
from pathlib import Path
from typing import Any, Protocol

import pytest

from db import opening_held, write_lock_held
from helpers import assistant, tool, user
from memproxy import admin
from memproxy.config import StorageConfig
from memproxy.exports import from_jsonl, to_jsonl
from memproxy.memory.sent import SentHistories, older
from memproxy.messages import ROOT_HASH, Message, chain_hashes, starts_unit
from memproxy.store import (EndpointUsage, KeptAnswer, NewMessage, NewResponse, SessionState, SQLiteStore, Store,
                            StoredCounts, StoredMessage, Summary, SummaryCall, Totals, TurnRecord, Usage)
from memproxy.store import open_store as open_store_config
from memproxy.store.base import MIXED_COUNTS
from memproxy.store.errors import StoreConflict, StoreUnavailable
from memproxy.store.migrations import migrations, statements
from memproxy.store.sql import QUERIES
from memproxy.store.sqlite import _CHECKPOINT_EVERY
from memproxy.tokens import TiktokenCounter
from stores import StoreUnderTest, store_under_test

class Opener(Protocol):
    def __call__(self, **changes: Any) -> Awaitable[Store]: ...

COUNTER = TiktokenCounter("o200k_base")


@pytest.fixture(params=["sqlite", "postgres"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[StoreUnderTest]:
    under_test = await store_under_test(request.param, tmp_path)
    yield under_test
    await under_test.drop()


@pytest.fixture
async def open_store(backend: StoreUnderTest) -> AsyncIterator[Opener]:
    opened: list[Store] = []

    async def opener(**changes: Any) -> Store:
        """A store on the backend's database, with `changes` to its settings (closed at the end)."""
        store = await (open_store_config(dataclasses.replace(backend.storage, **changes)) if changes
                       else backend.open())
        opened.append(store)
        return store

    yield opener
    for store in opened:
        await store.close()


def turn(
    session: SessionState | None, messages: list[Message], base: int | None = None, tokens: int = 10,
    tenant: str = "t", session_id: str = "s", system: list[Message] | None = None, **extra: Any,
) -> TurnRecord:
    """A turn continuing `session` at `base` (default: its end) with `messages`, `tokens` each."""
    length = session.length if session else 0
    base = length if base is None else base
    base_hash = extra.pop("base_hash", session.head_hash if session and base == length else ROOT_HASH)
    hashes = chain_hashes(base_hash, messages)
    return TurnRecord(
        tenant=tenant, session_id=session_id,
        expected_length=extra.pop("expected_length", length),
        expected_head_hash=session.head_hash if session else "",
        base=base, base_totals=Totals(base * tokens, base * tokens), base_hash=base_hash,
        messages=[NewMessage(m, tokens, starts_unit(m), h) for m, h in zip(messages, hashes)],
        system=system, model="small", kind="append",
        context_tokens=123, latency_ms=1.5, usage=Usage(7, 3),
    )


async def test_blank_database_gets_every_migration_once(open_store: Opener, backend: StoreUnderTest) -> None:
    # Four at once (replicas starting together) all open the new file, and apply each migration once:
    # on SQLite the ones that find it locked while another migrates wait for it (`_until_unlocked`).
    await asyncio.gather(*(open_store() for _ in range(4)))
    await open_store()  # opening again applies nothing twice
    ids = [row[0] for row in await backend.query("SELECT id FROM schema_migrations ORDER BY id")]
    assert ids == [migration_id for migration_id, _ in migrations(backend.kind)]
    assert ids[:2] == ["0001_initial", "0002_summaries"]
    if backend.kind == "sqlite":
        assert (await backend.query("PRAGMA journal_mode"))[0][0] == "wal"


async def test_an_opening_kept_waiting_ends_at_once_when_cancelled(backend: StoreUnderTest) -> None:
    """Another process holds what opening needs (the SQLite file, the schema's migration lock), so
    the opening waits, with a two-minute busy timeout; a stop signal's cancel then ends it promptly,
    not when that wait would have run out, and leaves no connection behind."""
    storage = dataclasses.replace(backend.storage, busy_timeout_ms=120_000)
    with opening_held(storage):
        opening = asyncio.ensure_future(open_store_config(storage))
        done, _ = await asyncio.wait([opening], timeout=0.5)
        assert not done, "the store opened while another process held it"
        cancelled = time.monotonic()
        opening.cancel()
        await asyncio.wait([opening])
        took = time.monotonic() - cancelled
    assert opening.cancelled()
    assert took < 5, f"the cancelled opening took {took:.1f} s to end"


async def test_unknown_session_is_none(open_store: Opener) -> None:
    store = await open_store()
    assert await store.get_session("t", "nope") is None
    await store.ping()


async def test_recorded_turn_is_committed_and_visible_to_another_store(open_store: Opener) -> None:
    writer, reader = await open_store(), await open_store()
    system = [{"role": "system", "content": "be brief"}]
    await writer.record_turn(turn(None, [user("hi"), assistant("hello")], system=system))
    session = await reader.get_session("t", "s")
    assert session is not None
    assert (session.length, session.head_cum, session.system) == (2, 20, system)
    assert session.head_hash == chain_hashes(ROOT_HASH, [user("hi"), assistant("hello")])[-1]
    stored = await reader.active_range(session, 0, 2)
    assert [m.body for m in stored] == [user("hi"), assistant("hello")]
    assert [(m.seq, m.tokens, m.cum_before) for m in stored] == [(0, 10, 0), (1, 10, 10)]


async def test_stored_counts_are_exact_and_bounded(open_store: Opener, backend: StoreUnderTest) -> None:
    """What the metrics' gauges read at each scrape. SQLite counts exactly; PostgreSQL counts up to
    100,000 rows a table one by one, and past that takes the planner's estimate (kept by ANALYZE)."""
    store = await open_store()
    assert await store.stored_counts() == StoredCounts(sessions=0, messages=0)
    for session_id in ("s", "other"):
        await store.record_turn(turn(None, [user("hi"), assistant("hello")], session_id=session_id))
    session = await store.get_session("t", "s")
    await store.record_turn(turn(session, [user("again"), assistant("yes")]))
    assert await store.stored_counts() == StoredCounts(sessions=2, messages=6)
    # Past the bound: 100,050 superseded copies of a message.
    columns = ", ".join(r[0] for r in await backend.query(
        "SELECT name FROM pragma_table_info('messages') WHERE name NOT IN ('id', 'seq', 'active')"
        if backend.kind == "sqlite" else
        "SELECT column_name FROM information_schema.columns WHERE table_schema = current_schema()"
        " AND table_name = 'messages' AND column_name NOT IN ('id', 'seq', 'active')"))
    await backend.query(f"WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < 100050)"
                        f" INSERT INTO messages ({columns}, seq, active) SELECT {columns}, 100 + g.n, 0"
                        f" FROM (SELECT * FROM messages WHERE seq = 0 LIMIT 1) m, g")
    await backend.query("ANALYZE messages")
    counts = await store.stored_counts()
    assert counts.sessions == 2
    if backend.kind == "sqlite":
        assert counts.messages == 100_056
    else:
        # the estimate ANALYZE left (here: exact), not the 100,001 rows the bounded count stopped at
        assert counts.messages != 100_001 and abs(counts.messages - 100_056) <= 5_000


async def test_reads_see_only_committed_data_and_do_not_wait_for_a_writer(
    open_store: Opener, backend: StoreUnderTest
) -> None:
    """A write transaction left open (another process recording a turn) hides what it wrote, and
    holds no read up: SQLite answers a turn's reads on the event loop, which must never wait."""
    store = await open_store()
    async with backend.uncommitted("INSERT INTO sessions (tenant, session_id, created_at, updated_at)"
                                   " VALUES ('t', 's', 0, 0)"):
        assert await asyncio.wait_for(store.get_session("t", "s"), 2) is None
        assert (await asyncio.wait_for(store.usage("t"), 2)).sessions == 0
    session = await store.get_session("t", "s")
    assert session is not None and session.length == 0


async def test_a_write_waits_for_another_writer_without_holding_up_the_loop(
    open_store: Opener, backend: StoreUnderTest
) -> None:
    """Another process in the middle of a write (here: creating the same session): the turn's write
    waits for it, off the event loop (SQLite writes on the loop only when the file is free), and
    lands once it commits."""
    store = await open_store()
    async with backend.uncommitted("INSERT INTO sessions (tenant, session_id, created_at, updated_at)"
                                   " VALUES ('t', 's', 0, 0)"):
        recording = asyncio.create_task(store.record_turn(turn(None, [user("1"), assistant("a")])))
        assert await asyncio.wait_for(store.get_session("t", "other"), 2) is None  # the loop runs on
        done, _ = await asyncio.wait([recording], timeout=0.2)
        assert not done  # it waits for the other writer
    await asyncio.wait_for(recording, 10)
    session = await store.get_session("t", "s")
    assert session is not None and session.length == 2


async def test_a_write_whose_caller_stops_waiting_is_whole_or_absent_and_the_writer_goes_on(
    open_store: Opener, backend: StoreUnderTest
) -> None:
    """A turn's write whose caller is cancelled (a client gone) while it waits for another writer:
    on SQLite it is already on the writer's thread and runs to its commit, on PostgreSQL its
    transaction is rolled back; whole or absent, never half. The store's next write is not held up."""
    store = await open_store()
    await store.record_turn(turn(None, [user("1"), assistant("a")]))
    session = await store.get_session("t", "s")
    async with backend.uncommitted("UPDATE sessions SET updated_at = updated_at WHERE session_id = 's'"):
        recording = asyncio.create_task(store.record_turn(turn(session, [user("2"), assistant("b")])))
        assert await asyncio.wait_for(store.get_session("t", "other"), 2) is None  # the loop runs on
        recording.cancel()
        await asyncio.wait([recording])
    # Written after the cancelled one, by the same writer: once it is stored, the other has ended.
    await asyncio.wait_for(store.record_turn(turn(None, [user("x"), assistant("y")], session_id="next")), 10)
    after = await store.get_session("t", "s")
    assert after is not None and after.length == (4 if backend.kind == "sqlite" else 2)
    assert [m.body for m in await store.active_range(after, 0, after.length)] == [
        user("1"), assistant("a"), user("2"), assistant("b")][:after.length]


async def test_sqlite_checkpoints_its_log_off_the_loop(tmp_path: Path) -> None:
    """The loop's connection never checkpoints on commit; the writer thread does, every so many
    writes, so the log stops growing. Measured: the log's growth per write before the first
    checkpoint, against its size after many."""
    path = tmp_path / "log.db"
    store = await SQLiteStore.open(f"sqlite:///{path}")
    wal = tmp_path / "log.db-wal"
    try:
        async def turns(first: int, count: int) -> None:
            for k in range(first, first + count):
                await store.record_turn(turn(None, [user(f"q{k}"), assistant(f"a{k}")], session_id=f"s{k}"))

        await turns(0, 1)
        start = wal.stat().st_size
        await turns(1, 16)
        per_write = (wal.stat().st_size - start) / 16
        assert per_write > 0
        await turns(17, 40 * _CHECKPOINT_EVERY)
        backend: Any = getattr(store, "_db")
        if backend._checkpointing is not None:
            await backend._checkpointing  # the last checkpoint started has run
        assert wal.stat().st_size < per_write * 4 * _CHECKPOINT_EVERY
    finally:
        await store.close()


async def test_sessions_are_scoped_by_tenant(open_store: Opener) -> None:
    store = await open_store()
    await store.record_turn(turn(None, [user("a"), assistant("x")], tenant="a"))
    await store.record_turn(turn(None, [user("b"), assistant("y")], tenant="b"))
    a, b = await store.get_session("a", "s"), await store.get_session("b", "s")
    assert a is not None and b is not None and a.pk != b.pk
    assert [m.body for m in await store.active_range(b, 0, 9)] == [user("b"), assistant("y")]


async def test_lookups_by_hash_position_and_running_total(open_store: Opener) -> None:
    store = await open_store()
    history = [user("q"), assistant(None, ["c1", "c2"]), tool("c1", "r1"), tool("c2", "r2"),
               assistant("done"), user("next"), assistant("ok")]
    await store.record_turn(turn(None, history))
    session = await store.get_session("t", "s")
    assert session is not None
    hashes = chain_hashes(ROOT_HASH, history)
    assert await store.matched_prefix(session, hashes) == 7
    assert await store.matched_prefix(session, hashes[:3]) == 3
    assert await store.matched_prefix(session, chain_hashes(ROOT_HASH, [user("other")])) == 0
    assert await store.totals_at(session, 0) == Totals(0, 0)
    assert await store.totals_at(session, 4) == Totals(40, 40)
    assert await store.totals_at(session, 7) == Totals(70, 70)
    assert await store.user_positions(session, 7, 5) == [5, 0]
    assert await store.user_positions(session, 5, 1) == [0]
    # Tool results are not unit starts: the unit holding position 3 starts at the call, position 1.
    snap = await store.snapshot(session, 4, whole_last_unit=True, room=0)
    assert (snap.base_totals, snap.must_start, snap.last_user, snap.start) == (Totals(40, 40), 1, 0, 1)
    assert [m.seq for m in snap.messages] == [1, 2, 3] and snap.summary is None
    # The tail read is what fits the room: units from position 4 on hold 30 tokens, from 1, 60.
    snap = await store.snapshot(session, 7, whole_last_unit=False, room=55)
    assert (snap.must_start, snap.last_user, snap.start) == (7, 5, 4)
    assert [m.seq for m in snap.messages] == [4, 5, 6] and snap.totals_at(4) == Totals(40, 40)
    assert snap.totals_at(3) is None  # out of reach: costs more than the room
    snap = await store.snapshot(session, 7, whole_last_unit=True, room=1000)
    assert (snap.must_start, snap.start, len(snap.messages)) == (6, 0, 7)
    snap = await store.snapshot(session, 7, whole_last_unit=False, room=-5)
    assert (snap.start, snap.messages) == (7, [])


async def test_fork_supersedes_the_tail_and_keeps_it(open_store: Opener, backend: StoreUnderTest) -> None:
    store = await open_store()
    await store.record_turn(turn(None, [user("1"), assistant("a"), user("2"), assistant("b")]))
    session = await store.get_session("t", "s")
    assert session is not None
    base_hash = chain_hashes(ROOT_HASH, [user("1"), assistant("a")])[-1]
    await store.record_turn(turn(session, [user("2 edited"), assistant("c")], base=2, base_hash=base_hash))
    after = await (await open_store()).get_session("t", "s")
    assert after is not None and after.length == 4
    assert [m.body["content"] for m in await store.active_range(after, 0, 4)] == ["1", "a", "2 edited", "c"]
    rows = await backend.query("SELECT seq, active FROM messages ORDER BY id")
    assert rows == [(0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]


async def test_a_branch_is_read_back_whole_active_or_superseded(open_store: Opener) -> None:
    """`branch` walks a chain back from its last message: the superseded branch an edit forked off,
    as it was (the messages before the fork are the active ones), the active one alike; and None
    once the cap has deleted part of it."""
    store = await open_store()
    first = [user("1"), assistant("a"), user("2"), assistant("b")]
    await store.record_turn(turn(None, first))
    session = await store.get_session("t", "s")
    assert session is not None
    hashes = chain_hashes(ROOT_HASH, first)
    await store.record_turn(turn(session, [user("2 edited"), assistant("c"), user("3"), assistant("d")], base=2,
                                 base_hash=hashes[1]))
    session = await store.get_session("t", "s")
    assert session is not None
    old = await store.branch(session, 3, hashes[3])
    assert old is not None and [m.body for m in old] == first
    assert [m.chain_hash for m in old] == hashes and [m.seq for m in old] == [0, 1, 2, 3]
    active = await store.branch(session, 5, session.head_hash)
    assert active is not None and [m.body["content"] for m in active] == ["1", "a", "2 edited", "c", "3", "d"]
    assert await store.branch(session, 3, "no such hash") is None
    assert await store.cap_messages(session, 6) == 2  # the superseded messages go first
    assert await store.branch(session, 3, hashes[3]) is None
    assert await store.branch(session, 5, session.head_hash) == active


async def test_a_stale_continuation_goes_after_the_turn_that_beat_it(
    open_store: Opener, backend: StoreUnderTest
) -> None:
    store = await open_store()
    await store.record_turn(turn(None, [user("1"), assistant("a")]))
    stale = await store.get_session("t", "s")
    await store.record_turn(turn(stale, [user("2"), assistant("b")]))
    await store.record_turn(turn(stale, [user("2 too"), assistant("c")]))  # planned before "2" was stored
    after = await (await open_store()).get_session("t", "s")
    assert after is not None and after.length == 6 and after.head_cum == 60
    bodies = [m.body for m in await store.active_range(after, 0, 6)]
    assert [b["content"] for b in bodies] == ["1", "a", "2", "b", "2 too", "c"]
    # Its chained hashes and running totals were recomputed on the new head.
    stored = await store.active_range(after, 0, 6)
    assert [m.chain_hash for m in stored] == chain_hashes(ROOT_HASH, bodies)
    assert [m.cum_before for m in stored] == [0, 10, 20, 30, 40, 50]
    assert after.head_hash == stored[-1].chain_hash


async def test_a_stale_edit_is_refused_and_changes_nothing(open_store: Opener, backend: StoreUnderTest) -> None:
    store = await open_store()
    await store.record_turn(turn(None, [user("1"), assistant("a"), user("2"), assistant("b")]))
    stale = await store.get_session("t", "s")
    assert stale is not None
    await store.record_turn(turn(stale, [user("3"), assistant("c")]))
    fork = chain_hashes(ROOT_HASH, [user("1"), assistant("a")])[-1]
    with pytest.raises(StoreConflict):  # its fork point still exists, but what it superseded moved on
        await store.record_turn(turn(stale, [user("2 edited"), assistant("x")], base=2, base_hash=fork))
    assert await backend.query("SELECT count(*) FROM messages") == [(6,)]
    assert await backend.query("SELECT count(*) FROM turns") == [(2,)]


async def test_a_continuation_of_a_history_since_edited_is_refused(
    open_store: Opener, backend: StoreUnderTest
) -> None:
    store = await open_store()
    await store.record_turn(turn(None, [user("1"), assistant("a")]))
    stale = await store.get_session("t", "s")
    await store.record_turn(turn(stale, [user("1 edited"), assistant("b")], base=0, base_hash=ROOT_HASH))
    with pytest.raises(StoreConflict):  # "a" is no longer the history it continues
        await store.record_turn(turn(stale, [user("2"), assistant("c")]))
    assert await backend.query("SELECT count(*) FROM turns") == [(2,)]


async def test_concurrent_writers_on_one_session_are_all_kept_once(
    open_store: Opener, backend: StoreUnderTest
) -> None:
    writers = [await open_store() for _ in range(8)]  # as many replicas, each its own pool or file
    await writers[0].record_turn(turn(None, [user("1"), assistant("a")]))
    session = await writers[0].get_session("t", "s")
    await asyncio.gather(*(writer.record_turn(turn(session, [user(f"q{k}"), assistant(f"a{k}")]))
                           for k, writer in enumerate(writers)))
    after = await writers[0].get_session("t", "s")
    assert after is not None and after.length == 2 + 2 * len(writers)
    stored = await writers[0].active_range(after, 0, after.length)
    bodies = [m.body for m in stored]
    assert sorted(b["content"] for b in bodies[2:]) == sorted(
        [f"q{k}" for k in range(8)] + [f"a{k}" for k in range(8)])
    assert all(bodies[i]["content"][1:] == bodies[i + 1]["content"][1:] for i in range(2, after.length, 2))
    assert [m.chain_hash for m in stored] == chain_hashes(ROOT_HASH, bodies)
    assert [m.seq for m in stored] == list(range(after.length))
    assert await backend.query("SELECT count(*) FROM messages") == [(after.length,)]


async def test_writers_creating_one_session_at_once_are_all_kept(open_store: Opener) -> None:
    writers = [await open_store() for _ in range(4)]
    await asyncio.gather(*(writer.record_turn(turn(None, [user(f"q{k}"), assistant(f"a{k}")]))
                           for k, writer in enumerate(writers)))
    after = await writers[0].get_session("t", "s")
    assert after is not None and after.length == 8


async def test_usage_and_system_prompt_are_kept(open_store: Opener, backend: StoreUnderTest) -> None:
    store = await open_store()
    system = [{"role": "developer", "content": "rules"}]
    await store.record_turn(turn(None, [user("1"), assistant("a")], system=system))
    session = await store.get_session("t", "s")
    await store.record_turn(turn(session, [user("2"), assistant("b")], system=None))
    after = await store.get_session("t", "s")
    assert after is not None and after.system == system  # a turn without a system prompt keeps the last
    usage = await backend.query("SELECT prompt_tokens, completion_tokens, model FROM turns ORDER BY id")
    assert usage == [(7, 3, "small"), (7, 3, "small")]


async def test_summariser_calls_count_in_usage_but_not_as_turns(open_store: Opener) -> None:
    store, reader = await open_store(), await open_store()
    await store.record_turn(turn(None, [user("1"), assistant("a")]))
    session = await store.get_session("t", "s")
    assert session is not None
    await store.record_summary_call(session, SummaryCall("small", 200, Usage(180, 20), 12.5, cost=0.5))
    usage = await reader.usage("t")
    assert (usage.turns, usage.summary_calls) == (1, 1)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cost) == (7 + 180, 3 + 20, 0.5)
    assert (usage.context_tokens, usage.full_tokens) == (123 + 200, 0)  # turn() records no full_tokens
    [info], _ = await reader.list_sessions("t", 10)
    assert (info.turns, info.prompt_tokens, info.cost) == (1, 187, 0.5)
    await store.delete_session(session)
    # Paid for while its session was deleted (a compaction racing a delete): counted with the
    # tenant's deleted sessions.
    await store.record_summary_call(session, SummaryCall("small", 200, Usage(50, 5), 1.0, cost=0.25))
    assert (await reader.usage("t")).summary_calls == 0
    deleted = await reader.deleted_usage("t")
    assert (deleted.sessions, deleted.turns, deleted.summary_calls, deleted.cost) == (1, 1, 2, 0.75)
    assert (deleted.prompt_tokens, deleted.completion_tokens) == (7 + 180 + 50, 3 + 20 + 5)
    # Another tenant's session made since may hold the deleted one's row id (SQLite reuses them):
    # a summary of the deleted session still counts with its own tenant, never on that session.
    await store.record_turn(turn(None, [user("2"), assistant("b")], tenant="u", session_id="new"))
    newer = await store.get_session("u", "new")
    assert newer is not None
    await store.record_summary_call(session, SummaryCall("small", 200, Usage(50, 5), 1.0, cost=0.25))
    assert (await reader.usage("u")).summary_calls == 0 and (await reader.deleted_usage("t")).summary_calls == 3
    with pytest.raises(StoreConflict):
        await store.save_summary(session, 0, summary(2, newer.head_hash))
    assert (await store.get_session("u", "new")) == newer  # no summary of another session's on it


async def test_a_turn_whose_session_was_deleted_meanwhile_is_refused_and_its_cost_kept(open_store: Opener) -> None:
    store, other = await open_store(), await open_store()
    await store.record_turn(turn(None, [user("1"), assistant("a")]))
    session = await store.get_session("t", "s")
    assert session is not None
    await other.delete_session(session)
    with pytest.raises(StoreConflict):
        await store.record_turn(turn(session, [user("2"), assistant("b")]))
    assert await store.get_session("t", "s") is None  # nothing of it is written
    deleted = await store.deleted_usage("t")
    assert (deleted.sessions, deleted.turns, deleted.prompt_tokens, deleted.completion_tokens) == (1, 2, 14, 6)


async def test_endpoint_usage_adds_up_per_tenant_and_endpoint_and_outlives_sessions(open_store: Opener) -> None:
    store, reader = await open_store(), await open_store()
    await store.add_endpoint_usage(EndpointUsage("t", "embeddings", 1, prompt_tokens=5))
    await store.add_endpoint_usage(EndpointUsage("t", "embeddings", 1, prompt_tokens=7, cost=0.25))
    await store.add_endpoint_usage(EndpointUsage("t", "completions", 1, 3, 4))
    await store.add_endpoint_usage(EndpointUsage("u", "embeddings", 2, 1))
    await store.record_turn(turn(None, [user("q"), assistant("a")]))
    assert await reader.endpoint_usage("t") == [EndpointUsage("t", "completions", 1, 3, 4, None),
                                                EndpointUsage("t", "embeddings", 2, 12, 0, 0.25)]
    assert [(u.tenant, u.endpoint) for u in await reader.endpoint_usage(None)] == [
        ("t", "completions"), ("t", "embeddings"), ("u", "embeddings")]
    assert await reader.endpoint_usage("nobody") == []
    assert await store.delete_tenant("t") == 1
    assert len(await reader.endpoint_usage("t")) == 2  # accounting outlives the conversations


async def test_a_response_is_kept_with_its_turn_for_its_tenant_alone(open_store: Opener) -> None:
    writer, reader = await open_store(), await open_store()
    body = {"id": "resp_1", "object": "response", "output": [{"type": "message", "content": "x\u0000y"}]}
    items = [{"type": "message", "role": "user", "content": "hi"}]
    await writer.record_turn(dataclasses.replace(turn(None, [user("hi"), assistant("hello")]),
                                                 response=NewResponse("resp_1", body, items)))
    kept = await reader.get_response("t", "resp_1")
    assert kept is not None
    assert (kept.session_id, kept.seq, kept.body, kept.input_items) == ("s", 1, body, items)
    assert kept.chain_hash == chain_hashes(ROOT_HASH, [user("hi"), assistant("hello")])[-1]
    assert kept.active and kept.head
    assert await reader.get_response("other-tenant", "resp_1") is None  # ids are scoped by tenant
    assert await reader.get_response("t", "resp_2") is None
    output_only = await reader.get_response("t", "resp_1", with_input=False)  # what an item_reference reads
    assert output_only == dataclasses.replace(kept, input_items=[])
    assert await reader.get_response("other-tenant", "resp_1", with_input=False) is None

    # A later turn moves the head; an edit back at the start supersedes the response's answer.
    session = await reader.get_session("t", "s")
    await writer.record_turn(dataclasses.replace(turn(session, [user("more"), assistant("ok")]),
                                                 response=NewResponse("resp_2", {"id": "resp_2"}, [])))
    kept = await reader.get_response("t", "resp_1")
    assert kept is not None and kept.active and not kept.head
    session = await reader.get_session("t", "s")
    await writer.record_turn(dataclasses.replace(turn(session, [user("edited"), assistant("e")], base=0),
                                                 kind="edit"))
    kept = await reader.get_response("t", "resp_1")
    assert kept is not None and not kept.active and not kept.head

    assert not await writer.delete_response("other-tenant", "resp_1")
    assert await writer.delete_response("t", "resp_1")
    assert await reader.get_response("t", "resp_1") is None
    assert not await writer.delete_response("t", "resp_1")
    # Deleting the session deletes its responses.
    session = await reader.get_session("t", "s")
    assert session is not None
    await writer.delete_session(session)
    assert await reader.get_response("t", "resp_2") is None


async def test_kept_answers_are_the_sessions_responses_whose_answers_stand(open_store: Opener) -> None:
    """What names a conversation's items (`memproxy.conversation_items`): the kept responses of the
    session whose answers are still active, by position; an edit before one drops it."""
    writer, reader = await open_store(), await open_store()
    output = [{"type": "message", "id": "msg_1_0"}]
    await writer.record_turn(dataclasses.replace(turn(None, [user("hi"), assistant("hello")]),
                                                 response=NewResponse("resp_1", {"output": output}, [])))
    session = await reader.get_session("t", "s")
    assert session is not None
    await writer.record_turn(dataclasses.replace(turn(session, [user("more"), assistant("ok")]),
                                                 response=NewResponse("resp_2", {"output": []}, [])))
    session = await reader.get_session("t", "s")
    assert session is not None
    assert await reader.kept_answers(session) == [KeptAnswer("resp_1", 1, output), KeptAnswer("resp_2", 3, [])]
    await writer.record_turn(dataclasses.replace(turn(session, [user("edited"), assistant("e")], base=2),
                                                 kind="edit"))
    session = await reader.get_session("t", "s")
    assert session is not None and await reader.kept_answers(session) == [KeptAnswer("resp_1", 1, output)]


async def test_a_rebased_turn_keeps_its_response_where_its_answer_landed(open_store: Opener) -> None:
    store = await open_store()
    await store.record_turn(turn(None, [user("a"), assistant("b")]))
    session = await store.get_session("t", "s")
    planned = dataclasses.replace(turn(session, [user("c"), assistant("d")]),
                                  response=NewResponse("resp_late", {"id": "resp_late"}, []))
    await store.record_turn(turn(session, [user("x"), assistant("y")]))  # another writer first
    await store.record_turn(planned)
    kept = await store.get_response("t", "resp_late")
    moved = await store.get_session("t", "s")
    assert kept is not None and moved is not None
    assert (kept.seq, kept.chain_hash, kept.head) == (5, moved.head_hash, True)


async def test_the_session_keeps_which_counter_made_its_counts(open_store: Opener) -> None:
    """The first turn's counter; the same again keeps it; another makes it a mix, until a turn
    replaces the whole chain (an edit from the first message) with counts of its own."""
    store = await open_store()

    async def record(session: Any, messages: list[Message], tokenizer: str | None, **kwargs: Any) -> Any:
        await store.record_turn(dataclasses.replace(turn(session, messages, **kwargs), tokenizer=tokenizer))
        return await store.get_session("t", "s")

    session = await record(None, [user("1"), assistant("a")], "cl100k_base")
    assert session.tokenizer == "cl100k_base"
    session = await record(session, [user("2"), assistant("b")], "cl100k_base")
    assert session.tokenizer == "cl100k_base"
    session = await record(session, [user("3"), assistant("c")], None)  # a write that counts nothing
    assert session.tokenizer == "cl100k_base"
    session = await record(session, [user("4"), assistant("d")], "o200k_base")
    assert session.tokenizer == MIXED_COUNTS
    session = await record(session, [user("5"), assistant("e")], "cl100k_base")
    assert session.tokenizer == MIXED_COUNTS  # stays a mix
    session = await record(session, [user("1 edited"), assistant("x")], "o200k_base", base=0, base_hash=ROOT_HASH)
    assert session.tokenizer == "o200k_base" and session.length == 2
    loaded = await store.load("t", "s", 1000)
    assert loaded is not None and loaded.session.tokenizer == "o200k_base"


async def test_tool_results_are_refused_not_rebased_after_another_turn(
    open_store: Opener, backend: StoreUnderTest
) -> None:
    """The session ends with a tool call; the results, planned on it, land after another writer's
    turn: rebased, they would follow a message that made no call, and every later request would
    send them orphaned (a provider's 400). Refused instead."""
    store = await open_store()
    await store.record_turn(turn(None, [user("look it up"), assistant(None, ["c1"])]))
    session = await store.get_session("t", "s")
    await store.record_turn(turn(session, [user("meanwhile"), assistant("ok")]))  # another writer first
    with pytest.raises(StoreConflict):
        await store.record_turn(turn(session, [tool("c1", "found"), assistant("it is there")]))
    assert await backend.query("SELECT count(*) FROM messages") == [(4,)]


async def test_a_pinned_turn_is_refused_not_rebased(open_store: Opener, backend: StoreUnderTest) -> None:
    """A turn whose history is fixed (a Responses `previous_response_id`), planned before another
    writer's turn landed, would continue a chain that now holds its sibling's exchange: refused."""
    store = await open_store()
    await store.record_turn(turn(None, [user("a"), assistant("b")]))
    session = await store.get_session("t", "s")
    await store.record_turn(turn(session, [user("x"), assistant("y")]))  # another writer first
    with pytest.raises(StoreConflict):
        await store.record_turn(dataclasses.replace(turn(session, [user("c"), assistant("d")]), pinned=True))
    assert await backend.query("SELECT count(*) FROM turns") == [(2,)]
    assert await backend.query("SELECT count(*) FROM messages") == [(4,)]


def test_queries_that_serve_a_turn_use_indexes(tmp_path: Path) -> None:
    """No query on the hot path scans a table: its cost follows the request, not the history.
    (SQLite; the PostgreSQL plans are checked in test_postgres.py.)"""
    asyncio.run(_open_and_close(tmp_path / "plans.db"))
    with sqlite3.connect(tmp_path / "plans.db") as db:
        for name, sql in QUERIES.items():
            sql = sql.format(marks="?,?,?")
            params = [1] * sql.count("?")
            plan = " | ".join(row[3] for row in db.execute(f"EXPLAIN QUERY PLAN {sql}", params))
            # a list of constants, or `head`'s one row worked out before its message ranges are read
            assert "SCAN" not in re.sub(r"SCAN (\d+ )?CONSTANT|SCAN h\b", "", plan), f"{name}: {plan}"
            assert "INDEX" in plan, f"{name}: {plan}"


async def _open_and_close(path: Path) -> None:
    store = await SQLiteStore.open(f"sqlite:///{path}")
    await store.close()


async def test_compact_forms_keep_their_own_running_total(open_store: Opener) -> None:
    store = await open_store()
    long_output = tool("c1", "x" * 1000)
    short_form = tool("c1", "x…x")
    messages = [user("q"), assistant(None, ["c1"]), long_output, assistant("done")]
    hashes = chain_hashes(ROOT_HASH, messages)
    record = turn(None, messages)
    news = [NewMessage(m, 10, starts_unit(m), h) for m, h in zip(messages, hashes)]
    news[2] = NewMessage(long_output, 100, False, hashes[2], compact_body=short_form, compact_tokens=5)
    await store.record_turn(dataclasses.replace(record, messages=news))
    session = await store.get_session("t", "s")
    assert session is not None and (session.head_cum, session.head_compact_cum) == (130, 35)
    assert await store.totals_at(session, 3) == Totals(120, 25)
    stored = await store.active_range(session, 0, 4)
    assert stored[2].body == long_output and stored[2].compact == short_form
    assert stored[1].compact == stored[1].body  # no compact form: sent as stored
    # The tail read for a room of 30 tokens: only the last unit as stored (10), but from the call on
    # in compact form (10 + 5 + 10): the snapshot reads what either count may send.
    snap = await store.snapshot(session, 4, whole_last_unit=False, room=30)
    assert (snap.start, [m.seq for m in snap.messages]) == (1, [1, 2, 3])
    snap = await store.snapshot(session, 4, whole_last_unit=False, room=20)
    assert (snap.start, snap.totals_at(3)) == (3, Totals(120, 25))


def summary(covers: int, covers_hash: str, text: str = "s") -> Summary:
    return Summary(version=0, text=text, covers=covers, covers_hash=covers_hash, tokens=5,
                   replaced_tokens=50, model="small")


async def test_summaries_are_versioned_and_go_stale_when_their_history_changes(open_store: Opener) -> None:
    store, other = await open_store(), await open_store()
    history = [user("1"), assistant("a"), user("2"), assistant("b"), user("3"), assistant("c")]
    await store.record_turn(turn(None, history))
    session = await store.get_session("t", "s")
    assert session is not None
    hashes = chain_hashes(ROOT_HASH, history)
    assert await store.current_summary(session, 6) is None and session.summary_version == 0
    assert await store.newest_summary_version(session) == 0
    await store.save_summary(session, 0, summary(2, hashes[1], "first"))
    await store.save_summary(session, 1, summary(4, hashes[3], "second"))
    summarised = await other.get_session("t", "s")
    assert summarised is not None and summarised.summary_version == 2  # the session says it has some
    current = await other.current_summary(session, 6)
    assert current is not None and (current.version, current.text, current.covers) == (2, "second", 4)
    # A summary covering more than the messages kept is not used for them: the older one is.
    older = await other.current_summary(session, 3)
    assert older is not None and older.text == "first"
    with pytest.raises(StoreConflict):  # another version was saved meanwhile
        await store.save_summary(session, 1, summary(4, hashes[3]))
    with pytest.raises(StoreConflict):  # it covers messages that are not the active history
        await store.save_summary(session, 2, summary(4, chain_hashes(ROOT_HASH, [user("x")])[0]))
    # An edit at position 2 supersedes what "second" covers: "first" is used again.
    await store.record_turn(turn(session, [user("2 edited"), assistant("d")], base=2, base_hash=hashes[1]))
    edited = await store.get_session("t", "s")
    assert edited is not None
    rebased = await store.current_summary(edited, edited.length)
    assert rebased is not None and rebased.text == "first"
    assert [s.text for s in await other.summary_history(edited)] == ["first", "second"]
    # The version a fold saves after is the newest saved, "second", though "first" is in use.
    assert await other.newest_summary_version(edited) == 2
    await store.save_summary(edited, 2, summary(2, hashes[1], "third"))


async def test_the_oldest_schema_migrates_with_its_data(backend: StoreUnderTest) -> None:
    """A database left at the first migration, holding a conversation, takes every later migration
    when a store opens it, and goes on serving and recording that conversation."""
    first_id, first_sql = migrations(backend.kind)[0]
    if backend.kind == "postgres":
        await backend.query(f'CREATE SCHEMA "{backend.storage.schema}"')
    for statement in statements(first_sql):
        await backend.query(statement)
    await backend.query("CREATE TABLE schema_migrations (id TEXT PRIMARY KEY, applied_at REAL NOT NULL)")
    await backend.query("INSERT INTO schema_migrations VALUES (?, 0)", first_id)
    question = user("where is the lighthouse")
    [head] = chain_hashes(ROOT_HASH, [question])
    await backend.query("INSERT INTO sessions (tenant, session_id, created_at, updated_at, length, head_hash,"
                        " head_cum) VALUES ('t', 's', 0, 0, 1, ?, 12)", head)
    [(pk,)] = await backend.query("SELECT pk FROM sessions")
    await backend.query("INSERT INTO turns (session_pk, created_at, model, kind, context_tokens, latency_ms)"
                        " VALUES (?, 0, 'small', 'new', 12, 1.0)", pk)
    [(turn_id,)] = await backend.query("SELECT id FROM turns")
    await backend.query("INSERT INTO messages (session_pk, turn_id, seq, role, body, tokens, cum_before,"
                        " unit_start, chain_hash, created_at) VALUES (?, ?, 0, 'user', ?, 12, 0, 1, ?, 0)",
                        pk, turn_id, json.dumps(question), head)

    store = await backend.open()
    try:
        ids = [row[0] for row in await backend.query("SELECT id FROM schema_migrations ORDER BY id")]
        assert ids == [migration_id for migration_id, _ in migrations(backend.kind)]
        session = await store.get_session("t", "s")
        assert session is not None and session.head_compact_cum == 12
        [message] = await store.active_range(session, 0, 1)
        assert message.body == question
        assert (message.compact_tokens, message.compact_cum_before, message.compact_body) == (12, 0, None)
        assert await store.current_summary(session, 1) is None
        # Its text was indexed by the migration that made the index (0009_recall).
        assert (await store.recall_postings(session, ["lighthouse"], 1)).words == [{"s": [0]}]
        [line] = await store.recall_messages(session, [("s", 0, 0)], 1)  # its line, counted when recalled
        assert (line.text, line.tokens) == ("where is the lighthouse", None)
        await store.record_turn(turn(session, [assistant("a")]))  # new rows take fresh ids
        after = await store.get_session("t", "s")
        assert after is not None and after.length == 2
        assert [m.body for m in await store.active_range(after, 0, 2)] == [question, assistant("a")]
    finally:
        await store.close()


async def test_metadata_merges_from_two_stores_at_once_all_land(open_store: Opener) -> None:
    first, second = await open_store(), await open_store()
    await first.set_metadata("t", "s", {"kept": 1})
    merges = [(first if i % 2 else second).merge_metadata("t", "s", {f"k{i}": i}) for i in range(16)]
    results = await asyncio.gather(*merges)
    session = await first.get_session("t", "s")
    assert session is not None
    assert await second.get_metadata(session) == {"kept": 1, **{f"k{i}": i for i in range(16)}}
    assert sorted(len(r or {}) for r in results) == list(range(2, 18))  # each saw every merge before it
    assert await first.merge_metadata("t", "nobody", {"k": 1}) is None
    assert await first.get_session("t", "nobody") is None


async def test_a_write_to_an_expired_session_starts_it_afresh(open_store: Opener, backend: StoreUnderTest) -> None:
    store = await open_store()
    await store.record_turn(turn(None, [user("1"), assistant("a")], system=[{"role": "system", "content": "x"}]))
    await store.set_metadata("t", "s", {"old": True})
    old = await store.get_session("t", "s")
    assert old is not None
    # Not yet expired: the write keeps the history.
    assert await store.merge_metadata("t", "s", {"k": 1}, expired_before=old.updated_at - 1) == {"old": True, "k": 1}
    assert await store.merge_metadata("t", "s", {"k": 2}, expired_before=time.time() + 1) == {"k": 2}
    fresh = await store.get_session("t", "s")
    assert fresh is not None and (fresh.length, fresh.system, fresh.head_hash) == (0, None, "")
    assert await backend.query("SELECT count(*) FROM messages") == [(0,)]
    assert (await store.deleted_usage("t")).turns == 1
    await store.record_turn(turn(fresh, [user("2"), assistant("b")]))
    renewed = await store.get_session("t", "s")
    assert renewed is not None
    assert await store.clear_session(renewed, expired_before=time.time() + 1)
    assert await store.get_metadata(renewed) == {}
    assert (await store.deleted_usage("t")).turns == 2


async def test_deleting_sessions_keeps_their_usage_once(open_store: Opener) -> None:
    first, second = await open_store(), await open_store()
    for tenant, session_id in [("t", "a"), ("t", "b"), ("t", "c"), ("u", "a")]:
        await first.record_turn(turn(None, [user("1"), assistant("a")], tenant=tenant, session_id=session_id))
    session = await first.get_session("t", "a")
    assert session is not None
    await first.record_summary_call(session, SummaryCall("small", 200, Usage(180, 20), 12.5, cost=0.5))
    before = (await first.usage("t")).plus(await first.deleted_usage("t"))
    # Two stores deleting one session at once: it counts once.
    await asyncio.gather(first.delete_session(session), second.delete_session(session))
    deleted = await second.deleted_usage("t")
    assert (deleted.sessions, deleted.turns, deleted.summary_calls, deleted.cost) == (1, 1, 1, 0.5)
    assert (deleted.prompt_tokens, deleted.completion_tokens) == (7 + 180, 3 + 20)
    assert await second.prune(time.time() + 1, "t") == 2
    assert await second.delete_tenant("t") == 0
    current, deleted = await second.usage("t"), await second.deleted_usage("t")
    assert current.sessions == 0 and deleted.sessions == 3
    assert dataclasses.replace(deleted, sessions=before.sessions) == before
    assert (await second.deleted_usage("u")).sessions == 0 and (await second.usage("u")).turns == 1
    assert (await second.deleted_usage(None)).turns == 3


async def test_a_turn_planned_on_an_expired_session_restarts_it_only_if_it_still_is(open_store: Opener) -> None:
    store = await open_store()
    await store.record_turn(turn(None, [user("old"), assistant("a")]))
    old = await store.get_session("t", "s")
    assert old is not None
    cutoff = old.updated_at + 1e-6  # the turn was planned when the session had idled past this
    await store.record_turn(dataclasses.replace(turn(None, [user("new"), assistant("b")]), expired_before=cutoff))
    session = await store.get_session("t", "s")
    assert session is not None and [m.body for m in await store.active_range(session, 0, 9)] == [
        user("new"), assistant("b")]
    assert (await store.deleted_usage("t")).turns == 1

    # The next turn is planned on it as expired too, but a metadata write restarts it first: the
    # turn then continues the restarted session instead of deleting what that write stored.
    cutoff = session.updated_at + 1e-6
    await store.set_metadata("t", "s", {"step": 1}, expired_before=cutoff)
    await store.record_turn(dataclasses.replace(turn(None, [user("later"), assistant("c")]), expired_before=cutoff))
    session = await store.get_session("t", "s")
    assert session is not None and await store.get_metadata(session) == {"step": 1}
    assert [m.body for m in await store.active_range(session, 0, 9)] == [user("later"), assistant("c")]
    assert (await store.deleted_usage("t")).turns == 2


def test_sessions_summarised_before_0007_know_their_summary_version(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    before = [(migration_id, sql) for migration_id, sql in migrations() if migration_id < "0007"]
    with closing(sqlite3.connect(path)) as db:
        for _, sql in before:
            db.executescript(sql)
        db.execute("CREATE TABLE schema_migrations (id TEXT PRIMARY KEY, applied_at REAL NOT NULL)")
        db.executemany("INSERT INTO schema_migrations VALUES (?, 0)", [(m,) for m, _ in before])
        db.execute("INSERT INTO sessions (pk, tenant, session_id, created_at, updated_at)"
                   " VALUES (1, 't', 'summarised', 0, 0), (2, 't', 'not', 0, 0)")
        db.executemany("INSERT INTO summaries (session_pk, version, text, covers, covers_hash, tokens,"
                       " replaced_tokens, model, created_at) VALUES (1, ?, 'x', 1, 'h', 1, 2, 'm', 0)",
                       [(1,), (2,)])
        db.commit()

    async def check() -> None:
        store = await SQLiteStore.open(f"sqlite:///{path}")
        try:
            sessions = [await store.get_session("t", name) for name in ("summarised", "not")]
            assert [s.summary_version if s else None for s in sessions] == [2, 0]
        finally:
            await store.close()

    asyncio.run(check())


async def test_sqlite_runs_nothing_on_the_event_loops_thread(tmp_path: Path) -> None:
    """Every statement of a turn, its reads and a checkpoint runs on a connection's own thread
    (aiosqlite), never on the thread running the event loop."""
    import threading

    store = await SQLiteStore.open(f"sqlite:///{tmp_path / 'threads.db'}")
    backend: Any = getattr(store, "_db")
    seen: list[tuple[int, str]] = []
    for conn in {id(c): c for c in (backend._writer, backend._reader, backend._checkpointer)}.values():
        await conn.set_trace_callback(lambda sql: seen.append((threading.get_ident(), sql)))
    try:
        await store.record_turn(turn(None, [user("q0"), assistant("a0")]))
        session = await store.get_session("t", "s")
        assert session is not None and session.head_message == assistant("a0")
        await store.record_turn(turn(session, [user("q1"), assistant("a1")]))
        session = await store.get_session("t", "s")
        assert session is not None
        await store.snapshot(session, session.length, False, 10_000)
        for k in range(_CHECKPOINT_EVERY):
            await store.record_turn(turn(None, [user(f"q{k}"), assistant(f"a{k}")], session_id=f"o{k}"))
        if backend._checkpointing is not None:
            await backend._checkpointing
    finally:
        await store.close()
    statements_seen = [sql for _, sql in seen]
    assert any("wal_checkpoint" in sql for sql in statements_seen)
    assert any(sql.startswith("INSERT INTO messages") for sql in statements_seen)
    assert threading.get_ident() not in {thread for thread, _ in seen}


async def test_turns_written_together_are_each_whole_and_a_moved_one_goes_its_own_way(open_store: Opener) -> None:
    """Turns recorded at once (on SQLite, one transaction and one commit for the batches queued
    together): every one is stored whole on its own session; one planned against a head that has
    since moved is rebased or refused by itself, and the others are kept."""
    store, other = await open_store(), await open_store()
    for k in range(6):
        await store.record_turn(turn(None, [user(f"q{k}"), assistant(f"a{k}")], session_id=f"s{k}"))
    sessions = [await store.get_session("t", f"s{k}") for k in range(6)]
    # Another writer moves s0 after this store read it: s0's planned turn no longer fits its batch.
    await other.record_turn(turn(sessions[0], [user("elsewhere"), assistant("moved")], session_id="s0"))
    edit = turn(sessions[1], [user("edited"), assistant("e")], base=0, session_id="s1")
    await other.record_turn(turn(sessions[1], [user("q1b"), assistant("a1b")], session_id="s1"))
    results = await asyncio.gather(
        store.record_turn(turn(sessions[0], [user("late"), assistant("l")], session_id="s0")),  # continues: rebased
        store.record_turn(edit),  # an edit against a moved head: refused
        *(store.record_turn(turn(sessions[k], [user(f"r{k}"), assistant(f"b{k}")], session_id=f"s{k}"))
          for k in range(2, 6)),
        *(store.record_turn(turn(None, [user(f"n{k}"), assistant(f"c{k}")], session_id=f"n{k}")) for k in range(4)),
        return_exceptions=True)
    assert results[0] is None and isinstance(results[1], StoreConflict)
    assert all(r is None for r in results[2:]), results
    s0 = await store.get_session("t", "s0")
    assert s0 is not None
    assert [m.body for m in await store.active_range(s0, 0, s0.length)] == [
        user("q0"), assistant("a0"), user("elsewhere"), assistant("moved"), user("late"), assistant("l")]
    s1 = await store.get_session("t", "s1")
    assert s1 is not None and s1.length == 4  # the edit wrote nothing
    for k in range(2, 6):
        session = await store.get_session("t", f"s{k}")
        assert session is not None
        assert [m.body for m in await store.active_range(session, 0, session.length)] == [
            user(f"q{k}"), assistant(f"a{k}"), user(f"r{k}"), assistant(f"b{k}")]
        records = await store.export_session(session)
        turn_ids = [r["id"] for r in records if r["type"] == "turn"]
        assert [r["turn"] for r in records if r["type"] == "message"] == [turn_ids[0]] * 2 + [turn_ids[1]] * 2
    for k in range(4):
        session = await store.get_session("t", f"n{k}")
        assert session is not None and session.length == 2


async def test_an_export_is_the_session_at_one_moment_while_turns_land(open_store: Opener) -> None:
    """Exports (and so forks) read by a replica while another writes turns: each holds the session
    as it was at one moment, never a message of a turn it lacks or a head its messages do not reach."""
    writer, reader = await open_store(), await open_store()
    await writer.record_turn(turn(None, [user("q0"), assistant("a0")]))
    exported = []
    for i in range(1, 25):  # each export read while a turn is written
        session, seen = await writer.get_session("t", "s"), await reader.get_session("t", "s")
        assert seen is not None
        _, records = await asyncio.gather(writer.record_turn(turn(session, [user(f"q{i}"), assistant(f"a{i}")])),
                                          reader.export_session(seen))
        exported.append(records)
    for records in exported:
        assert from_jsonl(to_jsonl(records)) == records  # every relation holds
    assert len({len(records) for records in exported}) > 1  # the turns landed in between


async def test_the_snapshot_read_with_the_session_is_the_snapshot_at_its_head(open_store: Opener) -> None:
    """`load` reads the session and its snapshot at the head at once: for every room up to the one
    it was read for, and either rule for the last unit, `Loaded.snapshot` gives what `snapshot`
    does (the same marks, totals and summary, and every message `snapshot` reads); a base before
    the head, a larger room, or a newest summary an edit left stale is never answered from it."""
    store = await open_store()
    history: list[Message] = []
    for k in range(12):  # units of varied sizes, one a tool loop
        history += [user(f"q{k} " + "w" * (k % 4) * 40), assistant(f"a{k}")]
    history += [user("call"), assistant(None, ["c1"]), tool("c1", "result " * 30)]
    await store.record_turn(turn(None, history, tokens=10))
    session = await store.get_session("t", "s")
    assert session is not None and await store.load("t", "nobody", 1000) is None
    hashes = chain_hashes(ROOT_HASH, history)
    for summarised in (False, True):
        if summarised:
            await store.save_summary(session, 0, summary(6, hashes[5]))
            session = await store.get_session("t", "s")
            assert session is not None
        for loaded_room in (60, 150, 1000):
            loaded = await store.load("t", "s", loaded_room)
            assert loaded is not None and loaded.session == session
            assert loaded.snapshot(session.length - 1, False, loaded_room) is None
            assert loaded.snapshot(session.length, False, loaded_room + 1) is None
            for room in range(0, loaded_room + 1, 15):
                for whole_last_unit in (False, True):
                    got = loaded.snapshot(session.length, whole_last_unit, room)
                    want = await store.snapshot(session, session.length, whole_last_unit, room)
                    assert got is not None
                    assert (got.base, got.base_totals, got.must_start, got.last_user, got.summary,
                            got.summary_totals) == (want.base, want.base_totals, want.must_start,
                                                    want.last_user, want.summary, want.summary_totals)
                    assert got.start <= want.start
                    assert got.messages[got.index(want.start):] == want.messages
    # An edit leaves the newest summary's history behind: the read cannot tell which one is in use.
    edit = turn(session, [user("edited"), assistant("e")], base=4)
    await store.record_turn(edit)
    session = await store.get_session("t", "s")
    assert session is not None and session.length == 6
    loaded = await store.load("t", "s", 1000)
    assert loaded is not None and not loaded.summary_known
    assert loaded.snapshot(session.length, False, 1000) is None
    assert (await store.snapshot(session, session.length, False, 1000)).summary is None  # none in use


async def test_the_history_cache_never_serves_a_stale_history(open_store: Opener, backend: StoreUnderTest) -> None:
    """A store keeps each session's messages between turns and reads only what is new
    (`memproxy.store.history_cache`). Whatever happens to the session meanwhile, through another
    store on the same database (another replica), what it loads is what a store without the cache
    loads: after turns, an edit, a summary and the message cap, a larger room, a clear, a deletion
    followed by the same messages again (the same chain hashes, other token counts), a deletion and
    new messages unseen in between, a fork and an import written under the cached session's id.
    Nor does what the planner keeps of the history as sent, made from the cached messages
    (`memory.sent`): it is what working it out afresh from the uncached ones gives."""
    cached, writer = await open_store(), await open_store()
    uncached = await open_store(history_cache_mb=0)  # closed by the fixture, whatever fails
    history = [m for k in range(6) for m in (user(f"q{k}"), assistant(f"a{k}"))]
    histories = SentHistories()

    async def same(room: int = 1000) -> SessionState | None:
        got, want = await cached.load("t", "s", room), await uncached.load("t", "s", room)
        assert got == want
        if got is not None and want is not None and got.messages:
            kept, afresh = histories.older(got.messages, True, 1, COUNTER), older(want.messages, True, 1, COUNTER)
            assert (kept.bodies, kept.tokens, kept.saved) == (afresh.bodies, afresh.tokens, afresh.saved)
        return None if want is None else want.session

    await writer.record_turn(turn(None, history))
    session = await same()
    assert session is not None and len(cached._history) == 1  # type: ignore[attr-defined]
    await writer.record_turn(turn(session, [user("next"), assistant("n")]))  # another replica's turn
    session = await same()
    assert session is not None and session.length == 14
    await writer.record_turn(turn(session, [user("edited"), assistant("e")], base=6))  # an edit
    session = await same()
    assert session is not None and session.length == 8
    await writer.save_summary(session, 0, summary(6, session_hashes(await writer.active_range(session, 0, 6))[5]))
    session = await writer.get_session("t", "s")
    assert session is not None and await writer.cap_messages(session, 4) > 0  # the cap deletes the oldest
    await same()
    await same(room=30)  # a room that reaches only the newest messages, then one that reaches them all
    session = await same(room=1000)
    assert session is not None
    assert await writer.clear_session(session)
    assert await same() is not None
    await writer.record_turn(turn(None, history, tokens=10))
    session = await same()
    assert session is not None
    await writer.delete_session(session)
    assert await same() is None
    await writer.record_turn(turn(None, history, tokens=20))  # the same hashes, other rows
    loaded = await cached.load("t", "s", 1000)
    assert loaded is not None and [m.tokens for m in loaded.messages] == [20] * len(history)
    session = await same()
    assert session is not None
    # Deleted and written again with as many messages, unseen by the cached store meanwhile: on
    # SQLite the new rows take the deleted rows' ids (and the session its row's), which the
    # session's creation time tells apart.
    await writer.delete_session(session)
    await writer.record_turn(turn(None, [user(f"new {m['content']}") for m in history], tokens=30))
    session = await same()
    assert session is not None
    # A fork of another session, then an import, each written where the cached session was.
    await writer.record_turn(turn(None, [user("other"), assistant("o"), user("more"), assistant("m")],
                                  session_id="other"))
    other = await writer.get_session("t", "other")
    assert other is not None
    await writer.delete_session(session)
    await admin.fork(writer, other, "t", "s", at=2)
    session = await same()
    assert session is not None and session.length == 2
    records = await writer.export_session(other)
    await writer.delete_session(session)
    await writer.import_session("t", "s", records)
    session = await same()
    assert session is not None and session.length == 4
    # Deleted, its older export imported again and continued by another writer: the import keeps
    # the creation time, and on SQLite the continuation's rows take the very ids the deleted rows
    # had. Only the row's incarnation tells the two apart.
    earlier = await writer.export_session(session)
    await writer.record_turn(turn(session, [user("old topic"), assistant("old answer")]))
    session = await same()
    assert session is not None
    await writer.delete_session(session)
    await writer.import_session("t", "s", earlier)
    restored = await writer.get_session("t", "s")
    assert restored is not None and restored.incarnation != session.incarnation
    await writer.record_turn(turn(restored, [user("new topic"), assistant("new answer")]))
    await same()
    loaded = await cached.load("t", "s", 1000)
    assert loaded is not None and [m.body for m in loaded.messages][-2:] == [user("new topic"), assistant("new answer")]


def session_hashes(messages: list[StoredMessage]) -> list[str]:
    return [m.chain_hash for m in messages]


async def test_writes_queued_behind_a_lock_held_elsewhere_wait_one_busy_timeout(tmp_path: Path) -> None:
    """SQLite: another process holds the write lock past `busy_timeout_ms` while turns queue for the
    writer. Each gets `StoreUnavailable` after one busy timeout, not one per turn queued before it
    (the writes queued together were tried again round after round, each round waiting as long)."""
    busy = 0.4
    store = await SQLiteStore.open(f"sqlite:///{tmp_path / 'held.db'}", busy_timeout_ms=int(busy * 1000))
    try:
        with write_lock_held(StorageConfig(url=f"sqlite:///{tmp_path / 'held.db'}")):
            started = time.monotonic()
            results = await asyncio.gather(*(store.record_turn(turn(None, [user(f"q{k}"), assistant("a")],
                                                                    session_id=f"s{k}")) for k in range(6)),
                                           return_exceptions=True)
            elapsed = time.monotonic() - started
        assert all(isinstance(r, StoreUnavailable) for r in results), results
        # The first alone (the writer was idle), then the five queued behind it together: two waits.
        assert elapsed < 3 * busy, elapsed
        await store.record_turn(turn(None, [user("q"), assistant("a")]))  # the lock gone, writes go on
    finally:
        await store.close()


async def test_a_turn_that_fills_the_disk_is_absent_whole_alone_or_written_with_others(tmp_path: Path) -> None:
    """SQLite: a turn whose write runs out of room halfway (SQLite may roll back the whole
    transaction then) leaves nothing of itself, written alone or together with others; the turns
    written with it are stored whole, and once there is room again the same turn is written."""
    store = await SQLiteStore.open(f"sqlite:///{tmp_path / 'full.db'}")
    try:
        for k in range(3):
            await store.record_turn(turn(None, [user(f"q{k}"), assistant(f"a{k}")], session_id=f"s{k}"))
        sessions = [await store.get_session("t", f"s{k}") for k in range(3)]
        before = [await store.export_session(s) for s in sessions if s is not None]
        writer = store._db._writer  # type: ignore[attr-defined]  # the one connection that writes
        [(pages,)] = await writer.execute_fetchall("PRAGMA page_count")
        await writer.execute_fetchall(f"PRAGMA max_page_count = {pages + 16}")  # room for small turns only
        big = [user("x " * 200_000), assistant("too big")]

        def small(k: int) -> TurnRecord:
            return turn(sessions[k], [user(f"r{k}"), assistant(f"b{k}")], session_id=f"s{k}")

        with pytest.raises(StoreUnavailable):  # alone: the idle writer takes it at once
            await store.record_turn(turn(sessions[0], big, session_id="s0"))
        results = await asyncio.gather(
            store.record_turn(small(1)), store.record_turn(turn(sessions[0], big, session_id="s0")),
            store.record_turn(small(2)), return_exceptions=True)
        assert results[0] is None and isinstance(results[1], StoreUnavailable) and results[2] is None, results
        assert await store.export_session(sessions[0]) == before[0]  # type: ignore[arg-type]
        for k in (1, 2):
            session = await store.get_session("t", f"s{k}")
            assert session is not None
            assert [m.body for m in await store.active_range(session, 0, session.length)] == [
                user(f"q{k}"), assistant(f"a{k}"), user(f"r{k}"), assistant(f"b{k}")]
        await writer.execute_fetchall("PRAGMA max_page_count = 1073741823")
        await store.record_turn(turn(sessions[0], big, session_id="s0"))
        s0 = await store.get_session("t", "s0")
        assert s0 is not None and [m.body for m in await store.active_range(s0, 0, s0.length)][2:] == big
    finally:
        await store.close()


async def test_refreshing_statistics_changes_nothing_stored_and_informs_the_planner_where_it_plans_by_them(
    backend: StoreUnderTest, open_store: Opener
) -> None:
    """`memproxy migrate-store` ends with it: on PostgreSQL the copied tables are analysed (a table
    never analysed has `reltuples` -1, and a few rows are too few for autovacuum to analyse them);
    SQLite, whose statements are written for plans made without statistics, gathers none."""
    writer = await open_store()
    await writer.record_turn(turn(None, [user("q"), assistant("a")]))
    session = await writer.get_session("t", "s")
    assert session is not None
    before = await writer.export_session(session)
    if backend.kind == "postgres":
        assert await backend.query("SELECT reltuples FROM pg_class WHERE oid = to_regclass('messages')") == [(-1,)]

    await writer.refresh_statistics()

    reader = await open_store()
    session = await reader.get_session("t", "s")
    assert session is not None and await reader.export_session(session) == before
    if backend.kind == "postgres":
        assert await backend.query("SELECT reltuples FROM pg_class WHERE oid = to_regclass('messages')") == [(2,)]
    else:
        assert await backend.query("SELECT name FROM sqlite_master WHERE name LIKE 'sqlite_stat%'") == []
