"""The session admin API (issue 4): export, and import of an export, whole or damaged.

The proxy runs in process on a real port, driven by the `openai` SDK for chats and a plain aiohttp
client for `/v1/sessions` (helpers in `tests/admin_api.py`); what the API reports is checked against
what the fake upstream received and against the store, read from a second connection.
"""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp
import pytest

from admin_api import (
    Api,
    MakeStorage,
    SYSTEM,
    StartProxy,
    TABLES,
    api_for,
    assert_error,
    config_of,
    preview_of,
    short_summary,
    start,
    tool_call,
    words,
)
from conftest import OTHER_KEY, PROXY_KEY, Proxy
from db import table_rows
from fake_upstream import FakeUpstream, Reply
from helpers import assistant, send_turn, user
from memproxy.typedefs import SUMMARIZER

pytestmark = pytest.mark.both_stores


# --- export and import --------------------------------------------------------------------------


async def test_export_imports_back_exactly(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    proxy = await start(start_proxy, make_storage, upstream, summaries=True, overflow="summarize", tail_turns=1,
                        tool_output_max_tokens=64)
    api = api_for(http, proxy)
    upstream.summarizer = short_summary
    history = [SYSTEM, user("q1 — with ünïcode " + words(80, "q"))]
    await send_turn(proxy, "orig", history, **{"X-Memproxy-User": "alice"})  # recall_scope: user finds it by her
    history += [assistant("reply 1"), user("q2")]
    await send_turn(proxy, "orig", history)
    await send_turn(proxy, "orig", history[:3] + [user("q2, edited")])  # a superseded branch
    upstream.enqueue(Reply(tool_calls=[tool_call("call_1", "search")]))
    await send_turn(proxy, "orig", history[:3] + [user("q2, edited"), assistant("reply 3"), user("search")])
    await send_turn(proxy, "orig", history[:3] + [user("q2, edited"), assistant("reply 3"), user("search"),
                                             {"role": "assistant", "content": None,
                                              "tool_calls": [tool_call("call_1", "search")]},
                                             {"role": "tool", "tool_call_id": "call_1", "content": words(300, "r")}])
    assert (await api.post("/sessions/orig/compact"))["outcome"] == "applied"
    await api.call("PUT", "/sessions/orig/metadata", json={"known": {"city": "Oslo"}, "pending": None})

    async with http.get(f"{proxy.url}/sessions/orig/export",
                        headers={"Authorization": f"Bearer {PROXY_KEY}"}) as response:
        assert response.status == 200 and response.content_type == "application/x-ndjson"
        exported = await response.text()
    records = [json.loads(line) for line in exported.splitlines()]
    assert exported.endswith("\n") and len(records) == len(exported.splitlines())
    kinds = [r["type"] for r in records]
    assert kinds[0] == "session" and kinds.count("session") == 1
    assert kinds.count("turn") == 6 and kinds.count("summary") == 1  # 5 chat turns, 1 summariser call
    assert [r["kind"] for r in records if r["type"] == "turn"].count("summary") == 1
    assert kinds.count("message") == 10  # 8 on the active chain, 2 superseded
    assert records[0]["session_id"] == "orig" and records[0]["metadata"] == {"known": {"city": "Oslo"},
                                                                           "pending": None}
    assert records[0]["end_user"] == "alice"
    assert records[0]["tokenizer"] == "o200k_base"  # which counter made its counts, as the store keeps it

    body = await api.post("/sessions/import?session_id=copy", data=exported.encode(), status=201)
    assert body == {"id": "copy", "object": "session", "imported": True}
    again = await api.get("/sessions/copy/export")
    assert again == exported.replace('"session_id":"orig"', '"session_id":"copy"', 1)
    assert again != exported

    original, copy = await api.get("/sessions/orig"), await api.get("/sessions/copy")
    assert {**copy, "id": "orig"} == original

    # A fork is the same conversation, for the same end user; it is no chat turn of the tenant's.
    turns = (await api.get("/usage"))["turns"]
    await api.post("/sessions/orig/fork", json={"new_id": "forked"}, status=201)
    forked = json.loads((await api.get("/sessions/forked/export")).splitlines()[0])
    assert (forked["end_user"], forked["tokenizer"]) == ("alice", "o200k_base")
    assert (await api.get("/usage"))["turns"] == turns

    # The copy goes on as the original would.
    preview = await preview_of(api, "orig", "next")
    await send_turn(proxy, "copy", [user("next")], **{"X-Memproxy-History": "new"})
    assert json.dumps(upstream.last().messages) == json.dumps(preview["messages"])
    await proxy.app[SUMMARIZER].wait_idle()

    # The exported id is taken: 409; under the id in the export, into another tenant, it is free.
    assert_error(await api.post("/sessions/import", data=exported.encode(), status=409),
                 type="invalid_request_error", code="session_conflict")
    # An id asked for but empty (a shell variable unset) is refused, not taken for the export's.
    assert_error(await api.post("/sessions/import?session_id=", data=exported.encode(), status=400),
                 type="invalid_request_error", param="session_id")
    await api.as_(OTHER_KEY).post("/sessions/import", data=exported.encode(), status=201)
    assert (await api.as_(OTHER_KEY).get("/sessions/orig"))["messages"] == original["messages"]


@pytest.mark.parametrize("text", [
    "", "not json at all\n", '{"type": "turn", "id": 1}\n', "[1, 2, 3]\n",
    '{"type": "session", "session_id": "x"}\n{"type": "session", "session_id": "y"}\n',
    '{"type": "session", "session_id": "x"}\n{"type": "gossip"}\n',
    '{"type": "session", "session_id": "x"}\n{"type": "message", "id": 1}\n',
    '{"type": "session", "session_id": "x", "created_at": "yesterday"}\n',
], ids=["empty", "not-json", "no-session", "not-objects", "two-sessions", "unknown-record",
        "message-without-fields", "bad-session-fields"])
async def test_import_of_a_malformed_export_is_400_and_stores_nothing(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession, text: str
) -> None:
    proxy = await start(start_proxy, make_storage, upstream)
    api = api_for(http, proxy)
    body = await api.post("/sessions/import?session_id=imported", data=text.encode(), status=400)
    assert_error(body, type="invalid_request_error")
    assert [len(found) for found in table_rows(config_of(proxy), *TABLES).values()] == [0, 0, 0, 0]


MISSING = object()
# A damaged field of an otherwise good export: (record type, which of them, field, value, what the
# error names). Each is one a careless edit or a broken tool could write, and each used to be stored
# (to fail at the next chat, or as a database error on one store and a wrong value on the other).
DAMAGE: dict[str, tuple[str, int, str, Any, str]] = {
    "system prompt a string": ("session", 0, "system_prompt", "You are terse.", "'system_prompt'"),
    "system prompt of user messages": ("session", 0, "system_prompt", [user("hi")], "'system_prompt'"),
    "system prompt of non-messages": ("session", 0, "system_prompt", [{"role": "system"}], "'system_prompt'"),
    "metadata a list": ("session", 0, "metadata", ["a", "b"], "'metadata'"),
    "history mode unknown": ("session", 0, "history_mode", "bogus", "'history_mode'"),
    "length negative": ("session", 0, "length", -1, "'length'"),
    "length a float": ("session", 0, "length", 4.0, "'length'"),
    "length huge": ("session", 0, "length", 2**31 - 1, "a gap"),  # refused without walking it
    "time not a number": ("session", 0, "created_at", "yesterday", "'created_at'"),
    # Not JSON: refused as the line is parsed, before any field is read.
    "time NaN": ("session", 0, "updated_at", float("nan"), "NaN is not a JSON number"),
    "time infinite": ("turn", 1, "created_at", float("inf"), "Infinity is not a JSON number"),
    "head not the last message": ("session", 0, "head_hash", "0" * 32, "'head_hash'"),
    "head tokens wrong": ("session", 0, "head_cum", 1, "'head_cum'"),
    "tokens a string": ("turn", 0, "prompt_tokens", "lots", "'prompt_tokens'"),
    "tokens beyond a column": ("turn", 0, "completion_tokens", 2**40, "'completion_tokens'"),
    "tokens a boolean": ("turn", 0, "context_tokens", True, "'context_tokens'"),
    "cost negative": ("turn", 0, "cost", -1.5, "'cost'"),
    "model missing": ("turn", 0, "model", MISSING, "'model'"),
    "marker not a flag": ("turn", 0, "marker", 2, "'marker'"),
    "sent half null": ("turn", 0, "included", None, "all null or all set"),
    "body a string": ("message", 0, "body", "hello", "'body'"),
    "body without content": ("message", 0, "body", {"role": "user"}, "'body'"),
    "body of another role": ("message", 0, "role", "assistant", "'role'"),
    "role unknown": ("message", 0, "role", "wizard", "'role'"),
    "active not a flag": ("message", 1, "active", 2, "'active'"),
    "position beyond a column": ("message", 1, "seq", 2**40, "'seq'"),
    "tokens negative": ("message", 1, "tokens", -5, "'tokens'"),
    "chain hash missing": ("message", 1, "chain_hash", MISSING, "'chain_hash'"),
    "compact form not a message": ("message", 1, "compact_body", [1], "'compact_body'"),
    "parent not before it": ("message", 1, "parent", 999, "not before it"),
    "turn not before it": ("message", 1, "turn", 999, "not before it"),
    "a message id twice": ("message", 1, "id", 1, "a second message id"),
    "summary beyond the length": ("summary", 0, "covers", 10**6, "more than the session's length"),
    "summary version 0": ("summary", 0, "version", 0, "'version'"),
}


# Damage only the relations between records show: the error is about the export, not one line.
ABOUT_THE_WHOLE_EXPORT = {"head not the last message", "head tokens wrong", "length huge", "summary beyond the length"}


async def exported_session(proxy: Proxy, upstream: FakeUpstream, api: Api) -> str:
    """An export with every kind of record: system prompt, metadata, turns, messages, a summary."""
    upstream.summarizer = short_summary
    await send_turn(proxy, "orig", [SYSTEM, user("q1 " + words(80, "q"))])
    await send_turn(proxy, "orig", [user("q2")])
    await send_turn(proxy, "orig", [user("q3")])
    assert (await api.post("/sessions/orig/compact"))["outcome"] == "applied"
    await api.call("PUT", "/sessions/orig/metadata", json={"k": "v"})
    export: str = await api.get("/sessions/orig/export")
    return export


def damage(exported: str, kind: str, nth: int, field: str, value: Any) -> tuple[str, int]:
    """The export with one field of its `nth` record of `kind` changed (MISSING: removed), and the
    line that record is on."""
    lines = exported.splitlines()
    records = [json.loads(line) for line in lines]
    index = [i for i, r in enumerate(records) if r["type"] == kind][nth]
    if value is MISSING:
        del records[index][field]
    else:
        records[index][field] = value
    lines[index] = json.dumps(records[index])
    return "\n".join(lines) + "\n", index + 1


@pytest.mark.parametrize("case", list(DAMAGE))
async def test_import_refuses_a_damaged_field_naming_its_line_and_stores_nothing(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession,
    case: str,
) -> None:
    proxy = await start(start_proxy, make_storage, upstream, summaries=True, overflow="summarize", tail_turns=1)
    api, config = api_for(http, proxy), config_of(proxy)
    exported = await exported_session(proxy, upstream, api)
    before = table_rows(config, *TABLES)
    kind, nth, field, value, named = DAMAGE[case]
    text, line = damage(exported, kind, nth, field, value)

    body = await api.post("/sessions/import?session_id=copy", data=text.encode(), status=400)
    assert_error(body, type="invalid_request_error")
    message = body["error"]["message"]
    assert named in message, message
    if case not in ABOUT_THE_WHOLE_EXPORT:
        assert f"line {line}:" in message, message
    assert table_rows(config, *TABLES) == before
    await api.get("/sessions/copy", status=404)
    # The undamaged export still imports, and the copy chats like the original.
    await api.post("/sessions/import?session_id=copy", data=exported.encode(), status=201)
    await send_turn(proxy, "copy", [user("q4")], **{"X-Memproxy-History": "new"})
    await proxy.app[SUMMARIZER].wait_idle()


async def test_import_brings_future_times_back_to_now_and_takes_older_exports(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """A session "active tomorrow" would outlive every prune and idle TTL: its times become now. An
    export written before turns kept what their requests were made of imports too."""
    proxy = await start(start_proxy, make_storage, upstream, summaries=True, overflow="summarize", tail_turns=1)
    api = api_for(http, proxy)
    exported = await exported_session(proxy, upstream, api)
    records = [json.loads(line) for line in exported.splitlines()]
    later = time.time() + 30 * 86400
    records[0]["history_mode"] = "full"  # what memproxy learned of a client before it stopped learning
    for record in records:
        record.update({t: later for t in ("created_at", "updated_at") if t in record})
        if record["type"] == "turn":
            for name in ("summary_version", "first_sent", "included", "omitted", "unsummarised_omitted",
                         "marker", "trimmed", "deduplicated"):
                del record[name]
    started = time.time()
    await api.post("/sessions/import?session_id=copy", data="".join(json.dumps(r) + "\n" for r in records).encode(),
                   status=201)
    finished = time.time()
    copy = [json.loads(line) for line in (await api.get("/sessions/copy/export")).splitlines()]
    times = [r[t] for r in copy for t in ("created_at", "updated_at") if t in r]
    assert len(times) == len(records) + 1 and all(started <= t <= finished for t in times)
    assert all(r["summary_version"] is None for r in copy if r["type"] == "turn")
    assert "history_mode" not in copy[0]  # imported, ignored, and no longer exported
    def bodies(detail: Any) -> list[Any]:
        return [(m["position"], m["message"]) for m in detail["messages"]]

    assert bodies(await api.get("/sessions/copy")) == bodies(await api.get("/sessions/orig"))
    # Now "delete everything older than now" reaches it.
    assert (await api.call("DELETE", "/sessions?all=true"))["deleted"] == 2
    await proxy.app[SUMMARIZER].wait_idle()


async def test_a_cleared_session_with_a_summary_imports_back_exactly(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """A clear (or an edit back to fewer messages) keeps the summaries written before it: their
    `covers` may then exceed the session's length. Such an export is still the store's own records,
    and imports back (a summary beyond the length is stale: it never stands for anything)."""
    proxy = await start(start_proxy, make_storage, upstream, summaries=True, overflow="summarize", tail_turns=1)
    api = api_for(http, proxy)
    exported = await exported_session(proxy, upstream, api)
    assert any(json.loads(line)["type"] == "summary" for line in exported.splitlines())
    await api.post("/sessions/orig/clear")
    await send_turn(proxy, "orig", [user("afresh")])
    exported = await api.get("/sessions/orig/export")
    await api.post("/sessions/import?session_id=copy", data=exported.encode(), status=201)
    assert await api.get("/sessions/copy/export") == exported.replace('"session_id":"orig"', '"session_id":"copy"', 1)
    preview = await preview_of(api, "orig", "next")
    await send_turn(proxy, "copy", [user("next")], **{"X-Memproxy-History": "new"})
    assert json.dumps(upstream.last().messages) == json.dumps(preview["messages"])
    await proxy.app[SUMMARIZER].wait_idle()
