"""Rolling summaries (issue 3, item 5): the overflow policies before a summary covers the turns
(marker, drop, summarize), their timeouts and back-off.

The fake upstream plays the chat model and the summariser; every forwarded request is recounted and
checked against the budget, the order and the `summaries` table (`tests/summaries.py`).
"""

from __future__ import annotations

import threading

import pytest

from fake_upstream import FakeUpstream, Reply
from helpers import user
from memproxy.config import StorageConfig
from memproxy.memory.fit import marker_message
from memproxy.tokens import request_tokens
from memproxy.typedefs import CONFIG
from summaries import (
    BUDGET,
    COUNTER,
    Conversation,
    MARKER,
    REJECTED,
    SUMMARIES,
    SYSTEM,
    StartProxy,
    fact_summariser,
    facts_in,
    gated,
    start,
    stored_tokens,
    summary_rows,
)
from test_budget import words

pytestmark = pytest.mark.both_stores


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
