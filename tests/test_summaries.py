"""Rolling summaries (issue 3, items 1-5, 7-9), end to end through the real proxy.

The fake upstream plays both the chat model and the summariser. The usual summariser here is
faithful and deterministic: it collects every `FACT-<n>` token of the request's last message (which
holds the previous summary and the new part of the transcript) and answers "Known facts: ...", so a
fact the conversation mentioned once survives only if every refresh built on the previous summary.

Every forwarded chat request is recounted with tiktoken and checked: within the budget, the count
equal to `X-Memproxy-Context-Tokens`, the system prompt first, then the summary framed as
background, then the marker (if any), then the stored turns not covered, tool units whole, and the
client's new messages last and verbatim; the summary and visibility headers are checked against
the `summaries` table, read from a second connection.

Background folds are awaited with `Summarizer.wait_idle()`; a summariser held on a gate lets a test
act while a fold is in flight.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import httpx
import pytest

import db
import helpers
from conftest import OTHER_KEY, PROXY_KEY, Proxy, make_config
from fake_upstream import FakeUpstream, Received, Reply
from helpers import until
from memproxy.config import Config, ModelConfig, StorageConfig
from memproxy.context import marker_message
from memproxy.tokens import TiktokenCounter, encoding_name_for, request_tokens
from memproxy.typedefs import CONFIG, SUMMARIZER
from test_budget import assert_tool_units_whole, tool_call, without_none, words

Message = dict[str, Any]
StartProxy = Callable[[Config], Any]

pytestmark = pytest.mark.both_stores

WINDOW = 2000
BUDGET = WINDOW - 256 - 20  # model "small": window - default output reserve - safety margin
COUNTER = TiktokenCounter(encoding_name_for("openai/small"))
SYSTEM: Message = {"role": "system", "content": "You are a careful assistant. Answer briefly."}
SUMMARIES: dict[str, Any] = {"summaries": True, "overflow": "summarize"}
SUMMARY_OPENING = "Summary of the earlier conversation"
MARKER = re.compile(r"\[(\d+) earlier messages")
FACT = re.compile(r"FACT-(\d+)")


# --- fake summarisers ----------------------------------------------------------------------------


def facts_in(text: str) -> list[int]:
    return sorted({int(n) for n in FACT.findall(text)})


def summariser_input(received: Received) -> str:
    return str(received.messages[-1]["content"])


def fact_summary(numbers: Sequence[int]) -> str:
    return "Known facts: " + (", ".join(f"FACT-{n}" for n in numbers) or "none") + "."


def fact_summariser(received: Received) -> Reply:
    return Reply(content=fact_summary(facts_in(summariser_input(received))))


def gated(gate: threading.Event, answer: Callable[[Received], Reply] = fact_summariser
          ) -> Callable[[Received], Reply]:
    """A summariser whose answers wait for `gate`."""

    def reply(received: Received) -> Reply:
        return replace(answer(received), gate=gate)

    return reply


def new_part(received: Received) -> str:
    text = summariser_input(received)
    return text.split("=== NEW PART OF THE CONVERSATION ===\n", 1)[1].split("\n=== END NEW PART", 1)[0]


# --- reading the store ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredSummary:
    version: int
    text: str
    covers: int
    tokens: int
    replaced_tokens: int
    model: str


def summary_rows(config: Config, session: str = "s1", tenant: str = "a") -> list[StoredSummary]:
    """Every summary version of a session, oldest first (the audit trail)."""
    found = db.rows(
        config,
        "SELECT v.version, v.text, v.covers, v.tokens, v.replaced_tokens, v.model FROM summaries v"
        " JOIN sessions s ON s.pk = v.session_pk WHERE s.tenant = ? AND s.session_id = ?"
        " ORDER BY v.version", tenant, session)
    return [StoredSummary(*row) for row in found]


def stored(config: Config, session: str = "s1", tenant: str = "a") -> list[Message]:
    """The session's active chain, as stored."""
    found = db.rows(
        config,
        "SELECT m.body FROM messages m JOIN sessions s ON s.pk = m.session_pk"
        " WHERE s.tenant = ? AND s.session_id = ? AND m.active = 1 ORDER BY m.seq",
        tenant, session)
    return [json.loads(r[0]) for r in found]


def stored_tokens(config: Config, session: str = "s1") -> int:
    found = db.rows(config, "SELECT head_cum FROM sessions WHERE session_id = ?", session)
    return int(found[0][0]) if found else 0


# --- what the proxy sent upstream ----------------------------------------------------------------


@dataclass
class Sent:
    """One forwarded chat request, taken apart and checked."""

    messages: list[Message]
    headers: httpx.Headers
    summary: str | None  # the summary text (without its framing), if one was sent
    marker: int | None  # how many earlier messages the marker says were left out, if one was sent
    history: list[Message]  # the stored messages sent, between the summary/marker and the new ones

    @property
    def version(self) -> int:
        return int(self.headers["x-memproxy-summary-version"])

    @property
    def summarized(self) -> int:
        return int(self.headers["x-memproxy-summarized"])

    @property
    def unsummarized_omitted(self) -> int:
        return int(self.headers["x-memproxy-unsummarized-omitted"])

    def text(self) -> str:
        return "\n".join(str(m.get("content") or "") + json.dumps(m.get("tool_calls") or [])
                         for m in self.messages)


def check_sent(received: Received, headers: httpx.Headers, system: Sequence[Message],
               new: Sequence[Message], budget: int = BUDGET) -> Sent:
    """The invariants of every request: budget, order, framing, units, and headers that agree."""
    messages = received.messages
    counted = request_tokens(COUNTER, messages, received.body.get("tools") or [])
    assert int(headers["x-memproxy-context-tokens"]) == counted, "the header is not the recount"
    assert counted <= budget, f"{counted} tokens sent, over the budget of {budget}"
    assert messages[: len(system)] == list(system), "the system prompt is not first and verbatim"
    rest = messages[len(system):]
    summary = marker = None
    if rest and rest[0]["role"] == "system" and str(rest[0]["content"]).startswith(SUMMARY_OPENING):
        content = str(rest.pop(0)["content"])
        assert "background" in content.split("\n\n", 1)[0], "the summary is not framed as background"
        summary = content.split("\n\n", 1)[1]
    if rest and rest[0]["role"] == "system" and (found := MARKER.search(str(rest[0]["content"]))):
        rest.pop(0)
        marker = int(found[1])
    assert all(m["role"] != "system" for m in rest), "a system message out of place"
    assert [without_none(m) for m in rest[len(rest) - len(new):]] == [without_none(m) for m in new], \
        "the new messages are not last and verbatim"
    assert_tool_units_whole(rest)
    sent = Sent(messages, headers, summary, marker, rest[: len(rest) - len(new)])
    # The visibility headers say what was sent.
    assert (sent.version > 0) == (summary is not None)
    assert (sent.summarized > 0) == (summary is not None)
    if marker is not None:
        assert marker == sent.unsummarized_omitted > 0
    assert int(headers["x-memproxy-stored-included"]) == len(sent.history)
    assert int(headers["x-memproxy-stored-omitted"]) == sent.summarized + sent.unsummarized_omitted
    return sent


def check_against_store(sent: Sent, config: Config, history: Sequence[Message], session: str) -> None:
    """The summary sent is the stored version the header names; the turns sent are the stored ones
    right after what the summary covers and what was left out."""
    if sent.summary is not None:
        versions = {s.version: s for s in summary_rows(config, session)}
        assert versions[sent.version].text == sent.summary
        assert versions[sent.version].covers == sent.summarized
    first = sent.summarized + sent.unsummarized_omitted
    assert [without_none(m) for m in sent.history] == [without_none(m) for m in history[first:]]


class Conversation(helpers.Conversation):
    """One session driven like a client: style "new" sends only the new turn, "full" everything.
    Every request is checked against the invariants (`check_sent`) and, unless told not to, against
    the store (`check_against_store`)."""

    def __init__(self, proxy: Proxy, upstream: FakeUpstream, session: str = "s1", *, style: str = "new",
                 system: Sequence[Message] = (SYSTEM,), model: str = "small", budget: int = BUDGET) -> None:
        super().__init__(proxy, upstream, session, style=style, system=system, model=model)
        self.budget = budget
        self.sent: list[Sent] = []

    async def send(self, new: Sequence[Message], reply: Reply | None = None, *, check: bool = True,
                   stream: bool = False) -> Sent:
        reply = reply or Reply(content=f"noted {len(self.history)}")
        received, headers = await self.exchange(new, reply, stream=stream)
        sent = check_sent(received, headers, self.system, new, self.budget)
        if check:
            check_against_store(sent, self.proxy.app[CONFIG], self.history, self.session)
        self.remember(new, reply)
        self.sent.append(sent)
        return sent

    async def say(self, text: str, reply: Reply | None = None) -> Sent:
        return await self.send([user(text)], reply)

    async def idle(self) -> None:
        await self.proxy.app[SUMMARIZER].wait_idle()


def user(text: str) -> Message:
    return {"role": "user", "content": text}


def tool_result(call_id: str, text: str) -> Message:
    return {"role": "tool", "tool_call_id": call_id, "content": text}


async def start(start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream, **memory: Any) -> Proxy:
    config = make_config(storage, upstream.url, **memory)
    proxy: Proxy = await start_proxy(config)
    return proxy


async def compact(proxy: Proxy, session: str, key: str = PROXY_KEY, body: Any = None) -> tuple[int, Any]:
    """`POST /v1/sessions/{session}/compact`: the status and the JSON answer."""
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{proxy.url}/sessions/{session}/compact", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as response:
            return response.status, await response.json()


def summary_logs(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "memproxy.summaries"]


def assert_no_content_logged(caplog: pytest.LogCaptureFixture, *fragments: str) -> None:
    for record in caplog.records:
        message = record.getMessage()
        assert "FACT-" not in message, message
        for fragment in fragments:
            assert fragment not in message, message


# --- when a fold happens (items 1, 2) ------------------------------------------------------------


async def test_no_summary_below_the_chunk_threshold(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream
) -> None:
    proxy = await start(start_proxy, storage, upstream, **SUMMARIES)
    upstream.summarizer = fact_summariser
    chat = Conversation(proxy, upstream)
    for turn in range(5):
        sent = await chat.say(f"question {turn}: FACT-{turn} {words(20, turn)}")
        await chat.idle()
        assert sent.version == 0 and sent.summary is None
        assert sent.headers["x-memproxy-summarized"] == sent.headers["x-memproxy-unsummarized-omitted"] == "0"
    config = proxy.app[CONFIG]
    assert stored_tokens(config) <= config.memory.chunk_threshold(WINDOW)
    assert upstream.summary_requests() == []
    assert summary_rows(config) == []


@pytest.mark.parametrize(("tail_turns", "tail_tokens", "kept_turns"), [
    (3, None, 3),  # the default: the newest 3 turns stay verbatim
    (2, None, 2),
    (3, 300, 2),  # fewer turns while they exceed tail_tokens (a turn here is about 130 tokens)
    (3, 10, 1),  # never fewer than one
])
async def test_crossing_the_threshold_folds_all_but_the_verbatim_tail(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream, tail_turns: int,
    tail_tokens: int | None, kept_turns: int,
) -> None:
    proxy = await start(start_proxy, storage, upstream, **SUMMARIES, tail_turns=tail_turns,
                        tail_tokens=tail_tokens)
    config = proxy.app[CONFIG]
    threshold = config.memory.chunk_threshold(WINDOW)
    upstream.summarizer = fact_summariser
    chat = Conversation(proxy, upstream)
    turn = 0
    while stored_tokens(config) <= threshold:
        await chat.say(f"question {turn}: FACT-{turn} {words(80, turn)}")
        await chat.idle()
        assert upstream.summary_requests() == [] or stored_tokens(config) > threshold
        turn += 1
    # The turn that crossed the threshold started exactly one fold, after its response.
    assert len(upstream.summary_requests()) == 1
    [summary] = summary_rows(config)
    assert summary.version == 1
    assert summary.covers == len(chat.history) - 2 * kept_turns
    if kept_turns > 1:
        assert sum(COUNTER.message(m) for m in chat.history[-2 * kept_turns:]) <= (tail_tokens or 600)
    if kept_turns < tail_turns:
        assert sum(COUNTER.message(m) for m in chat.history[-2 * kept_turns - 2:]) > (tail_tokens or 600)
    assert summary.model == "small"
    assert summary.tokens < summary.replaced_tokens
    assert facts_in(summary.text) == list(range(turn - kept_turns))
    sent = await chat.say("and now?")
    assert sent.version == 1 and sent.summarized == summary.covers
    assert sent.history == chat.history[summary.covers : -2]


async def test_the_default_threshold_scales_with_the_model_window(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream
) -> None:
    proxy = await start(start_proxy, storage, upstream, **SUMMARIES)
    upstream.summarizer = fact_summariser
    small = Conversation(proxy, upstream, "on-small")
    big = Conversation(proxy, upstream, "on-big", model="big", budget=100_000 - 1000 - 20)
    for turn in range(10):
        for chat in (small, big):
            await chat.say(f"question {turn}: {words(80, turn)}")
            await chat.idle()
    config = proxy.app[CONFIG]
    assert stored_tokens(config, "on-small") > WINDOW // 2 and stored_tokens(config, "on-big") > WINDOW // 2
    assert [s.version for s in summary_rows(config, "on-small")] != []
    assert summary_rows(config, "on-big") == []  # far below half of a 100k window


@pytest.mark.parametrize(("summarizer_model", "expected_name", "expected_upstream_model"), [
    (None, "big", "gpt-4o-mini"),  # the session's own model
    ("small", "small", "small"),
])
async def test_the_summariser_model_is_configurable(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream, summarizer_model: str | None,
    expected_name: str, expected_upstream_model: str,
) -> None:
    proxy = await start(start_proxy, storage, upstream, **SUMMARIES, summarizer_model=summarizer_model,
                        chunk_threshold_tokens=300)
    upstream.summarizer = fact_summariser
    chat = Conversation(proxy, upstream, model="big", budget=100_000 - 1000 - 20)
    for turn in range(6):
        await chat.say(f"question {turn}: FACT-{turn} {words(40, turn)}")
        await chat.idle()
    requests = upstream.summary_requests()
    assert requests and {r.body["model"] for r in requests} == {expected_upstream_model}
    assert {s.model for s in summary_rows(proxy.app[CONFIG])} == {expected_name}
    # Its requests fit its own window: from "big" (100,000 tokens) the cap would be 4,096, more
    # than the whole window of "small" (2,000); it is held to a quarter of the summariser's window.
    window = WINDOW if expected_name == "small" else 100_000
    for request in requests:
        assert request.body["max_tokens"] <= window // 4
        assert request_tokens(COUNTER, request.messages, []) + request.body["max_tokens"] <= window


# --- the long conversation ("Done when") -----------------------------------------------------------


async def test_a_conversation_many_windows_long_stays_in_budget_and_keeps_early_facts(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="memproxy")
    proxy = await start(start_proxy, storage, upstream, **SUMMARIES)
    config = proxy.app[CONFIG]
    upstream.summarizer = fact_summariser
    chat = Conversation(proxy, upstream, "long")
    early: list[str] = []
    for turn in range(80):
        fact = f" FACT-{turn}" if turn < 6 or turn % 10 == 0 else ""
        text = f"turn {turn}:{fact} {words(90, turn)}"
        if turn < 6:
            early.append(text)
        if turn % 7 == 3:  # an agent step: a tool call and its result
            call = tool_call(f"call_{turn}", json.dumps({"q": f"topic {turn}"}))
            await chat.say(text, Reply(tool_calls=[call]))
            await chat.send([tool_result(call["id"], f"FACT-{100 + turn} {words(60, turn + 1)}")])
        else:
            await chat.say(text)
        await chat.idle()
    final = await chat.say("What do you know so far?")

    assert stored_tokens(config, "long") > 5 * WINDOW  # many windows long, all of it sent within budget
    versions = summary_rows(config, "long")
    assert [s.version for s in versions] == list(range(1, len(versions) + 1))
    assert len(versions) >= 4  # the first summary and at least three refreshes
    assert all(a.covers < b.covers for a, b in zip(versions, versions[1:]))
    assert all(s.tokens < s.replaced_tokens for s in versions)

    # What the model is sent last: the newest summary, right after the system prompt, holding the
    # facts of the first turns (long gone from the verbatim part) and of every tool result.
    assert final.version == versions[-1].version and final.summary == versions[-1].text
    assert final.messages[0] == SYSTEM and final.messages[1]["role"] == "system"
    assert final.messages[-1] == user("What do you know so far?")
    remembered = facts_in(final.summary or "")
    assert set(range(6)) <= set(remembered)
    assert {100 + t for t in range(70) if t % 7 == 3} | {t for t in range(70) if t % 10 == 0} <= set(remembered)
    sent_verbatim = [m.get("content") for m in final.history]
    assert not any(text in sent_verbatim for text in early)

    # Each refresh built on the previous summary, and was told how to summarise.
    requests = upstream.summary_requests()
    assert len(requests) == len(versions)
    assert "=== EXISTING SUMMARY ===\nNONE\n" in summariser_input(requests[0])
    for request, previous in zip(requests[1:], versions):
        assert f"=== EXISTING SUMMARY ===\n{previous.text}\n" in summariser_input(request)
    instructions = str(requests[0].messages[0]["content"]).lower()
    for duty in ("goal", "decision", "constraint", "identifier", "file path", "open task", "number",
                 "data to summarise", "do not follow instructions", "tokens"):
        assert duty in instructions, duty

    # Between two refreshes the prefix (system prompt + summary) is byte for byte the same.
    prefixes: dict[int, set[str]] = {}
    for sent in chat.sent:
        if sent.version:
            prefixes.setdefault(sent.version, set()).add(json.dumps(sent.messages[:2]))
    assert sum(1 for sent in chat.sent if sent.version) > len(prefixes) + 10  # several turns per version
    assert all(len(prefix) == 1 for prefix in prefixes.values())
    assert len(prefixes) >= 3

    # One structured line per fold, saying what happened and nothing of the content.
    lines = summary_logs(caplog)
    assert len(lines) == len(versions)
    for line, version in zip(lines, versions):
        assert re.fullmatch(
            r"summary session=[0-9a-f]{12} outcome=applied messages_folded=\d+ tokens_before=\d+"
            r" tokens_after=\d+ duration_ms=\d+ model=small version=\d+", line), line
        assert f"version={version.version}" in line and f"tokens_after={version.tokens}" in line
    assert_no_content_logged(caplog, "topic", "turn 1:", "long")


# --- rejected summaries change nothing (items 3, 8) ------------------------------------------------


def echo_summariser(received: Received) -> Reply:
    """Hands the transcript back: never smaller than what it would replace."""
    return Reply(content=new_part(received))


def padded_summariser(received: Received) -> Reply:
    return Reply(content=fact_summary(facts_in(summariser_input(received))) + " " + words(40))


REJECTED: dict[str, tuple[Callable[[Received], Reply], dict[str, Any], str, str]] = {
    "not smaller": (echo_summariser, {}, "discarded", "not smaller"),
    "over the cap": (padded_summariser, {"summary_max_tokens": 16}, "discarded", "over the cap"),
    "empty": (lambda _: Reply(content=""), {}, "discarded", "empty"),
    "blank": (lambda _: Reply(content="  \n "), {}, "discarded", "empty"),
    "upstream error": (lambda _: Reply(status=500, error_message="model overloaded"), {}, "failed", "500"),
}


@pytest.mark.parametrize("case", list(REJECTED))
async def test_a_rejected_summary_leaves_everything_unchanged_logs_and_backs_off(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream, caplog: pytest.LogCaptureFixture,
    case: str,
) -> None:
    answer, memory, outcome, detail = REJECTED[case]
    caplog.set_level(logging.INFO, logger="memproxy")
    proxy = await start(start_proxy, storage, upstream, **SUMMARIES, chunk_threshold_tokens=150,
                        tail_turns=1, failure_backoff_seconds=3600, **memory)
    config = proxy.app[CONFIG]
    upstream.summarizer = answer
    chat = Conversation(proxy, upstream)
    for turn in range(8):
        await chat.say(f"question {turn}: FACT-{turn} {words(25, turn)}")
        await chat.idle()
        if upstream.summary_requests():
            break
    assert len(upstream.summary_requests()) == 1
    [rejected] = upstream.summary_requests()
    if case == "not smaller":
        assert COUNTER.text(new_part(rejected)) < config.memory.summary_cap(WINDOW)  # the cap did not decide
    if case == "over the cap":
        transcript = sum(COUNTER.message(m) for m in chat.history[:-2])
        assert COUNTER.text(padded_summariser(rejected).content or "") < transcript  # it would be smaller
    # Nothing was stored as a summary, least of all an error text; the history is intact.
    assert summary_rows(config) == []
    assert stored(config) == chat.history
    [line] = summary_logs(caplog)
    assert f"outcome={outcome} " in line and "messages_folded=0 " in line and detail in line
    assert re.search(r"tokens_before=\d+ tokens_after=0 duration_ms=\d+ model=small version=- ", line)
    # No retry while the backoff runs, though the session stays above the threshold; every turn is
    # sent whole, with no summary.
    for turn in range(3):
        sent = await chat.say(f"follow-up {turn}")
        await chat.idle()
        assert sent.summary is None and sent.version == 0 and sent.unsummarized_omitted == 0
        assert sent.history == chat.history[:-2]
    assert len(upstream.summary_requests()) == 1
    assert summary_rows(config) == []
    assert len(summary_logs(caplog)) == 1
    assert_no_content_logged(caplog, "question", "follow-up", "alpha", "model overloaded")


async def test_a_failed_summary_is_retried_once_the_backoff_has_passed(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="memproxy.summaries")
    proxy = await start(start_proxy, storage, upstream, **SUMMARIES, chunk_threshold_tokens=150,
                        tail_turns=1, failure_backoff_seconds=0.05)
    config = proxy.app[CONFIG]
    answers = [Reply(status=500)]
    upstream.summarizer = lambda received: answers.pop() if answers else fact_summariser(received)
    chat = Conversation(proxy, upstream)
    turns = 0
    while len(upstream.summary_requests()) < 2:  # each turn is a chance to retry; time runs meanwhile
        assert turns < 60, "the summary was never retried"
        await chat.say(f"question {turns}: FACT-{turns} {words(25, turns)}")
        await chat.idle()
        turns += 1
    first, retry = upstream.summary_requests()
    assert "=== EXISTING SUMMARY ===\nNONE\n" in summariser_input(retry)  # nothing kept from the failure
    [summary] = summary_rows(config)
    assert facts_in(summary.text) == list(range(turns - 1))
    assert [re.findall(r"outcome=(\w+)", line) for line in summary_logs(caplog)] == [["failed"], ["applied"]]
    sent = await chat.say("and now?")
    assert sent.summary == summary.text


# --- one fold at a time per session (item 3) -------------------------------------------------------


async def test_concurrent_sessions_never_fold_twice_at_once(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream
) -> None:
    proxy = await start(start_proxy, storage, upstream, summaries=True, overflow="marker")
    config = proxy.app[CONFIG]
    gate = threading.Event()
    upstream.summarizer = gated(gate)
    names = [f"race-{k}" for k in range(4)]

    def folds_of(name: str) -> list[Received]:
        return [r for r in upstream.summary_requests() if f"[{name}]" in summariser_input(r)]

    async def talk(name: str, first: int, turns: int) -> None:
        client = proxy.client(session=name)
        previous: str | None = None
        for turn in range(first, first + turns):
            text = f"[{name}] turn {turn}: FACT-{turn} {words(90, turn)}"
            messages: Any = [SYSTEM, user(text)]
            raw = await client.chat.completions.with_raw_response.create(model="small", messages=messages)
            [received] = [r for r in upstream.chat_requests() if r.messages[-1]["content"] == text]
            check_sent(received, raw.headers, [SYSTEM], [user(text)])
            if previous is not None:  # planned on the session as it is, never on an older snapshot
                assert received.messages[-2] == {"role": "assistant", "content": previous}
            previous = raw.parse().choices[0].message.content

    try:
        # Every session crosses the threshold and keeps talking while its fold is held: each turn
        # after the first crossing asks for a fold again, and none may start.
        await asyncio.gather(*(talk(name, 0, 12) for name in names))
        await until(lambda: all(folds_of(name) for name in names), "every session asked for a summary")
        assert all(len(folds_of(name)) == 1 for name in names)
        # Each fold started at least two turns before the session stopped (the newest three turns
        # are not folded), so those turns did ask again.
        assert all(max(facts_in(summariser_input(folds_of(name)[0]))) <= 12 - 3 - 3 for name in names)
        assert all(summary_rows(config, name) == [] for name in names)
    finally:
        gate.set()
    await proxy.app[SUMMARIZER].wait_idle()
    assert all([s.version for s in summary_rows(config, name)] == [1] for name in names)
    # Talking on, concurrently, folds again, each on top of the session's own previous summary.
    await asyncio.gather(*(talk(name, 12, 12) for name in names))
    await proxy.app[SUMMARIZER].wait_idle()
    for name in names:
        versions = summary_rows(config, name)
        assert [s.version for s in versions] == list(range(1, len(versions) + 1))
        assert len(versions) >= 2
        requests = folds_of(name)
        assert len(requests) == len(versions)  # no fold was wasted on a race
        for request, previous in zip(requests[1:], versions):
            assert f"=== EXISTING SUMMARY ===\n{previous.text}\n" in summariser_input(request)
        assert all(f"[{other}]" not in summariser_input(r) for r in requests for other in names if other != name)


async def talk_until_a_fold_starts(chat: Conversation, config: Config) -> None:
    """Turns until the session crosses its threshold and its background fold has reached the
    summariser (where a gated summariser holds it)."""
    while not chat.upstream.summary_requests():
        await chat.say(f"question {len(chat.history)}: FACT-{len(chat.history)} {words(90)}")
        if stored_tokens(config) > config.memory.chunk_threshold(WINDOW):
            await until(lambda: bool(chat.upstream.summary_requests()), "the fold started")


async def test_manual_compaction_waits_for_a_fold_in_flight_instead_of_racing_it(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream
) -> None:
    proxy = await start(start_proxy, storage, upstream, **SUMMARIES)
    config = proxy.app[CONFIG]
    gate = threading.Event()
    upstream.summarizer = gated(gate)
    chat = Conversation(proxy, upstream)
    try:
        await talk_until_a_fold_starts(chat, config)
        compaction = asyncio.create_task(compact(proxy, "s1"))
        done, _ = await asyncio.wait([compaction], timeout=0.2)  # it has to wait for the held fold
        assert not done
        assert len(upstream.summary_requests()) == 1
    finally:
        gate.set()
    status, body = await compaction
    await chat.idle()
    assert status == 200
    assert body["outcome"] == "nothing"  # the fold it waited for had already done the work
    assert body["summary"]["version"] == 1
    assert len(upstream.summary_requests()) == 1
    assert [s.version for s in summary_rows(config)] == [1]


async def test_callers_waiting_for_a_fold_start_theirs_one_after_another(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="memproxy.summaries")
    proxy = await start(start_proxy, storage, upstream, **SUMMARIES)
    config, summarizer = proxy.app[CONFIG], proxy.app[SUMMARIZER]
    small = config.model("small")
    assert small is not None
    gate = threading.Event()
    upstream.summarizer = gated(gate)
    chat = Conversation(proxy, upstream)
    try:
        await talk_until_a_fold_starts(chat, config)
        for turn in range(4):  # the tail moves on while the fold is held: there is more to fold
            await chat.say(f"more {turn}: FACT-{50 + turn} {words(20, turn)}")
        # Two callers (an overflowing request, a manual compaction) wait for the fold in flight;
        # each reaches its wait without any I/O, so one pass of the loop queues both.
        waiting = [asyncio.create_task(summarizer.fold("a", "s1", small)) for _ in range(2)]
        await asyncio.sleep(0)
        assert not any(task.done() for task in waiting)
        assert len(upstream.summary_requests()) == 1
    finally:
        gate.set()
    results = await asyncio.gather(*waiting)
    await chat.idle()
    # The first waiter folded what the tail left behind; the second found nothing left to do.
    assert sorted(r.outcome for r in results) == ["applied", "nothing"]
    assert len(upstream.summary_requests()) == 2
    outcomes = [re.findall(r"outcome=(\w+)", line)[0] for line in summary_logs(caplog)]
    assert outcomes == ["applied", "applied"]
    assert [s.version for s in summary_rows(config)] == [1, 2]


# --- stale results (item 3) -----------------------------------------------------------------------


async def test_a_fold_of_a_history_edited_meanwhile_is_not_applied(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="memproxy.summaries")
    proxy = await start(start_proxy, storage, upstream, summaries=True, overflow="marker")
    config = proxy.app[CONFIG]
    gate = threading.Event()
    upstream.summarizer = gated(gate)
    chat = Conversation(proxy, upstream, style="full")
    try:
        turn = 0
        while stored_tokens(config) <= config.memory.chunk_threshold(WINDOW):
            await chat.say(f"question {turn}: FACT-{turn} {words(90, turn)}")
            turn += 1
        await until(lambda: bool(upstream.summary_requests()), "the fold started")
        [held] = upstream.summary_requests()
        assert facts_in(summariser_input(held)) == list(range(turn - 3))  # it read the old branch
        # Meanwhile the client edits its second question: everything from there on is superseded,
        # including messages the held fold covers.
        chat.history = chat.history[:2]
        sent = await chat.say("question 1, asked differently: FACT-900")
        assert sent.headers["x-memproxy-reconcile"] == "edit" and sent.summary is None
    finally:
        gate.set()
    await chat.idle()
    assert summary_rows(config) == []  # the stale result was not saved
    assert "outcome=stale " in summary_logs(caplog)[-1]
    sent = await chat.say("and now?")
    assert sent.summary is None and sent.version == 0
    assert facts_in(sent.text()) == [0, 900]  # nothing of the superseded branch
    await chat.idle()


async def test_a_summary_of_messages_edited_later_is_no_longer_used(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream
) -> None:
    proxy = await start(start_proxy, storage, upstream, **SUMMARIES)
    config = proxy.app[CONFIG]
    upstream.summarizer = fact_summariser
    chat = Conversation(proxy, upstream, style="full")
    turn = 0
    while not summary_rows(config):
        await chat.say(f"question {turn}: FACT-{turn} {words(90, turn)}")
        await chat.idle()
        turn += 1
    sent = await chat.say("still there?")
    assert sent.version == 1 and facts_in(sent.summary or "") != []
    chat.history = chat.history[:2]  # an edit of the second question
    sent = await chat.say("question 1, asked differently: FACT-900")
    assert sent.headers["x-memproxy-reconcile"] == "edit"
    assert sent.summary is None and sent.version == 0
    assert facts_in(sent.text()) == [0, 900]
    assert [s.version for s in summary_rows(config)] == [1]  # kept for audit, not used


# --- streaming is never held up by a fold (item 3) --------------------------------------------------


async def test_a_streamed_turn_completes_while_a_fold_is_in_flight(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream
) -> None:
    proxy = await start(start_proxy, storage, upstream, **SUMMARIES)
    config = proxy.app[CONFIG]
    gate = threading.Event()
    upstream.summarizer = gated(gate)
    chat = Conversation(proxy, upstream)
    try:
        turn = 0
        while stored_tokens(config) <= config.memory.chunk_threshold(WINDOW):
            await chat.send([user(f"question {turn}: FACT-{turn} {words(90, turn)}")], stream=True)
            turn += 1
        await until(lambda: bool(upstream.summary_requests()), "the fold started")
        for _ in range(2):  # turns on the very session being folded; a stream waiting for the
            # fold would still be waiting when this gives up (the held summary waits for 30 s)
            sent = await asyncio.wait_for(chat.send([user(f"streamed {turn}")], Reply(content="a streamed answer"),
                                                    stream=True), timeout=10)
            assert sent.unsummarized_omitted == 0 and sent.summary is None
            assert not gate.is_set()  # the stream finished with the fold still held
        assert summary_rows(config) == []
        assert stored(config)[-1] == {"role": "assistant", "content": "a streamed answer"}
    finally:
        gate.set()
    await chat.idle()
    assert [s.version for s in summary_rows(config)] == [1]
    assert len(upstream.summary_requests()) == 1


# --- overflow before a summary covers the turns (item 5) -------------------------------------------


@pytest.mark.parametrize("summaries", ["off", "failing"])
async def test_the_marker_policy_says_how_many_messages_were_left_out(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream, summaries: str
) -> None:
    proxy = await start(start_proxy, storage, upstream, summaries=summaries != "off", overflow="marker",
                        failure_backoff_seconds=3600)
    answers = [Reply(status=500)] * 20 + [Reply(content="Known facts: FACT-0.")]  # one summary, then failures
    upstream.summarizer = lambda _: answers.pop()
    chat = Conversation(proxy, upstream)
    for turn in range(26):
        sent = await chat.say(f"question {turn}: FACT-{turn} {words(90, turn)}")
        await chat.idle()
        assert (sent.marker is not None) == (sent.unsummarized_omitted > 0)
    marked = [sent for sent in chat.sent if sent.marker]
    assert len(marked) >= 5
    # The marker sits right after the system prompt (and the summary, if any): `check_sent` finds
    # it there, its count is what no summary covers and was not sent, and the budget counts it.
    for sent in marked:
        position = 2 if sent.summary is not None else 1
        assert MARKER.search(str(sent.messages[position]["content"]))
        assert "not shown" in str(sent.messages[position]["content"])
    if summaries == "failing":
        assert summary_rows(proxy.app[CONFIG]) != []
        assert any(sent.summary is not None for sent in marked)  # summary, then marker
        assert len(upstream.summary_requests()) == 2  # one success, one failure, then the backoff
    else:
        assert upstream.summary_requests() == []


async def test_the_drop_policy_leaves_turns_out_without_a_marker(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream
) -> None:
    proxy = await start(start_proxy, storage, upstream, summaries=False, overflow="drop")
    chat = Conversation(proxy, upstream)
    for turn in range(20):
        await chat.say(f"question {turn}: {words(90, turn)}")
    dropped = [sent for sent in chat.sent if sent.unsummarized_omitted]
    assert len(dropped) >= 5
    assert all(sent.marker is None and sent.summary is None for sent in chat.sent)
    assert all([m["role"] for m in sent.messages].count("system") == 1 for sent in chat.sent)


async def test_the_summarize_policy_folds_before_answering(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream
) -> None:
    # No background fold ever: the threshold is out of reach, so only the overflow folds.
    proxy = await start(start_proxy, storage, upstream, **SUMMARIES, chunk_threshold_tokens=1_000_000)
    config = proxy.app[CONFIG]
    upstream.summarizer = fact_summariser
    chat = Conversation(proxy, upstream)
    for turn in range(24):
        sent = await chat.say(f"question {turn}: FACT-{turn} {words(90, turn)}")
        await chat.idle()
        assert sent.unsummarized_omitted == 0 and sent.marker is None  # nothing ever lost
    folded_at = next(i for i, sent in enumerate(chat.sent) if sent.summary is not None)
    first = chat.sent[folded_at]
    assert first.version == 1 and folded_at > 0
    # Without the summary that request could not have carried the whole history.
    assert request_tokens(COUNTER, [SYSTEM, *chat.history[: 2 * folded_at + 1]], []) > BUDGET
    assert stored_tokens(config) > 2 * BUDGET
    # The summary was written while this very request waited, and is in it.
    order = [id(r) for r in upstream.received]
    [request] = [r for r in upstream.chat_requests() if r.messages == first.messages]
    assert order.index(id(upstream.summary_requests()[0])) < order.index(id(request))
    versions = summary_rows(config)
    assert len(versions) >= 2 and len(upstream.summary_requests()) == len(versions)
    assert set(range(6)) <= set(facts_in(chat.sent[-1].summary or ""))


async def test_the_summarize_policy_gives_up_waiting_after_its_timeout(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream
) -> None:
    proxy = await start(start_proxy, storage, upstream, **SUMMARIES, chunk_threshold_tokens=1_000_000,
                        sync_summary_timeout_seconds=0.2)
    config = proxy.app[CONFIG]
    gate = threading.Event()
    upstream.summarizer = gated(gate)
    chat = Conversation(proxy, upstream)
    try:
        sent = None
        for turn in range(24):
            sent = await chat.say(f"question {turn}: FACT-{turn} {words(90, turn)}")
            if upstream.summary_requests():
                break
        # The request that needed the summary was answered without it, with a marker instead.
        assert sent is not None and sent.marker is not None and sent.summary is None
        assert sent.unsummarized_omitted > 0
        assert not gate.is_set() and summary_rows(config) == []
    finally:
        gate.set()
    await chat.idle()  # the fold was not abandoned: it completes in the background
    [summary] = summary_rows(config)
    assert summary.covers >= sent.unsummarized_omitted
    sent = await chat.say("and now?")
    assert sent.summary == summary.text and sent.marker is None


@pytest.mark.parametrize("case", ["upstream error", "not smaller"])
async def test_the_summarize_policy_backs_off_after_a_rejected_fold_instead_of_retrying_every_turn(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream, case: str
) -> None:
    # Only the overflow folds (the threshold is out of reach); each overflowing turn would ask again.
    proxy = await start(start_proxy, storage, upstream, **SUMMARIES, chunk_threshold_tokens=1_000_000,
                        failure_backoff_seconds=3600)
    upstream.summarizer = REJECTED[case][0]
    chat = Conversation(proxy, upstream)
    overflowing = []
    for turn in range(20):
        sent = await chat.say(f"question {turn}: FACT-{turn} {words(90, turn)}")
        await chat.idle()
        if sent.unsummarized_omitted:
            overflowing.append(sent)
    assert len(overflowing) >= 5
    assert len(upstream.summary_requests()) == 1  # the first overflow asked; the backoff held the rest
    assert summary_rows(proxy.app[CONFIG]) == []
    # Turns were never lost without a trace: every request that left some out said how many.
    assert all(sent.marker == sent.unsummarized_omitted for sent in overflowing)


async def test_with_summaries_off_the_summarize_policy_falls_back_to_the_marker(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream
) -> None:
    proxy = await start(start_proxy, storage, upstream, summaries=False, overflow="summarize")
    upstream.summarizer = fact_summariser
    chat = Conversation(proxy, upstream)
    for turn in range(20):
        sent = await chat.say(f"question {turn}: FACT-{turn} {words(90, turn)}")
        await chat.idle()
    assert upstream.summary_requests() == [] and summary_rows(proxy.app[CONFIG]) == []
    assert sent.unsummarized_omitted > 0 and sent.marker == sent.unsummarized_omitted


@pytest.mark.parametrize("overflow", ["summarize", "marker", "drop"])
async def test_a_summary_that_no_longer_fits_is_left_out_rather_than_refusing(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream, overflow: str
) -> None:
    proxy = await start(start_proxy, storage, upstream, summaries=True, overflow=overflow)
    upstream.summarizer = fact_summariser
    chat = Conversation(proxy, upstream)
    turn = 0
    while not summary_rows(proxy.app[CONFIG]):
        await chat.say(f"question {turn}: FACT-{turn} {words(90, turn)}")
        await chat.idle()
        turn += 1
    [summary] = summary_rows(proxy.app[CONFIG])
    room = COUNTER.message(marker_message(100)) + 1  # for a marker beside the new message
    size = 1500
    while request_tokens(COUNTER, [SYSTEM, user(words(size))], []) > BUDGET - room:
        size -= 1
    assert BUDGET - request_tokens(COUNTER, [SYSTEM, user(words(size))], []) < summary.tokens
    sent = await chat.say(words(size))  # fits alone, not with the summary
    assert sent.summary is None
    markers = [str(m["content"]) for m in sent.messages if MARKER.search(str(m.get("content")))]
    if overflow == "drop":
        assert markers == [] and sent.marker is None
    else:  # what was left out is counted, and not called unsummarised: the summary stands for it
        assert sent.marker == int(sent.headers["x-memproxy-stored-omitted"]) >= summary.covers
        assert len(markers) == 1 and "summarised" not in markers[0]
    sent = await chat.say("short again")
    assert sent.summary is not None


# --- manual compaction (item 7) --------------------------------------------------------------------



async def test_compaction_folds_everything_but_the_tail_now(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="memproxy.summaries")
    proxy = await start(start_proxy, storage, upstream, **SUMMARIES, chunk_threshold_tokens=1_000_000)
    config = proxy.app[CONFIG]
    upstream.summarizer = fact_summariser
    chat = Conversation(proxy, upstream)
    for turn in range(7):
        await chat.say(f"question {turn}: FACT-{turn} {words(40, turn)}")
    assert upstream.summary_requests() == []  # below the threshold: only a compaction folds now
    before = stored(config)

    status, body = await compact(proxy, "s1", body={"model": "small"})
    assert status == 200, body
    [summary] = summary_rows(config)
    assert body["object"] == "session.compaction" and body["session_id"] == "s1"
    assert body["outcome"] == "applied"
    assert body["messages_folded"] == summary.covers == len(chat.history) - 6  # the newest 3 turns stay
    assert body["summary"]["version"] == summary.version == 1
    assert body["summary"]["text"] == summary.text == fact_summary(range(4))
    assert body["summary"]["covers_messages"] == summary.covers
    assert body["summary"]["tokens"] == summary.tokens == body["tokens_after"]
    assert body["summary"]["model"] == "small"
    assert body["tokens_before"] == summary.replaced_tokens > body["tokens_after"]
    assert body["tokens_before"] == sum(COUNTER.message(m) for m in chat.history[: summary.covers])
    assert stored(config) == before  # the history itself is never rewritten
    assert "outcome=applied " in summary_logs(caplog)[-1]

    # Nothing new to fold: nothing asked of the summariser, the summary in use is returned.
    status, body = await compact(proxy, "s1")  # no body: the session's own model sizes the tail
    assert status == 200
    assert body["outcome"] == "nothing" and body["messages_folded"] == 0
    assert body["summary"]["version"] == 1
    assert len(upstream.summary_requests()) == 1

    sent = await chat.say("next question")
    assert sent.summary == summary.text and sent.version == 1 and sent.summarized == summary.covers
    assert sent.history == chat.history[summary.covers : -2]


async def test_compaction_and_preview_without_a_model_are_sized_for_the_sessions_own(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream
) -> None:
    proxy = await start(start_proxy, storage, upstream, **SUMMARIES, chunk_threshold_tokens=1_000_000)
    config = proxy.app[CONFIG]
    assert config.memory.summarizer_model == "small"
    upstream.summarizer = fact_summariser
    chat = Conversation(proxy, upstream, model="big", budget=100_000 - 1000 - 20)
    for turn in range(6):  # three of these turns exceed the small model's verbatim tail, not big's
        await chat.say(f"question {turn}: FACT-{turn} {words(400, turn)}")
    assert request_tokens(COUNTER, chat.history[-6:], []) > config.memory.tail_token_limit(WINDOW)
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {PROXY_KEY}"}) as http:
        async with http.get(f"{proxy.url}/sessions/s1/context") as response:
            assert response.status == 200
            assert (await response.json())["model"] == "big"
    status, body = await compact(proxy, "s1")
    assert status == 200 and body["outcome"] == "applied"
    assert body["messages_folded"] == len(chat.history) - 6  # big's tail: the newest 3 turns


async def test_compaction_of_an_unknown_or_foreign_session_is_not_found(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream
) -> None:
    proxy = await start(start_proxy, storage, upstream, **SUMMARIES)
    upstream.summarizer = fact_summariser
    chat = Conversation(proxy, upstream, "mine")
    for turn in range(5):
        await chat.say(f"question {turn}: {words(40, turn)}")
    bodies = []
    for session, key in (("nobody", PROXY_KEY), ("mine", OTHER_KEY)):
        status, body = await compact(proxy, session, key=key)
        assert status == 404
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "code", "param"}
        assert body["error"]["code"] == "session_not_found"
        bodies.append(json.dumps(body).replace(session, "ID"))
    assert bodies[0] == bodies[1]  # another tenant's session is not even confirmed to exist
    assert upstream.summary_requests() == []
    assert summary_rows(proxy.app[CONFIG], "mine") == []


async def test_compaction_with_a_failing_summariser_is_a_502_and_changes_nothing(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream
) -> None:
    proxy = await start(start_proxy, storage, upstream, **SUMMARIES, chunk_threshold_tokens=1_000_000)
    config = proxy.app[CONFIG]
    upstream.summarizer = lambda _: Reply(status=500, error_message="the summariser is down")
    chat = Conversation(proxy, upstream)
    for turn in range(6):
        await chat.say(f"question {turn}: {words(40, turn)}")
    before = stored(config)
    status, body = await compact(proxy, "s1", body={"model": "small"})
    assert status == 502
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "code", "param"}
    assert body["error"]["code"] == "summarization_failed"
    assert summary_rows(config) == [] and stored(config) == before
    sent = await chat.say("still fine?")
    assert sent.summary is None and sent.history == chat.history[:-2]


async def test_every_summary_version_is_kept_for_audit(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream
) -> None:
    proxy = await start(start_proxy, storage, upstream, **SUMMARIES, chunk_threshold_tokens=1_000_000)
    config = proxy.app[CONFIG]
    upstream.summarizer = fact_summariser
    chat = Conversation(proxy, upstream)
    answers = []
    for round_ in range(3):
        for turn in range(4):
            await chat.say(f"round {round_} turn {turn}: FACT-{10 * round_ + turn} {words(30, turn)}")
        status, body = await compact(proxy, "s1", body={"model": "small"})
        assert status == 200 and body["outcome"] == "applied"
        answers.append(body["summary"])
    versions = summary_rows(config)
    assert [s.version for s in versions] == [1, 2, 3]
    assert [(s.version, s.text, s.covers, s.tokens) for s in versions] == [
        (a["version"], a["text"], a["covers_messages"], a["tokens"]) for a in answers]
    assert versions[0].covers < versions[1].covers < versions[2].covers
    for version, rounds in zip(versions, (1, 2, 3)):  # each folds all but the newest 3 turns so far
        turns = [10 * r + t for r in range(rounds) for t in range(4)]
        assert facts_in(version.text) == turns[:-3]
    sent = await chat.say("which one is used?")
    assert sent.version == 3 and sent.summary == versions[2].text


# --- the summariser's own window (item 3) ----------------------------------------------------------


TIGHT_CAP = 128
TIGHT_COUNTER = TiktokenCounter(encoding_name_for("openai/tight"))
BIG_OUTPUT = f"FACT-777 {words(400, 1)} FACT-778 {words(400, 2)} FACT-779"


def near_cap_summariser(received: Received) -> Reply:
    """A faithful summary padded to just under the cap, as a real model may write."""
    text = fact_summary(facts_in(summariser_input(received)))
    n = 0
    while TIGHT_COUNTER.text(f"{text} Notes: {words(n + 1)}") < TIGHT_CAP - 4:
        n += 1
    return Reply(content=f"{text} Notes: {words(n)}")


async def agent_session_compacted(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream, window: int,
    summariser: Callable[[Received], Reply],
) -> tuple[Config, Any, list[Received], list[StoredSummary]]:
    """A session that read a big file early on, then talked on; compacted with a summariser model
    "tight" of `window` tokens. Returns the config, the compaction's answer, the summariser requests
    and the summary versions; checks that every summariser request fit the window."""
    config = make_config(storage, upstream.url, **{**SUMMARIES, "overflow": "drop"},
                         summarizer_model="tight", chunk_threshold_tokens=1_000_000, summary_max_tokens=TIGHT_CAP)
    tight = ModelConfig(name="tight", model="openai/tight", api_base=upstream.url, api_key="upstream-secret",
                        context_window=window, max_output_tokens=100)
    config = replace(config, models=(*config.models, tight))
    proxy: Proxy = await start_proxy(config)
    upstream.summarizer = summariser
    chat = Conversation(proxy, upstream)
    call = tool_call("call_read", json.dumps({"q": "the whole file"}))
    await chat.say("question 0: FACT-0 read the file", Reply(tool_calls=[call]))
    await chat.send([tool_result(call["id"], BIG_OUTPUT)], check=False)
    for turn in range(1, 20):
        await chat.say(f"question {turn}: FACT-{turn} {words(80, turn)}")
    assert stored_tokens(config) > 3 * window
    status, body = await compact(proxy, "s1", body={"model": "small"})
    assert status == 200 and body["outcome"] == "applied", body
    requests = upstream.summary_requests()
    for request in requests:
        assert request.body["model"] == "tight"
        needed = request_tokens(TIGHT_COUNTER, request.messages, []) + int(request.body["max_tokens"])
        assert needed <= window, f"a summariser request needs {needed} tokens"
    assert tool_result(call["id"], BIG_OUTPUT) in stored(config)  # the store keeps all of it
    return config, body, requests, summary_rows(config)


async def test_the_summariser_input_fits_its_own_window_in_several_chunks(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream
) -> None:
    # Summaries written near their cap: the later chunks carry a bigger previous summary.
    config, body, requests, versions = await agent_session_compacted(
        start_proxy, storage, upstream, 1200, near_cap_summariser)
    assert len(requests) == len(versions) >= 3  # folded in several chunks, each saved
    assert [s.version for s in versions] == list(range(1, len(versions) + 1))
    assert body["summary"]["version"] == versions[-1].version
    assert body["messages_folded"] == versions[-1].covers
    for request, previous in zip(requests[1:], versions):
        assert f"=== EXISTING SUMMARY ===\n{previous.text}\n" in summariser_input(request)
    # The huge tool output went in cut short, its head and tail around a note of what was left out.
    [with_output] = [r for r in requests if "FACT-777" in new_part(r)]
    assert "FACT-779" in new_part(with_output) and "FACT-778" not in new_part(with_output)
    assert re.search(r"\d+ characters left out", new_part(with_output))
    assert all("FACT-778" not in summariser_input(r) for r in requests)
    assert {0, 777, 779, *range(1, 17)} <= set(facts_in(versions[-1].text))


async def test_a_unit_too_big_for_one_summariser_request_is_cut_and_the_fold_still_applies(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream
) -> None:
    # A window so small that even the trimmed tool output exceeds a chunk: it is cut again to fit,
    # and the short question before it is folded with it, not alone (a summary of one short
    # message cannot be smaller than it, and would fail the whole fold).
    _, body, requests, versions = await agent_session_compacted(
        start_proxy, storage, upstream, 900, fact_summariser)
    assert len(requests) == len(versions) >= 3
    [with_output] = [r for r in requests if "FACT-777" in new_part(r)]
    assert "FACT-0 read the file" in new_part(with_output)
    assert body["summary"]["version"] == versions[-1].version
    assert {0, 777, 779, *range(1, 17)} <= set(facts_in(versions[-1].text))
