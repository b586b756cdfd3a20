"""PostgreSQL faults that must end in bounded time, and a write that must stand.

- A turn whose transaction committed is stored, and said to be, even when its connection dies on the
  way back to the pool (asyncpg's reset query fails after the COMMIT).
- A row another client keeps locked (a `SELECT ... FOR UPDATE` left open in psql) is a 503
  `store_unavailable` for what must lock it, and an answered turn not stored, within
  `storage.lock_timeout_ms`; the rest of the proxy, the pool included, keeps serving.
- A server that stops answering (a relay of the test's own that holds every byte, connections left
  open) is a 503 within `storage.pool_timeout_ms` plus `statement_timeout_ms`, `/readyz` included, or
  a turn without memory under `on_failure: passthrough`; the proxy recovers once it answers again.
- A replica frozen in the middle of a write (its event loop stopped, as a paused VM's would be) holds
  its session's lock until the server ends its idle transaction (`idle_in_transaction_timeout_ms`).

All on the machine's PostgreSQL; nothing of asyncpg is replaced. The one hook is the pool's
documented `reset` coroutine, which asyncpg runs as it takes a connection back after use.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import aiohttp
import asyncpg
import openai
import pytest

from conftest import PROXY_KEY, Proxy, make_config
from db import connect, rows, run_async
from fake_upstream import FakeUpstream
from helpers import assistant, chat, user
from memproxy.config import Config, StorageConfig
from memproxy.store import StoreUnavailable, open_store
from memproxy.store.errors import translated
from memproxy.store.postgres import PostgresBackend, PostgresStore
from memproxy.store.sql import Script
from relay import Relay, through
from test_store_contract import turn

HANG = 15.0  # past this a call is taken to hang: each bound tested here is far below it
SLACK = 1.5  # what a bounded call may take beyond its configured limits (a busy test machine)
StartProxy = Callable[[Config], Any]


@pytest.fixture
def store_kind() -> str:
    return "postgres"


# --- a committed write stands ----------------------------------------------------------------------


async def test_a_committed_write_stands_when_its_connection_dies_on_the_way_back_to_the_pool(
    storage: StorageConfig, caplog: pytest.LogCaptureFixture,
) -> None:
    await (await open_store(storage)).close()  # migrated
    killer = await connect(storage)
    doomed = threading.Event()  # the next connection given back dies first

    async def reset(conn: asyncpg.Connection) -> None:
        """asyncpg's own reset, run on a connection whose backend ended right after the COMMIT."""
        if doomed.is_set():
            doomed.clear()
            # The 5 s: pg_terminate_backend waits until the backend has exited.
            assert await killer.fetchval("SELECT pg_terminate_backend($1, 5000)", conn.get_server_pid())
        await conn.reset()

    pool = await asyncpg.create_pool(storage.url, min_size=1, max_size=1, reset=reset,
                                     server_settings={"search_path": f'"{storage.schema}"'})
    store = PostgresStore(PostgresBackend(pool))
    try:
        doomed.set()
        await store.record_turn(turn(None, [user("q1"), assistant("a1")]))  # a batch
        doomed.set()
        await store.set_metadata("t", "s", {"step": 1})  # a script
        doomed.set()
        session = await store.get_session("t", "s")  # a read
        assert not doomed.is_set()  # each of the three gave back a connection that died
        assert session is not None and session.length == 2
        stored = rows(storage, "SELECT body FROM messages ORDER BY seq")
        assert [body for (body,) in stored] == ['{"role":"user","content":"q1"}', '{"role":"assistant","content":"a1"}']
        assert rows(storage, "SELECT metadata FROM sessions") == [('{"step":1}',)]
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        # The error's class only: which one depends on when asyncpg notices the socket closed.
        assert len(warned) == 3 and all(re.fullmatch(r"a store connection failed as it went back to the pool"
                                                     r" \(\w+\); it is replaced", w) for w in warned), warned
        # The pool replaced the connection each time.
        await store.record_turn(turn(session, [user("q2"), assistant("a2")]))
        assert rows(storage, "SELECT length FROM sessions") == [(4,)]
    finally:
        await store.close()
        await killer.close()


def test_asyncpgs_broken_protocol_state_is_the_stores_failure() -> None:
    """What asyncpg raises when a connection lost mid-operation leaves its protocol in a state it
    cannot leave ("cannot switch to state 15; another operation (2) is in progress") is a sick
    store (503 store_unavailable), not a bug (500)."""
    with pytest.raises(StoreUnavailable) as caught, translated():
        raise asyncpg.InternalClientError("cannot switch to state 15; another operation (2) is in progress")
    assert str(caught.value) == "the store failed: InternalClientError"


# --- helpers for the bounded waits -----------------------------------------------------------------


async def api(proxy: Proxy, method: str, path: str) -> int:
    async with aiohttp.ClientSession() as http:
        async with http.request(method, f"{proxy.url}{path}", headers={"Authorization": f"Bearer {PROXY_KEY}"}) \
                as response:
            if response.status != 200:
                body = await response.json()
                assert body["error"]["code"] == "store_unavailable" and body["error"]["type"] == "server_error", body
            return response.status


async def ready(proxy: Proxy) -> int:
    async with aiohttp.ClientSession() as http:
        async with http.get(proxy.server.make_url("/readyz")) as response:
            return response.status


async def turn_status(proxy: Proxy, session: str, text: str) -> tuple[int, dict[str, str]]:
    """A plain turn's status and memproxy's headers; a 503 must be the store's, OpenAI-shaped."""
    try:
        raw = await proxy.client(session).chat.completions.with_raw_response.create(
            model="small", messages=[user(text)], extra_headers={"X-Memproxy-History": "new"})
    except openai.APIStatusError as exc:
        body = exc.response.json()
        assert body == {"error": {"message": body["error"]["message"], "type": "server_error",
                                  "code": "store_unavailable", "param": None}}
        return exc.status_code, {}
    return raw.http_response.status_code, {k: v for k, v in raw.headers.items() if k.startswith("x-memproxy-")}


async def timed(*calls: Any) -> tuple[list[Any], float]:
    """The calls' results, run at once, and how long the slowest took (failing past `HANG`)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    results = await asyncio.wait_for(asyncio.gather(*calls), HANG)
    return list(results), loop.time() - started


def session_rows(storage: StorageConfig, session_id: str) -> list[tuple[Any, ...]]:
    """Everything stored of one session: its row, its turns and its messages."""
    return rows(storage, "SELECT s.length, s.head_hash, s.summary_version, t.id, t.kind, m.id, m.active, m.body"
                         " FROM sessions s LEFT JOIN turns t ON t.session_pk = s.pk"
                         " LEFT JOIN messages m ON m.turn_id = t.id WHERE s.session_id = ? ORDER BY t.id, m.id",
                session_id)


# --- a row another client keeps locked -------------------------------------------------------------


async def test_a_row_another_client_keeps_locked_is_a_503_in_bounded_time_and_nothing_half_written(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream,
) -> None:
    # The statement limit far above the lock's: only lock_timeout_ms can end these waits in time.
    limited = replace(storage, lock_timeout_ms=300, statement_timeout_ms=60_000, pool_max_size=2)
    proxy: Proxy = await start_proxy(make_config(limited, upstream.url))
    for session in ("locked", "free"):
        await chat(proxy.client(session), [user(f"{session} one")])
    before = session_rows(storage, "locked")
    holder = await connect(storage)
    try:
        async with holder.transaction():  # psql's BEGIN; SELECT ... FOR UPDATE, left open
            await holder.execute("SELECT pk FROM sessions WHERE session_id = 'locked' FOR UPDATE")
            # More calls waiting on the lock than the pool has connections, and others beside them.
            results, took = await timed(
                api(proxy, "POST", "/sessions/locked/clear"), api(proxy, "GET", "/sessions/locked/export"),
                api(proxy, "POST", "/sessions/locked/clear"), turn_status(proxy, "locked", "locked two"),
                turn_status(proxy, "free", "free two"), ready(proxy))
            assert took < 2 * 0.3 + SLACK, took
            clear, export, clear_again, locked_turn, free_turn, readiness = results
            assert (clear, export, clear_again, readiness) == (503, 503, 503, 200)
            assert locked_turn == (200, {**locked_turn[1], "x-memproxy-stored": "false"})  # answered, not kept
            assert free_turn == (200, {**free_turn[1], "x-memproxy-stored": "true"})
            assert session_rows(storage, "locked") == before  # nothing of any of them, half or whole
    finally:
        await holder.close()
    assert await api(proxy, "POST", "/sessions/locked/clear") == 200  # the lock gone, all is as before
    assert (await turn_status(proxy, "locked", "locked three"))[1]["x-memproxy-stored"] == "true"


# --- a server that stops answering -----------------------------------------------------------------


@pytest.fixture
async def relay(storage: StorageConfig) -> AsyncIterator[Relay]:
    started = await Relay.to(storage)
    yield started
    await started.close()


async def test_a_server_that_stops_answering_is_a_503_within_the_limits_and_the_proxy_recovers(
    start_proxy: StartProxy, storage: StorageConfig, relay: Relay, upstream: FakeUpstream,
) -> None:
    limited = replace(through(storage, relay), pool_min_size=1, pool_max_size=2, pool_timeout_ms=1000,
                      statement_timeout_ms=1000)
    proxy: Proxy = await start_proxy(make_config(limited, upstream.url))
    passthrough: Proxy = await start_proxy(make_config(replace(limited, on_failure="passthrough"), upstream.url))
    for each in (proxy, passthrough):
        await chat(each.client("warm"), [user("warm")])  # a connection of each pool is open, idle
    sent = len(upstream.chat_requests())

    relay.stall()
    # More turns than the pool has connections: those that get none wait pool_timeout_ms at most.
    results, took = await timed(*(turn_status(proxy, f"s{i}", "stalled") for i in range(4)), ready(proxy),
                                turn_status(passthrough, "p", "stalled"))
    assert took < 1.0 + 1.0 + SLACK, took
    *turns, readiness, (status, headers) = results
    assert turns == [(503, {})] * 4 and readiness == 503
    assert status == 200 and headers["x-memproxy-memory"] == "unavailable"  # answered without memory
    assert len(upstream.chat_requests()) == sent + 1  # the passthrough turn only

    relay.resume()
    deadline = asyncio.get_running_loop().time() + HANG
    while await ready(proxy) != 200:  # new connections replace the abandoned ones
        assert asyncio.get_running_loop().time() < deadline, "the proxy never became ready again"
    status, headers = await turn_status(proxy, "s0", "answered")
    assert (status, headers["x-memproxy-stored"]) == (200, "true")
    assert [body for (body,) in rows(storage, "SELECT m.body FROM messages m JOIN sessions s ON s.pk = m.session_pk"
                                              " WHERE s.session_id = 's0' ORDER BY m.seq")][0] \
        == '{"role":"user","content":"answered"}'


# --- a replica frozen mid-write --------------------------------------------------------------------


async def test_a_replica_frozen_mid_write_holds_its_lock_only_until_the_server_ends_its_transaction(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream,
) -> None:
    limited = replace(storage, lock_timeout_ms=200, idle_in_transaction_timeout_ms=1000)
    proxy: Proxy = await start_proxy(make_config(limited, upstream.url))
    await chat(proxy.client("s1"), [user("one")])
    locked, thaw = threading.Event(), threading.Event()

    def frozen_write() -> Script[None]:
        yield "SELECT pk FROM sessions WHERE session_id = ? FOR UPDATE", ["s1"]
        locked.set()
        thaw.wait(HANG)  # the replica's event loop stops here, as a paused process's would
        yield "UPDATE sessions SET updated_at = updated_at WHERE session_id = ?", ["s1"]

    async def frozen_replica() -> BaseException | None:
        """Another replica, with the same settings, on an event loop of its own."""
        store = await open_store(limited)
        try:
            await store._db.write(frozen_write())  # type: ignore[attr-defined]
        except StoreUnavailable as exc:
            return exc
        finally:
            await store.close()
        return None

    replica = asyncio.ensure_future(asyncio.to_thread(run_async, frozen_replica))
    try:
        assert await asyncio.to_thread(locked.wait, HANG)
        loop = asyncio.get_running_loop()
        frozen_at = loop.time()
        assert await api(proxy, "POST", "/sessions/s1/clear") == 503  # its lock holds
        while await api(proxy, "POST", "/sessions/s1/clear") != 200:
            assert loop.time() < frozen_at + 1.0 + 0.2 + SLACK, "the frozen replica's lock was never freed"
    finally:
        thaw.set()
        failed = await replica
    assert isinstance(failed, StoreUnavailable)  # thawed, it finds its transaction ended by the server
    assert rows(storage, "SELECT count(*) FROM messages WHERE active = 1") == [(0,)]  # the clear stands
