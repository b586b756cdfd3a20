"""Rolling summaries (issue 3, items 1-3, 8): when a fold happens, a conversation many windows long,
rejected summaries that change nothing, and the summariser's own window.

The fake upstream plays the chat model and the summariser; every forwarded request is recounted and
checked against the budget, the order and the `summaries` table (`tests/summaries.py`).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from conftest import Proxy, make_config
from fake_upstream import FakeUpstream, Received, Reply
from helpers import user
from memproxy.config import Config, ModelConfig, StorageConfig
from memproxy.tokens import TiktokenCounter, encoding_name_for, request_tokens
from memproxy.typedefs import CONFIG
from summaries import (
    COUNTER,
    Conversation,
    REJECTED,
    SUMMARIES,
    SYSTEM,
    StartProxy,
    StoredSummary,
    WINDOW,
    assert_no_content_logged,
    compact,
    fact_summariser,
    fact_summary,
    facts_in,
    new_part,
    padded_summariser,
    start,
    stored,
    stored_tokens,
    summariser_input,
    summary_logs,
    summary_rows,
    tool_result,
)
from test_budget import tool_call, words

pytestmark = pytest.mark.both_stores


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


@pytest.mark.parametrize("transport", ["openai", "litellm"])
async def test_a_reasoning_summariser_gets_parameters_it_accepts(
    start_proxy: StartProxy, storage: StorageConfig, upstream: FakeUpstream, transport: str
) -> None:
    """memproxy's own request, like any client's, must be valid for its model (issue 15, item 3):
    to OpenAI's reasoning models `max_tokens` and `temperature: 0` are a 400 (the fake refuses
    them as the API does). The summary goes through litellm whatever the model's transport, which
    sends `max_completion_tokens` (the cap plus room to think) and no temperature."""
    config = make_config(storage, upstream.url, transport, **SUMMARIES, summarizer_model="thinker",
                         chunk_threshold_tokens=300)
    thinker = ModelConfig(name="thinker", model="openai/o3-mini", api_base=upstream.url, api_key="upstream-secret",
                          context_window=200_000, max_output_tokens=1000, transport=transport)
    proxy = await start_proxy(replace(config, models=(*config.models, thinker)))
    upstream.summarizer = fact_summariser
    chat = Conversation(proxy, upstream)
    for turn in range(6):
        await chat.say(f"question {turn}: FACT-{turn} {words(40, turn)}")
        await chat.idle()
    requests = upstream.summary_requests()
    assert requests and all(r.body["model"] == "o3-mini" for r in requests)
    for request in requests:
        assert "max_tokens" not in request.body and "temperature" not in request.body
        cap = config.memory.summary_cap(WINDOW)
        assert cap < request.body["max_completion_tokens"] <= cap + 4096
    rows = summary_rows(proxy.app[CONFIG])
    assert rows and {s.model for s in rows} == {"thinker"}  # answered, applied
    assert facts_in(rows[-1].text)


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
