"""Retention (issue 4): expiry, the sweep, deleting a tenant's sessions and the message cap.

The proxy runs in process on a real port, driven by the `openai` SDK for chats and a plain aiohttp
client for `/v1/sessions` (helpers in `tests/admin_api.py`); what the API reports is checked against
what the fake upstream received and against the store, read from a second connection.
Where a test needs an old session it moves the session's last activity into the past from a
second connection: the clock is never waited on.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from typing import Any

import aiohttp
import httpx
import openai
import pytest

from admin_api import (
    ADMIN_KEY,
    Api,
    MakeStorage,
    Message,
    NOTHING_DELETED,
    SYSTEM,
    StartProxy,
    TABLES,
    age,
    api_for,
    assert_error,
    config_of,
    preview_of,
    rows_of,
    session_pk,
    short_summary,
    snapshot,
    start,
    stored_bodies,
    words,
    write_db,
)
from conftest import OTHER_KEY, Proxy
from db import rows, table_rows
from fake_upstream import FakeUpstream, Reply
from helpers import Conversation, assistant, send_turn, until, user
from memproxy.config import RetentionConfig
from memproxy.typedefs import SUMMARIZER

pytestmark = pytest.mark.both_stores


# --- retention ----------------------------------------------------------------------------------


async def test_retention_is_off_by_default(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    proxy = await start(start_proxy, make_storage, upstream)
    assert config_of(proxy).retention == RetentionConfig(idle_ttl_seconds=None, max_messages_per_session=None)
    await send_turn(proxy, "s1", [user("remember me")])
    await age(config_of(proxy), "s1", 10 * 365 * 86400)
    await send_turn(proxy, "s1", [user("ten years later")])
    assert upstream.last().messages == [user("remember me"), assistant("reply 1"), user("ten years later")]


async def test_an_expired_session_behaves_as_new_and_its_past_is_gone(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    proxy = await start(start_proxy, make_storage, upstream, retention=RetentionConfig(idle_ttl_seconds=60))
    api, config = api_for(http, proxy), config_of(proxy)
    await send_turn(proxy, "idle", [SYSTEM, user("my name is Ada")])
    await send_turn(proxy, "idle", [user("I live in Paris")])
    await api.call("PATCH", "/sessions/idle/metadata", json={"step": 2})
    await send_turn(proxy, "busy", [user("still here")])
    old_pk = session_pk(config, "idle")
    assert old_pk is not None
    await age(config, "idle", 61)

    preview = await preview_of(api, "idle", "who am I?")
    assert preview["expired"] is True and preview["messages"] == [user("who am I?")]
    await send_turn(proxy, "idle", [user("who am I?")])
    assert upstream.last().messages == [user("who am I?")]
    assert stored_bodies(config, "idle") == [user("who am I?"), assistant("reply 4")]
    assert rows_of(config, old_pk) == {table: 0 for table in TABLES}
    detail = await api.get("/sessions/idle")
    assert detail["metadata"] == {} and detail["system"] is None and detail["title"] == "who am I?"
    assert detail["usage"]["turns"] == 1
    usage = await api.get("/usage")  # what the replaced session spent still counts
    assert (usage["sessions"], usage["turns"], usage["deleted_sessions"]["turns"]) == (2, 4, 2)

    # The session that was not idle is untouched.
    await send_turn(proxy, "busy", [user("and now?")])
    assert upstream.last().messages == [user("still here"), assistant("reply 3"), user("and now?")]


async def test_a_long_conversation_resent_to_its_expired_session_is_answered(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream
) -> None:
    """An expired session is new, and a full-history client resends its whole conversation, more
    than the window holds: it is stored afresh as history and answered, never refused for good."""
    proxy = await start(start_proxy, make_storage, upstream, retention=RetentionConfig(idle_ttl_seconds=60))
    upstream.summarizer = short_summary
    config = config_of(proxy)
    history: list[Message] = []
    for k in range(10):
        history += [user(f"q{k} " + words(80, "q")), assistant(f"a{k} " + words(40, "a"))]
    await send_turn(proxy, "long", [*history[:2], user("first")])
    await age(config, "long", 61)
    whole = [*history, user("after a pause")]
    headers = await send_turn(proxy, "long", whole)
    assert headers["X-Memproxy-Reconcile"] == "new"  # read as the client sent it: to a session anew
    assert upstream.last().messages[-1] == user("after a pause")
    stored = stored_bodies(config, "long")
    assert stored[:-1] == whole and stored[-1]["role"] == "assistant"  # the expired turn's "first" is gone


async def test_a_response_of_an_expired_session_is_not_found(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream
) -> None:
    """`previous_response_id` naming a response of an expired session is a 400
    `previous_response_not_found`, as an expired response is at OpenAI: continuing the session's newest answer would go on with no memory of it,
    and an older one would resend its expired history as the new session's."""
    proxy = await start(start_proxy, make_storage, upstream, retention=RetentionConfig(idle_ttl_seconds=60))
    config, client = config_of(proxy), proxy.client(session=None)
    first = await client.responses.create(model="small", input="my name is Ada")
    second = await client.responses.create(model="small", input="I live in Paris", previous_response_id=first.id)
    await age(config, first.id, 61)
    stored, sent = stored_bodies(config, first.id), len(upstream.chat_requests())
    for previous in (second.id, first.id):  # the session's newest answer, and one before it
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(model="small", input="who am I?", previous_response_id=previous)
        assert refused.value.code == "previous_response_not_found"
    assert stored_bodies(config, first.id) == stored and len(upstream.chat_requests()) == sent


async def test_a_response_whose_branch_the_cap_deleted_is_a_conflict(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream
) -> None:
    """A response an edit superseded is continued on its branch, unless the cap has deleted it
    (superseded messages go first): then a 409, nothing sent or stored, rather than a guess."""
    proxy = await start(start_proxy, make_storage, upstream, retention=RetentionConfig(max_messages_per_session=4))
    config, client = config_of(proxy), proxy.client(session=None)
    first = await client.responses.create(model="small", input="my name is Ada")
    second = await client.responses.create(model="small", input="I live in Paris", previous_response_id=first.id)
    await client.responses.create(model="small", input="I live in Rome", previous_response_id=first.id)
    await until(lambda: rows(config, "SELECT count(*) FROM messages WHERE active = 0") == [(0,)],
                "the cap deleted the superseded branch")
    stored, sent = stored_bodies(config, first.id), len(upstream.chat_requests())
    with pytest.raises(openai.ConflictError) as refused:
        await client.responses.create(model="small", input="where do I live?", previous_response_id=second.id)
    assert refused.value.code == "session_conflict"
    assert stored_bodies(config, first.id) == stored and len(upstream.chat_requests()) == sent


EXPIRED_WRITES: dict[str, tuple[str, str, Any, Any]] = {
    # method, path, body, the metadata after it
    "PATCH metadata": ("PATCH", "/sessions/idle/metadata", {"step": 3}, {"step": 3}),
    "PUT metadata": ("PUT", "/sessions/idle/metadata", {"fresh": True}, {"fresh": True}),
    "clear": ("POST", "/sessions/idle/clear", None, {}),
}


@pytest.mark.parametrize("write", list(EXPIRED_WRITES))
async def test_a_write_to_an_expired_session_starts_it_afresh_first(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession,
    write: str,
) -> None:
    """A metadata write or a clear renews a session's activity; on an expired one it must not bring
    the past back to life: the session is started afresh first, exactly as a chat turn would."""
    proxy = await start(start_proxy, make_storage, upstream, retention=RetentionConfig(idle_ttl_seconds=60))
    api, config = api_for(http, proxy), config_of(proxy)
    upstream.enqueue(*[Reply(content=f"reply {i}", usage={"prompt_tokens": 10, "completion_tokens": 1})
                       for i in range(1, 4)])
    await send_turn(proxy, "idle", [SYSTEM, user("my name is Ada")])
    await send_turn(proxy, "idle", [user("I live in Paris")])
    await api.call("PATCH", "/sessions/idle/metadata", json={"step": 2, "secret": "the old state"})
    await age(config, "idle", 61)
    assert await api.get("/sessions/idle/metadata") == {}  # expired: nothing of it is current

    method, path, body, metadata = EXPIRED_WRITES[write]
    await api.call(method, path, **({} if body is None else {"json": body}))
    new_pk = session_pk(config, "idle")  # the old session is gone (SQLite may reuse its key)
    assert new_pk is not None and rows_of(config, new_pk) == {"sessions": 1, "turns": 0, "messages": 0,
                                                              "summaries": 0}
    assert rows(config, "SELECT count(*) FROM messages") == [(0,)]
    detail = await api.get("/sessions/idle")
    assert detail["metadata"] == metadata and detail["messages"] == [] and detail["superseded"] == []
    assert detail["system"] is None and detail["title"] is None and detail["usage"]["turns"] == 0
    await send_turn(proxy, "idle", [user("who am I?")])
    assert upstream.last().messages == [user("who am I?")]
    # What the old session spent still counts for the tenant.
    usage = await api.get("/usage")
    assert (usage["turns"], usage["prompt_tokens"], usage["deleted_sessions"]["turns"]) == (3, 30, 2)


async def test_delete_every_session_of_a_tenant_whatever_the_clock(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    proxy = await start(start_proxy, make_storage, upstream)
    api, config = api_for(http, proxy), config_of(proxy)
    admin, other = api.as_(ADMIN_KEY), api.as_(OTHER_KEY)
    for session in ("one", "two", "future"):
        await send_turn(proxy, session, [user(f"{session} in a")])
    await api.call("PUT", "/sessions/only-metadata/metadata", json={"k": 1})
    for session in ("one", "b-only"):
        await send_turn(proxy, session, [user(f"{session} in b")], key=OTHER_KEY)
    # Written by a replica whose clock is a day ahead: `prune --older-than 0s` would skip it.
    await asyncio.to_thread(write_db, config, "UPDATE sessions SET updated_at = updated_at + 86400"
                                              " WHERE session_id = 'future'")
    b_before = await snapshot(api, "one", "b")

    for query in ("", "?all=false", "?all=1"):  # deleting everything is never implied
        assert_error(await api.call("DELETE", f"/sessions{query}", status=400), type="invalid_request_error",
                     param="all")
    assert_error(await admin.call("DELETE", "/sessions?all=true", status=400), type="invalid_request_error",
                 param="tenant")
    assert len((await api.get("/sessions"))["data"]) == 4

    # A tenant key naming another tenant is refused, not taken as its own: nothing is deleted.
    assert_error(await api.call("DELETE", "/sessions?all=true&tenant=b", status=403), type="permission_error",
                 param="tenant")
    assert len((await api.get("/sessions"))["data"]) == 4
    body = await api.call("DELETE", "/sessions?all=true&tenant=a")  # its own, named
    assert body == {"object": "session.deleted", "tenant": "a", "deleted": 4}
    assert (await api.get("/sessions"))["data"] == []
    assert rows(config, "SELECT count(*) FROM sessions WHERE tenant = 'a'") == [(0,)]
    assert rows(config, "SELECT count(*) FROM messages m JOIN sessions s ON s.pk = m.session_pk"
                        " WHERE s.tenant = 'a'") == [(0,)]
    assert await snapshot(api, "one", "b") == b_before  # tenant b is untouched
    assert [s["id"] for s in (await other.get("/sessions"))["data"]] == ["b-only", "one"]
    assert (await api.call("DELETE", "/sessions?all=true"))["deleted"] == 0

    assert await admin.call("DELETE", "/sessions?all=true&tenant=b") == {
        "object": "session.deleted", "tenant": "b", "deleted": 2}
    assert rows(config, "SELECT count(*) FROM sessions") == [(0,)]
    await send_turn(proxy, "one", [user("back again")])
    assert upstream.last().messages == [user("back again")]


async def test_usage_of_deleted_sessions_stays_with_their_tenant(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """Deleting sessions (one, every one, pruned, swept, expired) deletes their content, not what they
    cost: each deletion adds their usage to their tenant's rollup in the same transaction."""
    retention = RetentionConfig(idle_ttl_seconds=3600, sweep_interval_seconds=0.05)
    proxy = await start(start_proxy, make_storage, upstream, retention=retention)
    api, config = api_for(http, proxy), config_of(proxy)
    other = api.as_(OTHER_KEY)
    spent = {"prompt_tokens": 100, "completion_tokens": 10}
    upstream.enqueue(*[Reply(content=f"answer {i}", usage=spent) for i in range(8)])
    for session in ("deleted", "swept", "expired", "kept"):
        await send_turn(proxy, session, [user(f"{session}: first")])
    await send_turn(proxy, "deleted", [user("deleted: second")], model="big")  # priced
    await send_turn(proxy, "b1", [user("tenant b")], key=OTHER_KEY)
    before, before_b = await api.get("/usage"), await other.get("/usage")
    assert before["turns"] == 5 and before["cost"] > 0 and before["deleted_sessions"] == NOTHING_DELETED

    await api.call("DELETE", "/sessions/deleted")
    await age(config, "swept", 7200)
    await until(lambda: session_pk(config, "swept") is None, "the sweep removed the idle session")
    await age(config, "expired", 7200)  # swept, or replaced by its next turn: deleted either way
    await send_turn(proxy, "expired", [user("expired: again")])

    after = await api.get("/usage")
    deleted = after["deleted_sessions"]
    assert (deleted["sessions"], deleted["turns"], deleted["prompt_tokens"]) == (3, 4, 400)
    assert deleted["cost"] == pytest.approx(before["cost"])  # the priced turn was in a deleted session
    assert {**after, "deleted_sessions": None} == {
        **before, "sessions": 2, "turns": 6, "prompt_tokens": 600, "completion_tokens": 60,
        "context_tokens": after["context_tokens"], "full_history_tokens": after["full_history_tokens"],
        "tokens_saved": after["tokens_saved"], "cost": pytest.approx(before["cost"]), "deleted_sessions": None}
    assert after["context_tokens"] > before["context_tokens"]
    assert await other.get("/usage") == before_b  # nothing of a's went to b

    # Every session of the tenant at once: all of it in the rollup, none of it in b's.
    await api.call("DELETE", "/sessions?all=true")
    final = await api.get("/usage")
    assert final["sessions"] == 0 and final["deleted_sessions"]["sessions"] == 5
    assert {k: v for k, v in final.items() if k not in ("sessions", "deleted_sessions")} == \
        {k: v for k, v in after.items() if k not in ("sessions", "deleted_sessions")}
    assert {k: v for k, v in final["deleted_sessions"].items() if k != "sessions"} == \
        {k: v for k, v in final.items() if k not in ("object", "tenant", "sessions", "deleted_sessions", "endpoints")}
    rollup = rows(config, "SELECT * FROM tenant_usage")
    assert [r[0] for r in rollup] == ["a"]  # a tenant and its sums: no session id, no content
    assert (await api.as_(ADMIN_KEY).get("/usage"))["prompt_tokens"] == 700
    assert await other.get("/usage") == before_b


async def test_the_sweep_removes_expired_sessions(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    retention = RetentionConfig(idle_ttl_seconds=60, sweep_interval_seconds=0.05)
    proxy = await start(start_proxy, make_storage, upstream, retention=retention)
    api, config = api_for(http, proxy), config_of(proxy)
    for session in ("stale", "recent"):
        await send_turn(proxy, session, [user(f"{session} conversation")])
    await send_turn(proxy, "stale", [user("more")], key=OTHER_KEY)  # another tenant's, idle too
    stale_pk, recent_pk = session_pk(config, "stale"), session_pk(config, "recent")
    assert stale_pk is not None and recent_pk is not None
    recent_rows = rows_of(config, recent_pk)
    # Expired for a turn, but not yet for the sweep: a turn planned on it just before its TTL may
    # still be upstream (the longest model timeout and the summary wait), and must find it. Aged
    # first: the sweep that removes the stale sessions below has seen it.
    await send_turn(proxy, "just-expired", [user("in flight")])
    await age(config, "just-expired", 61)
    await age(config, "stale", 3600)
    await age(config, "stale", 3600, tenant="b")

    await until(lambda: session_pk(config, "stale") is None and session_pk(config, "stale", "b") is None,
                "the sweep removed the idle sessions")
    assert rows_of(config, stale_pk) == {table: 0 for table in TABLES}
    assert rows_of(config, recent_pk) == recent_rows
    assert session_pk(config, "just-expired") is not None
    assert [s["id"] for s in (await api.get("/sessions"))["data"]] == ["recent", "just-expired"]
    await api.get("/sessions/stale", status=404)


async def test_a_turn_on_a_session_near_its_ttl_marks_it_active_as_it_begins(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream
) -> None:
    """The sweep spares a session as long again as a turn may take, but a stream's timeout bounds
    only the wait between chunks: a long answer planned just before the TTL would lose the whole
    conversation to the sweep while it streams. A turn on a session idle for more than half its
    TTL marks it active before it goes upstream; one used more recently costs no write."""
    proxy = await start(start_proxy, make_storage, upstream, retention=RetentionConfig(idle_ttl_seconds=60))
    config = config_of(proxy)
    for session in ("near", "recent"):
        await send_turn(proxy, session, [user(f"{session} conversation")])
        upstream.wait_for_request()  # its arrival, taken off the count
    await age(config, "near", 45)
    await age(config, "recent", 20)

    def last_active(session: str) -> float:
        [(updated_at,)] = rows(config, "SELECT updated_at FROM sessions WHERE session_id = ?", session)
        return float(updated_at)

    for session, touched in (("near", True), ("recent", False)):
        before = last_active(session)
        gate = threading.Event()
        upstream.enqueue(Reply(content="a long answer", gate=gate))
        turn = asyncio.create_task(send_turn(proxy, session, [user("go on")]))
        await asyncio.to_thread(upstream.wait_for_request)  # the turn is upstream
        assert (last_active(session) > before + 40) is touched, session
        gate.set()
        await turn


async def test_a_request_refused_as_too_long_leaves_a_session_near_its_ttl_as_it_was(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream
) -> None:
    """The mark of activity a turn near its session's TTL makes is for a turn that goes upstream:
    a request refused as too long (400 `context_length_exceeded`) changes nothing stored, so it
    neither keeps the session from expiring nor moves it up the list of recent sessions."""
    proxy = await start(start_proxy, make_storage, upstream, retention=RetentionConfig(idle_ttl_seconds=60))
    config = config_of(proxy)
    await send_turn(proxy, "near", [user("a conversation")])
    await age(config, "near", 45)
    before = table_rows(config, *TABLES)
    with pytest.raises(openai.BadRequestError) as caught:
        await send_turn(proxy, "near", [user(words(2000, "x"))])
    assert caught.value.code == "context_length_exceeded"
    assert table_rows(config, *TABLES) == before
    assert len(upstream.chat_requests()) == 1


async def converse_with_edits(proxy: Proxy, upstream: FakeUpstream, api: Api,
                              pause: Callable[[int], Any]) -> httpx.Headers:
    """A full-history client; a summary is made after turn 2, then the user edits the message after
    it. `pause(n)` runs after the n-th turn. Returns the headers of the last turn."""
    history: list[Message] = []

    async def turn(n: int, sent: list[Message]) -> httpx.Headers:
        upstream.enqueue(Reply(content=f"answer {n}"))
        headers = await send_turn(proxy, "s1", sent)
        history[:] = sent + [assistant(f"answer {n}")]
        await pause(n)
        return headers

    await turn(1, [user("q1 " + words(60, "a"))])
    await turn(2, history + [user("q2")])
    assert (await api.post("/sessions/s1/compact"))["summary"]["covers_messages"] == 2
    await turn(3, history[:2] + [user("q2, edited")])  # supersedes q2 and its answer
    await turn(4, history + [user("q3")])
    return await turn(5, history + [user("q4")])


async def test_an_edit_of_a_message_the_cap_deleted_is_an_edit_not_an_append(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream
) -> None:
    """A full-history client edits an early message the cap has deleted: where it forked cannot be
    told, but its messages are the conversation. They are not appended after the branch they
    edited away (which the model would then be sent, and the store hold twice)."""
    upstream.summarizer = short_summary
    proxy = await start(start_proxy, make_storage, upstream, retention=RetentionConfig(max_messages_per_session=4),
                        summaries=True, overflow="summarize", tail_turns=1)
    config = config_of(proxy)
    talk = Conversation(proxy, upstream, "s1", style="full")
    for n in range(6):
        new, reply = [user(f"q{n} " + words(200, str(n)))], Reply(content=f"answer {n}")
        await talk.exchange(new, reply)
        talk.remember(new, reply)
    await proxy.app[SUMMARIZER].wait_idle()
    await until(lambda: rows(config, "SELECT MIN(seq) FROM messages")[0][0] > 2, "the cap deleted the opening")
    talk.history = talk.history[:2]
    edited = user("q1, edited")
    received, headers = await talk.exchange([edited], Reply(content="answer to the edit"))
    assert headers["x-memproxy-reconcile"] == "edit"
    assert [m for m in received.messages if m.get("role") != "system"] == [*talk.history, edited]
    active = [json.loads(body) for (body,) in rows(config, "SELECT body FROM messages WHERE active = 1 ORDER BY seq")]
    assert active == [*talk.history, edited, assistant("answer to the edit")]


async def test_message_cap_deletes_only_what_can_never_be_sent_again(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    memory = {"summaries": True, "overflow": "summarize", "tail_turns": 1}
    upstream.summarizer = short_summary
    uncapped = await start(start_proxy, make_storage, upstream, db="uncapped", **memory)

    async def nothing(n: int) -> None:
        pass

    expected_headers = await converse_with_edits(uncapped, upstream, api_for(http, uncapped), nothing)
    expected = upstream.last().messages

    upstream.reset()
    upstream.summarizer = short_summary
    capped = await start(start_proxy, make_storage, upstream, db="capped",
                         retention=RetentionConfig(max_messages_per_session=4), **memory)
    config = config_of(capped)
    seen: dict[int, list[tuple[int, Message]]] = {}

    def messages() -> list[tuple[int, Message]]:
        return [(r[0], json.loads(r[1])) for r in rows(config, "SELECT active, body FROM messages ORDER BY id")]

    # The stored messages after each turn, once the cap has been applied (it runs after the answer).
    settled = {1: 2, 2: 4, 3: 4, 4: 5, 5: 7}

    async def settle(n: int) -> None:
        await until(lambda: len(messages()) == settled[n], f"the cap applied after turn {n}")
        seen[n] = messages()

    headers = await converse_with_edits(capped, upstream, api_for(http, capped), settle)

    # The same conversation sends the same requests with and without the cap.
    assert upstream.last().messages == expected
    assert headers["X-Memproxy-Context-Tokens"] == expected_headers["X-Memproxy-Context-Tokens"]
    q1 = user("q1 " + words(60, "a"))
    # Superseded messages go first: the edit left 6 stored, the superseded two went.
    assert seen[3] == [(1, q1), (1, assistant("answer 1")), (1, user("q2, edited")), (1, assistant("answer 3"))]
    # Then what the summary stands for, except its last message (it proves the summary still
    # applies); never a message the summary does not cover.
    assert seen[4] == [(1, assistant("answer 1")), (1, user("q2, edited")), (1, assistant("answer 3")),
                       (1, user("q3")), (1, assistant("answer 4"))]

    # A capped session still exports, imports back and forks.
    api = api_for(http, capped)
    exported = await api.get("/sessions/s1/export")
    await api.post("/sessions/import?session_id=s1-copy", data=exported.encode(), status=201)
    assert await api.get("/sessions/s1-copy/export") == exported.replace('"session_id":"s1"', '"session_id":"s1-copy"')
    await api.post("/sessions/s1/fork", json={"new_id": "s1-fork"}, status=201)
    preview = await preview_of(api, "s1", "q5")
    assert (await preview_of(api, "s1-fork", "q5"))["messages"] == preview["messages"]
    await capped.app[SUMMARIZER].wait_idle()
    await uncapped.app[SUMMARIZER].wait_idle()
