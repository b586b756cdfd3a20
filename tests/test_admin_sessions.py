"""The session admin API (issue 4): list, show, compact, delete, clear, fork and metadata.

The proxy runs in process on a real port, driven by the `openai` SDK for chats and a plain aiohttp
client for `/v1/sessions` (helpers in `tests/admin_api.py`); what the API reports is checked against
what the fake upstream received and against the store, read from a second connection.
"""

from __future__ import annotations

import asyncio
import logging
import re

import aiohttp
import litellm
import pytest

from admin_api import (
    MakeStorage,
    Message,
    SYSTEM,
    StartProxy,
    TABLES,
    USAGE,
    api_for,
    assert_error,
    config_of,
    preview_of,
    rows_of,
    session_pk,
    short_summary,
    start,
    tool_call,
    words,
    write_db,
)
from conftest import OTHER_KEY
from db import rows
from fake_upstream import FakeUpstream, Reply
from helpers import assistant, send_turn, user
from memproxy.admin import fork
from memproxy.errors import Conflict
from memproxy.memory.fit import SUMMARY_PREFIX
from memproxy.typedefs import STORE

pytestmark = pytest.mark.both_stores


# --- list ---------------------------------------------------------------------------------------


async def test_list_newest_activity_first_with_titles_sizes_and_usage(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    proxy = await start(start_proxy, make_storage, upstream)
    api, config = api_for(http, proxy), config_of(proxy)
    long_prompt = "  " + "Please plan a three week trip through Japan, Korea and Taiwan in spring " * 3
    upstream.enqueue(*[Reply(content=f"answer {i}", usage=USAGE) for i in range(5)])
    await send_turn(proxy, "priced", [SYSTEM, user(long_prompt)], model="big")
    await send_turn(proxy, "unpriced", [user("first question")])
    await send_turn(proxy, "unpriced", [user("second question")])
    await send_turn(proxy, "later", [user("hello")])
    await send_turn(proxy, "priced", [user("and the budget?")], model="big")  # now the newest activity

    page = await api.get("/sessions")
    assert page["object"] == "list" and page["next"] is None
    assert [s["id"] for s in page["data"]] == ["priced", "later", "unpriced"]
    by_id = {s["id"]: s for s in page["data"]}
    priced, unpriced = by_id["priced"], by_id["unpriced"]

    assert priced["title"] == long_prompt.strip()[:100] and len(priced["title"]) == 100
    assert unpriced["title"] == "first question"  # the first prompt, not the latest
    assert priced["tenant"] == "a" and priced["object"] == "session"
    assert priced["message_count"] == 4 and unpriced["message_count"] == 4
    for s in page["data"]:
        [(tokens, created, updated)] = rows(
            config, "SELECT (SELECT sum(tokens) FROM messages WHERE session_pk = s.pk AND active = 1),"
            " created_at, updated_at FROM sessions s WHERE session_id = ?", s["id"])
        assert s["tokens_stored"] == tokens > 0
        assert (s["created_at"], s["updated_at"]) == (created, updated)
    assert priced["created_at"] < unpriced["created_at"] < priced["updated_at"]
    updates = [s["updated_at"] for s in page["data"]]
    assert updates == sorted(updates, reverse=True)

    # Usage is what the upstream reported; cost where litellm knows the price of the model.
    assert priced["usage"]["turns"] == 2 and unpriced["usage"]["turns"] == 2
    for s in (priced, unpriced):
        assert (s["usage"]["prompt_tokens"], s["usage"]["completion_tokens"]) == (2000, 400)
    unit_prices = litellm.cost_per_token(model="openai/gpt-4o-mini", prompt_tokens=1000, completion_tokens=200)
    assert priced["usage"]["cost"] == pytest.approx(2 * sum(unit_prices))
    assert priced["usage"]["cost"] > 0
    assert unpriced["usage"]["cost"] is None
    assert priced["summary_version"] == 0


async def test_list_pages_cover_every_session_exactly_once(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    proxy = await start(start_proxy, make_storage, upstream)
    api, config = api_for(http, proxy), config_of(proxy)
    ids = [f"s{i}" for i in range(7)]
    for session in ids:
        await send_turn(proxy, session, [user(f"hello from {session}")])
    await send_turn(proxy, "s2", [user("s2 again")])  # an older session is now the newest
    await send_turn(proxy, "other-tenant", [user("hi")], key=OTHER_KEY)

    async def walk() -> list[list[str]]:
        pages: list[list[str]] = []
        page = await api.get("/sessions?limit=3")
        while True:
            pages.append([s["id"] for s in page["data"]])
            if page["next"] is None:
                return pages
            page = await api.get(f"/sessions?limit=3&after={page['next']}")

    assert await walk() == [["s2", "s6", "s5"], ["s4", "s3", "s1"], ["s0"]]

    # Sessions with the same last activity still come once each, in a stable order.
    await asyncio.to_thread(write_db, config, "UPDATE sessions SET updated_at = 1700000000.5")
    assert await walk() == [["s6", "s5", "s4"], ["s3", "s2", "s1"], ["s0"]]

    # A limit as large as the list: one page, no cursor.
    page = await api.get("/sessions?limit=7")
    assert len(page["data"]) == 7 and page["next"] is None


@pytest.mark.parametrize("query, param", [
    ("limit=0", "limit"), ("limit=-1", "limit"), ("limit=1001", "limit"), ("limit=ten", "limit"),
    ("limit=", "limit"), ("after=yesterday", "after"), ("after=1.5_x", "after"), ("after=1_2_3", "after"),
    # Well-formed but beyond what a database holds: refused, not a database error.
    ("after=1.0_99999999999999999999", "after"), ("after=1.0_-9223372036854775809", "after"),
    ("after=1e400_1", "after"), ("after=nan_1", "after"), ("after=inf_1", "after"), ("after=-inf_1", "after"),
])
async def test_list_rejects_a_bad_limit_or_cursor(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession,
    query: str, param: str,
) -> None:
    proxy = await start(start_proxy, make_storage, upstream)
    body = await api_for(http, proxy).get(f"/sessions?{query}", status=400)
    assert_error(body, type="invalid_request_error", param=param)


# --- show and compact ---------------------------------------------------------------------------


async def test_show_lists_messages_in_order_and_superseded_branches_apart(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    proxy = await start(start_proxy, make_storage, upstream)
    api = api_for(http, proxy)
    history = [SYSTEM, user("q1")]
    await send_turn(proxy, "s1", history)
    history += [assistant("reply 1"), user("q2")]
    await send_turn(proxy, "s1", history)
    history += [assistant("reply 2"), user("q3")]
    await send_turn(proxy, "s1", history)
    # The user edits q2, then goes on from the edit.
    edited = history[:3] + [user("q2, edited")]
    await send_turn(proxy, "s1", edited)
    await send_turn(proxy, "s1", edited + [assistant("reply 4"), user("q5")])
    await api.call("PUT", "/sessions/s1/metadata", json={"pending_question": "which city?"})

    detail = await api.get("/sessions/s1")
    assert detail["id"] == "s1" and detail["tenant"] == "a"
    assert detail["system"] == [SYSTEM]
    assert "history_mode" not in detail  # no longer learned (issue 11)
    assert [m["message"] for m in detail["messages"]] == [
        user("q1"), assistant("reply 1"), user("q2, edited"), assistant("reply 4"), user("q5"),
        assistant("reply 5")]
    assert [m["position"] for m in detail["messages"]] == list(range(6))
    assert all(m["tokens"] > 0 for m in detail["messages"])
    [branch] = detail["superseded"]  # one branch, kept apart, not mixed into the messages
    assert branch["forked_at"] == 2
    assert [(m["position"], m["message"]) for m in branch["messages"]] == [
        (2, user("q2")), (3, assistant("reply 2")), (4, user("q3")), (5, assistant("reply 3"))]
    assert detail["message_count"] == 6
    assert detail["summary"] is None and detail["summary_history"] == []
    assert detail["metadata"] == {"pending_question": "which city?"}


async def test_compact_and_show_give_the_summary_and_its_history(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    proxy = await start(start_proxy, make_storage, upstream, summaries=True, overflow="summarize", tail_turns=1)
    api = api_for(http, proxy)
    texts = iter(["First summary: the user asked q1 and q2.", "Second summary: q1 to q4 were answered."])
    upstream.summarizer = lambda received: Reply(content=next(texts))
    for i in range(1, 4):
        await send_turn(proxy, "s1", [user(f"question number {i}, with some words to summarise")])
    first = await api.post("/sessions/s1/compact", json={"model": "small"})
    assert first["outcome"] == "applied" and first["messages_folded"] == 4
    assert first["summary"]["version"] == 1 and first["summary"]["covers_messages"] == 4
    assert first["tokens_after"] < first["tokens_before"]
    for i in range(4, 6):
        await send_turn(proxy, "s1", [user(f"question number {i}, with some words to summarise")])
    second = await api.post("/sessions/s1/compact")
    assert second["outcome"] == "applied" and second["summary"]["version"] == 2
    assert (await api.post("/sessions/s1/compact"))["outcome"] == "nothing"  # only the tail is left

    detail = await api.get("/sessions/s1")
    assert detail["summary"]["text"] == "Second summary: q1 to q4 were answered."
    assert detail["summary"]["covers_messages"] == 8
    assert [(s["version"], s["text"], s["covers_messages"]) for s in detail["summary_history"]] == [
        (1, "First summary: the user asked q1 and q2.", 4), (2, "Second summary: q1 to q4 were answered.", 8)]
    assert detail["summary_version"] == 2 and len(detail["messages"]) == 10  # the messages stay
    listed = (await api.get("/sessions"))["data"][0]
    assert listed["summary_version"] == 2
    body = await api.post("/sessions/s1/compact", json={"model": "nope"}, status=404)
    assert_error(body, type="invalid_request_error", code="model_not_found", param="model")


def marker_sent(message: Message) -> bool:
    return message["role"] == "system" and bool(re.match(r"\[\d+ earlier messages .*not shown", message["content"]))


async def test_show_tells_for_each_turn_what_its_request_was_made_of(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """Not only the next request: for every past turn, `show` says which summary went, from which
    stored position, how much was left out and whether a marker said so, as the upstream saw it."""
    proxy = await start(start_proxy, make_storage, upstream, summaries=True, overflow="marker",
                        chunk_threshold_tokens=100_000, tail_turns=1)
    api = api_for(http, proxy)
    upstream.summarizer = short_summary
    headers = [await send_turn(proxy, "s1", [SYSTEM, user("q1 " + words(60, "a"))]),
               await send_turn(proxy, "s1", [user("q2 " + words(60, "b"))])]
    assert (await api.post("/sessions/s1/compact"))["summary"]["version"] == 1
    headers.append(await send_turn(proxy, "s1", [user("q3, short")]))  # sends the summary
    for i in range(4, 7):  # each ~600 tokens: by the last, unsummarised turns no longer fit
        headers.append(await send_turn(proxy, "s1", [user(f"q{i}: " + words(600, f"w{i}"))]))
    sent = [r.messages for r in upstream.chat_requests()]
    assert len(sent) == 6

    detail = await api.get("/sessions/s1")
    chats = [t for t in detail["turns"] if t["kind"] != "summary"]
    assert [t["kind"] for t in detail["turns"]] == ["new", "append", "summary", "append", "append", "append",
                                                    "append"]
    assert detail["turns"][2]["sent"] is None and detail["turns"][2]["stored_messages"] == 0
    stored = [m["message"] for m in detail["messages"]]
    summaries = {s["version"]: s["covers_messages"] for s in detail["summary_history"]}
    for n, (turn, messages, header) in enumerate(zip(chats, sent, headers)):
        extras = [m for m in messages[1:] if m["role"] == "system"]  # after the system prompt
        summary = [m for m in extras if m["content"].startswith(SUMMARY_PREFIX)]
        history = messages[1 + len(extras) : -1]
        base = turn["stored_from_position"]  # where this turn's own messages went
        assert turn["stored_messages"] == 2 and stored[base] == messages[-1]
        first = next(i for i in range(base + 1) if stored[i : i + len(history)] == history) if history else base
        expected = {
            "summary_version": 1 if summary else 0,
            "from_position": first,
            "stored_included": len(history),
            "stored_omitted": base - len(history),
            "unsummarised_omitted": first - (summaries[1] if summary else 0),
            "marker": any(marker_sent(m) for m in extras),
            "tool_outputs_trimmed": 0,
            "deduplicated": 0,
            "recalled": [],  # recall is off in these tests
        }
        assert turn["sent"] == expected, f"turn {n + 1}"
        assert turn["context_tokens"] == int(header["X-Memproxy-Context-Tokens"])
        assert expected["stored_omitted"] == int(header["X-Memproxy-Stored-Omitted"])
    assert [t["sent"]["summary_version"] for t in chats] == [0, 0, 1, 1, 1, 1]
    assert [t["sent"]["marker"] for t in chats] == [False] * 4 + [True, True]
    assert chats[-1]["sent"]["unsummarised_omitted"] > 0

    # The export carries it, and an import gives it back.
    exported = await api.get("/sessions/s1/export")
    await api.post("/sessions/import?session_id=s1-copy", data=exported.encode(), status=201)
    assert (await api.get("/sessions/s1-copy"))["turns"] == detail["turns"]


# --- delete, clear, fork ------------------------------------------------------------------------


async def test_delete_removes_everything_about_a_session_for_good(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    proxy = await start(start_proxy, make_storage, upstream, summaries=True, overflow="summarize", tail_turns=1)
    api, config = api_for(http, proxy), config_of(proxy)
    upstream.summarizer = short_summary
    for session in ("doomed", "kept"):
        for i in range(3):
            await send_turn(proxy, session, [user(f"{session} question {i} with enough words to fold")])
        await api.post(f"/sessions/{session}/compact")
        await api.call("PATCH", f"/sessions/{session}/metadata", json={"owner": session})
    pk, kept_pk = session_pk(config, "doomed"), session_pk(config, "kept")
    assert pk is not None and kept_pk is not None
    before = rows_of(config, kept_pk)
    assert all(rows_of(config, pk)[table] > 0 for table in TABLES)

    body = await api.call("DELETE", "/sessions/doomed")
    assert body == {"id": "doomed", "object": "session.deleted", "deleted": True}
    assert rows_of(config, pk) == {table: 0 for table in TABLES}
    assert rows(config, "SELECT count(*) FROM messages WHERE body LIKE '%doomed%'") == [(0,)]
    assert rows_of(config, kept_pk) == before
    assert_error(await api.get("/sessions/doomed", status=404), type="invalid_request_error",
                 code="session_not_found")
    await api.call("DELETE", "/sessions/doomed", status=404)
    assert [s["id"] for s in (await api.get("/sessions"))["data"]] == ["kept"]

    # The id may be used again: a new conversation, nothing of the old one sent.
    await send_turn(proxy, "doomed", [user("start over")])
    assert upstream.last().messages == [user("start over")]


async def test_clear_keeps_the_record_and_sends_nothing_from_before(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    proxy = await start(start_proxy, make_storage, upstream)
    api = api_for(http, proxy)
    await send_turn(proxy, "s1", [SYSTEM, user("my name is Ada")])
    await send_turn(proxy, "s1", [user("I live in Paris")])
    await api.call("PUT", "/sessions/s1/metadata", json={"step": 2})
    created = (await api.get("/sessions/s1"))["created_at"]

    body = await api.post("/sessions/s1/clear")
    assert body == {"id": "s1", "object": "session.cleared", "cleared": True}
    detail = await api.get("/sessions/s1")
    assert detail["created_at"] == created and detail["metadata"] == {"step": 2}
    assert detail["messages"] == [] and detail["message_count"] == 0 and detail["system"] is None
    assert [m["message"] for b in detail["superseded"] for m in b["messages"]] == [
        user("my name is Ada"), assistant("reply 1"), user("I live in Paris"), assistant("reply 2")]
    assert (await preview_of(api, "s1", "who am I?"))["messages"] == [user("who am I?")]

    await send_turn(proxy, "s1", [user("who am I?")])
    assert upstream.last().messages == [user("who am I?")]
    await send_turn(proxy, "s1", [user("and where?")])
    assert upstream.last().messages == [user("who am I?"), assistant("reply 3"), user("and where?")]
    assert (await api.get("/sessions/s1"))["title"] == "my name is Ada"  # the record is the same one


async def test_fork_at_a_message_continues_independently(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    proxy = await start(start_proxy, make_storage, upstream)
    api = api_for(http, proxy)
    await send_turn(proxy, "s1", [SYSTEM, user("q1")])
    await send_turn(proxy, "s1", [user("q2")])
    await send_turn(proxy, "s1", [user("q3")])
    original = await api.get("/sessions/s1")

    body = await api.post("/sessions/s1/fork", json={"new_id": "s1-alt", "at": 2}, status=201)
    assert body == {"id": "s1-alt", "object": "session", "forked_from": "s1", "messages": 2}
    fork = await api.get("/sessions/s1-alt")
    assert [m["message"] for m in fork["messages"]] == [user("q1"), assistant("reply 1")]
    assert fork["system"] == [SYSTEM] and fork["superseded"] == []

    await send_turn(proxy, "s1-alt", [user("q2, another way")])
    assert upstream.last().messages == [SYSTEM, user("q1"), assistant("reply 1"), user("q2, another way")]
    await send_turn(proxy, "s1", [user("q4")])
    assert upstream.last().messages == [SYSTEM, user("q1"), assistant("reply 1"), user("q2"), assistant("reply 2"),
                                        user("q3"), assistant("reply 3"), user("q4")]
    after = await api.get("/sessions/s1")
    assert after["messages"][:6] == original["messages"] and len(after["messages"]) == 8
    assert [m["message"] for m in (await api.get("/sessions/s1-alt"))["messages"]] == [
        user("q1"), assistant("reply 1"), user("q2, another way"), assistant("reply 4")]

    # Without `at`, the whole conversation.
    await api.post("/sessions/s1/fork", json={"new_id": "s1-copy"}, status=201)
    assert (await api.get("/sessions/s1-copy"))["messages"] == after["messages"]

    body = await api.post("/sessions/s1/fork", json={"new_id": "s1-alt"}, status=409)
    assert_error(body, type="invalid_request_error", code="session_conflict")
    assert [m["message"] for m in (await api.get("/sessions/s1-alt"))["messages"]][-1] == assistant("reply 4")
    for bad, param in [({"new_id": "x", "at": 9}, "at"), ({"new_id": "x", "at": -1}, "at"),
                       ({"new_id": "x", "at": True}, "at"), ({"new_id": "no spaces"}, "new_id"), ({}, "new_id")]:
        assert_error(await api.post("/sessions/s1/fork", json=bad, status=400),
                     type="invalid_request_error", param=param)
    assert (await api.get("/sessions/x", status=404))["error"]["code"] == "session_not_found"


async def test_a_fork_that_races_a_change_of_its_session_is_a_conflict(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """The fork reads the session, then exports it: an edit, a clear or a turn landing between the
    two (another replica's) made a 400 that blamed the message cap. A 409 that says to retry, and
    no fork."""
    proxy = await start(start_proxy, make_storage, upstream)
    api = api_for(http, proxy)
    store = proxy.app[STORE]
    await send_turn(proxy, "s1", [user("q1")])
    await send_turn(proxy, "s1", [user("q2")])
    read = await store.get_session("a", "s1")
    assert read is not None and read.length == 4
    await api.post("/sessions/s1/clear", status=200)  # lands after the fork's read
    with pytest.raises(Conflict):
        await fork(store, read, "a", "s1-fork")
    await api.get("/sessions/s1-fork", status=404)
    # Read afresh, the fork goes through.
    fresh = await store.get_session("a", "s1")
    assert fresh is not None and await fork(store, fresh, "a", "s1-fork") == 0


async def test_fork_never_cuts_between_a_tool_call_and_its_results(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    proxy = await start(start_proxy, make_storage, upstream)
    api, config = api_for(http, proxy), config_of(proxy)
    calls = [tool_call("call_1", "search"), tool_call("call_2", "lookup")]
    upstream.enqueue(Reply(tool_calls=calls), Reply(content="found it"))
    await send_turn(proxy, "s1", [user("search twice")])
    await send_turn(proxy, "s1", [{"role": "tool", "tool_call_id": "call_1", "content": "result one"},
                             {"role": "tool", "tool_call_id": "call_2", "content": "result two"}])
    roles = [m["message"]["role"] for m in (await api.get("/sessions/s1"))["messages"]]
    assert roles == ["user", "assistant", "tool", "tool", "assistant"]

    for inside in (2, 3):  # after the call, before (all of) its results
        body = await api.post("/sessions/s1/fork", json={"new_id": f"cut-{inside}", "at": inside}, status=400)
        assert_error(body, type="invalid_request_error", param="at")
        assert session_pk(config, f"cut-{inside}") is None
    for at, kept in [(0, []), (1, ["user"]), (4, roles[:4]), (5, roles)]:
        await api.post("/sessions/s1/fork", json={"new_id": f"fork-{at}", "at": at}, status=201)
        fork = await api.get(f"/sessions/fork-{at}")
        assert [m["message"]["role"] for m in fork["messages"]] == kept
    # A fork that ends with a call and its results sends them whole.
    await send_turn(proxy, "fork-4", [user("and then?")])
    assert [m["role"] for m in upstream.last().messages] == ["user", "assistant", "tool", "tool", "user"]


# --- metadata -----------------------------------------------------------------------------------


async def test_metadata_put_replaces_patch_merges_and_values_are_never_logged(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # memproxy and aiohttp at every level; the rest at `serve`'s default level (test_sessions_cli.py
    # runs a server at DEBUG and checks the same).
    caplog.set_level(logging.INFO)
    for name in ("memproxy", "aiohttp"):
        caplog.set_level(logging.DEBUG, logger=name)
    proxy = await start(start_proxy, make_storage, upstream)
    api = api_for(http, proxy)
    secrets = ["sk-live-4f9a8b7c6d5e", "hunter2-password", "4111 1111 1111 1111", "ada@example.org"]

    # An agent sets its state before the first turn: PUT creates the session.
    state = {"known": {"api_key": secrets[0], "email": secrets[3]}, "pending_question": "which account?",
             "attempts": 1, "tags": ["billing", None], "ok": True}
    assert await api.call("PUT", "/sessions/agent-7/metadata", json=state) == state
    assert await api.get("/sessions/agent-7/metadata") == state
    listed = (await api.get("/sessions"))["data"]
    assert [(s["id"], s["message_count"]) for s in listed] == [("agent-7", 0)]

    await send_turn(proxy, "agent-7", [user("hello")])
    assert upstream.last().messages == [user("hello")]  # metadata is never sent upstream
    merged = await api.call("PATCH", "/sessions/agent-7/metadata",
                            json={"pending_question": None, "password": secrets[1], "attempts": 2})
    assert merged == {"known": {"api_key": secrets[0], "email": secrets[3]}, "attempts": 2, "tags": ["billing", None],
                      "ok": True, "password": secrets[1]}
    assert await api.get("/sessions/agent-7/metadata") == merged
    assert (await api.get("/sessions/agent-7"))["metadata"] == merged

    replaced = await api.call("PUT", "/sessions/agent-7/metadata", json={"card": secrets[2]})
    assert replaced == {"card": secrets[2]} == await api.get("/sessions/agent-7/metadata")
    assert [m["message"] for m in (await api.get("/sessions/agent-7"))["messages"]] == [
        user("hello"), assistant("reply 1")]  # replacing the metadata leaves the conversation alone
    await api.get("/sessions/agent-7/export")
    await api.get("/sessions/agent-7/context")

    assert_error(await api.call("PATCH", "/sessions/nobody/metadata", json={"a": 1}, status=404),
                 type="invalid_request_error", code="session_not_found")
    for bad in (b"[1, 2]", b'"text"', b"{not json"):
        for method in ("PUT", "PATCH"):
            assert_error(await api.call(method, "/sessions/agent-7/metadata", data=bad, status=400),
                         type="invalid_request_error")
    # An empty body says nothing: it once replaced the metadata with {} (and created a session).
    for empty in (b"", b"  \n"):
        for session in ("agent-7", "nobody"):
            assert_error(await api.call("PUT", f"/sessions/{session}/metadata", data=empty, status=400),
                         type="invalid_request_error")
    assert await api.get("/sessions/agent-7/metadata") == {"card": secrets[2]}
    assert [s["id"] for s in (await api.get("/sessions"))["data"]] == ["agent-7"]

    assert caplog.records, "the run logged nothing: the check below would prove nothing"
    for record in caplog.records:
        text = f"{record.getMessage()} {record.args!r} {record.exc_text or ''}"
        for secret in secrets:
            assert secret not in text, f"{record.name} logged a metadata value"


async def test_concurrent_metadata_patches_of_distinct_keys_all_land(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """Each PATCH merges under the session's row lock: none is lost to another read before it."""
    proxy = await start(start_proxy, make_storage, upstream)
    api = api_for(http, proxy)
    await api.call("PUT", "/sessions/agent/metadata", json={"kept": True})
    results = await asyncio.gather(*[api.call("PATCH", "/sessions/agent/metadata", json={f"key{i}": i})
                                     for i in range(20)])
    expected = {"kept": True, **{f"key{i}": i for i in range(20)}}
    assert await api.get("/sessions/agent/metadata") == expected
    # Each answer is the metadata its own merge wrote: it holds its key and every earlier one.
    assert all(f"key{i}" in result and result["kept"] for i, result in enumerate(results))
    assert sorted(len(result) for result in results) == list(range(2, 22))
    # Removing keys concurrently loses no removal either.
    await asyncio.gather(*[api.call("PATCH", "/sessions/agent/metadata", json={f"key{i}": None})
                           for i in range(0, 20, 2)])
    assert await api.get("/sessions/agent/metadata") == {
        "kept": True, **{f"key{i}": i for i in range(1, 20, 2)}}
