"""Rolling summaries (issue 3, item 7): manual compaction (`POST /v1/sessions/{id}/compact`) and the
audit trail of summary versions.

The fake upstream plays the chat model and the summariser; every forwarded request is recounted and
checked against the budget, the order and the `summaries` table (`tests/summaries.py`).
"""

from __future__ import annotations

import json
import logging

import aiohttp
import pytest

from conftest import OTHER_KEY, PROXY_KEY
from fake_upstream import FakeUpstream, Reply
from memproxy.config import StorageConfig
from memproxy.tokens import request_tokens
from memproxy.typedefs import CONFIG
from summaries import (
    COUNTER,
    Conversation,
    SUMMARIES,
    StartProxy,
    WINDOW,
    compact,
    fact_summariser,
    fact_summary,
    facts_in,
    start,
    stored,
    summary_logs,
    summary_rows,
)
from test_budget import words

pytestmark = pytest.mark.both_stores


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
