"""Many replicas, one truth: `memproxy serve` processes sharing one PostgreSQL schema.

Real processes on 127.0.0.1 (port 0), driven by the `openai` SDK, in front of the fake provider. Three
replicas are started at once for the module on one fresh schema (so they migrate it together): A and B
serve the conversations, and a third is the one killed with SIGKILL mid-stream. What is checked is what reached the provider and what the
database holds, read from a connection of the test's own (`tests/db.py`).

How concurrent turns on one session are kept whole (memproxy/store/sql/turns.py, `record_turn`): a turn
is written in one transaction that first locks the session's row (`FOR UPDATE`) and checks the
session is still where the turn was planned; a turn that only continues the history is then
appended after the other replica's turn, an edit or regenerate that lost the race gets 409.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from db import rows, write_lock_held, writes_waiting
from fake_upstream import FakeUpstream, Received, Reply
from helpers import assistant, chat, until, user
from memproxy.config import StorageConfig
from memproxy.store.migrations import migrations
from processes import Served, serve, storage_section, store_for_processes, write_config
from stores import POSTGRES_URL

Message = dict[str, Any]

# Summaries on, folding once summary + unsummarised history pass 400 tokens, the newest turn kept
# verbatim; the short conversations of most tests stay far below that.
MEMORY = """\
memory:
  summarizer_model: small
  summaries: true
  chunk_threshold_tokens: 400
  tail_turns: 1
  overflow: drop
  tool_output_max_tokens: 0
  dedupe_min_tokens: 0
"""


@dataclass
class Cluster:
    a: Served
    b: Served
    victim: Served  # the one killed mid-stream
    storage: StorageConfig
    config: Path  # their config file, for a replica of a test's own


@pytest.fixture(scope="module")
def cluster(upstream_server: FakeUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    folder = tmp_path_factory.mktemp("replicas")
    with store_for_processes("postgres", folder) as storage:
        assert storage.schema is not None
        assert rows(StorageConfig(url=POSTGRES_URL), "SELECT count(*) FROM pg_namespace WHERE nspname = ?",
                    storage.schema) == [(0,)]  # fresh: the replicas create the schema and migrate it together
        config = write_config(folder / "memproxy.yaml", upstream_server.url, storage_section(storage),
                              memory=MEMORY)
        replicas: list[Served] = []
        try:
            replicas = serve(config, [folder / f"{name}.log" for name in ("a", "b", "victim")])
            yield Cluster(a=replicas[0], b=replicas[1], victim=replicas[2], storage=storage, config=config)
        finally:
            codes = {r.log.name: r.stop() for r in replicas}
    assert codes["a.log"] == 0, replicas[0].log.read_text()
    assert codes["b.log"] == 0, replicas[1].log.read_text()


# --- reading the shared store ------------------------------------------------------------------


def stored(storage: StorageConfig, session: str, active: int | None = None) -> list[Message]:
    """The session's message bodies in the order they were written (`active`: 1 the chain only, 0
    the superseded only, None all)."""
    sql = ("SELECT m.body FROM messages m JOIN sessions s ON s.pk = m.session_pk"
           " WHERE s.tenant = 'a' AND s.session_id = ?")
    params: list[Any] = [session]
    if active is not None:
        sql += " AND m.active = ?"
        params.append(active)
    return [json.loads(body) for (body,) in rows(storage, sql + " ORDER BY m.id", *params)]


def chain(storage: StorageConfig, session: str) -> list[Message]:
    """The active history in its order, checked to be numbered 0..n-1 as the session row says."""
    found = rows(storage, "SELECT m.seq, m.body, s.length FROM messages m JOIN sessions s ON s.pk = m.session_pk"
                          " WHERE s.tenant = 'a' AND s.session_id = ? AND m.active = 1 ORDER BY m.seq", session)
    assert [seq for seq, _, _ in found] == list(range(len(found)))
    assert all(length == len(found) for _, _, length in found)
    return [json.loads(body) for _, body, _ in found]


def turn_count(storage: StorageConfig, session: str) -> int:
    [(count,)] = rows(storage, "SELECT count(*) FROM turns t JOIN sessions s ON s.pk = t.session_pk"
                               " WHERE s.tenant = 'a' AND s.session_id = ?", session)
    return int(count)


async def in_thread(wait: Callable[[], Any]) -> None:
    await asyncio.get_running_loop().run_in_executor(None, wait)


def session_id(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


# --- one conversation, turns alternating between replicas --------------------------------------


@pytest.mark.parametrize("style", ["full", "new"])
async def test_turns_alternating_between_replicas_see_one_history(
    cluster: Cluster, upstream: FakeUpstream, style: str
) -> None:
    """Each request reaches the provider with the whole conversation, whichever replica served the
    turn before; each message is stored once. `full`: the client resends its history; `new`: only
    the new turn."""
    session = session_id(f"alternate-{style}")
    clients = [cluster.a.async_client(session), cluster.b.async_client(session)]
    history: list[Message] = []
    try:
        for i in range(4):
            question = user(f"question {i}")
            reply, _ = await chat(clients[i % 2], [*(history if style == "full" else []), question])
            assert upstream.last().messages == [*history, question]
            history += [question, assistant(reply)]
    finally:
        for client in clients:
            await client.close()
    assert stored(cluster.storage, session) == history  # each once, nothing superseded
    assert chain(cluster.storage, session) == history
    assert turn_count(cluster.storage, session) == 4


# --- concurrent turns on one session, one to each replica --------------------------------------


async def overlapping_turns(
    cluster: Cluster, upstream: FakeUpstream, session: str, requests: tuple[list[Message], list[Message]]
) -> tuple[str, str]:
    """Send requests[0] to A and requests[1] to B so both are with the provider at once, each planned
    on the same stored history; then let both answers go. Their replies."""
    gates = (threading.Event(), threading.Event())
    upstream.enqueue(Reply(content="answer via A", gate=gates[0]), Reply(content="answer via B", gate=gates[1]))
    clients = (cluster.a.async_client(session), cluster.b.async_client(session))
    tasks: list[asyncio.Task[tuple[str, httpx.Headers]]] = []
    try:
        tasks.append(asyncio.create_task(chat(clients[0], requests[0])))
        await in_thread(upstream.wait_for_request)  # A's request is held by the provider
        tasks.append(asyncio.create_task(chat(clients[1], requests[1])))
        await in_thread(upstream.wait_for_request)  # and B's, planned on the same history
        assert [r.messages[-1] for r in upstream.chat_requests()[-2:]] == [requests[0][-1], requests[1][-1]]
    finally:
        for gate in gates:
            gate.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for client in clients:
            await client.close()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results[0][0], results[1][0]  # type: ignore[index]


async def first_turn(cluster: Cluster, upstream: FakeUpstream, session: str) -> list[Message]:
    client = cluster.a.async_client(session)
    try:
        reply, _ = await chat(client, [user("q1")])
    finally:
        await client.close()
    upstream.wait_for_request()  # take its arrival off the count
    return [user("q1"), assistant(reply)]


@pytest.mark.parametrize("existing", [True, False], ids=["stored-session", "new-session"])
async def test_concurrent_new_turns_on_two_replicas_are_both_kept_once(
    cluster: Cluster, upstream: FakeUpstream, existing: bool
) -> None:
    """`new-session`: both are the first turn of a session neither replica has seen yet."""
    session = session_id("concurrent-new")
    history = await first_turn(cluster, upstream, session) if existing else []
    x, y = user("x via A"), user("y via B")
    reply_a, reply_b = await overlapping_turns(cluster, upstream, session, ([x], [y]))
    assert (reply_a, reply_b) == ("answer via A", "answer via B")
    # Both were planned on the same stored history and sent with it.
    assert [r.messages for r in upstream.chat_requests()[-2:]] == [[*history, x], [*history, y]]

    turn_a, turn_b = [x, assistant(reply_a)], [y, assistant(reply_b)]
    kept = chain(cluster.storage, session)
    assert kept in ([*history, *turn_a, *turn_b], [*history, *turn_b, *turn_a])  # whole turns, in some order
    assert stored(cluster.storage, session) == kept  # every message once, nothing superseded
    assert turn_count(cluster.storage, session) == len(history) // 2 + 2
    assert rows(cluster.storage, "SELECT count(*) FROM sessions WHERE session_id = ?", session) == [(1,)]

    # The next turn, on either replica, goes out with both.
    client = cluster.b.async_client(session)
    try:
        await chat(client, [user("after both")])
    finally:
        await client.close()
    assert upstream.last().messages == [*kept, user("after both")]


async def test_two_continuations_of_one_response_on_two_replicas_never_merge(
    cluster: Cluster, upstream: FakeUpstream
) -> None:
    """Two branches from one `previous_response_id`, each with the provider at once on its own
    replica: the one recorded second would continue a chain that now holds its sibling's exchange.
    It is refused (409), never appended after it (in one process the second is an edit instead)."""
    session = session_id("response-branches")
    clients = (cluster.a.async_client(session), cluster.b.async_client(session))
    try:
        upstream.enqueue(Reply(content="root answer"))
        root = await clients[0].responses.create(model="small", input="root question")
        upstream.wait_for_request()
        gates = (threading.Event(), threading.Event())
        upstream.enqueue(Reply(content="answer via A", gate=gates[0]), Reply(content="answer via B", gate=gates[1]))
        branches = [asyncio.create_task(client.responses.create(model="small", input=f"branch {name}",
                                                                  previous_response_id=root.id))
                    for client, name in zip(clients, "AB")]
        await in_thread(upstream.wait_for_request)
        await in_thread(upstream.wait_for_request)  # both planned on the root's history
        for gate in gates:
            gate.set()
        results = await asyncio.gather(*branches, return_exceptions=True)
    finally:
        for client in clients:
            await client.close()
    answered = [(name, r) for name, r in zip("AB", results) if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, openai.ConflictError)]
    assert len(answered) == 1 and len(refused) == 1, results
    [(name, response)] = answered  # the provider's replies go by arrival: either may have either
    assert chain(cluster.storage, session) == [user("root question"), assistant("root answer"),
                                               user(f"branch {name}"), assistant(response.output_text)]


async def test_concurrent_full_history_turns_are_both_kept_and_the_next_one_rewrites_the_history(
    cluster: Cluster, upstream: FakeUpstream
) -> None:
    """Two full-history clients continue one conversation at once: both turns are stored (the one
    recorded second is appended after the first). Each client then resends only its own view. Where
    its turn was recorded first, that view stops before the other's: an edit, which supersedes the
    other client's turn (kept as a superseded branch, never sent again). Where it was recorded
    second, the view is the stored start and then the stored tail, the other's turn between them:
    a window, nothing superseded."""
    session = session_id("concurrent-full")
    history = await first_turn(cluster, upstream, session)
    x, y = user("x via A"), user("y via B")
    reply_a, reply_b = await overlapping_turns(cluster, upstream, session, ([*history, x], [*history, y]))
    assert [r.messages for r in upstream.chat_requests()[-2:]] == [[*history, x], [*history, y]]
    turn_a, turn_b = [x, assistant(reply_a)], [y, assistant(reply_b)]
    kept = chain(cluster.storage, session)
    assert kept in ([*history, *turn_a, *turn_b], [*history, *turn_b, *turn_a])
    assert stored(cluster.storage, session) == kept

    # A's client continues from what it saw: history, its own turn, a new question.
    view_a = [*history, *turn_a, user("next via A")]
    client = cluster.a.async_client(session)
    try:
        raw = await client.chat.completions.with_raw_response.create(model="small", messages=view_a)  # type: ignore[arg-type]
        reply = raw.parse().choices[0].message.content or ""
    finally:
        await client.close()
    written = [user("next via A"), assistant(reply)]
    if kept[len(history)] == x:  # A's turn was recorded first: its view stops there, an edit of what follows
        assert raw.headers["X-Memproxy-Reconcile"] == "edit"
        assert upstream.last().messages == view_a  # exactly the client's view, B's turn not in it
        assert chain(cluster.storage, session) == [*view_a, assistant(reply)]
        assert stored(cluster.storage, session, active=0) == turn_b
    else:  # B's first: A's view is the stored start and then the stored tail, B's turn between (kept)
        assert raw.headers["X-Memproxy-Reconcile"] == "window"
        assert upstream.last().messages == [*kept, user("next via A")]
        assert chain(cluster.storage, session) == [*kept, *written]
        assert stored(cluster.storage, session, active=0) == []
    assert stored(cluster.storage, session) == [*kept, *written]


# --- one summariser per session across replicas ------------------------------------------------


async def test_one_summarisation_per_session_across_replicas(cluster: Cluster, upstream: FakeUpstream) -> None:
    session = session_id("summary")
    asked = threading.Event()
    release = threading.Event()

    def summarizer(received: Received) -> Reply:
        asked.set()
        return Reply(content="The user asked about alpha and beta; both were answered.", gate=release)

    upstream.summarizer = summarizer
    a, b = cluster.a.async_client(session), cluster.b.async_client(session)
    long_words = " ".join(f"alpha{i} beta{i}" for i in range(90))
    try:
        await chat(a, [user(f"first: {long_words}")])  # under the threshold: no fold
        assert not asked.is_set()
        await chat(a, [user(f"second: {long_words}")])  # over it: A folds the first turn, held
        await in_thread(lambda: asked.wait(30))
        assert asked.is_set(), "A did not start summarising"
        # B is over the threshold too, after its turn and when asked to compact now: it stands aside.
        await chat(b, [user("third")])
        compaction = await b.post(f"/sessions/{session}/compact", cast_to=object, body={},
                                  options={"timeout": 10})  # answers at once: it does not wait for A
        assert isinstance(compaction, dict)
        assert (compaction["outcome"], compaction["detail"]) == (
            "nothing", "another process is summarising this session")
        assert len(upstream.summary_requests()) == 1
    finally:
        release.set()
        await a.close()
        await b.close()
    # A's fold completes and lets the session go; only then is the lease free.
    await until(lambda: rows(cluster.storage, "SELECT count(*) FROM summary_leases")[0][0] == 0
                and rows(cluster.storage, "SELECT count(*) FROM summaries")[0][0] > 0, "A's summary is saved",
                timeout=30.0, interval=0.05)
    assert rows(cluster.storage, "SELECT s.version, s.covers FROM summaries s JOIN sessions x ON x.pk = s.session_pk"
                                 " WHERE x.session_id = ?", session) == [(1, 2)]
    assert len(upstream.summary_requests()) == 1


# --- a replica killed mid-stream ----------------------------------------------------------------


async def test_replica_killed_mid_stream_leaves_no_half_turn_and_another_continues(
    cluster: Cluster, upstream: FakeUpstream
) -> None:
    session = session_id("killed")
    victim = cluster.victim.async_client(session)
    held = threading.Event()
    try:
        first, _ = await chat(victim, [user("q1")])
        upstream.enqueue(Reply(content="an answer that the replica never finishes", gate_after_first_chunk=held))
        question: Any = [user("q2")]
        stream = await victim.chat.completions.create(model="small", stream=True, messages=question)
        received = ""
        async for chunk in stream:
            received += (chunk.choices[0].delta.content or "") if chunk.choices else ""
            if received:
                break  # the answer is on its way, the rest held by the provider
        assert received and received != "an answer that the replica never finishes"
        cluster.victim.process.kill()  # SIGKILL: no cleanup, no goodbye
        cluster.victim.process.wait()
        await stream.close()
    finally:
        held.set()
        await victim.close()
    assert cluster.victim.process.returncode == -9

    expected = [user("q1"), assistant(first)]
    assert stored(cluster.storage, session) == expected  # nothing of the cut turn
    assert turn_count(cluster.storage, session) == 1
    # The other replica serves the retry: q2 once, no trace of the partial answer.
    client = cluster.a.async_client(session)
    try:
        reply, _ = await chat(client, [user("q2")])
    finally:
        await client.close()
    assert upstream.last().messages == [*expected, user("q2")]
    assert chain(cluster.storage, session) == [*expected, user("q2"), assistant(reply)]
    assert stored(cluster.storage, session) == chain(cluster.storage, session)


async def test_replica_killed_halfway_through_writing_a_turn_leaves_none_of_it(
    cluster: Cluster, upstream: FakeUpstream, tmp_path: Path
) -> None:
    """SIGKILL while the turn's transaction is open: its `turns` row is written and its messages wait
    for a lock another connection holds. The database must roll all of it back."""
    session = session_id("half-written")
    [doomed] = serve(cluster.config, [tmp_path / "doomed.log"])
    client = doomed.async_client(session)
    try:
        first, _ = await chat(client, [user("q1")])
        with write_lock_held(cluster.storage, table="messages"):
            second = asyncio.create_task(chat(client, [user("q2")]))
            await until(lambda: bool(writes_waiting(cluster.storage, "messages")), "the turn's write is halfway",
                        timeout=30.0, interval=0.05)
            [writer] = writes_waiting(cluster.storage, "messages")
            # Halfway indeed: the same transaction has already inserted its row into `turns`.
            assert rows(cluster.storage, "SELECT count(*) FROM pg_locks WHERE pid = ? AND granted"
                                         " AND relation = 'turns'::regclass AND mode = 'RowExclusiveLock'",
                        writer) == [(1,)]
            doomed.process.kill()
            doomed.process.wait()
            with pytest.raises(openai.APIConnectionError):
                await second
    finally:
        await client.close()
        doomed.stop()
    assert doomed.process.returncode == -9
    # The other replica's turn waits for the dead transaction's row lock, then sees none of it.
    other = cluster.a.async_client(session)
    try:
        reply, _ = await chat(other, [user("q2")])
    finally:
        await other.close()
    expected = [user("q1"), assistant(first), user("q2"), assistant(reply)]
    assert upstream.last().messages == expected[:3]
    assert chain(cluster.storage, session) == expected
    assert stored(cluster.storage, session) == expected
    assert turn_count(cluster.storage, session) == 2


# --- migrations when replicas start together ----------------------------------------------------


def test_replicas_starting_together_on_a_fresh_schema_migrate_once(cluster: Cluster) -> None:
    """The module's three replicas were launched at once on a schema that did not exist yet."""
    ids = [i for (i,) in rows(cluster.storage, "SELECT id FROM schema_migrations ORDER BY id")]
    assert ids == [migration_id for migration_id, _ in migrations("postgres")]  # each once
    tables = {t for (t,) in rows(cluster.storage, "SELECT table_name FROM information_schema.tables"
                                                  " WHERE table_schema = current_schema()")}
    assert {"sessions", "turns", "messages", "summaries", "summary_leases"} <= tables
