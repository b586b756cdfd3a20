"""Rolling summaries (issue 3, item 3): one fold at a time per session, stale results never applied,
and streamed turns never held up by a fold in flight (a summariser held on a gate).

The fake upstream plays the chat model and the summariser; every forwarded request is recounted and
checked against the budget, the order and the `summaries` table (`tests/summaries.py`).
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from collections.abc import Awaitable, Callable
from typing import Any, cast

import pytest

from conftest import Proxy
from fake_upstream import FakeUpstream, Received, Reply
from helpers import until, user
from memproxy.concurrency import BackgroundTasks
from memproxy.config import Config, StorageConfig
from memproxy.memory.summaries import Summarizer
from memproxy.store import StoredMessage, TurnStore
from memproxy.typedefs import CONFIG, PROVIDER, STORE, SUMMARIZER
from summaries import (
    Conversation,
    SUMMARIES,
    SYSTEM,
    StartProxy,
    WINDOW,
    check_sent,
    compact,
    fact_summariser,
    facts_in,
    gated,
    start,
    stored,
    stored_tokens,
    summariser_input,
    summary_logs,
    summary_rows,
)
from test_budget import words

pytestmark = pytest.mark.both_stores


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


async def test_background_summaries_run_a_few_at_once_and_the_rest_fold_later(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream
) -> None:
    """Each background fold holds its session's history until the summariser answers: with a slow
    summariser, a burst of sessions over their thresholds held it for every one of them at once
    (1.2 GB for 2,000). At most `memory.background_summaries` run; the others fold on a later turn."""
    proxy = await start(start_proxy, storage, upstream, summaries=True, overflow="marker", background_summaries=2)
    config = proxy.app[CONFIG]
    gate = threading.Event()
    upstream.summarizer = gated(gate)
    names = [f"burst-{k}" for k in range(4)]

    async def talk(name: str, first: int, turns: int) -> None:
        client = proxy.client(session=name)
        for turn in range(first, first + turns):
            messages: Any = [SYSTEM, user(f"[{name}] turn {turn}: FACT-{turn} {words(90, turn)}")]
            await client.chat.completions.create(model="small", messages=messages)

    try:
        await asyncio.gather(*(talk(name, 0, 12) for name in names))  # every one over its threshold
        await until(lambda: len(upstream.summary_requests()) == 2, "two folds reached the summariser")
        await asyncio.gather(*(talk(name, 12, 2) for name in names))  # each turn asks again
        assert len(upstream.summary_requests()) == 2
    finally:
        gate.set()
    await proxy.app[SUMMARIZER].wait_idle()
    for turn in range(14, 20):  # the others fold as their turns go on
        await asyncio.gather(*(talk(name, turn, 1) for name in names))
        await proxy.app[SUMMARIZER].wait_idle()
    assert all(summary_rows(config, name) for name in names)


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


async def summarised(start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream
                     ) -> tuple[Proxy, Conversation, int]:
    """A full-history conversation told until its first summary is saved; the turns it took."""
    proxy = await start(start_proxy, storage, upstream, **SUMMARIES)
    config = proxy.app[CONFIG]
    upstream.summarizer = fact_summariser
    chat = Conversation(proxy, upstream, style="full")
    turn = 0
    while not summary_rows(config):
        await chat.say(f"question {turn}: FACT-{turn} {words(90, turn)}")
        await chat.idle()
        turn += 1
    return proxy, chat, turn


class _EditedOnRead:
    """A session's store whose first read of a range of messages waits for `edit` first: another
    process's edit landing between a fold's lease and its read."""

    def __init__(self, store: TurnStore, edit: Callable[[], Awaitable[None]]) -> None:
        self._store = store
        self._edit: Callable[[], Awaitable[None]] | None = edit

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def active_range(self, *args: Any) -> list[StoredMessage]:
        if self._edit is not None:
            edit, self._edit = self._edit, None
            await edit()
        return await self._store.active_range(*args)


async def test_a_fold_that_reads_after_an_edit_before_the_summarys_end_is_stale(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream
) -> None:
    """The messages after the summary in use, read once an edit before its end has landed, follow
    another history than the one it stands for: a summary of them on top of it would stand for
    the edited question without having read it."""
    proxy, chat, turn = await summarised(start_proxy, storage, upstream)
    config = proxy.app[CONFIG]
    for extra in range(turn, turn + 3):
        await chat.say(f"question {extra}: FACT-{extra} {words(20, extra)}")
    await chat.idle()
    versions = [s.version for s in summary_rows(config)]

    async def edit() -> None:  # the second question edited, the rest resent as it was
        chat.history[2] = user("question 1, asked differently: FACT-900")
        _, headers = await chat.exchange([user("and then?")], Reply(content="edited"))
        assert headers["x-memproxy-reconcile"] == "edit"

    store = _EditedOnRead(proxy.app[STORE], edit)
    folding = Summarizer(config, cast(TurnStore, store), proxy.app[PROVIDER], BackgroundTasks())
    session = await proxy.app[STORE].get_session("a", "s1")
    assert session is not None
    result = await folding.fold("a", "s1", config.models[0], upto=session.length - 2)
    assert store._edit is None  # the edit landed, between the lease and the read
    assert result.outcome == "stale", result
    await chat.idle()
    assert [s.version for s in summary_rows(config)][: len(versions)] == versions
    assert all("FACT-900" in s.text or s.version in versions for s in summary_rows(config))


async def test_a_summary_of_messages_edited_later_is_no_longer_used(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream
) -> None:
    proxy, chat, _ = await summarised(start_proxy, storage, upstream)
    config = proxy.app[CONFIG]
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


async def test_a_request_waiting_for_a_fold_that_fails_does_not_call_the_summariser_again(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream
) -> None:
    """A summariser that is down costs one call per backoff period: an overflowing request that
    found a fold in flight, and waited for it to fail, gets the marker instead of a call of its own."""
    proxy = await start(start_proxy, storage, upstream, **SUMMARIES, failure_backoff_seconds=3600)
    config = proxy.app[CONFIG]
    gate = threading.Event()
    upstream.summarizer = gated(gate, lambda _: Reply(status=500, error_message="model down"))
    chat = Conversation(proxy, upstream)
    try:
        await talk_until_a_fold_starts(chat, config)
        for turn in range(20):  # the history outgrows the window while the fold is held
            waiting = asyncio.create_task(chat.say(f"more {turn}: {words(150, turn)}"))
            done, _ = await asyncio.wait([waiting], timeout=0.3)
            if not done:
                break  # it overflowed, and waits for the fold in flight
        assert not done
        assert len(upstream.summary_requests()) == 1
    finally:
        gate.set()
    sent = await waiting
    await chat.idle()
    assert sent.unsummarized_omitted > 0 and sent.marker == sent.unsummarized_omitted
    assert len(upstream.summary_requests()) == 1  # the failed fold's call, and no other
    assert summary_rows(config) == []
