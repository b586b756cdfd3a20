"""The token budget and the pre-flight overflow check (issue item 7), through the real proxy.

The conftest model "small" has a window of 2000 tokens, a default output reserve of 256 and a safety
margin of 20, so its default input budget is 1724. Every upstream request is recounted here with
tiktoken and checked against an independent oracle of the rule: system prompt, then the longest
suffix of the stored history that fits, cut only before a whole unit (an assistant message with
`tool_calls` and all its results), then the new messages verbatim and last.

The helpers at the top are shared with `test_properties.py`.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import replace
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import openai
import pytest

from conftest import Proxy, make_config
from db import rows, table_rows
from fake_upstream import FakeUpstream, Received, Reply
from helpers import Conversation
from memproxy.config import Config, StorageConfig
from memproxy.logs import fields
from memproxy.provider import LitellmCounter, load_litellm
from memproxy.memory.fit import settle_unanswered_calls
from memproxy.store.sqlite import sqlite_path
from memproxy.timing import PARTS
from memproxy.tokens import REPLY_PRIMING, TiktokenCounter, encoding_name_for, request_tokens
from memproxy.typedefs import CONFIG

pytestmark = pytest.mark.both_stores

Message = dict[str, Any]

WINDOW = 2000
DEFAULT_RESERVE = 256
MARGIN = 20
DEFAULT_BUDGET = WINDOW - DEFAULT_RESERVE - MARGIN
COUNTER = TiktokenCounter(encoding_name_for("openai/small"))

_VOCABULARY = ("alpha", "beta", "gamma", "délta", "数据", "ok", "🙂", "tool", "memory", "proxy",
               "ünïcode", "x", "lorem", "ipsum", "42", "naïve", "Καλημέρα", "token")

TOOLS: list[dict[str, Any]] = [{
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a fact up in the knowledge base.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
    },
}]


def words(n: int, salt: int = 0) -> str:
    """Deterministic text of `n` words, mixing ASCII and multi-byte scripts."""
    return " ".join(_VOCABULARY[(salt + 7 * i + i // 3) % len(_VOCABULARY)] for i in range(n))


def tokens(messages: Sequence[Message]) -> int:
    return sum(COUNTER.message(m) for m in messages)


def tool_call(call_id: str, arguments: str = '{"q": "x"}') -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": "lookup", "arguments": arguments}}


def without_none(message: Message) -> Message:
    return {k: v for k, v in message.items() if v is not None}


def mandatory_tail(history: Sequence[Message], new: Sequence[Message]) -> int:
    """How many trailing stored messages must go with `new`: the call a new tool result answers."""
    if new and new[0]["role"] != "tool":
        return 0
    for i in range(len(history) - 1, -1, -1):
        if history[i]["role"] != "tool":
            return len(history) - i
    return len(history)


def expected_kept(history: Sequence[Message], fixed: int, budget: int, must: int = 0) -> int:
    """The oracle: the longest suffix of `history` starting at a unit boundary that fits; where
    that leaves history out, from the first user message in it before the newest exchange (the
    client's new user message, or with `must`, the latest stored user message), else from the
    newest exchange (an answer is never kept without its question)."""
    kept, total = 0, 0
    for i in range(len(history) - 1, -1, -1):
        total += COUNTER.message(history[i])
        if history[i]["role"] == "tool":
            continue  # a cut may not fall before a tool result
        if fixed + total > budget and len(history) - i > must:
            break
        kept = len(history) - i
    kept = max(kept, must)
    if 0 < kept < len(history):
        users = [i for i, m in enumerate(history) if m["role"] == "user"]
        newest = len(history) if not must else max([u for u in users], default=len(history))
        opening = [u for u in users if len(history) - kept <= u < newest]
        if opening:
            return len(history) - opening[0]
        if len(history) - kept < newest:
            return len(history) - newest
    return kept


def expected_history(history: Sequence[Message], new: Sequence[Message], fixed: int, budget: int,
                     must: int = 0) -> list[Message]:
    """The oracle's stored messages sent: the suffix `expected_kept` finds; where `new` holds no user
    message (an agent loop) and that suffix leaves out the latest stored one (the loop's question),
    the question first, if it fits beside what must be sent, then the suffix that fits beside it."""
    kept = expected_kept(history, fixed, budget, must)
    users = [i for i, m in enumerate(history) if m["role"] == "user"]
    if users and users[-1] < len(history) - kept and not any(m["role"] == "user" for m in new):
        question = COUNTER.message(history[users[-1]])
        if fixed + question + tokens(history[len(history) - must:]) <= budget:
            kept = expected_kept(history, fixed + question, budget, must)
            return [history[users[-1]], *history[len(history) - kept:]]
    return list(history[len(history) - kept:])


def assert_tool_units_whole(conversation: Sequence[Message]) -> None:
    """No orphan tool result, no call without all its results, results right after their call."""
    assert not conversation or conversation[0]["role"] != "tool", "a request starts with a tool result"
    i = 0
    while i < len(conversation):
        message = conversation[i]
        assert message["role"] != "tool", f"orphan tool result at {i}: {message}"
        i += 1
        calls = message.get("tool_calls") or []
        if message["role"] != "assistant" or not calls:
            continue
        wanted = sorted(call["id"] for call in calls)
        answered: list[str] = []
        while i < len(conversation) and conversation[i]["role"] == "tool":
            answered.append(conversation[i]["tool_call_id"])
            i += 1
        assert sorted(answered) == wanted, f"calls {wanted} answered by {answered}"


def as_system(message: Message) -> Message:
    return {**message, "role": "system"} if message.get("role") == "developer" else dict(message)


def check_sent(
    sent: Received,
    headers: Mapping[str, str],
    *,
    system: Sequence[Message],
    history: Sequence[Message],
    new: Sequence[Message],
    budget: int,
) -> int:
    """Check one upstream request against the rule and the response headers; returns stored kept."""
    messages = sent.messages
    tools = sent.body.get("tools") or []
    counted = request_tokens(COUNTER, messages, tools)
    assert int(headers["x-memproxy-context-tokens"]) == counted
    assert counted <= budget
    assert int(headers["x-memproxy-input-budget"]) == budget
    # Verbatim, but for a `developer` message's role: litellm sends it as `system` to a model that
    # does not know `developer` (memproxy's own client keeps it).
    assert [as_system(m) for m in messages[: len(system)]] == [as_system(m) for m in system], \
        "the system prompt is not first"
    rest = messages[len(system):]
    assert all(m["role"] not in ("system", "developer") for m in rest)
    assert rest[len(rest) - len(new):] == list(new), "the new messages are not last and verbatim"
    kept = rest[: len(rest) - len(new)]
    assert_tool_units_whole(rest)
    fixed = tokens(system) + tokens(new) + COUNTER.tools(tools) + REPLY_PRIMING
    must = mandatory_tail(history, new)
    assert [without_none(m) for m in kept] == [without_none(m) for m in expected_history(history, new, fixed, budget, must)], \
        "what was sent of the history is not the newest part that fits (an agent loop's question ahead of it)"
    assert int(headers["x-memproxy-stored-included"]) == len(kept)
    assert int(headers["x-memproxy-stored-omitted"]) == len(history) - len(kept)
    return len(kept)


def db_path(proxy: Proxy) -> str:
    """The proxy's SQLite file (for modules that read it with sqlite3; `db_state` reads either store)."""
    return sqlite_path(proxy.app[CONFIG].storage.url)


def db_state(proxy: Proxy) -> dict[str, list[tuple[Any, ...]]]:
    """Every row the proxy has stored, read from a connection of the test's own."""
    return table_rows(proxy.app[CONFIG], "sessions", "messages", "turns")


def stored_roles(proxy: Proxy) -> list[str]:
    """Roles of the active messages of the proxy's one session, in order."""
    return [role for (role,) in rows(proxy.app[CONFIG], "SELECT role FROM messages WHERE active = 1 ORDER BY seq")]


def assert_context_length_exceeded(exc: openai.BadRequestError, param: str | None = None) -> None:
    assert exc.status_code == 400
    body = exc.response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "code", "param"}
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "context_length_exceeded"
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param


class Chat(Conversation):
    """One session driven like a real client: "full" resends everything, "new" only the new turn.

    `history` is what the proxy has stored, in the form the client echoes it.
    """

    def __init__(self, proxy: Proxy, upstream: FakeUpstream, style: str, session: str,
                 system: Sequence[Message] = (), tools: Sequence[dict[str, Any]] = ()) -> None:
        super().__init__(proxy, upstream, session, style=style, system=system, tools=tools)

    async def send(
        self, new: Sequence[Message], reply: Reply | None = None, budget: int = DEFAULT_BUDGET,
        **params: Any,
    ) -> tuple[int, Mapping[str, str]]:
        """Send, check the upstream request against the rule, remember the turn; returns kept."""
        reply = reply or Reply(content=f"answer {len(self.history)}: {words(30, len(self.history))}")
        received, headers = await self.exchange(new, reply, **params)
        kept = check_sent(received, headers, system=self.system, history=self.history,
                          new=new, budget=budget)
        self.remember(new, reply)
        return kept, headers


# --- the budget over a long conversation -------------------------------------------------------


@pytest.mark.parametrize("style", ["full", "new"])
async def test_long_conversation_stays_in_budget_keeping_the_newest_turns(
    proxy: Proxy, upstream: FakeUpstream, style: str
) -> None:
    system = [{"role": "system", "content": "You are terse."}]
    chat = Chat(proxy, upstream, style, f"long-{style}", system)
    first_user = ""
    kept_per_turn: list[int] = []
    for turn in range(16):
        user = {"role": "user", "content": f"question {turn}: {words(70, turn)}"}
        first_user = first_user or user["content"]
        started = time.perf_counter()
        kept, headers = await chat.send([user])
        elapsed_ms = (time.perf_counter() - started) * 1000
        kept_per_turn.append(kept)
        timing = server_timing(headers)
        assert list(timing) == [*PARTS, "memory", "upstream"]
        assert_parts_within_memory(timing, PARTS)
        assert timing["memory"] + timing["upstream"] <= elapsed_ms  # two parts of what the client waited
    assert kept_per_turn[:3] == [0, 2, 4]  # at first everything fits
    assert kept_per_turn[-1] < 2 * 15  # later the oldest turns are left out
    assert int(headers["x-memproxy-stored-omitted"]) > 0
    last = upstream.last().messages
    assert first_user not in [m.get("content") for m in last]
    assert last[-1]["content"].startswith("question 15:")


async def test_stream_reports_context_tokens_and_timing(
    proxy: Proxy, upstream: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="memproxy.http")
    client = proxy.client(session="stream-headers")
    for turn in range(2):
        raw = await client.chat.completions.with_raw_response.create(
            model="small", stream=True, tools=TOOLS,  # type: ignore[arg-type]
            messages=[{"role": "user", "content": f"q{turn} {words(20)}"}])
        stream = raw.parse()
        async for _ in stream:
            pass
        sent = upstream.last()
        assert int(raw.headers["x-memproxy-context-tokens"]) == request_tokens(COUNTER, sent.messages, TOOLS)
        assert int(raw.headers["x-memproxy-stored-included"]) == len(sent.messages) - 1 == 2 * turn
        assert raw.headers["x-memproxy-stored-omitted"] == "0"
        assert raw.headers["x-memproxy-input-budget"] == str(DEFAULT_BUDGET)
        # The headers leave before the answer is recorded: no `record` yet.
        timing = server_timing(raw.headers)
        assert list(timing) == ["parse", "reconcile", "budget", "recall", "store", "memory",
                                "upstream-first-chunk"]
        assert_parts_within_memory(timing, ("parse", "reconcile", "budget", "recall", "store"))
    # The request's log line has it, with the whole split.
    [record] = [r for r in caplog.records if r.name == "memproxy.http"][-1:]
    assert [k for k in fields(record) if k.endswith("_ms")] == ["duration_ms", *(f"{p}_ms" for p in PARTS),
                                                               "memory_ms", "upstream_ms"]


async def test_pass_through_reports_timing(proxy: Proxy, upstream: FakeUpstream) -> None:
    upstream.enqueue(Reply(content="hello"))
    raw = await proxy.client(session=None).chat.completions.with_raw_response.create(
        model="small", messages=[{"role": "user", "content": "hi"}])
    timing = server_timing(raw.headers)
    assert list(timing) == [*PARTS, "memory", "upstream"]
    assert_parts_within_memory(timing, PARTS)


def server_timing(headers: Mapping[str, str]) -> dict[str, float]:
    """`Server-Timing` as name -> ms, every entry parsed."""
    timing = {}
    for entry in headers["server-timing"].split(", "):
        match = re.fullmatch(r"([a-z-]+);dur=(\d+\.\d\d)", entry)
        assert match is not None, headers["server-timing"]
        timing[match[1]] = float(match[2])
    return timing


def assert_parts_within_memory(timing: dict[str, float], parts: Sequence[str]) -> None:
    """The parts do not overlap: together they are at most `memory` (each printed value is rounded
    to 0.01 ms, hence the slack)."""
    assert sum(timing[part] for part in parts) <= timing["memory"] + 0.005 * (len(parts) + 1)


# --- the output reserve --------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens", "both"])
async def test_a_bigger_output_reserve_keeps_less_history(
    proxy: Proxy, upstream: FakeUpstream, key: str
) -> None:
    """Where both are set, the larger is reserved: providers differ in which one they honour."""
    kept: dict[str, int] = {}
    for name, reserve in (("default", None), ("big", 1200)):
        chat = Chat(proxy, upstream, "new", f"reserve-{name}")
        for turn in range(6):
            await chat.send([{"role": "user", "content": f"q{turn} {words(60, turn)}"}])
        budget = WINDOW - (reserve or DEFAULT_RESERVE) - MARGIN
        params = {} if not reserve else {"max_completion_tokens": 100, "max_tokens": reserve} if key == "both" \
            else {key: reserve}
        kept[name], headers = await chat.send([{"role": "user", "content": "and now?"}], budget=budget,
                                               **params)
        assert headers["x-memproxy-input-budget"] == str(budget)
        for sent, value in params.items():
            assert upstream.last().body[sent] == value  # still forwarded
    assert kept["big"] < kept["default"]


async def test_exactly_the_budget_fits_and_one_token_more_is_refused(
    proxy: Proxy, upstream: FakeUpstream
) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": words(50), "name": "ann"}]
    needed = request_tokens(COUNTER, messages, TOOLS)
    fits = WINDOW - MARGIN - needed
    raw = await proxy.client(session="edge-fits").chat.completions.with_raw_response.create(
        model="small", messages=messages, tools=TOOLS, max_tokens=fits)  # type: ignore[arg-type]
    assert raw.headers["x-memproxy-context-tokens"] == raw.headers["x-memproxy-input-budget"] == str(needed)
    assert len(upstream.chat_requests()) == 1
    with pytest.raises(openai.BadRequestError) as caught:
        await proxy.client(session="edge-over").chat.completions.create(
            model="small", messages=messages, tools=TOOLS, max_tokens=fits + 1)  # type: ignore[arg-type]
    assert_context_length_exceeded(caught.value, "messages")
    assert len(upstream.chat_requests()) == 1


# --- the pre-flight overflow check ---------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("stored_turns", [0, 2])
async def test_new_messages_that_cannot_fit_are_refused_before_upstream_and_not_stored(
    proxy: Proxy, upstream: FakeUpstream, stream: bool, stored_turns: int
) -> None:
    chat = Chat(proxy, upstream, "new", "overflow")
    for turn in range(stored_turns):
        await chat.send([{"role": "user", "content": f"q{turn}"}])
    huge = {"role": "user", "content": words(2000)}
    assert tokens([huge]) + REPLY_PRIMING > DEFAULT_BUDGET
    calls, state = len(upstream.chat_requests()), db_state(proxy)
    with pytest.raises(openai.BadRequestError) as caught:
        await chat.client.chat.completions.create(model="small", messages=[huge], stream=stream)
    assert_context_length_exceeded(caught.value, "messages")
    assert len(upstream.chat_requests()) == calls
    assert db_state(proxy) == state
    assert len(state["sessions"]) == (1 if stored_turns else 0)
    # The session goes on as if the refused message had never been sent.
    await chat.send([{"role": "user", "content": "short"}])
    assert huge not in upstream.last().messages


def exchanges(turns: int) -> list[Message]:
    """A conversation of `turns` exchanges, about 100 tokens each."""
    return [m for turn in range(turns)
            for m in ({"role": "user", "content": f"question {turn}: {words(60, turn)}"},
                      {"role": "assistant", "content": f"answer {turn}: {words(30, turn + 50)}"})]


async def test_a_conversation_too_long_to_send_is_kept_as_history_not_refused(
    proxy: Proxy, upstream: FakeUpstream
) -> None:
    """A session that does not hold the conversation (a chat pointed at memproxy for the first
    time, or one whose session expired or was cleared) is sent all of it, more than fits: its
    history is stored and left out as memory leaves out any, and the client gets its answer."""
    history = exchanges(12)
    question = {"role": "user", "content": "and what came first?"}
    assert tokens([*history, question]) + REPLY_PRIMING > DEFAULT_BUDGET
    raw = await proxy.client(session="resent").chat.completions.with_raw_response.create(
        model="small", messages=[*history, question])  # type: ignore[arg-type]
    reply = raw.parse().choices[0].message.content
    assert raw.headers["X-Memproxy-Reconcile"] == "new"  # as the client's request was read, history stored first
    assert int(raw.headers["X-Memproxy-Stored-Omitted"]) > 0
    sent = upstream.chat_requests()[-1].messages
    assert sent[-1] == question and sent[-3:-1] == history[-2:]  # the newest turns verbatim, the oldest out
    assert tokens(sent) + REPLY_PRIMING <= DEFAULT_BUDGET
    stored = [json.loads(body) for (body,) in rows(proxy.app[CONFIG], "SELECT body FROM messages ORDER BY seq")]
    assert stored == [*history, question, {"role": "assistant", "content": reply}]

    # A long prompt of the client's own, with no answer in it, is not history: still refused.
    calls, state = len(upstream.chat_requests()), db_state(proxy)
    prompt = [{"role": "user", "content": words(700, k)} for k in range(3)]
    with pytest.raises(openai.BadRequestError) as caught:
        await proxy.client(session="prompt").chat.completions.create(
            model="small", messages=prompt)  # type: ignore[arg-type]
    assert_context_length_exceeded(caught.value, "messages")
    assert len(upstream.chat_requests()) == calls and db_state(proxy) == state


@pytest.mark.parametrize("header", [None, "new"])
async def test_exchanges_the_store_lacks_are_kept_as_history_not_refused(
    proxy: Proxy, upstream: FakeUpstream, header: str | None
) -> None:
    """A session holds its first exchange; the client then sends exchanges memproxy never stored (a
    turn whose answer was not recorded, a conversation continued elsewhere), more than fits, and a
    question: whether it resends the stored exchange too (`continue`) or only what is new to memproxy
    (`X-Memproxy-History: new`), the exchanges are stored first as history and the question answered."""
    client = proxy.client(session=f"lacks-{header}")
    first = {"role": "user", "content": "hello"}
    answer = (await client.chat.completions.create(model="small", messages=[first])).choices[0].message
    stored = [first, {"role": "assistant", "content": answer.content}]
    unseen = exchanges(14)
    question = {"role": "user", "content": "and what came first?"}
    assert tokens([*unseen, question]) + REPLY_PRIMING > DEFAULT_BUDGET
    sent_messages = [*unseen, question] if header else [*stored, *unseen, question]
    raw = await client.chat.completions.with_raw_response.create(
        model="small", messages=sent_messages,  # type: ignore[arg-type]
        extra_headers={"X-Memproxy-History": header} if header else None)
    reply = raw.parse().choices[0].message.content
    assert int(raw.headers["X-Memproxy-Stored-Omitted"]) > 0
    sent = upstream.chat_requests()[-1].messages
    assert sent[-1] == question and sent[-3:-1] == unseen[-2:]
    assert tokens(sent) + REPLY_PRIMING <= DEFAULT_BUDGET
    bodies = [json.loads(body) for (body,) in rows(proxy.app[CONFIG], "SELECT body FROM messages WHERE active = 1"
                                                                      " ORDER BY seq")]
    assert bodies == [*stored, *unseen, question, {"role": "assistant", "content": reply}]


async def test_an_edit_early_in_a_long_conversation_is_answered_not_refused(
    proxy: Proxy, upstream: FakeUpstream
) -> None:
    """A full-history client edits an early message of a conversation longer than the window (an
    agent clearing an old tool output): the edited branch from the fork on is more than fits, so
    it is stored first, as a resent history is, and planned as its continuation."""
    history = exchanges(14)
    client = proxy.client(session="edited")
    first = {"role": "user", "content": "and what came first?"}
    answer = (await client.chat.completions.create(model="small", messages=[*history, first])).choices[0].message
    edited = [history[0], {"role": "assistant", "content": "answer 0: [cleared]"}, *history[2:], first,
              {"role": "assistant", "content": answer.content}]
    question = {"role": "user", "content": "and then?"}
    assert tokens([*edited[1:], question]) + REPLY_PRIMING > DEFAULT_BUDGET
    raw = await client.chat.completions.with_raw_response.create(
        model="small", messages=[*edited, question])  # type: ignore[arg-type]
    reply = raw.parse().choices[0].message.content
    sent = upstream.chat_requests()[-1].messages
    assert sent[-1] == question and tokens(sent) + REPLY_PRIMING <= DEFAULT_BUDGET
    stored = [json.loads(body) for (body,) in rows(proxy.app[CONFIG], "SELECT body FROM messages WHERE active = 1 "
                                                                      "ORDER BY seq")]
    assert stored == [*edited, question, {"role": "assistant", "content": reply}]
    superseded = rows(proxy.app[CONFIG], "SELECT body FROM messages WHERE active = 0")
    assert len(superseded) == len(history) + 1  # the old branch from the fork on, kept for audit
    # Said as the client's request was read (its history stored first, the turn then planned as
    # that history's continuation): an edit, and what it superseded.
    assert (raw.headers["X-Memproxy-Reconcile"], raw.headers["X-Memproxy-Superseded"]) == ("edit", str(len(superseded)))


async def test_system_prompt_and_tool_schemas_are_part_of_what_must_fit(
    proxy: Proxy, upstream: FakeUpstream
) -> None:
    system = [{"role": "system", "content": words(600, 1)}]
    tools = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "description": words(600, 2)}}]
    user = [{"role": "user", "content": "hi"}]
    assert request_tokens(COUNTER, system + user, []) <= DEFAULT_BUDGET
    assert request_tokens(COUNTER, user, tools) <= DEFAULT_BUDGET
    assert request_tokens(COUNTER, system + user, tools) > DEFAULT_BUDGET
    client = proxy.client(session="sys-tools")
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model="small", messages=system + user, tools=tools)  # type: ignore[arg-type]
    assert_context_length_exceeded(caught.value)
    assert upstream.chat_requests() == []
    assert db_state(proxy)["messages"] == []
    raw = await client.chat.completions.with_raw_response.create(
        model="small", messages=system + user, tools=TOOLS)  # type: ignore[arg-type]
    assert int(raw.headers["x-memproxy-context-tokens"]) == request_tokens(COUNTER, system + user, TOOLS)


@pytest.mark.parametrize(("key", "value", "param"), [
    ("max_tokens", WINDOW, "max_tokens"),
    ("max_completion_tokens", WINDOW, "max_completion_tokens"),
    ("max_tokens", 50_000, "max_tokens"),
    ("max_tokens", WINDOW - 10, "messages"),  # leaves an input budget below zero
])
async def test_an_output_reserve_that_leaves_no_room_is_refused(
    proxy: Proxy, upstream: FakeUpstream, key: str, value: int, param: str
) -> None:
    chat = Chat(proxy, upstream, "new", "reserve-too-big")
    await chat.send([{"role": "user", "content": "first"}])
    state = db_state(proxy)
    with pytest.raises(openai.BadRequestError) as caught:
        await chat.client.chat.completions.create(
            model="small", messages=[{"role": "user", "content": "hi"}], **{key: value})
    assert_context_length_exceeded(caught.value, param)
    assert len(upstream.chat_requests()) == 1
    assert db_state(proxy) == state


# --- tool units ----------------------------------------------------------------------------------


def tool_results(calls: Sequence[dict[str, Any]], size: int) -> list[Message]:
    return [{"role": "tool", "tool_call_id": c["id"], "content": f"{c['id']}: {words(size, i)}"}
            for i, c in enumerate(calls)]


async def test_tool_units_are_never_split_when_old_history_is_dropped(
    proxy: Proxy, upstream: FakeUpstream
) -> None:
    """An agent session with big parallel tool results; the output reserve sweeps so that the cut
    falls everywhere in the history, including inside tool units."""
    chat = Chat(proxy, upstream, "new", "units", [{"role": "system", "content": "agent"}], TOOLS)
    unit_mattered = 0
    for turn in range(4):
        calls = [tool_call(f"call_{turn}_{k}", json.dumps({"q": words(k + 2)})) for k in range(turn % 3 + 1)]
        await chat.send([{"role": "user", "content": f"task {turn}"}], Reply(tool_calls=calls))
        await chat.send(tool_results(calls, 60 + 40 * turn), Reply(tool_calls=[tool_call(f"call_{turn}_x")]))
        await chat.send(tool_results([tool_call(f"call_{turn}_x")], 30))
    for reserve in range(1500, 100, -70):
        budget = WINDOW - reserve - MARGIN
        new = [{"role": "user", "content": f"probe {reserve}"}]
        fixed = tokens(chat.system + new) + COUNTER.tools(TOOLS) + REPLY_PRIMING
        naive = _message_granular_kept(chat.history, fixed, budget)
        kept, _ = await chat.send(new, budget=budget, max_tokens=reserve)
        unit_mattered += naive != kept
    assert unit_mattered >= 3  # the sweep did put the cut inside tool units


def _message_granular_kept(history: Sequence[Message], fixed: int, budget: int) -> int:
    total, kept = fixed, 0
    for message in reversed(history):
        total += COUNTER.message(message)
        if total > budget:
            break
        kept += 1
    return kept


@pytest.mark.parametrize("style", ["new", "full"])
async def test_agent_loop_sends_the_stored_call_with_its_new_results(
    proxy: Proxy, upstream: FakeUpstream, style: str
) -> None:
    """The client sends only tool results (or everything); the budget fits the stored call and its
    results but not the question before it: the call goes, the question is left out."""
    system = [{"role": "system", "content": "agent"}]
    chat = Chat(proxy, upstream, style, f"loop-{style}", system, TOOLS)
    calls = [tool_call("call_a", '{"q": "a"}'), tool_call("call_b", '{"q": "b"}')]
    await chat.send([{"role": "user", "content": words(600)}], Reply(tool_calls=calls))
    results = tool_results(calls, 40)
    call_message = chat.history[-1]
    needed = tokens(system + [call_message] + results) + COUNTER.tools(TOOLS) + REPLY_PRIMING
    kept, headers = await chat.send(results, budget=needed, max_tokens=WINDOW - MARGIN - needed)
    assert kept == 1
    assert headers["x-memproxy-stored-omitted"] == "1"
    assert headers["x-memproxy-context-tokens"] == str(needed)
    assert [without_none(m) for m in upstream.last().messages] == [*system, without_none(call_message), *results]


@pytest.mark.parametrize("style", ["new", "full"])
async def test_agent_loop_refuses_when_the_stored_call_and_its_results_cannot_fit(
    proxy: Proxy, upstream: FakeUpstream, style: str
) -> None:
    system = [{"role": "system", "content": "agent"}]
    chat = Chat(proxy, upstream, style, f"loop-over-{style}", system, TOOLS)
    calls = [tool_call("call_a", json.dumps({"q": words(80)}))]
    await chat.send([{"role": "user", "content": "go"}], Reply(tool_calls=calls))
    results = tool_results(calls, 40)
    results_alone = tokens(system + results) + COUNTER.tools(TOOLS) + REPLY_PRIMING
    with_call = results_alone + tokens(chat.history[-1:])
    budget = with_call - 1
    assert results_alone <= budget  # the new messages alone would fit
    state = db_state(proxy)
    with pytest.raises(openai.BadRequestError) as caught:
        await chat.client.chat.completions.create(
            model="small", messages=chat.request(results), tools=TOOLS,  # type: ignore[arg-type]
            max_tokens=WINDOW - MARGIN - budget)
    assert_context_length_exceeded(caught.value, "messages")
    assert len(upstream.chat_requests()) == 1
    assert db_state(proxy) == state
    # With room, the same results go through once, with their call, and are stored once.
    await chat.send(results)
    assert stored_roles(proxy) == ["user", "assistant", "tool", "assistant"]


@pytest.mark.parametrize("ids", [("call_Zr8xKp2Qw9LmN4vB7yT1sD6f", "call_Qm3vB8nL1xT5rK9wZ2pY7cA4"), ("c", "d")],
                         ids=["provider-ids", "one-letter-ids"])
async def test_a_call_the_client_abandoned_goes_as_text_never_unanswered(
    proxy: Proxy, upstream: FakeUpstream, ids: tuple[str, str]
) -> None:
    """A new-turn-only agent gets tool calls back, does not run them, and asks something else (or
    took a structured answer given as a call, as pydantic-ai and instructor do, and never answers
    it): the model still sees what it called, as text, never as a call without its result. Told
    so only where that costs no more than the call did (one-letter ids: the call is left out)."""
    chat = Chat(proxy, upstream, "new", "abandoned", tools=TOOLS)
    await chat.send([{"role": "user", "content": "look two things up"}],
                    Reply(tool_calls=[tool_call(ids[0]), tool_call(ids[1], '{"q": "y"}')]))
    raw = await chat.client.chat.completions.with_raw_response.create(
        model="small", tools=TOOLS, messages=[{"role": "user", "content": "never mind, say hi"}])  # type: ignore[arg-type]
    sent = upstream.last().messages
    assert_tool_units_whole(sent)
    told = [{"role": "assistant", "content": '[called lookup {"q": "x"}, no result]\n[called lookup {"q": "y"}, no result]'}]
    assert sent == [{"role": "user", "content": "look two things up"},
                    *(told if ids[0].startswith("call_") else []),
                    {"role": "user", "content": "never mind, say hi"}]
    assert int(raw.headers["X-Memproxy-Context-Tokens"]) == tokens(sent) + COUNTER.tools(TOOLS) + REPLY_PRIMING
    assert stored_roles(proxy) == ["user", "assistant", "user", "assistant"]  # the store keeps the calls


def test_an_unanswered_custom_tool_call_is_told_with_its_input() -> None:
    """A custom tool's call (`{"type": "custom", "custom": {"name", "input"}}`) is told as a
    function's is, its input as it was given; text before it stays."""
    calls = [{"id": "call_Zr8xKp2Qw9LmN4vB7yT1sD6f", "type": "custom", "custom": {"name": "patch", "input": "*** a"}}]
    stored = [{"role": "user", "content": "fix it"}, {"role": "assistant", "content": "Patching.", "tool_calls": calls}]
    counts = [COUNTER.message(m) for m in stored]
    sent, saved = settle_unanswered_calls(stored, counts, [{"role": "user", "content": "thanks"}], COUNTER)
    assert sent[1] == {"role": "assistant", "content": "Patching.\n[called patch *** a, no result]"}
    assert saved == counts[1] - COUNTER.message(sent[1]) >= 0
    # The call itself counts its name and input, as a function's counts its name and arguments.
    bare = {"role": "assistant", "content": None, "tool_calls": [{**calls[0], "custom": {"name": "", "input": ""}}]}
    assert COUNTER.message(stored[1]) - COUNTER.message({**bare, "content": "Patching."}) == COUNTER.text("patch") + COUNTER.text("*** a")


async def test_a_session_that_opens_on_a_tool_result_never_sends_it_without_its_call(
    proxy: Proxy, upstream: FakeUpstream
) -> None:
    """A client whose first message is a tool result (its call lived elsewhere): however short the
    history, the result is never sent again without the call it answers, nor the answer to it
    alone: a conversation never opens with the model's answer (Anthropic's and Gemini's APIs
    refuse one)."""
    client = proxy.client(session="opens-on-a-result")
    orphan = {"role": "tool", "tool_call_id": "call_elsewhere", "content": "42"}
    await client.chat.completions.create(model="small", messages=[orphan])  # type: ignore[list-item]
    raw = await client.chat.completions.with_raw_response.create(
        model="small", messages=[{"role": "user", "content": "and then?"}])
    assert upstream.last().messages == [{"role": "user", "content": "and then?"}]
    assert raw.headers["X-Memproxy-Stored-Omitted"] == raw.headers["X-Memproxy-Unsummarized-Omitted"] == "2"


async def test_function_and_output_schemas_count_against_the_budget(proxy: Proxy, upstream: FakeUpstream) -> None:
    schema = {"name": "answer", "schema": {"type": "object", "properties": {"text": {"type": "string"}}}}
    functions = [{"name": "lookup", "parameters": {"type": "object", "properties": {}}}]
    message = [{"role": "user", "content": "hi"}]
    client = proxy.client(session=None, **{"X-Session-Id": "schemas"})
    plain = await client.chat.completions.with_raw_response.create(model="small", messages=message)  # type: ignore[arg-type]
    with_schemas = await client.chat.completions.with_raw_response.create(
        model="small", messages=message,  # type: ignore[arg-type]
        response_format={"type": "json_schema", "json_schema": schema},  # type: ignore[typeddict-item]
        functions=functions,  # type: ignore[list-item]
        extra_headers={"X-Memproxy-History": "new"},
    )
    grown = int(with_schemas.headers["X-Memproxy-Context-Tokens"]) - int(plain.headers["X-Memproxy-Context-Tokens"])
    stored_turn = COUNTER.message({"role": "assistant", "content": "reply 1"}) + COUNTER.message(message[0])
    assert grown == stored_turn + COUNTER.tools([*functions, schema])
    assert upstream.last().body["response_format"] == {"type": "json_schema", "json_schema": schema}


async def test_a_resent_history_whose_newest_message_cannot_fit_is_refused_and_not_stored(
    proxy: Proxy, upstream: FakeUpstream
) -> None:
    """A conversation the session does not hold, too long to send, whose newest message alone
    cannot fit: refused with a 400 before anything is sent or stored; its history, which would be
    stored first were the request answered, is not stored either (bad input changes nothing)."""
    history = exchanges(3)
    huge = {"role": "user", "content": words(2000)}
    assert tokens([huge]) + REPLY_PRIMING > DEFAULT_BUDGET
    state = db_state(proxy)
    with pytest.raises(openai.BadRequestError) as caught:
        await proxy.client(session="resent-huge").chat.completions.create(
            model="small", messages=[*history, huge])  # type: ignore[arg-type]
    assert_context_length_exceeded(caught.value, "messages")
    assert upstream.chat_requests() == []
    assert db_state(proxy) == state


@pytest.mark.parametrize("memory", [{"head_turns": 1, "tool_output_max_tokens": 1000}, {"tool_output_max_tokens": 0}],
                         ids=["opening-turns", "trimming-off"])
async def test_an_older_answers_reasoning_is_not_counted_once_it_is_left_out(
    start_proxy: Callable[[Config], Awaitable[Proxy]], storage: StorageConfig, upstream: FakeUpstream,
    memory: dict[str, Any],
) -> None:
    """A reasoning model's answers are stored with their reasoning, which goes no more once their
    exchange is over: the opening turns (`memory.head_turns`) and, with trimming off, the older
    kept turns are sent without it, and counted so. Counted with it, a long reasoning took the room
    of turns that fit (and `X-Memproxy-Context-Tokens` said more than was sent)."""
    proxy = await start_proxy(make_config(storage, upstream.url, **memory))
    upstream.tokens, upstream.window = (lambda body: request_tokens(COUNTER, body["messages"], [])), WINDOW
    client = proxy.client(session="thinking", **{"X-Memproxy-History": "new"})
    left_out = False
    for i in range(8):
        upstream.enqueue(Reply(content=f"answer {i}", reasoning_content=words(300, salt=i)))
        raw = await client.chat.completions.with_raw_response.create(
            model="small", messages=[{"role": "user", "content": words(150, salt=i)}])
        sent = upstream.last().messages
        assert not any("reasoning_content" in m for m in sent)
        assert int(raw.headers["X-Memproxy-Context-Tokens"]) == request_tokens(COUNTER, sent, [])
        left_out = left_out or int(raw.headers["X-Memproxy-Stored-Omitted"]) > 0
    assert left_out


async def test_an_output_schema_counts_whole_with_litellms_counter(
    start_proxy: Callable[[Config], Awaitable[Proxy]], storage: StorageConfig, upstream: FakeUpstream,
) -> None:
    """A model whose tokenizer tiktoken does not know is counted by litellm's counter, which renders
    a function's name, description and parameters alone: a JSON schema the answer must follow was
    some 20 tokens whatever its size, and a long one overflowed the window with history it did not
    leave room for. It counts as its compact JSON, as tiktoken's counter counts it."""
    config = make_config(storage, upstream.url)
    proxy = await start_proxy(replace(config, models=tuple(
        replace(m, tokenizer="litellm") if m.name == "small" else m for m in config.models)))
    counter = LitellmCounter(load_litellm(), "openai/small")
    schema: dict[str, Any] = {"name": "answer", "schema": {"type": "object", "description": words(400),
                                                           "properties": {"text": {"type": "string"}}}}

    def provider_tokens(body: dict[str, Any]) -> int:
        schemas = json.dumps([body["response_format"]["json_schema"]], separators=(",", ":"), ensure_ascii=False)
        return sum(counter.message(m) for m in body["messages"]) + counter.text(schemas) + REPLY_PRIMING

    upstream.tokens, upstream.window = provider_tokens, WINDOW
    client = proxy.client(session="schema", **{"X-Memproxy-History": "new"})
    for i in range(6):
        raw = await client.chat.completions.with_raw_response.create(
            model="small", messages=[{"role": "user", "content": words(150, salt=i)}],
            extra_body={"response_format": {"type": "json_schema", "json_schema": schema}})
        assert int(raw.headers["X-Memproxy-Context-Tokens"]) >= provider_tokens(upstream.last().body)
    assert int(raw.headers["X-Memproxy-Stored-Omitted"]) > 0


async def test_tool_calls_count_whole_with_litellms_counter(
    start_proxy: Callable[[Config], Awaitable[Proxy]], storage: StorageConfig, upstream: FakeUpstream,
) -> None:
    """litellm's counter reads a function call's arguments alone, and refuses a custom tool's call
    (a 500 for a conversation that held one): calls count their id, name and arguments or input,
    as tiktoken's counter counts them."""
    config = make_config(storage, upstream.url)
    proxy = await start_proxy(replace(config, models=tuple(
        replace(m, tokenizer="litellm") if m.name == "small" else m for m in config.models)))
    custom: Message = {"id": "call_Zr8xKp2Qw9LmN4vB7yT1sD6f", "type": "custom", "custom": {"name": "patch", "input": "*** a"}}
    messages: list[Message] = [
        {"role": "user", "content": "patch it"}, {"role": "assistant", "content": None, "tool_calls": [custom]},
        {"role": "tool", "tool_call_id": custom["id"], "content": "patched"}, {"role": "user", "content": "thanks"}]
    raw = await proxy.client(session="custom").chat.completions.with_raw_response.create(
        model="small", messages=messages)  # type: ignore[arg-type]
    assert upstream.last().messages[1]["tool_calls"] == [custom]

    counter = LitellmCounter(load_litellm(), "openai/small")
    sent = sum(counter.message(m) for m in upstream.last().messages) + REPLY_PRIMING
    assert int(raw.headers["X-Memproxy-Context-Tokens"]) == sent
    function: Message = {"id": "call_Qm3vB8nL1xT5rK9wZ2pY7cA4", "type": "function",
                "function": {"name": "lookup", "arguments": '{"q": "x"}'}}
    calls = {"role": "assistant", "content": None, "tool_calls": [function]}
    bare = {**calls, "tool_calls": [{**function, "id": "", "function": {"name": "", "arguments": '{"q": "x"}'}}]}
    assert counter.message(calls) - counter.message(bare) == counter.text(function["id"]) + counter.text("lookup")
    assert counter.message(messages[1]) > counter.message({"role": "assistant", "content": None})
