"""Session memory end to end: the real proxy, the official SDK as the client, the fake provider.

Every test drives `POST /v1/chat/completions` with `openai.AsyncOpenAI` (or a raw aiohttp client where
the SDK cannot do what a test needs, such as hanging up mid-request) and checks two things: what the
fake upstream received, and what the store holds, read from a connection of the test's own. Each test
runs on SQLite and on PostgreSQL.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

import aiohttp
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from conftest import OTHER_KEY, PROXY_KEY, Proxy
from db import rows, write_lock_held, writes_waiting
from fake_upstream import FakeUpstream, Reply
from helpers import assistant, chat, complete, stream_chat, until, user
from memproxy.app import create_app
from memproxy.config import Config
from memproxy.typedefs import LOCKS, STORE, TASKS

pytestmark = pytest.mark.both_stores

Message = dict[str, Any]
T = TypeVar("T")
StartProxy = Callable[[Config], Any]


# --- reading the store from a connection of the test's own (tests/db.py) -----------------------


def stored(config: Config, session: str = "s1", tenant: str = "a", active: int | None = 1) -> list[Message]:
    """Bodies of the session's messages in stored order: the active chain (`active=1`), the superseded
    ones (`active=0`) or all (`active=None`)."""
    sql = ("SELECT m.body FROM messages m JOIN sessions s ON s.pk = m.session_pk"
           " WHERE s.tenant = ? AND s.session_id = ?")
    params: list[Any] = [tenant, session]
    if active is not None:
        sql += " AND m.active = ?"
        params.append(active)
    return [json.loads(body) for (body,) in rows(config, sql + " ORDER BY m.id", *params)]


def turn_rows(config: Config, session: str = "s1", tenant: str = "a") -> list[tuple[Any, ...]]:
    """(kind, model, prompt_tokens, completion_tokens) of each recorded turn, oldest first."""
    return rows(config,
                "SELECT t.kind, t.model, t.prompt_tokens, t.completion_tokens FROM turns t"
                " JOIN sessions s ON s.pk = t.session_pk WHERE s.tenant = ? AND s.session_id = ? ORDER BY t.id",
                tenant, session)


def count(config: Config, table: str) -> int:
    [(n,)] = rows(config, f"SELECT count(*) FROM {table}")
    return int(n)


def assert_chain_consistent(config: Config, session: str = "s1", tenant: str = "a") -> None:
    """The active chain is numbered 0..n-1 without gaps and the session row agrees with it."""
    [(length,)] = rows(config, "SELECT length FROM sessions WHERE tenant = ? AND session_id = ?", tenant, session)
    seqs = [seq for (seq,) in rows(
        config, "SELECT m.seq FROM messages m JOIN sessions s ON s.pk = m.session_pk"
        " WHERE s.tenant = ? AND s.session_id = ? AND m.active = 1 ORDER BY m.id", tenant, session)]
    assert seqs == list(range(length))


def system_prompts(config: Config) -> list[Any]:
    return [json.loads(value) for (value,) in rows(config, "SELECT system_prompt FROM sessions")]


# --- talking to the proxy ------------------------------------------------------------------------


async def wait_for_upstream(upstream: FakeUpstream) -> None:
    await asyncio.get_running_loop().run_in_executor(None, upstream.wait_for_request, 10.0)


async def gather_all(tasks: list[asyncio.Task[T]]) -> list[T]:
    """Await every task, then raise the first failure: no task is left behind when a test fails."""
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results  # type: ignore[return-value]


# --- how clients send history -------------------------------------------------------------------


async def test_full_history_client_stores_only_the_new_messages(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    client = proxy.client()
    history: list[Message] = []
    kinds = []
    for i in range(1, 4):
        history.append(user(f"question {i}"))
        completion, headers = await complete(client, history)
        kinds.append(headers["X-Memproxy-Reconcile"])
        # Echo the reply back as the SDK gives it, nulls and all, like a typical chat app does.
        history.append(completion.choices[0].message.model_dump())
        # Upstream sees the conversation once, in the stored form.
        assert upstream.last().messages == [
            m for j in range(1, i + 1) for m in (user(f"question {j}"), assistant(f"reply {j}"))
        ][:-1]

    assert kinds == ["new", "continue", "continue"]
    expected = [m for j in range(1, 4) for m in (user(f"question {j}"), assistant(f"reply {j}"))]
    assert stored(config, active=None) == expected  # every message once, none superseded
    assert [k for k, *_ in turn_rows(config)] == ["new", "continue", "continue"]
    assert_chain_consistent(config)


async def test_new_turn_only_client_is_appended_after_the_stored_history(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    client = proxy.client()
    kinds = []
    for i in range(1, 4):
        _, headers = await chat(client, [user(f"message {i}")])
        kinds.append(headers["X-Memproxy-Reconcile"])
    assert kinds == ["new", "append", "append"]
    assert upstream.last().messages == [
        user("message 1"), assistant("reply 1"), user("message 2"), assistant("reply 2"), user("message 3"),
    ]
    assert stored(config, active=None) == [
        user("message 1"), assistant("reply 1"), user("message 2"), assistant("reply 2"),
        user("message 3"), assistant("reply 3"),
    ]
    assert_chain_consistent(config)


async def test_client_that_trims_its_history_to_a_window(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    window = 3  # the client keeps its newest 3 messages and adds the new one
    client = proxy.client()
    history: list[Message] = []
    kinds = []
    for i in range(1, 6):
        sent = history[-window:] + [user(f"q{i}")]
        reply, headers = await chat(client, sent)
        kinds.append(headers["X-Memproxy-Reconcile"])
        history += [user(f"q{i}"), assistant(reply)]
        # Memory gives upstream the whole conversation, not just the client's window.
        assert upstream.last().messages == history[:-1]

    # Turn 2 resends everything (3 messages or fewer exist); from turn 3 on the window starts inside
    # the stored history.
    assert kinds == ["new", "continue", "window", "window", "window"]
    assert stored(config, active=None) == history
    assert_chain_consistent(config)


async def test_edit_supersedes_the_stored_tail_and_continues_the_new_branch(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    client = proxy.client()
    history: list[Message] = []
    for i in range(1, 4):
        history.append(user(f"q{i}"))
        reply, _ = await chat(client, history)
        history.append(assistant(reply))
    old_tail = history[2:]  # q2 and everything after it

    # The user edits q2: the client's history diverges from the stored one at that message.
    edited = history[:2] + [user("q2, edited")]
    reply, headers = await chat(client, edited)
    assert headers["X-Memproxy-Reconcile"] == "edit"
    assert upstream.last().messages == edited
    branch = edited + [assistant(reply)]
    assert stored(config) == branch
    assert stored(config, active=0) == old_tail  # kept, but no longer on the chain

    # The next turn continues the new branch; nothing superseded is ever sent again.
    reply, headers = await chat(client, branch + [user("q5")])
    assert headers["X-Memproxy-Reconcile"] == "continue"
    assert upstream.last().messages == branch + [user("q5")]
    assert stored(config) == branch + [user("q5"), assistant(reply)]
    assert stored(config, active=0) == old_tail
    assert_chain_consistent(config)


async def test_edit_of_the_first_message_by_a_client_that_says_it_sends_full_history(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """`X-Memproxy-History: full`: the client's messages are the whole history, so a changed first
    message is an edit from the start, and the response says how much it supersedes."""
    client = proxy.client(**{"X-Memproxy-History": "full"})
    history = [user("q1")]
    history.append(assistant((await chat(client, history))[0]))
    history.append(user("q2"))
    reply, response_headers = await chat(client, history)
    assert response_headers["X-Memproxy-Reconcile"] == "continue"
    assert response_headers["X-Memproxy-Superseded"] == "0"
    history.append(assistant(reply))

    reply, response_headers = await chat(client, [user("q1, edited")])
    assert response_headers["X-Memproxy-Reconcile"] == "edit"
    assert response_headers["X-Memproxy-Superseded"] == "4"
    assert upstream.last().messages == [user("q1, edited")]
    assert stored(config) == [user("q1, edited"), assistant(reply)]
    assert stored(config, active=0) == history
    assert_chain_consistent(config)


async def test_a_full_history_client_sending_one_new_message_supersedes_nothing(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """Issue 11: nothing a client did before (here: resending everything) turns a message that
    matches nothing stored into an edit. Without the header it is a new message, appended."""
    client = proxy.client()
    history = [user("q1")]
    history.append(assistant((await chat(client, history))[0]))
    history.append(user("q2"))
    reply, response_headers = await chat(client, history)
    assert response_headers["X-Memproxy-Reconcile"] == "continue"
    history.append(assistant(reply))

    reply, response_headers = await chat(client, [user("q3")])
    assert response_headers["X-Memproxy-Reconcile"] == "append"
    assert response_headers["X-Memproxy-Superseded"] == "0"
    assert upstream.last().messages == history + [user("q3")]
    assert stored(config) == history + [user("q3"), assistant(reply)]
    assert stored(config, active=0) == []
    assert_chain_consistent(config)


async def test_regenerate_supersedes_the_last_answer(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    client = proxy.client()
    history = [user("q1")]
    history.append(assistant((await chat(client, history))[0]))
    history.append(user("q2"))
    history.append(assistant((await chat(client, history))[0]))  # "reply 2", to be regenerated

    # Regenerate: the client sends its history up to and including the last user message.
    upstream.enqueue(Reply(content="another answer to q2"))
    reply, headers = await chat(client, history[:3])
    assert reply == "another answer to q2"
    assert headers["X-Memproxy-Reconcile"] == "regenerate"
    assert upstream.last().messages == history[:3]  # q2 once, the old answer not at all
    assert stored(config) == history[:3] + [assistant("another answer to q2")]
    assert stored(config, active=0) == [assistant("reply 2")]

    reply, headers = await chat(client, history[:3] + [assistant("another answer to q2"), user("q3")])
    assert headers["X-Memproxy-Reconcile"] == "continue"
    sent = upstream.last().messages
    assert assistant("reply 2") not in sent
    assert sent == history[:3] + [assistant("another answer to q2"), user("q3")]
    assert_chain_consistent(config)


async def test_new_history_header_forces_append_of_a_repeated_first_message(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    await chat(proxy.client(), [user("hello")])
    # Without the header, sending the first message again would read as a regenerate of turn 1.
    reply, headers = await chat(proxy.client(**{"X-Memproxy-History": "new"}), [user("hello")])
    assert headers["X-Memproxy-Reconcile"] == "append"
    assert upstream.last().messages == [user("hello"), assistant("reply 1"), user("hello")]
    assert stored(config, active=None) == [user("hello"), assistant("reply 1"), user("hello"),
                                           assistant(reply)]
    assert_chain_consistent(config)


async def test_invalid_history_header_is_rejected(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await chat(proxy.client(**{"X-Memproxy-History": "everything"}), [user("hi")])
    assert caught.value.response.json()["error"]["param"] == "X-Memproxy-History"
    assert upstream.chat_requests() == []
    assert count(config, "sessions") == 0


# --- failures never store half a turn -----------------------------------------------------------


async def test_retry_after_upstream_failure_stores_the_user_message_once(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    client = proxy.client()
    # The very first turn fails: no session is created.
    upstream.enqueue(Reply(status=500))
    with pytest.raises(openai.InternalServerError):
        await chat(client, [user("q1")])
    assert count(config, "sessions") == 0
    reply1, _ = await chat(client, [user("q1")])
    assert upstream.last().messages == [user("q1")]

    # A later turn fails: the stored history is untouched, and the retry is not a duplicate.
    upstream.enqueue(Reply(status=503))
    with pytest.raises(openai.APIStatusError) as caught:
        await chat(client, [user("q2")])
    assert caught.value.status_code == 503
    assert stored(config, active=None) == [user("q1"), assistant(reply1)]
    assert len(turn_rows(config)) == 1

    reply2, _ = await chat(client, [user("q2")])
    assert upstream.last().messages == [user("q1"), assistant(reply1), user("q2")]
    assert stored(config, active=None) == [user("q1"), assistant(reply1), user("q2"), assistant(reply2)]
    assert len(turn_rows(config)) == 2
    assert_chain_consistent(config)


async def test_failed_edit_supersedes_nothing(proxy: Proxy, upstream: FakeUpstream, config: Config) -> None:
    client = proxy.client()
    history = [user("q1")]
    history.append(assistant((await chat(client, history))[0]))
    history.append(user("q2"))
    history.append(assistant((await chat(client, history))[0]))

    edited = history[:2] + [user("q2, edited")]
    upstream.enqueue(Reply(status=500))
    with pytest.raises(openai.InternalServerError):
        await chat(client, edited)
    assert stored(config, active=None) == history  # all still active: superseding waits for success

    reply, headers = await chat(client, edited)  # the retry succeeds
    assert headers["X-Memproxy-Reconcile"] == "edit"
    assert stored(config) == edited + [assistant(reply)]
    assert stored(config, active=0) == history[2:]


async def test_stream_cut_before_its_end_stores_nothing(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    client = proxy.client()
    await chat(client, [user("q1")])

    upstream.enqueue(Reply(content="a long answer that never ends", cut_stream=True))
    received = []
    with pytest.raises(openai.APIError):
        stream, _ = await stream_chat(client, [user("q2")])
        async for chunk in stream:
            received.append(chunk.choices[0].delta.content or "" if chunk.choices else "")
    assert "".join(received) != ""  # the client did see part of the answer before the cut
    assert stored(config, active=None) == [user("q1"), assistant("reply 1")]
    assert len(turn_rows(config)) == 1

    # Retrying the turn sends q2 once and never the partial answer.
    await chat(client, [user("q2")])
    assert upstream.last().messages == [user("q1"), assistant("reply 1"), user("q2")]
    assert_chain_consistent(config)


async def test_complete_stream_is_stored_with_its_assembled_content(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    client = proxy.client()
    upstream.enqueue(Reply(content="Hello from a streamed answer in pieces",
                           usage={"prompt_tokens": 42, "completion_tokens": 7, "total_tokens": 49}))
    stream, headers = await stream_chat(client, [user("stream please")],
                                        stream_options={"include_usage": True})
    assert headers["X-Memproxy-Reconcile"] == "new"
    assert headers["X-Session-Id"] == "s1"
    pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    assert len([p for p in pieces if p]) > 1  # it really came in several chunks
    assert "".join(pieces) == "Hello from a streamed answer in pieces"

    assert stored(config, active=None) == [user("stream please"),
                                           assistant("Hello from a streamed answer in pieces")]
    assert turn_rows(config) == [("new", "small", 42, 7)]

    await chat(client, [user("next")])
    assert upstream.last().messages == [
        user("stream please"), assistant("Hello from a streamed answer in pieces"), user("next"),
    ]


async def raw_stream(proxy: Proxy, body: dict[str, Any], **headers: str) -> list[dict[str, Any]]:
    """The events of one streamed request as the client receives them, `[DONE]` left out."""
    async with aiohttp.ClientSession() as http:
        async with http.post(proxy.server.make_url("/v1/chat/completions"), json={**body, "stream": True},
                             headers={"Authorization": f"Bearer {PROXY_KEY}", **headers}) as response:
            assert response.status == 200
            text = (await response.read()).decode()
    assert text.rstrip().endswith("data: [DONE]")
    return [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: {")]


async def test_a_streamed_turn_records_its_usage_though_the_client_did_not_ask_for_it(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    usage = {"prompt_tokens": 42, "completion_tokens": 7, "total_tokens": 49}
    upstream.enqueue(Reply(content="streamed with no usage asked for", usage=usage))
    events = await raw_stream(proxy, {"model": "small", "messages": [user("q1")]}, **{"X-Session-Id": "s1"})
    assert upstream.last().body["stream_options"] == {"include_usage": True}  # asked for the record
    # The client's stream is what it would have been: no usage field, no chunk of usage alone.
    assert events and all("usage" not in e and e["choices"] for e in events)
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == "streamed with no usage asked for"
    assert turn_rows(config) == [("new", "small", 42, 7)]
    # A client that asks for it gets it as the provider sent it.
    upstream.enqueue(Reply(content="with usage", usage=usage))
    events = await raw_stream(proxy, {"model": "small", "messages": [user("q2")],
                                      "stream_options": {"include_usage": True}}, **{"X-Session-Id": "s1"})
    # The last chunk carries it (with what litellm adds: token details) and, as OpenAI's, no choice
    # (litellm gives it one with an empty delta; clients tell the usage chunk by its empty choices).
    assert {k: events[-1]["usage"][k] for k in usage} == usage
    assert events[-1]["choices"] == []
    assert all(e.get("usage") is None for e in events[:-1])
    # Without a session nothing is recorded, and nothing is asked for.
    upstream.enqueue(Reply(content="passed through"))
    events = await raw_stream(proxy, {"model": "small", "messages": [user("q3")]})
    assert "stream_options" not in upstream.last().body and all("usage" not in e for e in events)


async def test_streamed_tool_calls_are_assembled_into_the_stored_message(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }}]
    calls = [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps({"city": "Tokyo, Japan"})}},
    ]
    client = proxy.client()
    upstream.enqueue(Reply(tool_calls=calls))
    stream, _ = await stream_chat(client, [user("weather in Paris and Tokyo?")], tools=tools)
    finish = [c.choices[0].finish_reason async for c in stream if c.choices]
    assert finish[-1] == "tool_calls"

    call_message = {"role": "assistant", "content": None, "tool_calls": calls}
    assert stored(config, active=None) == [user("weather in Paris and Tokyo?"), call_message]

    # The client answers the calls with only the new tool results; upstream gets call and results together.
    results = [{"role": "tool", "tool_call_id": "call_1", "content": "18C"},
               {"role": "tool", "tool_call_id": "call_2", "content": "25C"}]
    reply, headers = await chat(client, results, tools=tools)
    assert headers["X-Memproxy-Reconcile"] == "append"
    # (litellm leaves out the null content on the way.)
    assert upstream.last().messages == [user("weather in Paris and Tokyo?"),
                                        {"role": "assistant", "tool_calls": calls}, *results]
    assert stored(config, active=None) == [user("weather in Paris and Tokyo?"), call_message, *results,
                                           assistant(reply)]


async def test_n_greater_than_one_records_choice_zero(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    client = proxy.client()
    upstream.enqueue(Reply(content="first choice", choices=["second choice"]))
    completion, _ = await complete(client, [user("two please")], n=2)
    assert [c.message.content for c in completion.choices] == ["first choice", "second choice"]
    assert upstream.last().body["n"] == 2
    assert stored(config, active=None) == [user("two please"), assistant("first choice")]

    await chat(client, [user("go on")])
    assert upstream.last().messages == [user("two please"), assistant("first choice"), user("go on")]

    # A client that goes on with the second choice resends its history with it: an edit there.
    _, headers = await chat(client, [user("two please"), assistant("second choice"), user("and then?")])
    assert headers["X-Memproxy-Reconcile"] == "edit"
    assert upstream.last().messages == [user("two please"), assistant("second choice"), user("and then?")]


# --- the system prompt --------------------------------------------------------------------------


async def test_system_prompt_is_sent_first_and_remembered(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    client = proxy.client()
    system = {"role": "system", "content": [{"type": "text", "text": "You are terse."}], "name": "rules"}
    reply1, _ = await chat(client, [system, user("q1")])
    assert upstream.last().messages == [system, user("q1")]  # verbatim, parts and name included

    # No system prompt in the request: the session's stored one goes first.
    reply2, _ = await chat(client, [user("q2")])
    assert upstream.last().messages == [system, user("q1"), assistant(reply1), user("q2")]

    # A new system prompt replaces it, for this request and the next ones; it is never stored as a turn.
    other = {"role": "system", "content": "You are verbose."}
    reply3, _ = await chat(client, [other, user("q3")])
    assert upstream.last().messages[0] == other
    assert system not in upstream.last().messages
    await chat(client, [user("q4")])
    assert upstream.last().messages == [other, user("q1"), assistant(reply1), user("q2"), assistant(reply2),
                                        user("q3"), assistant(reply3), user("q4")]
    assert all(m["role"] != "system" for m in stored(config, active=None))
    assert system_prompts(config) == [[other]]


async def test_full_history_client_with_system_prompt_is_recognised(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    client = proxy.client()
    system = {"role": "system", "content": "Be brief."}
    history = [system, user("q1")]
    history.append(assistant((await chat(client, history))[0]))
    history.append(user("q2"))
    _, headers = await chat(client, history)
    assert headers["X-Memproxy-Reconcile"] == "continue"
    assert upstream.last().messages == history
    assert stored(config, active=None) == [user("q1"), assistant("reply 1"), user("q2"), assistant("reply 2")]


async def test_developer_prompt_is_remembered(proxy: Proxy, upstream: FakeUpstream, config: Config) -> None:
    developer = {"role": "developer", "content": "Answer in French."}
    client = proxy.client()
    await chat(client, [developer, user("q1")])
    await chat(client, [user("q2")])
    sent = upstream.last().messages
    assert sent[0]["content"] == "Answer in French."  # the role itself is litellm's to translate
    assert sent[1:] == [user("q1"), assistant("reply 1"), user("q2")]
    assert system_prompts(config) == [[developer]]


# --- the session header, tenants ----------------------------------------------------------------


async def test_without_session_header_the_request_passes_through_and_nothing_is_stored(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    client = proxy.client(session=None)
    messages = [
        {"role": "system", "content": "Be brief."},
        user("q1"), assistant("an answer this proxy never gave"), user("q1"), user("q2"),
    ]
    for _ in range(2):
        _, headers = await chat(client, messages)
        assert "X-Session-Id" not in headers
        assert "X-Memproxy-Reconcile" not in headers
        assert upstream.last().messages == messages  # exactly what the client sent, repeats included
    assert count(config, "sessions") == 0
    assert count(config, "messages") == 0
    assert count(config, "turns") == 0


@pytest.mark.parametrize("session_id", ["chat-42", "a.b_c:d-E9", "x" * 128])
async def test_session_id_is_echoed(
    proxy: Proxy, upstream: FakeUpstream, config: Config, session_id: str
) -> None:
    client = proxy.client(session=session_id)
    _, headers = await chat(client, [user("hi")])
    assert headers["X-Session-Id"] == session_id
    stream, headers = await stream_chat(client, [user("more")])
    assert headers["X-Session-Id"] == session_id
    assert [c async for c in stream]
    assert stored(config, session=session_id) == [user("hi"), assistant("reply 1"), user("more"),
                                                  assistant("reply 2")]


@pytest.mark.parametrize("session_id", ["bad id!", "x" * 129, "", "a/b", "semi;colon"])
async def test_invalid_session_id_is_rejected(
    proxy: Proxy, upstream: FakeUpstream, config: Config, session_id: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await chat(proxy.client(session=session_id), [user("hi")])
    body = caught.value.response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "code", "param"}
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] == "invalid_session_id"
    assert body["error"]["param"] == "X-Session-Id"
    assert "X-Session-Id" in body["error"]["message"]
    assert upstream.chat_requests() == []
    assert count(config, "sessions") == 0
    assert count(config, "messages") == 0


async def test_same_session_id_under_two_tenants_are_unrelated(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    alice = proxy.client(session="shared", key=PROXY_KEY)
    bob = proxy.client(session="shared", key=OTHER_KEY)
    await chat(alice, [user("alice 1")])
    _, headers = await chat(bob, [user("bob 1")])
    assert headers["X-Memproxy-Reconcile"] == "new"
    assert upstream.last().messages == [user("bob 1")]
    await chat(alice, [user("alice 2")])
    assert upstream.last().messages == [user("alice 1"), assistant("reply 1"), user("alice 2")]
    await chat(bob, [user("bob 2")])
    assert upstream.last().messages == [user("bob 1"), assistant("reply 2"), user("bob 2")]

    assert stored(config, "shared", "a") == [user("alice 1"), assistant("reply 1"), user("alice 2"),
                                             assistant("reply 3")]
    assert stored(config, "shared", "b") == [user("bob 1"), assistant("reply 2"), user("bob 2"),
                                             assistant("reply 4")]
    assert sorted(rows(config, "SELECT tenant, session_id FROM sessions")) == [("a", "shared"), ("b", "shared")]


# --- persistence and concurrency ----------------------------------------------------------------


async def test_history_survives_a_restart(
    start_proxy: StartProxy, upstream: FakeUpstream, config: Config
) -> None:
    first: Proxy = await start_proxy(config)
    system = {"role": "system", "content": "Remember things."}
    await chat(first.client(), [system, user("my name is Ada")])
    await first.close()

    second: Proxy = await start_proxy(config)
    _, headers = await chat(second.client(), [user("what is my name?")])
    assert headers["X-Memproxy-Reconcile"] == "append"
    assert upstream.last().messages == [system, user("my name is Ada"), assistant("reply 1"),
                                        user("what is my name?")]
    assert stored(config) == [user("my name is Ada"), assistant("reply 1"), user("what is my name?"),
                              assistant("reply 2")]


def lock_users(proxy: Proxy, tenant: str, session: str) -> int:
    """Requests holding or waiting for the session's lock (read from the lock table's internals)."""
    entry = proxy.app[LOCKS]._locks.get((tenant, session))
    return 0 if entry is None else entry[1]


async def test_concurrent_requests_on_one_session_are_serialised(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    client = proxy.client()
    gate = threading.Event()
    upstream.enqueue(Reply(content="first answer", gate=gate))
    requests = [asyncio.create_task(chat(client, [user("first")]))]
    try:
        await wait_for_upstream(upstream)  # the first request is in flight, held by the provider
        requests.append(asyncio.create_task(chat(client, [user("second")])))
        await until(lambda: lock_users(proxy, "a", "s1") == 2, "the second request waits for the session")
        assert len(upstream.chat_requests()) == 1  # it has not gone upstream alongside the first
    finally:
        gate.set()
        (reply1, _), (reply2, headers2) = await gather_all(requests)

    assert reply1 == "first answer"
    assert headers2["X-Memproxy-Reconcile"] == "append"
    # The second request ran after the first was recorded, and saw its turn.
    assert upstream.last().messages == [user("first"), assistant("first answer"), user("second")]
    assert stored(config, active=None) == [user("first"), assistant("first answer"), user("second"),
                                           assistant(reply2)]
    assert [k for k, *_ in turn_rows(config)] == ["new", "append"]
    assert_chain_consistent(config)
    assert lock_users(proxy, "a", "s1") == 0  # nothing left behind


async def test_requests_on_different_sessions_run_concurrently(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    gate = threading.Event()
    upstream.enqueue(Reply(content="slow answer", gate=gate))
    slow = asyncio.create_task(chat(proxy.client(session="slow"), [user("slow")]))
    try:
        await wait_for_upstream(upstream)
        # Another session is not held up by the first one's lock.
        reply, _ = await chat(proxy.client(session="fast"), [user("fast")])
        assert reply == "reply 2"
    finally:
        gate.set()
        [(slow_reply, _)] = await gather_all([slow])
    assert slow_reply == "slow answer"
    assert stored(config, "fast") == [user("fast"), assistant("reply 2")]
    assert stored(config, "slow") == [user("slow"), assistant("slow answer")]


def turn_write_waiting(proxy: Proxy, config: Config) -> bool:
    """The proxy has the answer and its write of the turn waits for the lock `write_lock_held` holds:
    on PostgreSQL the database says so; on SQLite the write waits in the store's writer thread, and
    the app's owned task writing it is all there is to see."""
    if config.storage.is_postgres:
        return bool(writes_waiting(config))
    return len(proxy.app[TASKS]) > 0


async def _hang_up_when(url: str, body: dict[str, Any], headers: dict[str, str], ready: Callable[[], bool],
                        what: str) -> None:
    """POST `body`, then, once `ready()` holds, hang up, as a client that goes away does."""
    async with aiohttp.ClientSession() as http:
        request = asyncio.create_task(http.post(url, json=body, headers=headers))
        try:
            await until(ready, what)
        finally:
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request


async def _observed_proxy(config: Config) -> tuple[Proxy, list[asyncio.Task[Any]]]:
    """A started proxy, and the task of each request's handler as it comes (to wait for the
    handler the test server cancels when its client goes away)."""
    handler_tasks: list[asyncio.Task[Any]] = []

    @web.middleware
    async def observe(request: web.Request, handler: Any) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        handler_tasks.append(task)
        result: web.StreamResponse = await handler(request)
        return result

    app = create_app(config)
    app.middlewares.append(observe)
    proxy = Proxy(TestServer(app, host="127.0.0.1", port=0), app)
    await proxy.server.start_server()
    return proxy, handler_tasks


async def test_turn_is_recorded_when_the_client_disconnects_after_the_answer(
    upstream: FakeUpstream, config: Config
) -> None:
    """The client hangs up after the upstream answer is complete, while the turn is being written.

    The write is held back by another connection holding the store's write lock (SQLite's, or a table
    lock every PostgreSQL write waits for); the test server cancels
    the handler when the client goes away (aiohttp's `handler_cancellation`), so the write must outlive
    the request. A follow-up request on the session must see the turn (requests are serialised).
    """
    proxy, handler_tasks = await _observed_proxy(config)
    try:
        url = proxy.url + "/chat/completions"
        headers = {"Authorization": f"Bearer {PROXY_KEY}", "X-Session-Id": "s1"}
        body = {"model": "small", "messages": [user("q1")]}
        with write_lock_held(config):
            # The answer came back and the turn is waiting for the write lock.
            await _hang_up_when(url, body, headers, lambda: turn_write_waiting(proxy, config),
                                "the turn is being written")
            # The server noticed and cancelled the handler while the write was pending.
            [task] = handler_tasks
            await until(lambda: task.cancelling() > 0 or task.done(), "the server notices the disconnect")
        # The write lock is free again: the follow-up request waits for the pending turn, then sees it.
        client = proxy.client()
        _, reply_headers = await chat(client, [user("q2")])
        assert reply_headers["X-Memproxy-Reconcile"] == "append"
        assert upstream.last().messages == [user("q1"), assistant("reply 1"), user("q2")]
        assert stored(config) == [user("q1"), assistant("reply 1"), user("q2"), assistant("reply 2")]
    finally:
        await proxy.close()


@pytest.mark.parametrize("finished", [True, False], ids=["after-finish", "mid-answer"])
async def test_a_stream_its_client_leaves_is_kept_once_its_answer_was_finished(
    upstream: FakeUpstream, config: Config, finished: bool
) -> None:
    """A client that reads a stream up to its finish reason and hangs up, before the usage chunk and
    `[DONE]` (a hand-written SSE reader, a UI that stops at the finish), has the whole answer: the
    turn is kept, and a next request sending only its new message continues it. One that hangs up
    before the finish reason saw no whole answer: nothing of the turn is kept. The provider holds
    back what follows the point the client leaves at, so the client surely leaves first."""
    proxy, handler_tasks = await _observed_proxy(config)
    held = threading.Event()
    upstream.enqueue(Reply(content="the whole answer", gate_before_end=held if finished else None,
                           gate_after_first_chunk=None if finished else held))
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(proxy.url + "/chat/completions",
                                 json={"model": "small", "messages": [user("q1")], "stream": True},
                                 headers={"Authorization": f"Bearer {PROXY_KEY}", "X-Session-Id": "s1"}) as response:
                async for line in response.content:  # leaving unread: the connection is closed
                    if not line.startswith(b"data: {"):
                        continue
                    choices = json.loads(line[len(b"data: "):])["choices"]
                    if choices and (choices[0]["finish_reason"] if finished else choices[0]["delta"].get("content")):
                        break
        [task] = handler_tasks
        await until(task.done, "the server notices the client left")
        held.set()
        _, reply_headers = await chat(proxy.client(), [user("q2")])
        if finished:
            assert reply_headers["X-Memproxy-Reconcile"] == "append"
            assert upstream.last().messages == [user("q1"), assistant("the whole answer"), user("q2")]
            assert stored(config) == [user("q1"), assistant("the whole answer"), user("q2"), assistant("reply 2")]
        else:
            assert upstream.last().messages == [user("q2")]
            assert stored(config) == [user("q2"), assistant("reply 2")]
    finally:
        held.set()
        await proxy.close()


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_a_turn_whose_session_is_deleted_meanwhile_gets_its_answer_not_remembered(
    proxy: Proxy, upstream: FakeUpstream, config: Config, stream: bool
) -> None:
    """The session is deleted (in another tab, by an admin) while its turn is upstream: the answer is
    paid for, so the client gets it, told it is not remembered; nothing of the turn is stored, and
    what it cost counts with the tenant's deleted sessions."""
    client = proxy.client()
    await chat(client, [user("first")])
    gate = threading.Event()
    upstream.enqueue(Reply(content="late answer", gate=gate))

    async def second() -> tuple[str, Any]:
        if not stream:
            return await chat(client, [user("second")])
        chunks, headers = await stream_chat(client, [user("second")])
        return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices]), headers

    task = asyncio.create_task(second())
    try:
        await until(lambda: len(upstream.chat_requests()) == 2, "the turn is upstream")
        async with aiohttp.ClientSession() as http:
            async with http.delete(proxy.server.make_url("/v1/sessions/s1"),
                                   headers={"Authorization": f"Bearer {PROXY_KEY}"}) as response:
                assert response.status == 200
    finally:
        gate.set()
        [(reply, headers)] = await gather_all([task])
    assert reply == "late answer"
    if not stream:
        assert headers["X-Memproxy-Stored"] == "false"
    assert stored(config, active=None) == []
    async with aiohttp.ClientSession() as http:
        async with http.get(proxy.server.make_url("/v1/usage"),
                            headers={"Authorization": f"Bearer {PROXY_KEY}"}) as got:
            usage = await got.json()
    assert usage["deleted_sessions"]["turns"] == 2  # the first turn, deleted with its session, and this one


def _writer(proxy: Proxy) -> Any:
    """The SQLite store's writer (`SQLiteBackend`): whether a write is on its thread, or queued."""
    return getattr(proxy.app[STORE], "_db")


async def test_a_resent_history_written_for_a_client_that_hung_up_is_seen_by_its_retry(
    upstream: FakeUpstream, config: Config
) -> None:
    """A conversation too long to send has its history stored before it is planned (`resent_history`).
    If the client hangs up while that write waits for the file's write lock, the session stays
    locked until the write is done, as for a turn's: the client's retry, sending the same
    conversation, then finds the history stored and continues it, instead of planning on the
    session as it was and storing the whole history a second time after the first."""
    if config.storage.is_postgres:
        pytest.skip("SQLite: a write the caller stopped waiting for still commits there")
    config = replace(config, storage=replace(config.storage, busy_timeout_ms=30_000))
    proxy, handler_tasks = await _observed_proxy(config)
    history = [m for n in range(40) for m in (user(f"question {n} " + "word " * 40), assistant(f"answer {n}"))]
    conversation = [*history, user("and the first question?")]
    try:
        url = proxy.url + "/chat/completions"
        headers = {"Authorization": f"Bearer {PROXY_KEY}", "X-Session-Id": "s1"}
        body = {"model": "small", "messages": conversation}
        with write_lock_held(config):
            await _hang_up_when(url, body, headers, lambda: _writer(proxy)._in_flight > 0,
                                "the history's write waits for the lock")
            [task] = handler_tasks
            await until(lambda: task.cancelling() > 0 or task.done(), "the server notices the disconnect")
            retry = asyncio.create_task(chat(proxy.client(), conversation))
            # The retry waits: for the session (its lock held until the write is done), or for the writer
            # (the hung-up request's write, whose caller stopped waiting, still first on its thread).
            await until(lambda: proxy.app[LOCKS]._locks.get(("a", "s1"), (None, 0))[1] > 1
                        or _writer(proxy)._in_flight > 0, "the retry waits")
        _, reply_headers = await retry
        assert stored(config) == [*conversation, assistant("reply 1")]  # the history once
        assert reply_headers["X-Memproxy-Reconcile"] == "continue"
    finally:
        await proxy.close()


async def test_one_conversation_resent_to_two_processes_at_once_is_stored_once(
    start_proxy: StartProxy, upstream: FakeUpstream, config: Config
) -> None:
    """Two processes on one store (replicas, or `serve --workers`) each get the same conversation,
    too long to send, for a session neither holds yet (a client's retry landing on another one):
    both plan it as new and store its history first. The one that writes second finds the
    session holding that history and goes on from it, planned again: the history is stored once,
    not a second time after the first."""
    storage = replace(config.storage, busy_timeout_ms=30_000, lock_timeout_ms=30_000)
    config = replace(config, storage=storage)
    first: Proxy = await start_proxy(config)
    second: Proxy = await start_proxy(config)
    history = [m for n in range(40) for m in (user(f"question {n} " + "word " * 40), assistant(f"answer {n}"))]
    conversation = [*history, user("and the first question?")]

    def waiting(count: int) -> bool:
        if config.storage.is_postgres:
            return len(writes_waiting(config)) == count
        return bool(sum(_writer(p)._in_flight for p in (first, second)) == count)

    with write_lock_held(config):  # both histories' writes wait until both are planned
        sent = asyncio.create_task(chat(first.client(), conversation))
        await until(lambda: waiting(1), "the first process's write waits")
        resent = asyncio.create_task(chat(second.client(), conversation))
        await until(lambda: waiting(2), "the second process's write waits")
    await gather_all([sent, resent])
    assert stored(config)[:len(history)] == history
    # Each message of the history stored once; the two turns after it overlapped, as any two do.
    everything = stored(config, active=None)
    assert [everything.count(m) for m in history] == [1] * len(history)
