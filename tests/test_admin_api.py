"""The session admin API (issue 4) through HTTP: every verb, tenant isolation, usage, retention.

The proxy runs in process on a real port and is driven by the `openai` SDK for chats and a plain
aiohttp client for `/v1/sessions`; the fake upstream records what each request really sent. What the
API reports is checked against that record and against the SQLite file, read from a second
connection (and, where a test needs an old session, written to from one: the clock is never waited on).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from contextlib import closing
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import httpx
import litellm
import openai
import pytest

from conftest import OTHER_KEY, PROXY_KEY, Proxy, make_config
from db import rows, table_query, table_rows
from fake_upstream import FakeUpstream, Received, Reply
from helpers import assistant, send_turn, until, user
from memproxy.config import Config, RetentionConfig, StorageConfig
from memproxy.context import SUMMARY_PREFIX
from memproxy.store.sqlite import sqlite_path
from memproxy.tokens import TiktokenCounter, encoding_name_for, request_tokens
from memproxy.typedefs import CONFIG, SUMMARIZER

Message = dict[str, Any]
StartProxy = Callable[[Config], Any]
MakeStorage = Callable[..., StorageConfig]

pytestmark = pytest.mark.both_stores

ADMIN_KEY = "admin-key-123"
SYSTEM: Message = {"role": "system", "content": "You are terse."}
TABLES = ("sessions", "turns", "messages", "summaries")
USAGE = {"prompt_tokens": 1000, "completion_tokens": 200, "total_tokens": 1200}


def words(n: int, tag: str) -> str:
    """About n tokens of text, distinct per tag."""
    return " ".join(f"{tag}{i % 10}" for i in range(n))


def short_summary(received: Received) -> Reply:
    return Reply(content="The user asked several questions; all were answered.")


# --- the proxy and the admin client -------------------------------------------------------------


async def start(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream,
    retention: RetentionConfig | None = None, db: str = "memproxy", **memory: Any,
) -> Proxy:
    config = make_config(make_storage(db), upstream.url, **memory)
    config = replace(config, auth=replace(config.auth, admin_keys=(ADMIN_KEY,)),
                     retention=retention or RetentionConfig())
    proxy: Proxy = await start_proxy(config)
    return proxy


@dataclass
class Api:
    """`/v1/...` requests with one key; each asserts its status and returns the decoded body."""

    http: aiohttp.ClientSession
    proxy: Proxy
    key: str = PROXY_KEY

    def as_(self, key: str) -> Api:
        return Api(self.http, self.proxy, key)

    async def call(self, method: str, path: str, status: int = 200, **kwargs: Any) -> Any:
        headers = {"Authorization": f"Bearer {self.key}"}
        async with self.http.request(method, f"{self.proxy.url}{path}", headers=headers, **kwargs) as response:
            text = await response.text()
            assert response.status == status, f"{method} {path}: {response.status} {text}"
            if response.content_type == "application/json":
                return json.loads(text)
            return text

    async def get(self, path: str, status: int = 200, **kwargs: Any) -> Any:
        return await self.call("GET", path, status, **kwargs)

    async def post(self, path: str, status: int = 200, **kwargs: Any) -> Any:
        return await self.call("POST", path, status, **kwargs)


@pytest.fixture
async def http(start_proxy: StartProxy) -> AsyncIterator[aiohttp.ClientSession]:
    # Depends on start_proxy so it closes before the proxies it talks to.
    async with aiohttp.ClientSession() as session:
        yield session


def api_for(http: aiohttp.ClientSession, proxy: Proxy) -> Api:
    return Api(http, proxy)


async def preview_of(api: Api, session: str, text: str, **body: Any) -> Any:
    """What the next request of `session` would send with the new user message `text` (in a POST
    body: content never goes in a URL)."""
    return await api.post(f"/sessions/{session}/context", json={"messages": [user(text)], **body})


def part(preview: Any, name: str) -> Any:
    """One labelled part of a context preview."""
    return next(p for p in preview["parts"] if p["part"] == name)


def assert_error(body: Any, *, type: str, code: str | None = None, param: str | None = None) -> None:
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "code", "param"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == type
    if code is not None:
        assert error["code"] == code
    assert error["param"] == param


# --- the store, from a second connection ---------------------------------------------------------


def config_of(proxy: Proxy) -> Config:
    return proxy.app[CONFIG]


def session_pk(config: Config, session: str, tenant: str = "a") -> int | None:
    found = rows(config, "SELECT pk FROM sessions WHERE tenant = ? AND session_id = ?", tenant, session)
    return int(found[0][0]) if found else None


def rows_of(config: Config, pk: int) -> dict[str, int]:
    queries = [("SELECT count(*) FROM sessions WHERE pk = ?", (pk,))]
    queries += [(f"SELECT count(*) FROM {table} WHERE session_pk = ?", (pk,)) for table in TABLES[1:]]
    return {table: found[0][0] for table, found in zip(TABLES, table_query(config, queries))}


def stored_bodies(config: Config, session: str, tenant: str = "a") -> list[Message]:
    found = rows(config, "SELECT m.body FROM messages m JOIN sessions s ON s.pk = m.session_pk"
                         " WHERE s.tenant = ? AND s.session_id = ? ORDER BY m.id", tenant, session)
    return [json.loads(r[0]) for r in found]


def write_db(config: Config, sql: str, *params: Any) -> int:
    """One write from a second connection (`tests/db.py` reads only); returns the rows changed."""
    if config.storage.is_postgres:
        return len(rows(config, f"{sql} RETURNING 1", *params))
    with closing(sqlite3.connect(sqlite_path(config.storage.url), timeout=5)) as db:
        changed = db.execute(sql, params).rowcount
        db.commit()
        return changed


async def age(config: Config, session: str, seconds: float, tenant: str = "a") -> None:
    """Make a session look idle for `seconds` by moving its last activity into the past. On a
    thread: the proxy's own writes (a sweep) need the event loop to finish theirs meanwhile."""
    changed = await asyncio.to_thread(
        write_db, config, "UPDATE sessions SET updated_at = updated_at - ? WHERE tenant = ? AND session_id = ?",
        seconds, tenant, session)
    assert changed == 1


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
    return message["role"] == "system" and "earlier messages of this conversation are not shown" in message["content"]


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


# --- the context the next request sends ---------------------------------------------------------


def tool_call(call_id: str, name: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": '{"q": "x"}'}}


async def converse(proxy: Proxy, upstream: FakeUpstream, scenario: str) -> None:
    """Session s1 of tenant a, as a client that sends only its new messages."""
    if scenario == "tool-output-trimmed":
        upstream.enqueue(Reply(tool_calls=[tool_call("call_1", "search")]))
        await send_turn(proxy, "s1", [SYSTEM, user("look it up")])
        await send_turn(proxy, "s1", [{"role": "tool", "tool_call_id": "call_1", "content": words(600, "row")}])
        return
    size = {"plain": 5, "summary": 150}.get(scenario, 300)
    for i in range(6):
        await send_turn(proxy, "s1", ([SYSTEM] if i == 0 else []) + [user(f"turn {i}: " + words(size, f"w{i}"))])
    if scenario == "summary":
        await proxy.app[SUMMARIZER].wait_idle()


SCENARIOS: dict[str, dict[str, Any]] = {
    "plain": {},
    "history-dropped": {"overflow": "drop"},
    "history-marked": {"overflow": "marker"},
    "summary": {"summaries": True, "overflow": "summarize", "chunk_threshold_tokens": 400, "tail_turns": 1},
    "tool-output-trimmed": {"tool_output_max_tokens": 64},
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
async def test_context_is_exactly_what_the_next_request_sends(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession, scenario: str
) -> None:
    proxy = await start(start_proxy, make_storage, upstream, **SCENARIOS[scenario])
    api = api_for(http, proxy)
    upstream.summarizer = short_summary
    await converse(proxy, upstream, scenario)
    stored = (await api.get("/sessions/s1"))["message_count"]

    preview = await preview_of(api, "s1", "what next?", model="small")
    without = await api.post("/sessions/s1/context", json={"model": "small"})
    assert await api.get("/sessions/s1/context?model=small") == without
    assert preview["object"] == "session.context" and preview["model"] == "small"
    assert preview["expired"] is False and preview["would_summarize"] is False
    budget = preview["budget"]
    assert budget == {"window": 2000, "output_reserve": 256, "safety_margin": 20, "input_tokens": 1724}
    assert preview["tokens"] <= budget["input_tokens"]

    parts = {p["part"]: p for p in preview["parts"]}
    assert sum(p.get("tokens", 0) for p in preview["parts"]) == preview["tokens"]
    assert parts["system"]["messages"] == 1 and parts["new"]["messages"] == 1
    assert parts["kept"]["messages"] + parts["left_out"]["messages"] == stored
    assert len(preview["messages"]) == (1 + ("summary" in parts) + ("marker" in parts)
                                        + parts["kept"]["messages"] + 1)
    assert preview["messages"][0] == SYSTEM and preview["messages"][-1] == user("what next?")
    if scenario in ("plain", "tool-output-trimmed"):
        assert parts["left_out"]["messages"] == 0 and "summary" not in parts and "marker" not in parts
    if scenario in ("history-dropped", "history-marked"):
        left_out = parts["left_out"]
        assert left_out["messages"] > 0 and left_out["unsummarised"] == left_out["messages"]
        assert ("marker" in parts) == (scenario == "history-marked")
    if scenario == "summary":
        assert parts["summary"]["version"] >= 1 and parts["summary"]["covers_messages"] > 0
        assert parts["left_out"]["summarised"] == parts["summary"]["covers_messages"]
        assert parts["left_out"]["unsummarised"] == 0
        assert preview["messages"][1]["content"].startswith(SUMMARY_PREFIX)
    assert parts["kept"]["tool_outputs_trimmed"] == (1 if scenario == "tool-output-trimmed" else 0)
    # What was left out is counted too, as stored: what the summary or marker stand in for.
    stored_tokens = [m["tokens"] for m in (await api.get("/sessions/s1"))["messages"]]
    assert parts["left_out"]["tokens_stored"] == sum(stored_tokens[: parts["kept"]["from_position"]])
    assert (parts["left_out"]["tokens_stored"] > 0) == (parts["left_out"]["messages"] > 0)

    # Now the client sends that message: upstream gets exactly the preview, byte for byte.
    headers = await send_turn(proxy, "s1", [user("what next?")])
    assert headers["X-Memproxy-Reconcile"] == "append"
    assert json.dumps(upstream.last().messages) == json.dumps(preview["messages"])
    assert int(headers["X-Memproxy-Context-Tokens"]) == preview["tokens"]
    assert int(headers["X-Memproxy-Stored-Omitted"]) == parts["left_out"]["messages"]
    counter = TiktokenCounter(encoding_name_for("openai/small"))  # recounted apart from memproxy
    assert request_tokens(counter, upstream.last().messages, []) == preview["tokens"]
    await proxy.app[SUMMARIZER].wait_idle()


async def test_context_says_when_the_next_request_will_summarise_first(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """The one case a preview cannot show: history that no longer fits and no summary covers is
    folded by the request itself. The preview says so (and shows the marker meanwhile)."""
    proxy = await start(start_proxy, make_storage, upstream, summaries=True, overflow="summarize",
                        chunk_threshold_tokens=100_000, tail_turns=1)
    api = api_for(http, proxy)
    upstream.summarizer = short_summary
    for i in range(6):  # on the large model everything fits
        await send_turn(proxy, "s1", [user(f"turn {i}: " + words(300, f"w{i}"))], model="big")
    preview = await preview_of(api, "s1", "next", model="small")
    assert preview["would_summarize"] is True and "marker" in {p["part"] for p in preview["parts"]}
    assert upstream.summary_requests() == []  # previewing folds nothing
    await send_turn(proxy, "s1", [user("next")])
    sent = upstream.last().messages
    assert upstream.summary_requests()  # folded first, then sent
    assert sent[0]["content"].startswith(SUMMARY_PREFIX) and sent != preview["messages"]
    assert (await preview_of(api, "s1", "next", model="small"))["would_summarize"] is False


async def test_no_content_in_a_url_and_none_in_the_access_log(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A URL is logged by access logs and proxies: the preview of a new message takes it in a body."""
    caplog.set_level(logging.DEBUG, logger="aiohttp.access")
    proxy = await start(start_proxy, make_storage, upstream)
    api = api_for(http, proxy)
    await send_turn(proxy, "s1", [user("hello")])
    for query in ("message=hi", "messages=hi", "model=small&message="):
        body = await api.get(f"/sessions/s1/context?{query}", status=400)
        assert_error(body, type="invalid_request_error", param="message")
    secret = "my passport number is X1234567"
    preview = await preview_of(api, "s1", secret)
    assert preview["messages"][-1] == user(secret)
    access = [r for r in caplog.records if r.name == "aiohttp.access"]
    assert any("/sessions/s1/context" in r.getMessage() for r in access), "no access log: proves nothing"
    assert not any(secret.split()[-1] in r.getMessage() for r in caplog.records)


async def test_context_counts_a_response_format_schema_as_the_chat_does(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    proxy = await start(start_proxy, make_storage, upstream)
    api = api_for(http, proxy)
    await send_turn(proxy, "s1", [user("hello")])
    schema = {"name": "answer", "schema": {"type": "object", "properties": {
        "city": {"type": "string", "description": "the city the user lives in, as they wrote it"},
        "country": {"type": "string"}}}}
    response_format = {"type": "json_schema", "json_schema": schema}
    plain = await preview_of(api, "s1", "where do I live?")
    shaped = await preview_of(api, "s1", "where do I live?", response_format=response_format)
    schema_tokens = part(shaped, "tools_and_priming")["tokens"] - part(plain, "tools_and_priming")["tokens"]
    assert schema_tokens > 10 and shaped["tokens"] == plain["tokens"] + schema_tokens

    client = proxy.client(session="s1")
    raw = await client.chat.completions.with_raw_response.create(
        model="small", messages=[user("where do I live?")], response_format=response_format)
    raw.parse()
    assert int(raw.headers["X-Memproxy-Context-Tokens"]) == shaped["tokens"]
    assert upstream.last().messages == shaped["messages"]


async def test_context_of_a_session_without_a_new_message_and_for_another_model(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    proxy = await start(start_proxy, make_storage, upstream)
    api = api_for(http, proxy)
    await send_turn(proxy, "s1", [user("hello")])
    preview = await api.get("/sessions/s1/context")  # the model the session chatted with by default
    assert preview["model"] == "small"
    assert preview["messages"] == [user("hello"), assistant("reply 1")]
    parts = {p["part"]: p for p in preview["parts"]}
    assert parts["new"] == {"part": "new", "messages": 0, "tokens": 0}
    big = await api.post("/sessions/s1/context", json={"model": "big", "max_tokens": 500})
    assert big["budget"]["window"] == 100_000 and big["budget"]["output_reserve"] == 500
    body = await api.get("/sessions/s1/context?model=nope", status=404)
    assert_error(body, type="invalid_request_error", code="model_not_found", param="model")
    body = await api.post("/sessions/s1/context", json={"max_tokens": 5000}, status=400)
    assert_error(body, type="invalid_request_error", param="max_tokens")
    body = await api.post("/sessions/s1/context", data=b"[1, 2]", status=400)
    assert_error(body, type="invalid_request_error", param=None)


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


# --- export and import --------------------------------------------------------------------------


async def test_export_imports_back_exactly(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    proxy = await start(start_proxy, make_storage, upstream, summaries=True, overflow="summarize", tail_turns=1,
                        tool_output_max_tokens=64)
    api = api_for(http, proxy)
    upstream.summarizer = short_summary
    history = [SYSTEM, user("q1 — with ünïcode " + words(80, "q"))]
    await send_turn(proxy, "orig", history)
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

    body = await api.post("/sessions/import?session_id=copy", data=exported.encode(), status=201)
    assert body == {"id": "copy", "object": "session", "imported": True}
    again = await api.get("/sessions/copy/export")
    assert again == exported.replace('"session_id":"orig"', '"session_id":"copy"', 1)
    assert again != exported

    original, copy = await api.get("/sessions/orig"), await api.get("/sessions/copy")
    assert {**copy, "id": "orig"} == original

    # The copy goes on as the original would.
    preview = await preview_of(api, "orig", "next")
    await send_turn(proxy, "copy", [user("next")], **{"X-Memproxy-History": "new"})
    assert json.dumps(upstream.last().messages) == json.dumps(preview["messages"])
    await proxy.app[SUMMARIZER].wait_idle()

    # The exported id is taken: 409; under the id in the export, into another tenant, it is free.
    assert_error(await api.post("/sessions/import", data=exported.encode(), status=409),
                 type="invalid_request_error", code="session_conflict")
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
    api, config = api_for(http, proxy), config_of(proxy)
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
    assert await api.get("/sessions/agent-7/metadata") == {"card": secrets[2]}

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


# --- tenants ------------------------------------------------------------------------------------

# Every endpoint that addresses one session, with a body it accepts.
SESSION_ENDPOINTS: list[tuple[str, str, Any]] = [
    ("GET", "/sessions/{id}", None),
    ("DELETE", "/sessions/{id}", None),
    ("POST", "/sessions/{id}/clear", None),
    ("POST", "/sessions/{id}/fork", {"new_id": "stolen"}),
    ("GET", "/sessions/{id}/export", None),
    ("GET", "/sessions/{id}/context?model=small", None),
    ("POST", "/sessions/{id}/context", {"messages": [user("hi")]}),
    ("POST", "/sessions/{id}/compact", {}),
    ("GET", "/sessions/{id}/metadata", None),
    ("PATCH", "/sessions/{id}/metadata", {"owner": "mallory"}),
]
ENDPOINT_IDS = [f"{method} {path.split('{id}')[1] or '/'}" for method, path, _ in SESSION_ENDPOINTS]


def with_tenant(path: str, tenant: str) -> str:
    return f"{path}{'&' if '?' in path else '?'}tenant={tenant}"


async def snapshot(api: Api, session: str, tenant: str | None = None) -> tuple[Any, Any]:
    """Everything the API says about a session: its detail and its export."""
    admin = api.as_(ADMIN_KEY)
    tenant = tenant or "a"
    return (await admin.get(with_tenant(f"/sessions/{session}", tenant)),
            await admin.get(with_tenant(f"/sessions/{session}/export", tenant)))


@pytest.mark.parametrize("method, path, body", SESSION_ENDPOINTS, ids=ENDPOINT_IDS)
async def test_another_tenants_session_is_a_404_like_one_that_does_not_exist(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession,
    method: str, path: str, body: Any,
) -> None:
    proxy = await start(start_proxy, make_storage, upstream, summaries=True, overflow="summarize", tail_turns=1)
    api = api_for(http, proxy)
    upstream.summarizer = short_summary
    for i in range(3):
        await send_turn(proxy, "private", [user(f"a secret plan, part {i}, in enough words to fold")])
    await api.call("PUT", "/sessions/private/metadata", json={"owner": "alice"})
    await send_turn(proxy, "mine", [user("hello")], key=OTHER_KEY)
    before = await snapshot(api, "private")
    received = len(upstream.received)

    kwargs = {} if body is None else {"json": body}
    other = api.as_(OTHER_KEY)
    hidden = await other.call(method, path.format(id="private"), status=404, **kwargs)
    absent = await other.call(method, path.format(id="nobody"), status=404, **kwargs)
    assert hidden == {"error": {"message": "No session 'private'.", "type": "invalid_request_error",
                                "code": "session_not_found", "param": None}}
    assert json.loads(json.dumps(absent).replace("nobody", "private")) == hidden

    assert await snapshot(api, "private") == before
    assert len(upstream.received) == received  # nothing was summarised or sent
    assert [s["id"] for s in (await other.get("/sessions"))["data"]] == ["mine"]
    assert [s["id"] for s in (await api.get("/sessions"))["data"]] == ["private"]


async def test_list_usage_and_metadata_are_per_tenant(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    proxy = await start(start_proxy, make_storage, upstream)
    api = api_for(http, proxy)
    other = api.as_(OTHER_KEY)
    upstream.enqueue(Reply(content="a1", usage={"prompt_tokens": 7, "completion_tokens": 3}),
                     Reply(content="b1", usage={"prompt_tokens": 50, "completion_tokens": 20}))
    await send_turn(proxy, "same-id", [user("from a")])
    await send_turn(proxy, "same-id", [user("from b")], key=OTHER_KEY)  # the same id, another tenant
    await api.call("PUT", "/sessions/same-id/metadata", json={"owner": "alice"})
    await other.call("PUT", "/sessions/same-id/metadata", json={"owner": "bob"})  # its own, not a's

    assert await api.get("/sessions/same-id/metadata") == {"owner": "alice"}
    assert await other.get("/sessions/same-id/metadata") == {"owner": "bob"}
    assert [m["message"] for m in (await other.get("/sessions/same-id"))["messages"]] == [
        user("from b"), assistant("b1")]
    [mine] = (await api.get("/sessions"))["data"]
    assert (mine["tenant"], mine["title"], mine["usage"]["prompt_tokens"]) == ("a", "from a", 7)
    usage_a, usage_b = await api.get("/usage"), await other.get("/usage")
    assert (usage_a["tenant"], usage_a["sessions"], usage_a["prompt_tokens"], usage_a["completion_tokens"]) == (
        "a", 1, 7, 3)
    assert (usage_b["tenant"], usage_b["sessions"], usage_b["prompt_tokens"], usage_b["completion_tokens"]) == (
        "b", 1, 50, 20)
    # A tenant key cannot widen its view with ?tenant=.
    assert [s["tenant"] for s in (await api.get("/sessions?tenant=b"))["data"]] == ["a"]
    assert (await api.get("/usage?tenant=b"))["prompt_tokens"] == 7
    assert await api.get("/sessions/same-id/metadata?tenant=b") == {"owner": "alice"}


async def test_admin_key_sees_every_tenant_and_names_one_per_session(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    proxy = await start(start_proxy, make_storage, upstream)
    api = api_for(http, proxy)
    admin = api.as_(ADMIN_KEY)
    upstream.enqueue(Reply(content="a1", usage={"prompt_tokens": 7, "completion_tokens": 3}),
                     Reply(content="b1", usage={"prompt_tokens": 50, "completion_tokens": 20}))
    await send_turn(proxy, "alpha", [user("from a")])
    await send_turn(proxy, "beta", [user("from b")], key=OTHER_KEY)

    listed = (await admin.get("/sessions"))["data"]
    assert [(s["tenant"], s["id"]) for s in listed] == [("b", "beta"), ("a", "alpha")]
    assert [s["id"] for s in (await admin.get("/sessions?tenant=a"))["data"]] == ["alpha"]
    assert (await admin.get("/usage"))["prompt_tokens"] == 57
    assert (await admin.get("/usage"))["tenant"] is None
    assert (await admin.get("/usage?tenant=b"))["prompt_tokens"] == 50

    detail = await admin.get("/sessions/alpha?tenant=a")
    assert [m["message"] for m in detail["messages"]] == [user("from a"), assistant("a1")]
    assert_error(await admin.get("/sessions/alpha?tenant=b", status=404), type="invalid_request_error",
                 code="session_not_found")
    await admin.call("PUT", "/sessions/alpha/metadata?tenant=a", json={"reviewed": True})
    assert await api.get("/sessions/alpha/metadata") == {"reviewed": True}
    export = await admin.get("/sessions/beta/export?tenant=b")
    await admin.post("/sessions/import?tenant=a&session_id=beta-copy", data=export.encode(), status=201)
    assert [m["message"] for m in (await api.get("/sessions/beta-copy"))["messages"]] == [
        user("from b"), assistant("b1")]
    await admin.call("DELETE", "/sessions/beta?tenant=b")
    assert (await api.as_(OTHER_KEY).get("/sessions"))["data"] == []

    # An admin key manages sessions; it does not chat.
    received = len(upstream.received)
    with pytest.raises(openai.PermissionDeniedError) as caught:
        await send_turn(proxy, "alpha", [user("let me in")], key=ADMIN_KEY)
    assert_error(caught.value.response.json(), type="permission_error", code="forbidden")
    with pytest.raises(openai.PermissionDeniedError):
        await proxy.client(session=None, key=ADMIN_KEY).chat.completions.create(
            model="small", messages=[{"role": "user", "content": "no session either"}])
    assert len(upstream.received) == received


@pytest.mark.parametrize("method, path, body", [
    *SESSION_ENDPOINTS, ("PUT", "/sessions/{id}/metadata", {"k": 1}), ("POST", "/sessions/import", None),
], ids=[*ENDPOINT_IDS, "PUT /metadata", "POST import"])
async def test_admin_key_without_a_tenant_on_a_session_endpoint_is_400(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession,
    method: str, path: str, body: Any,
) -> None:
    proxy = await start(start_proxy, make_storage, upstream)
    api = api_for(http, proxy)
    await send_turn(proxy, "alpha", [user("from a")])
    export = await api.get("/sessions/alpha/export")
    before = await snapshot(api, "alpha")
    kwargs: dict[str, Any] = {"json": body} if body is not None else {}
    if path.endswith("import"):
        kwargs = {"data": export.encode()}
    result = await api.as_(ADMIN_KEY).call(method, path.format(id="alpha"), status=400, **kwargs)
    assert_error(result, type="invalid_request_error", param="tenant")
    assert await snapshot(api, "alpha") == before
    assert [s["id"] for s in (await api.get("/sessions"))["data"]] == ["alpha"]


NOTHING_DELETED = {"sessions": 0, "turns": 0, "summary_calls": 0, "prompt_tokens": 0, "completion_tokens": 0,
                   "cost": None, "context_tokens": 0, "full_history_tokens": 0, "tokens_saved": 0}


# --- usage --------------------------------------------------------------------------------------


async def test_usage_counts_upstream_tokens_cost_and_tokens_kept_out(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    proxy = await start(start_proxy, make_storage, upstream, overflow="drop")
    api, config = api_for(http, proxy), config_of(proxy)
    usages = [{"prompt_tokens": 100 * (i + 1), "completion_tokens": 10 + i} for i in range(6)]
    upstream.enqueue(*[Reply(content=f"answer {i}", usage=u) for i, u in enumerate(usages)])
    omitted = []
    for i in range(5):  # ~300 tokens a turn in a 1724-token budget: older turns get left out
        headers = await send_turn(proxy, "long", [user(f"turn {i}: " + words(300, f"w{i}"))])
        omitted.append(int(headers["X-Memproxy-Stored-Omitted"]))
    await send_turn(proxy, "priced", [user("what does this cost?")], model="big")
    assert omitted[0] == 0 and omitted[-1] > 0

    turns = rows(config, "SELECT s.session_id, t.context_tokens, t.full_tokens, t.cost FROM turns t"
                         " JOIN sessions s ON s.pk = t.session_pk ORDER BY t.id")
    saved = {sid: sum(full - context for s, context, full, _ in turns if s == sid) for sid in ("long", "priced")}
    assert saved["long"] > 0 and saved["priced"] == 0
    # What resending everything would have cost: never less than what was sent, growing turn by
    # turn, and for the last turn the whole stored conversation recounted apart from memproxy.
    assert all(full >= context for _, context, full, _ in turns)
    assert [full for s, _, full, _ in turns if s == "long"] == sorted(full for s, _, full, _ in turns if s == "long")
    counter = TiktokenCounter(encoding_name_for("openai/small"))
    last_full = [full for s, _, full, _ in turns if s == "long"][-1]
    assert last_full == request_tokens(counter, stored_bodies(config, "long")[:-1], [])

    by_id = {s["id"]: s for s in (await api.get("/sessions"))["data"]}
    assert by_id["long"]["usage"] == {"turns": 5, "prompt_tokens": sum(u["prompt_tokens"] for u in usages[:5]),
                                      "completion_tokens": sum(u["completion_tokens"] for u in usages[:5]),
                                      "cost": None, "tokens_saved": saved["long"]}
    priced_cost = sum(litellm.cost_per_token(model="openai/gpt-4o-mini", prompt_tokens=600, completion_tokens=15))
    assert by_id["priced"]["usage"]["cost"] == pytest.approx(priced_cost) and priced_cost > 0
    assert (await api.get("/sessions/long"))["usage"] == by_id["long"]["usage"]

    usage = await api.get("/usage")
    assert usage == {
        "object": "usage", "tenant": "a", "sessions": 2, "turns": 6, "summary_calls": 0,
        "prompt_tokens": sum(u["prompt_tokens"] for u in usages),
        "completion_tokens": sum(u["completion_tokens"] for u in usages),
        "cost": pytest.approx(priced_cost),
        "context_tokens": sum(context for _, context, _, _ in turns),
        "full_history_tokens": sum(full for _, _, full, _ in turns),
        "tokens_saved": saved["long"],
        "deleted_sessions": NOTHING_DELETED,
    }
    assert (await api.as_(OTHER_KEY).get("/usage"))["turns"] == 0


async def test_summariser_calls_are_spending_too(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """A summariser call's tokens and cost count in its session's usage, and what it sent counts
    against the tokens memory saved; it is not a chat turn. Discarded summaries were paid for too."""
    proxy = await start(start_proxy, make_storage, upstream, summaries=True, overflow="summarize", tail_turns=1)
    api, config = api_for(http, proxy), config_of(proxy)
    for i in range(3):
        upstream.enqueue(Reply(content=f"answer {i}", usage={"prompt_tokens": 100, "completion_tokens": 10}))
        await send_turn(proxy, "s1", [user(f"question number {i}, with some words to summarise")])
    before = await api.get("/usage")
    bloated = Reply(content=words(2000, "bloat"), usage={"prompt_tokens": 400, "completion_tokens": 300})
    upstream.summarizer = lambda received: bloated
    assert (await api.post("/sessions/s1/compact"))["outcome"] == "discarded"  # not smaller: thrown away
    upstream.summarizer = lambda received: Reply(content="The user asked three questions.",
                                                 usage={"prompt_tokens": 300, "completion_tokens": 7})
    assert (await api.post("/sessions/s1/compact"))["outcome"] == "applied"

    [first, second] = rows(config, "SELECT model, context_tokens, prompt_tokens, completion_tokens, full_tokens"
                                   " FROM turns WHERE kind = 'summary' ORDER BY id")
    assert first[0] == "small" and first[2:] == (400, 300, 0) and second[2:] == (300, 7, 0)
    summariser_sent = first[1] + second[1]
    assert first[1] > 0 and first[1] == second[1]  # the same request, counted as the summariser sends it
    after = await api.get("/usage")
    assert after == {**before, "summary_calls": 2, "prompt_tokens": before["prompt_tokens"] + 700,
                     "completion_tokens": before["completion_tokens"] + 307,
                     "context_tokens": before["context_tokens"] + summariser_sent,
                     "tokens_saved": before["tokens_saved"] - summariser_sent}
    listed = (await api.get("/sessions"))["data"][0]["usage"]
    assert listed["turns"] == 3 and listed["prompt_tokens"] == 300 + 700
    assert listed["tokens_saved"] == after["tokens_saved"]


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

    body = await api.call("DELETE", "/sessions?all=true&tenant=b")  # a tenant key names only its own
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
        {k: v for k, v in final.items() if k not in ("object", "tenant", "sessions", "deleted_sessions")}
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
    await age(config, "stale", 3600)
    await age(config, "stale", 3600, tenant="b")

    await until(lambda: session_pk(config, "stale") is None and session_pk(config, "stale", "b") is None,
                "the sweep removed the idle sessions")
    assert rows_of(config, stale_pk) == {table: 0 for table in TABLES}
    assert rows_of(config, recent_pk) == recent_rows
    assert [s["id"] for s in (await api.get("/sessions"))["data"]] == ["recent"]
    await api.get("/sessions/stale", status=404)


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
