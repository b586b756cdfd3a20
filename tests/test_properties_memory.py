"""Property tests of context building with all of memory on: summaries, overflow, trimming, dedupe.

Hypothesis writes random agent conversations: user messages of random length or pastes of one of a
few files, rounds of 1-3 parallel tool calls whose outputs are random (often far over
`tool_output_max_tokens`) or the contents of those same files, and a random `max_tokens` per
request, played through the real proxy with the SDK by a client that resends the whole history or
one that sends only the new turn. A deterministic fake summariser answers the summary requests; the
overflow policy is "marker" or "summarize".

Every request either reaches the upstream fitting the budget exactly as reported, or is refused with
400 `context_length_exceeded` without calling the upstream or storing anything, and that happens
exactly when the mandatory part (system, tools, new messages and the stored call new tool results
answer) cannot fit. What reaches the upstream is, in order: the system prompt; the summary, framed as
background, when one is in use; a marker counting the unsummarised messages left out, if any; the
newest stored messages, from a unit boundary, the newest exchange verbatim and older ones in their
compact form with repeats sent once (checked against an independent oracle); no orphan tool result
and no unanswered call; and the new messages verbatim and last. No unit that would still have fit
was left out.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import openai
import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from conftest import Proxy, make_config
from db import table_rows
from fake_upstream import FakeUpstream, Received, Reply
from helpers import assistant_from, pinned_question
from memproxy.config import Config, StorageConfig
from memproxy.memory.shrink import trimmed_tool_output
from memproxy.tokens import request_tokens
from memproxy.typedefs import CONFIG, SUMMARIZER
from test_budget import (
    COUNTER,
    DEFAULT_RESERVE,
    MARGIN,
    TOOLS,
    WINDOW,
    Message,
    assert_context_length_exceeded,
    assert_tool_units_whole,
    mandatory_tail,
    tool_call,
    without_none,
    words,
)
from test_compaction import assert_preview_of

pytestmark = pytest.mark.both_stores

POLICIES: dict[str, dict[str, Any]] = {
    # overflow policy -> memory settings; the limits differ so both sides of each are exercised
    "marker": {"tool_output_max_tokens": 100, "dedupe_min_tokens": 50},
    "summarize": {"tool_output_max_tokens": 64, "dedupe_min_tokens": 10},
}
SUMMARY = "Earlier: the user asked for several files and tools; " + words(20, 9)
SUMMARY_OPENING = "Summary of the earlier conversation, for background only"
MARKER = re.compile(r"\[(\d+) earlier messages "
                    r"(?:of this conversation are not shown here: [^\]]*|are not shown here\.)\]")
FILES = [f"file {k}.txt:\n{words(n, 11 + k)}" for k, n in enumerate((20, 40, 150, 500))]
SAME_ANSWER = f"Done. {words(60, 5)}"  # an answer given more than once (never deduplicated)


def fixed_summariser(received: Received) -> Reply:
    return Reply(content=SUMMARY)


@dataclass(frozen=True)
class Content:
    file: int | None  # the contents of FILES[file], or else
    words: int  # a unique text of this many words


@dataclass(frozen=True)
class Round:
    outputs: tuple[Content, ...]  # one per parallel call
    max_tokens: int | None  # of the request that sends this round's results


@dataclass(frozen=True)
class Turn:
    user: Content
    max_tokens: int | None
    rounds: tuple[Round, ...]
    same_answer: bool


@dataclass(frozen=True)
class Script:
    style: str  # "full": resends the whole history; "new": sends only the new turn
    policy: str
    system_words: int | None
    salt: int
    turns: tuple[Turn, ...]


max_tokens = st.one_of(st.none(), st.none(), st.integers(1, 1700), st.integers(1, WINDOW + 100))
files = st.integers(0, len(FILES) - 1)


def contents(largest: int) -> st.SearchStrategy[Content]:
    return st.one_of(st.builds(Content, files, st.just(0)), st.builds(Content, st.none(), st.integers(0, largest)))


rounds = st.builds(Round, st.lists(contents(800), min_size=1, max_size=3).map(tuple), max_tokens)
turns = st.builds(Turn, contents(300), max_tokens, st.lists(rounds, max_size=2).map(tuple), st.booleans())
scripts = st.builds(
    Script,
    st.sampled_from(["full", "new"]),
    st.sampled_from(sorted(POLICIES)),
    st.one_of(st.none(), st.integers(0, 200)),
    st.integers(0, 1000),
    st.lists(turns, min_size=1, max_size=6).map(tuple),
)


def store_state(config: Config) -> dict[str, list[tuple[Any, ...]]]:
    """Every row the proxy has stored, summaries included, read from a second connection."""
    return table_rows(config, "sessions", "messages", "turns", "summaries")


def text_of(message: Message) -> str | None:
    content = message.get("content")
    return content if isinstance(content, str) else None


class Client:
    """Plays a script against the proxy and checks every request it makes."""

    def __init__(self, proxy: Proxy, upstream: FakeUpstream, script: Script) -> None:
        self.proxy = proxy
        self.client = proxy.clients[0] if proxy.clients else proxy.client(session=None)
        self.upstream = upstream
        self.config: Config = proxy.app[CONFIG]
        self.script = script
        self.memory = POLICIES[script.policy]
        self.limit: int = self.memory["tool_output_max_tokens"]
        self.session = f"mem-{uuid.uuid4().hex}"
        self.system: list[Message] = []
        if script.system_words is not None:
            self.system = [{"role": "system", "content": f"system: {words(script.system_words, script.salt)}"}]
        self.history: list[Message] = []  # what the proxy has stored, as the client echoes it
        self.summaries_checked = 0

    def render(self, content: Content, tag: str) -> str:
        if content.file is not None:
            return FILES[content.file]
        return f"{tag}: {words(content.words, self.script.salt + len(tag))}"

    async def play(self) -> None:
        for t, turn in enumerate(self.script.turns):
            replies = [Reply(tool_calls=[tool_call(f"call_{t}_{r}_{k}") for k in range(len(round_.outputs))])
                       for r, round_ in enumerate(turn.rounds)]
            replies.append(Reply(content=SAME_ANSWER if turn.same_answer else f"answer {t}: {words(20, t)}"))
            user = {"role": "user", "content": self.render(turn.user, f"turn {t}")}
            if not await self.exchange([user], turn.max_tokens, replies[0]):
                continue
            for r, round_ in enumerate(turn.rounds):
                asked = replies[r].tool_calls or []
                results = [{"role": "tool", "tool_call_id": call["id"], "content": self.render(c, f"out {call['id']}")}
                           for call, c in zip(asked, round_.outputs)]
                if await self.exchange(results, round_.max_tokens, replies[r + 1]):
                    continue
                short = [{**m, "content": "too long to show"} for m in results]
                if not await self.exchange(short, None, replies[r + 1]):
                    event("conversation ended: a call cannot be answered within the window")
                    return

    async def exchange(self, new: list[Message], reserve: int | None, reply: Reply) -> bool:
        """One request; True if it went upstream, False if it was refused as too long."""
        refused, budget = self.oracle(new, reserve)
        history = self.history if self.script.style == "full" else []
        params: dict[str, Any] = {} if reserve is None else {"max_tokens": reserve}
        headers = {"X-Session-Id": self.session}
        if self.script.style == "new":  # else a repeated first message would read as a regeneration
            headers["X-Memproxy-History"] = "new"
        calls, state = len(self.upstream.chat_requests()), store_state(self.config)
        if not refused:
            self.upstream.enqueue(reply)
        try:
            raw = await self.client.chat.completions.with_raw_response.create(
                model="small", messages=[*self.system, *history, *new], tools=TOOLS,  # type: ignore[arg-type, list-item]
                extra_headers=headers, **params)
        except openai.BadRequestError as exc:
            assert refused, f"refused though the mandatory part fits: {exc.response.text}"
            assert_context_length_exceeded(exc)
            assert len(self.upstream.chat_requests()) == calls, "refused after calling upstream"
            assert store_state(self.config) == state, "a refused request changed the store"
            event("refused")
            return False
        assert not refused, "sent though the mandatory part cannot fit"
        raw.parse()
        requests = self.upstream.chat_requests()
        assert len(requests) == calls + 1
        self.check_sent(requests[-1], raw.headers, new, budget)
        self.history += [*new, assistant_from(reply)]
        await self.proxy.app[SUMMARIZER].wait_idle()
        self.check_summary_requests()
        return True

    def oracle(self, new: list[Message], reserve: int | None) -> tuple[bool, int]:
        """Whether the request must be refused, and its input budget."""
        if reserve is not None and reserve >= WINDOW:
            return True, 0
        budget = WINDOW - (reserve or DEFAULT_RESERVE) - MARGIN
        return self.mandatory(new) > budget, budget

    def mandatory(self, new: list[Message]) -> int:
        must = mandatory_tail(self.history, new)
        return (request_tokens(COUNTER, [*self.system, *new], TOOLS)
                + sum(COUNTER.message(m) for m in self.history[len(self.history) - must:]))

    def compact(self, message: Message) -> Message:
        """How an older stored message is sent, before deduplication."""
        trimmed = trimmed_tool_output(message, self.limit, COUNTER)
        if trimmed is None:
            return message
        assert_preview_of(trimmed, message["content"], self.limit)
        return trimmed

    def expected_history(self, start: int, exchange_start: int) -> tuple[list[Message], int, int, int]:
        """The stored messages from `start` as they must be sent, how many were trimmed and
        deduplicated, and the tokens deduplication saved."""
        out: list[Message] = []
        seen: set[str] = set()
        trimmed = deduplicated = saved = 0
        for j in range(start, len(self.history)):
            message = self.history[j]
            if j >= exchange_start:
                out.append(message)
                continue
            body = self.compact(message)
            text, count = text_of(body), COUNTER.message(body)
            if message["role"] != "assistant" and text is not None and count >= self.memory["dedupe_min_tokens"]:
                if text in seen:
                    reference = {**body, "content": f"[The same {len(text)} characters as an earlier message "
                                                    "above; not repeated.]"}
                    if COUNTER.message(reference) < count:
                        out.append(reference)
                        deduplicated += 1
                        saved += count - COUNTER.message(reference)
                        continue
                seen.add(text)
            out.append(body)
            trimmed += body is not message
        return out, trimmed, deduplicated, saved

    def check_sent(self, sent: Received, headers: Mapping[str, str], new: list[Message], budget: int) -> None:
        messages = sent.messages
        counted = request_tokens(COUNTER, messages, TOOLS)
        assert int(headers["x-memproxy-context-tokens"]) == counted, "the reported count is not exact"
        assert counted <= budget
        assert int(headers["x-memproxy-input-budget"]) == budget
        base = len(self.history)

        # The prefix: system prompt, summary framed as background, marker.
        assert messages[: len(self.system)] == self.system, "the system prompt is not first"
        i = len(self.system)
        version, covers = int(headers["x-memproxy-summary-version"]), int(headers["x-memproxy-summarized"])
        summary_tokens = 0
        if version:
            summary = messages[i]
            assert summary["role"] == "system"
            assert summary["content"].startswith(SUMMARY_OPENING) and summary["content"].endswith(SUMMARY)
            summary_tokens = COUNTER.message(summary)
            i += 1
            event("a summary was sent")
        else:
            assert covers == 0
        unsummarised = int(headers["x-memproxy-unsummarized-omitted"])
        marker = MARKER.fullmatch(str(messages[i].get("content"))) if messages[i]["role"] == "system" else None
        if marker:
            assert int(marker[1]) == unsummarised > 0
            i += 1
            event("a marker was sent")
        elif unsummarised:
            # Unsummarised messages left out without a marker only when not even the short one fits.
            marker_tokens = COUNTER.message(_marker(base, short=True))
            assert self.mandatory(new) + summary_tokens + marker_tokens > budget
            event("left out without a marker: not even the marker fits")

        # The stored messages sent, then the new ones.
        rest = messages[i:]
        assert all(m["role"] not in ("system", "developer") for m in rest)
        assert rest[len(rest) - len(new):] == new, "the new messages are not last and verbatim"
        assert_tool_units_whole(rest)
        sent_history = rest[: len(rest) - len(new)]
        included = len(sent_history)
        users = [j for j, m in enumerate(self.history) if m["role"] == "user"]
        exchange_start = base if any(m["role"] == "user" for m in new) else (users[-1] if users else 0)
        # An agent loop whose exchange does not fit whole: its question goes first, verbatim.
        question = pinned_question(sent_history, self.history, new)
        if question is not None:
            sent_history = sent_history[1:]
            event("an agent loop's question sent ahead of its kept turns")
        start = base - len(sent_history)
        assert start >= covers, "a summarised message was sent again"
        asked = int(question is not None)
        assert int(headers["x-memproxy-stored-included"]) == included
        assert int(headers["x-memproxy-stored-omitted"]) == start - asked
        assert unsummarised == start - covers - int(question is not None and question >= covers)
        if question is None and users and exchange_start < start:  # the question left out: not even it fits
            least_marker = COUNTER.message(_marker(base, short=True))
            assert self.mandatory(new) + summary_tokens + COUNTER.message(self.history[exchange_start]) \
                + least_marker > budget, "an agent loop's question that fits was left out"
        expected, trimmed, deduplicated, saved = self.expected_history(start, exchange_start)
        assert [without_none(m) for m in sent_history] == [without_none(m) for m in expected]
        assert int(headers["x-memproxy-tool-outputs-trimmed"]) == trimmed
        assert int(headers["x-memproxy-deduplicated"]) == deduplicated
        if trimmed:
            event("older tool outputs trimmed")
        if deduplicated:
            event("repeats deduplicated")
        if start < exchange_start < base and any(m["role"] == "tool" for m in self.history[exchange_start:]):
            event("agent loop: its own tool outputs sent in full")

        # No whole unit that would still have fit was left out (compact forms counted, before
        # deduplication, with the room the largest marker would take). Kept history that opens
        # with a user message (or is the newest exchange alone, which does) may leave out units
        # that would open it with the assistant: from the nearest user message left out, nothing
        # would have fit.
        opens_with_user = start == exchange_start or (start < base and self.history[start]["role"] == "user")
        users_out = [j for j in range(covers, start) if self.history[j]["role"] == "user"]
        if start > covers and (users_out or not opens_with_user):
            unit = users_out[-1] if opens_with_user else \
                max(j for j in range(start) if self.history[j]["role"] != "tool")
            cost = sum(COUNTER.message(self.history[j] if j >= exchange_start else self.compact(self.history[j]))
                       for j in range(unit, start))
            # The room the fit held for the marker it sent: its estimate, the long form or the short one.
            held = _marker(base, short=marker is not None and "of this conversation" not in marker[0])
            slack = saved + (COUNTER.message(held) - COUNTER.message(messages[i - 1]) if marker else 0)
            assert counted + slack + cost > budget, "an older unit that fits was left out"
            event("older history left out")

    def check_summary_requests(self) -> None:
        """The summariser's own requests fit its window (model "small")."""
        requests = self.upstream.summary_requests()
        for request in requests[self.summaries_checked:]:
            needed = request_tokens(COUNTER, request.messages, []) + int(request.body["max_tokens"])
            assert needed <= WINDOW, f"a summary request needs {needed} tokens"
            event("summary requested")
        self.summaries_checked = len(requests)


def _marker(left_out: int, short: bool = False) -> Message:
    if short:
        return {"role": "system", "content": f"[{left_out} earlier messages are not shown here.]"}
    return {"role": "system", "content": f"[{left_out} earlier messages of this conversation are not shown "
                                         "here: they did not fit in the context window and have not been "
                                         "summarised yet.]"}


@pytest.fixture
def proxies() -> dict[str, Proxy]:
    """One proxy per overflow policy, started on first use and shared by the examples of a test."""
    return {}


@settings(max_examples=30, deadline=None, database=None,
          phases=[Phase.explicit, Phase.generate, Phase.shrink],  # "explain" replays hundreds of runs
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(script=scripts)
async def test_every_request_fits_with_memory_on_or_is_refused_up_front(
    make_storage: Callable[..., StorageConfig], start_proxy: Any, upstream: FakeUpstream, proxies: dict[str, Proxy],
    script: Script
) -> None:
    upstream.reset()  # a shrinking run may have left replies behind
    upstream.summarizer = fixed_summariser
    if script.policy not in proxies:
        config = make_config(make_storage(script.policy), upstream.url, summaries=True,
                             overflow=script.policy, **POLICIES[script.policy])
        proxies[script.policy] = await start_proxy(config)
    await Client(proxies[script.policy], upstream, script).play()


@settings(max_examples=200, deadline=None, database=None)
@given(
    text=st.one_of(st.text(max_size=6000), st.builds(words, st.integers(0, 3000), st.integers(0, 17))),
    limit=st.integers(64, 600),
    role=st.sampled_from(["tool", "function", "user", "assistant"]),
)
def test_trimming_is_bounded_and_idempotent(text: str, limit: int, role: str) -> None:
    message: Message = {"role": role, "content": text, **({"tool_call_id": "call_1"} if role == "tool" else {})}
    trimmed = trimmed_tool_output(message, limit, COUNTER)
    if role not in ("tool", "function") or COUNTER.text(text) <= limit:
        assert trimmed is None
        return
    assert trimmed is not None
    event("trimmed")
    assert_preview_of(trimmed, text, limit)  # head and tail of the original, the full size, under the limit
    assert {k: v for k, v in trimmed.items() if k != "content"} == {k: v for k, v in message.items() if k != "content"}
    assert trimmed_tool_output(trimmed, limit, COUNTER) is None
