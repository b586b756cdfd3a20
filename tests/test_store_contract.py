"""The contract every Store backend keeps, run against each backend (SQLite today).

Writes are checked from a second, independent store on the same database, so what is asserted is
what was committed, not what one connection happens to see.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from memproxy.errors import Conflict
from memproxy.messages import ROOT_HASH, Message, chain_hashes, starts_unit
from memproxy.store import NewMessage, SessionState, SQLiteStore, Store, TurnRecord, Usage
from memproxy.store.sqlite import QUERIES

Opener = Callable[[], Awaitable[Store]]


@pytest.fixture(params=["sqlite"])
async def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Opener]:
    opened: list[Store] = []
    url = f"sqlite:///{tmp_path / 'contract.db'}"

    async def opener() -> Store:
        store = await SQLiteStore.open(url)
        opened.append(store)
        return store

    yield opener
    for store in opened:
        await store.close()


def user(text: str) -> Message:
    return {"role": "user", "content": text}


def assistant(text: str | None, calls: list[str] | None = None) -> Message:
    message: Message = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [{"id": c, "type": "function", "function": {"name": "f", "arguments": "{}"}}
                                 for c in calls]
    return message


def tool(call_id: str, text: str) -> Message:
    return {"role": "tool", "tool_call_id": call_id, "content": text}


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
        base=base, base_cum=base * tokens, base_hash=base_hash,
        messages=[NewMessage(m, tokens, starts_unit(m), h) for m, h in zip(messages, hashes)],
        system=system, history_mode=extra.pop("history_mode", None), model="small", kind="test",
        context_tokens=123, latency_ms=1.5, usage=Usage(7, 3),
    )


async def test_blank_database_gets_every_migration_once(open_store: Opener, tmp_path: Path) -> None:
    await open_store()
    await open_store()  # opening again applies nothing twice
    with sqlite3.connect(tmp_path / "contract.db") as db:
        ids = [row[0] for row in db.execute("SELECT id FROM schema_migrations")]
        mode = db.execute("PRAGMA journal_mode").fetchone()[0]
    assert ids == ["0001_initial"]
    assert mode == "wal"


async def test_unknown_session_is_none(open_store: Opener) -> None:
    store = await open_store()
    assert await store.get_session("t", "nope") is None
    await store.ping()


async def test_recorded_turn_is_committed_and_visible_to_another_store(open_store: Opener) -> None:
    writer, reader = await open_store(), await open_store()
    system = [{"role": "system", "content": "be brief"}]
    await writer.record_turn(turn(None, [user("hi"), assistant("hello")], system=system, history_mode="full"))
    session = await reader.get_session("t", "s")
    assert session is not None
    assert (session.length, session.head_cum, session.system, session.history_mode) == (2, 20, system, "full")
    assert session.head_hash == chain_hashes(ROOT_HASH, [user("hi"), assistant("hello")])[-1]
    stored = await reader.active_range(session, 0, 2)
    assert [m.body for m in stored] == [user("hi"), assistant("hello")]
    assert [(m.seq, m.tokens, m.cum_before) for m in stored] == [(0, 10, 0), (1, 10, 10)]


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
    assert await store.cum_at(session, 0) == 0
    assert await store.cum_at(session, 4) == 40
    assert await store.cum_at(session, 7) == 70
    # Tool results are not unit starts: the unit holding position 3 starts at the call, position 1.
    assert await store.last_unit_start(session, 4) == 1
    assert await store.last_unit_start(session, 0) == 0
    assert await store.first_fitting_unit_start(session, 0, 15) == 4
    assert await store.first_fitting_unit_start(session, 0, 0) == 0
    assert await store.first_fitting_unit_start(session, 0, 71) is None


async def test_fork_supersedes_the_tail_and_keeps_it(open_store: Opener, tmp_path: Path) -> None:
    store = await open_store()
    await store.record_turn(turn(None, [user("1"), assistant("a"), user("2"), assistant("b")]))
    session = await store.get_session("t", "s")
    assert session is not None
    base_hash = chain_hashes(ROOT_HASH, [user("1"), assistant("a")])[-1]
    await store.record_turn(turn(session, [user("2 edited"), assistant("c")], base=2, base_hash=base_hash))
    after = await (await open_store()).get_session("t", "s")
    assert after is not None and after.length == 4
    assert [m.body["content"] for m in await store.active_range(after, 0, 4)] == ["1", "a", "2 edited", "c"]
    with sqlite3.connect(tmp_path / "contract.db") as db:
        rows = db.execute("SELECT seq, active FROM messages ORDER BY id").fetchall()
    assert rows == [(0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]


async def test_stale_turn_is_refused_and_changes_nothing(open_store: Opener, tmp_path: Path) -> None:
    store = await open_store()
    await store.record_turn(turn(None, [user("1"), assistant("a")]))
    stale = await store.get_session("t", "s")
    await store.record_turn(turn(stale, [user("2"), assistant("b")]))
    with pytest.raises(Conflict):
        await store.record_turn(turn(stale, [user("2 again"), assistant("c")]))
    with sqlite3.connect(tmp_path / "contract.db") as db:
        assert db.execute("SELECT count(*) FROM messages").fetchone()[0] == 4
        assert db.execute("SELECT count(*) FROM turns").fetchone()[0] == 2


async def test_concurrent_writers_on_one_session_one_wins(open_store: Opener, tmp_path: Path) -> None:
    first, second = await open_store(), await open_store()
    await first.record_turn(turn(None, [user("1"), assistant("a")]))
    session = await first.get_session("t", "s")
    results = await asyncio.gather(
        first.record_turn(turn(session, [user("x"), assistant("x")])),
        second.record_turn(turn(session, [user("y"), assistant("y")])),
        return_exceptions=True,
    )
    assert sorted(type(r).__name__ for r in results) == ["Conflict", "NoneType"]
    with sqlite3.connect(tmp_path / "contract.db") as db:
        assert db.execute("SELECT count(*) FROM messages WHERE active = 1").fetchone()[0] == 4
        seqs = [r[0] for r in db.execute("SELECT seq FROM messages WHERE active = 1 ORDER BY seq")]
    assert seqs == [0, 1, 2, 3]


async def test_usage_and_system_prompt_are_kept(open_store: Opener, tmp_path: Path) -> None:
    store = await open_store()
    system = [{"role": "developer", "content": "rules"}]
    await store.record_turn(turn(None, [user("1"), assistant("a")], system=system))
    session = await store.get_session("t", "s")
    await store.record_turn(turn(session, [user("2"), assistant("b")], system=None))
    after = await store.get_session("t", "s")
    assert after is not None and after.system == system  # a turn without a system prompt keeps the last
    with sqlite3.connect(tmp_path / "contract.db") as db:
        usage = db.execute("SELECT prompt_tokens, completion_tokens, model FROM turns").fetchall()
    assert usage == [(7, 3, "small"), (7, 3, "small")]


def test_queries_that_serve_a_turn_use_indexes(tmp_path: Path) -> None:
    """No query on the hot path scans a table: its cost follows the request, not the history."""
    asyncio.run(_open_and_close(tmp_path / "plans.db"))
    with sqlite3.connect(tmp_path / "plans.db") as db:
        for name, sql in QUERIES.items():
            sql = sql.format(marks="?,?,?")
            params = [1] * sql.count("?")
            plan = " | ".join(row[3] for row in db.execute(f"EXPLAIN QUERY PLAN {sql}", params))
            assert "SCAN" not in plan.replace("SCAN CONSTANT", ""), f"{name}: {plan}"
            assert "INDEX" in plan, f"{name}: {plan}"


async def _open_and_close(path: Path) -> None:
    store = await SQLiteStore.open(f"sqlite:///{path}")
    await store.close()
