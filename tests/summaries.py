"""What the tests of rolling summaries (issue 3) share: fake summarisers, the checks of every request.

The modules test_summaries, test_summary_races, test_summary_overflow and test_manual_compaction
drive rolling summaries end to end through the real proxy.

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

import json
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
from conftest import PROXY_KEY, Proxy, make_config
from fake_upstream import FakeUpstream, Received, Reply
from memproxy.config import Config, StorageConfig
from memproxy.tokens import TiktokenCounter, encoding_name_for, request_tokens
from memproxy.typedefs import CONFIG, SUMMARIZER
from test_budget import assert_tool_units_whole, without_none, words

Message = dict[str, Any]
StartProxy = Callable[[Config], Any]

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
        return await self.send([helpers.user(text)], reply)

    async def idle(self) -> None:
        await self.proxy.app[SUMMARIZER].wait_idle()


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


# --- summaries rejected (tests of folds and of the overflow policies) -------------------------------


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
    # A refusal written as the answer: short, so smaller than anything it would replace.
    "refused": (lambda _: Reply(content="I'm sorry, but I can't help with that."), {}, "discarded", "refused"),
    "refused, curly": (lambda _: Reply(content="I\u2019m unable to summarize this conversation."), {},
                       "discarded", "refused"),
    # A summary a content filter stopped short: what it left out is lost, as with a cut-off one.
    "content filter": (lambda r: replace(fact_summariser(r), finish_reason="content_filter"), {},
                       "discarded", "cut-off"),
}
