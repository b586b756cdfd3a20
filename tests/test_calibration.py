"""Token counts calibrated by what the provider reports (`memproxy.calibration`), through the proxy.

The fake provider here has a tokenizer of its own: it counts every request at 30% more than memproxy
does (memproxy's own exact count, times 1.3), reports that as `prompt_tokens`, and refuses with
OpenAI's `context_length_exceeded` a request that does not fit its 2,000-token window: a Mistral
or a Claude behind an estimated count. Memory must keep such a conversation going without one
overflow error reaching the client. The update rule itself is checked without a proxy.
"""

from __future__ import annotations

import json
import math
import re
import threading
from dataclasses import replace
from typing import Any

import openai
import pytest

from conftest import PROXY_KEY, Proxy
from db import rows
from fake_upstream import FakeUpstream, Reply
from helpers import assistant, complete, stream_chat, user
from memproxy.calibration import MAX_FACTOR, RELAX, STEP, Calibration, observed_from
from memproxy.config import Config, MemoryConfig, ModelConfig
from memproxy.errors import ContextLengthExceeded
from memproxy.memory.fit import Budget, Fixed, fit
from memproxy.tokens import TiktokenCounter, encoding_name_for, request_tokens
from memproxy.store.base import MIXED_COUNTS
from memproxy.typedefs import METRICS, PROVIDER, SUMMARIZER
from test_plan import COUNTER, SYSTEM, fixed_of, snapshot_of, stored

pytestmark = [pytest.mark.both_stores, pytest.mark.both_transports]

WINDOW = 2000  # the conftest model "small": output reserve 256, safety margin 20
RATIO = 1.3
COUNTING = TiktokenCounter(encoding_name_for("openai/small"))  # what memproxy counts "small" with


def provider_tokens(body: dict[str, Any]) -> int:
    return math.ceil(RATIO * request_tokens(COUNTING, body.get("messages") or [], body.get("tools") or []))


@pytest.fixture
def provider(upstream: FakeUpstream) -> FakeUpstream:
    upstream.tokens, upstream.window = provider_tokens, WINDOW
    return upstream


def sentence(i: int) -> str:
    return f"Turn {i}: the lighthouse keeper wrote down the weather, the ships and the tides of the day. " * 3


async def test_a_conversation_past_the_window_never_meets_the_providers_limit(
        proxy: Proxy, provider: FakeUpstream) -> None:
    client = proxy.client(session="long", **{"X-Memproxy-History": "new"})
    calibrations = []
    for i in range(40):
        provider.enqueue(Reply(content=sentence(1000 + i)))
        _, headers = await complete(client, [user(sentence(i))])  # raises on any error
        calibrations.append(float(headers["X-Memproxy-Token-Calibration"]))
    refused = [r for r in provider.chat_requests() if provider_tokens(r.body) + 256 > WINDOW]
    assert len(refused) <= 1  # at most the first request past the limit, planned again at once
    assert len(provider.chat_requests()) == 40 + len(refused)
    assert calibrations[0] == 1.0  # nothing seen yet
    assert calibrations[-1] == pytest.approx(RATIO, abs=0.02)  # learnt from the reported usage
    # What the provider accepted filled its window nearly to the end, not to 1/1.3 of it.
    last = provider.chat_requests()[-1]
    assert provider_tokens(last.body) + 256 > 0.9 * (WINDOW - 20)


async def told(proxy: Proxy, upstream: FakeUpstream, session: str, turns: int) -> openai.AsyncOpenAI:
    """A session of `turns` exchanges, told while the provider counts as memproxy does (its count
    unset: usage too small to compare), far past the window; its client."""
    counting, upstream.tokens = upstream.tokens, None
    client = proxy.client(session=session, **{"X-Memproxy-History": "new"})
    for i in range(turns):
        upstream.enqueue(Reply(content=sentence(100 + i)))
        await complete(client, [user(sentence(i))])
    upstream.tokens = counting
    return client


@pytest.mark.parametrize("stream", [False, True])
async def test_a_refusal_for_length_is_planned_again_for_the_providers_count(
        proxy: Proxy, provider: FakeUpstream, http: Any, stream: bool) -> None:
    """memproxy's count fits the next turn to the window; the provider counts 30% more and refuses.
    The turn is planned again with the count the refusal gives, and the client gets the answer,
    stored once. A stream is refused before its first chunk, so its client sees only the answer."""
    client = await told(proxy, provider, "refused", 30)
    before = len(provider.chat_requests())
    slow = threading.Event()  # the refusal takes the provider some 0.4 s
    threading.Timer(0.4, slow.set).start()
    provider.enqueue(Reply(content="first", gate=slow), Reply(content="answered"))
    if stream:
        chunks, headers = await stream_chat(client, [user("and the tides?")])
        assert "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices]) == "answered"
    else:
        completion, headers = await complete(client, [user("and the tides?")])
        assert completion.choices[0].message.content == "answered"
    refused, accepted = provider.chat_requests()[before:]
    assert provider_tokens(refused.body) + 256 > WINDOW >= provider_tokens(accepted.body) + 256
    assert float(headers["X-Memproxy-Token-Calibration"]) > RATIO  # from the refusal's own numbers
    assert accepted.messages[-1] == user("and the tides?")
    # The refused call is upstream time, not the next part's (it went to `reconcile`).
    timing = {part: float(ms) for part, ms in re.findall(r"([\w-]+);dur=([\d.]+)", headers["Server-Timing"])}
    assert timing["upstream-first-chunk" if stream else "upstream"] >= 200 > timing["reconcile"], timing
    async with http.get(f"{proxy.url}/sessions/refused", headers={"Authorization": f"Bearer {PROXY_KEY}"}
                        ) as response:
        shown = await response.json()
    assert len(shown["messages"]) == 2 * 30 + 2  # the turn, once
    registry = proxy.app[METRICS].registry
    assert registry.get_sample_value("memproxy_refused_for_length_total", {"model": "small"}) == 1


async def test_a_resent_history_refused_for_length_is_reported_as_the_client_sent_it(
        proxy: Proxy, provider: FakeUpstream) -> None:
    """A conversation resent to a new session, too long to send whole: its history is stored first
    and the turn planned as its continuation. Refused by the provider's count and planned again,
    the answer still says how the client's request was read, not how the stored history reads."""
    history = [m for i in range(30) for m in (user(sentence(i)), assistant(sentence(100 + i)))]
    provider.enqueue(Reply(content="first"), Reply(content="answered"))
    raw = await proxy.client(session="resent-refused").chat.completions.with_raw_response.create(
        model="small", messages=[*history, user("and the tides?")])
    refused, accepted = provider.chat_requests()
    assert provider_tokens(refused.body) + 256 > WINDOW >= provider_tokens(accepted.body) + 256
    assert raw.parse().choices[0].message.content == "answered"
    assert (raw.headers["X-Memproxy-Reconcile"], raw.headers["X-Memproxy-Superseded"]) == ("new", "0")


async def test_a_responses_turn_refused_for_length_is_planned_again(proxy: Proxy, provider: FakeUpstream) -> None:
    """The Responses API shares the turn's handling: through litellm's bridge to the chat-only
    provider, its refusal is planned again and the client gets the answer."""
    await told(proxy, provider, "responses", 30)
    before = len(provider.chat_requests())
    provider.enqueue(Reply(content="first"), Reply(content="answered"))
    client = proxy.client(session="responses")
    raw = await client.responses.with_raw_response.create(model="small", input="and the tides?")
    assert raw.parse().output_text == "answered"
    assert float(raw.headers["X-Memproxy-Token-Calibration"]) > RATIO
    refused, accepted = provider.chat_requests()[before:]
    assert provider_tokens(refused.body) + 256 > WINDOW >= provider_tokens(accepted.body) + 256


async def test_a_refusal_of_a_request_with_media_raises_that_sessions_factor_alone(
        proxy: Proxy, provider: FakeUpstream) -> None:
    """memproxy only estimates what an image or a clip costs, and a client chooses what it sends: a
    refusal of a request holding one raises the factor its session is planned with, so its next
    turns (the image still in their context) are not refused again, and leaves the model's, which
    every other session is planned with, as it was."""
    client = await told(proxy, provider, "media", 30)
    before = len(provider.chat_requests())
    provider.enqueue(Reply(content="first"), Reply(content="answered"))
    picture = user([{"type": "text", "text": "and this one?"},  # type: ignore[arg-type]
                    {"type": "image_url", "image_url": {"url": "https://example.com/tides.png"}}])
    completion, headers = await complete(client, [picture])
    assert completion.choices[0].message.content == "answered"
    assert float(headers["X-Memproxy-Token-Calibration"]) > RATIO  # the session's own
    refused, accepted = provider.chat_requests()[before:]
    assert provider_tokens(refused.body) + 256 > WINDOW >= provider_tokens(accepted.body) + 256
    assert proxy.app[PROVIDER].calibration.factor("small") == 1.0
    # The session's next turns, the image among what they send, are planned to fit at once.
    for i in range(3):
        provider.enqueue(Reply(content=sentence(200 + i)))
        await complete(client, [user(sentence(300 + i))])
    after = provider.chat_requests()[before + 2:]
    assert len(after) == 3 and all(provider_tokens(r.body) + 256 <= WINDOW for r in after)
    # Another session is planned with the model's factor.
    other = await told(proxy, provider, "other", 1)
    provider.enqueue(Reply(content="fine"))
    _, headers = await complete(other, [user("and the weather?")])
    assert float(headers["X-Memproxy-Token-Calibration"]) == 1.0


async def test_with_calibration_off_the_providers_refusal_reaches_the_client(
        start_proxy: Any, config: Config, provider: FakeUpstream) -> None:
    proxy = await start_proxy(replace(config, memory=replace(config.memory, calibrate_tokens=False)))
    client = await told(proxy, provider, "off", 30)
    before = len(provider.chat_requests())
    with pytest.raises(openai.BadRequestError) as refused:
        await complete(client, [user("and the tides?")])
    assert refused.value.code == "context_length_exceeded"
    assert len(provider.chat_requests()) == before + 1


async def folded_conversation(start_proxy: Any, config: Config, upstream: FakeUpstream) -> tuple[Proxy, Any]:
    """30 turns with summaries folding more than one transcript's room; the proxy and the last
    turn's headers."""
    memory = replace(config.memory, summaries=True, overflow="summarize", chunk_threshold_tokens=1800, tail_tokens=300)
    proxy = await start_proxy(replace(config, memory=memory))
    upstream.summarizer = lambda received: Reply(content="They talked about the lighthouse and its keeper.")
    client = proxy.client(session="folded", **{"X-Memproxy-History": "new"})
    for i in range(30):
        upstream.enqueue(Reply(content=sentence(1000 + i)))
        _, headers = await complete(client, [user(sentence(i))])
        await proxy.app[SUMMARIZER].wait_idle()
    return proxy, headers


async def test_summaries_are_folded_for_the_providers_count(
        start_proxy: Any, config: Config, provider: FakeUpstream) -> None:
    """The summariser's requests go to the same provider, here counting 90% more: at a 2,000-token
    window the summary cap and the answer's reserve leave a transcript room that a 30% higher count
    still fits (at 200,000 it would not). Its chunks are sized for the provider's count, learnt from
    the chat turns' usage or its own refusal, so folds apply."""
    provider.tokens = heavier = lambda body: math.ceil(1.9 / RATIO * provider_tokens(body))
    _, headers = await folded_conversation(start_proxy, config, provider)
    folds = provider.summary_requests()
    refused = [r for r in folds if heavier(r.body) + r.body["max_tokens"] > WINDOW]
    assert folds and len(refused) <= 1 and refused == folds[: len(refused)]  # one at most, the first
    assert int(headers["X-Memproxy-Summary-Version"]) > 0  # folds applied
    assert all(heavier(r.body) + 256 <= WINDOW for r in provider.chat_requests()[-10:])


async def test_a_provider_that_counts_as_memproxy_does_leaves_the_factor_at_one(
        start_proxy: Any, config: Config, upstream: FakeUpstream) -> None:
    """Chat turns and the summariser's own calls are counted as the provider counts them, the
    reply's priming included: the factor stays at 1 (the summariser's calls, counted without it,
    nudged it up)."""
    upstream.tokens, upstream.window = (
        lambda body: request_tokens(COUNTING, body.get("messages") or [], body.get("tools") or []), WINDOW)
    proxy, headers = await folded_conversation(start_proxy, config, upstream)
    assert upstream.summary_requests() and int(headers["X-Memproxy-Summary-Version"]) > 0
    assert proxy.app[PROVIDER].calibration.factor("small") == 1.0


async def with_cl100k_model(start_proxy: Any, config: Config, upstream: FakeUpstream) -> Proxy:
    """A proxy with "small" as it is and "small-cl100k": the same provider's model, counted with cl100k."""
    cl100k = ModelConfig(name="small-cl100k", model="openai/small", api_base=upstream.url, api_key="upstream-secret",
                         context_window=WINDOW, max_output_tokens=256, transport=config.models[0].transport,
                         tokenizer="cl100k_base")
    proxy: Proxy = await start_proxy(replace(config, models=(*config.models, cl100k)))
    return proxy


async def test_a_session_moved_to_a_model_counted_another_way_never_overflows(
        start_proxy: Any, config: Config, upstream: FakeUpstream) -> None:
    """A session told on a cl100k model, then continued on an o200k one: its stored counts are
    cl100k's, and a run of "¯" is a quarter of what o200k counts. Planned on them, every turn went
    over the window, the calibration's retry (at most twice the count) too, and the model's factor
    stuck at its highest for every session. What would be sent is counted again instead."""
    proxy = await with_cl100k_model(start_proxy, config, upstream)
    client = proxy.client(session="moved", **{"X-Memproxy-History": "new"})
    for i in range(6):
        upstream.enqueue(Reply(content=f"noted {i}"))
        await complete(client, [user(f"{i} " + "¯" * 400)], model="small-cl100k")
    assert [r[0] for r in rows(config, "SELECT tokenizer FROM sessions")] == ["cl100k_base"]
    upstream.tokens, upstream.window = (  # the provider of "small" counts as o200k does
        lambda body: request_tokens(COUNTING, body.get("messages") or [], body.get("tools") or []), WINDOW)
    sent_before = len(upstream.chat_requests())
    for i in range(3):
        upstream.enqueue(Reply(content=f"fine {i}"))
        _, headers = await complete(client, [user(f"and now {i}?")])  # raises on any error
        assert int(headers["X-Memproxy-Context-Tokens"]) == upstream.tokens(upstream.last().body)  # counted exactly
    sent = upstream.chat_requests()[sent_before:]
    assert len(sent) == 3 and all(upstream.tokens(r.body) + 256 <= WINDOW for r in sent)
    assert "¯" * 400 in str(sent[0].messages)  # not everything was dropped: what fits was sent
    assert proxy.app[PROVIDER].calibration.factor("small") == 1.0
    assert [r[0] for r in rows(config, "SELECT tokenizer FROM sessions")] == [MIXED_COUNTS]


async def test_a_moved_session_whose_whole_history_fit_the_old_count_never_overflows(
        start_proxy: Any, config: Config, upstream: FakeUpstream) -> None:
    """A short session told on a cl100k model, continued on an o200k one: its whole history fits
    the budget by its stored counts, but o200k counts it four times as high, past the window. Each
    plan again was for a factor raised by how far the whole request was over the budget, not by
    how far the count it was planned with was off: five plans sent the whole history each time,
    and then the request went upstream over the window."""
    proxy = await with_cl100k_model(start_proxy, config, upstream)
    client = proxy.client(session="moved-short", **{"X-Memproxy-History": "new"})
    for i in range(5):
        upstream.enqueue(Reply(content=f"noted {i}"))
        _, headers = await complete(client, [user(f"{i} " + "¯" * 400)], model="small-cl100k")
    assert int(headers["X-Memproxy-Context-Tokens"]) < (WINDOW - 256 - 20) / 2  # far from the window there
    upstream.tokens, upstream.window = (  # the provider of "small" counts as o200k does
        lambda body: request_tokens(COUNTING, body.get("messages") or [], body.get("tools") or []), WINDOW)
    upstream.enqueue(Reply(content="fine"))
    _, headers = await complete(client, [user("and now?")])  # raises on any error
    sent = upstream.last()
    assert int(headers["X-Memproxy-Context-Tokens"]) == upstream.tokens(sent.body) <= WINDOW - 256 - 20
    assert sent.messages[-1] == user("and now?") and "¯" * 400 in str(sent.messages)  # what fits is sent


async def test_a_regenerated_answer_on_a_model_counted_another_way_is_not_refused(
        start_proxy: Any, config: Config, upstream: FakeUpstream) -> None:
    """A question told on an o200k model of a large window, its answer regenerated on a cl100k
    model of a small one: the question, which must be sent, is stored at o200k's count, four
    times cl100k's, and was refused as too long by it (a 400 naming 2,407 tokens) though it fits
    as the new model counts it. What must be sent is counted again by the model's own counter."""
    proxy = await with_cl100k_model(start_proxy, config, upstream)
    client = proxy.client(session="regenerated")  # sends its whole history
    question = user("¯" * 2400)
    cl100k_counting = TiktokenCounter("cl100k_base")
    assert COUNTING.message(question) > WINDOW > 2 * cl100k_counting.message(question)
    upstream.enqueue(Reply(content="hi"), Reply(content="first answer"))
    await complete(client, [user("hello")], model="big")
    await complete(client, [user("hello"), assistant("hi"), question], model="big")
    upstream.tokens, upstream.window = (  # the provider of "small-cl100k" counts as cl100k does
        lambda body: request_tokens(cl100k_counting, body.get("messages") or [], body.get("tools") or []), WINDOW)
    upstream.enqueue(Reply(content="second answer"))
    _, headers = await complete(client, [user("hello"), assistant("hi"), question], model="small-cl100k")
    assert headers["X-Memproxy-Reconcile"] == "regenerate"
    sent = upstream.last()
    assert int(headers["X-Memproxy-Context-Tokens"]) == upstream.tokens(sent.body) <= WINDOW - 256 - 20
    assert sent.messages[-1] == question


async def test_a_resent_edit_on_a_model_counted_another_way_is_read_and_sent_as_that_edit(
        start_proxy: Any, config: Config, upstream: FakeUpstream) -> None:
    """A full-history client edits a message of a session told on a cl100k model and resends it to
    an o200k one, too long to send whole: its history is stored first (`resent_history`), counted by
    the new counter beside older counts of the other, and the turn planned as its continuation. The
    answer still says the request was an edit, what is sent fits as the provider counts it, and the
    session holds the edited branch once."""
    proxy = await with_cl100k_model(start_proxy, config, upstream)
    client = proxy.client(session="edited")  # sends its whole history
    history: list[dict[str, Any]] = []
    for i in range(8):
        upstream.enqueue(Reply(content=f"noted {i}"))
        new = user(f"{i} " + "¯" * 300)
        await complete(client, [*history, new], model="small-cl100k")
        history += [new, {"role": "assistant", "content": f"noted {i}"}]
    upstream.tokens, upstream.window = (  # the provider of "small" counts as o200k does
        lambda body: request_tokens(COUNTING, body.get("messages") or [], body.get("tools") or []), WINDOW)
    history[4] = user("2 edited " + "¯" * 300)
    assert request_tokens(COUNTING, history, []) + 256 > WINDOW  # too long to send whole
    upstream.enqueue(Reply(content="after the edit"))
    _, headers = await complete(client, [*history, user("and now?")])  # raises on any error
    assert headers["X-Memproxy-Reconcile"] == "edit"
    sent = upstream.last()
    assert int(headers["X-Memproxy-Context-Tokens"]) == upstream.tokens(sent.body) <= WINDOW - 256
    assert sent.messages[-1] == user("and now?") and "¯" * 300 in str(sent.messages)  # what fits is sent
    bodies = [json.loads(r[0]) for r in rows(config, "SELECT body FROM messages WHERE active = 1 ORDER BY seq")]
    assert [b.get("content") for b in bodies] == [m["content"] for m in history] + ["and now?", "after the edit"]


async def test_a_request_holding_media_teaches_the_factor_nothing(proxy: Proxy, provider: FakeUpstream) -> None:
    """An image is counted by an estimate of its own, not by the model's tokenizer (gpt-4o-mini
    bills a low-detail one at some 2,800 tokens): a request with an image reported at half as much
    again as its count says nothing of how the provider counts text, and the factor every session
    of the model is planned with stays where text put it."""
    image = {"type": "image_url", "image_url": {"url": "https://example.invalid/photo.png", "detail": "low"}}
    provider.tokens = lambda body: math.ceil(1.5 * request_tokens(COUNTING, body.get("messages") or [], []))
    pictures = proxy.client(session="pictures", **{"X-Memproxy-History": "new"})
    _, headers = await complete(pictures, [user([{"type": "text", "text": sentence(1) * 5}, image])])
    assert int(headers["X-Memproxy-Context-Tokens"]) >= observed_from(WINDOW)  # large enough to learn from
    assert proxy.app[PROVIDER].calibration.factor("small") == 1.0
    provider.tokens = provider_tokens  # text, reported at 1.3 times the count
    _, headers = await complete(proxy.client(session="words"), [user(" ".join(sentence(i) for i in range(18)))])
    assert int(headers["X-Memproxy-Context-Tokens"]) >= observed_from(WINDOW)
    assert proxy.app[PROVIDER].calibration.factor("small") == pytest.approx(RATIO, abs=0.02)


# --- the rule, without a proxy ---------------------------------------------------------------------


def test_the_factor_rises_to_a_higher_ratio_at_once_and_relaxes_slowly() -> None:
    calibration, big = Calibration(), observed_from(WINDOW)
    assert calibration.factor("m") == 1.0
    assert calibration.observe("m", big - 1, 3 * big, WINDOW) == 1.0  # too small to compare
    assert calibration.observe("m", big, None, WINDOW) == 1.0  # no usage reported
    assert calibration.observe("m", 2000, 2600, WINDOW) == pytest.approx(1.3)
    assert calibration.observe("m", 2000, 2200, WINDOW) == pytest.approx(1.3 - 0.2 * RELAX)
    assert calibration.factor("other") == 1.0  # per model
    for _ in range(200):
        calibration.observe("m", 2000, 1500, WINDOW)  # a provider counting less: never trusted below 1
    assert calibration.factor("m") == pytest.approx(1.0)
    assert calibration.observe("m", 2000, 10_000, WINDOW) == MAX_FACTOR
    off = Calibration(enabled=False)  # `memory.calibrate_tokens: false`: nothing is learnt
    assert off.observe("m", 2000, 2600, WINDOW) == off.refused("m", 2000, "prompt is too long", WINDOW) == 1.0
    assert off.factor("m") == 1.0


def test_a_refusal_raises_the_factor_to_what_the_provider_said_or_by_a_step() -> None:
    calibration = Calibration()
    said = "This model's maximum context length is 2000 tokens. However, you requested 2,600 tokens."
    assert calibration.refused("m", 2000, said, WINDOW) == pytest.approx(1.3 * 1.01)
    openai_said = "However, you requested 2856 tokens (2600 in the messages, 256 in the completion)."
    assert Calibration().refused("m", 2000, openai_said, WINDOW) == pytest.approx(1.3 * 1.01)
    anthropic_said = "input length and `max_tokens` exceed context limit: 1,800 + 256 > 2000"
    assert Calibration().refused("m", 1500, anthropic_said, WINDOW) == pytest.approx(1.2 * 1.01)
    assert Calibration().refused("m", 2000, "prompt is too long: 2400 tokens > 2000 maximum",
                                 WINDOW) == pytest.approx(1.2 * 1.01)
    assert calibration.refused("n", 2000, "prompt is too long", WINDOW) == pytest.approx(STEP)
    assert calibration.refused("n", 2000, "prompt is too long", WINDOW) == pytest.approx(STEP * STEP)


def test_calibration_plans_less_history_but_never_refuses_what_fits_by_count() -> None:
    memory = MemoryConfig(tool_output_max_tokens=0, dedupe_min_tokens=0, recall_tokens=0)
    history = [m for i in range(40)
               for m in (user(f"question {i} " * 10), {"role": "assistant", "content": f"answer {i} " * 10})]
    new = [user("the question")]
    snapshot = snapshot_of(stored(history, memory), new)
    plain = fit(snapshot, fixed_of([SYSTEM], new), Budget(WINDOW, 256, 20), "m", COUNTER, memory, use_marker=False)
    calibrated = fit(snapshot, fixed_of([SYSTEM], new), Budget(WINDOW, 256, 20, 1.5), "m", COUNTER, memory,
                     use_marker=False)
    assert calibrated.tokens <= int(1724 / 1.5) < plain.tokens <= 1724
    assert calibrated.included > 0
    # New messages that fit the count but not the calibrated budget go, with no history: no 400.
    long = [user("word " * 1300)]
    heavy = fixed_of([SYSTEM], long)
    assert int(1724 / 1.5) < heavy.tokens <= 1724
    snapshot = snapshot_of(stored(history, memory), long)
    sent = fit(snapshot, heavy, Budget(WINDOW, 256, 20, 1.5), "m", COUNTER, memory, use_marker=False)
    assert sent.messages == [SYSTEM, *long] and sent.included == 0
    with pytest.raises(ContextLengthExceeded):  # beyond the count itself it is refused, as always
        fit(snapshot, Fixed([SYSTEM], long, 1725), Budget(WINDOW, 256, 20, 1.5), "m", COUNTER, memory,
            use_marker=False)
