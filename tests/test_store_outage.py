"""A sick store (issue 12, item 7): PostgreSQL cut off and brought back while the proxy runs.

The proxy reaches PostgreSQL through a small TCP relay of the test's own (`Relay`) that the test cuts
(every open connection closed, new ones refused) and restores, as a restart or a network fault would.
While the store is cut:

- a chat turn gets an OpenAI-shaped 503 `store_unavailable` before anything is sent upstream, and
  `/readyz` says so;
- with `storage.on_failure: passthrough` the turn goes upstream as the client sent it, answered with
  `X-Memproxy-Memory: unavailable`, and nothing is stored;
- a turn the provider answered after the store went away returns its answer, `X-Memproxy-Stored: false`.

Once restored, the pool reconnects by itself: the next turn is stored and memory continues from the
client's history (the turn that was not stored included).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import aiohttp
import openai
import pytest

from conftest import PROXY_KEY, Proxy, make_config
from db import execute, rows
from fake_upstream import FakeUpstream, Reply
from memproxy.config import Config, ConfigError, StorageConfig, StoreFailurePolicy, parse_config
from relay import Relay
from relay import through as relay_to


@pytest.fixture
def store_kind() -> str:
    return "postgres"


@pytest.fixture
async def relay(storage: StorageConfig) -> AsyncIterator[Relay]:
    started = await Relay.to(storage)
    yield started
    await started.close()


def through(storage: StorageConfig, relay: Relay) -> StorageConfig:
    """The same database and schema, reached through the relay, on a pool of two."""
    return replace(relay_to(storage, relay), pool_min_size=1, pool_max_size=2)


StartProxy = Callable[[Config], Any]


async def start(start_proxy: StartProxy, storage: StorageConfig, relay: Relay, upstream: FakeUpstream,
                on_failure: StoreFailurePolicy = "error") -> Proxy:
    config = make_config(replace(through(storage, relay), on_failure=on_failure), upstream.url)
    proxy: Proxy = await start_proxy(config)
    return proxy


def stored(storage: StorageConfig) -> list[tuple[str, str]]:
    """(role, content) of every stored message, read directly from PostgreSQL (not through the relay)."""
    return [(json.loads(body)["role"], json.loads(body)["content"])
            for (body,) in rows(storage, "SELECT body FROM messages ORDER BY session_pk, seq")]


async def ready(proxy: Proxy) -> int:
    async with aiohttp.ClientSession() as http:
        async with http.get(proxy.server.make_url("/readyz")) as response:
            return response.status


def user(text: str) -> Any:
    return {"role": "user", "content": text}


def assistant(text: str) -> Any:
    return {"role": "assistant", "content": text}


async def test_a_cut_store_is_a_503_before_any_upstream_call_and_recovers(
    start_proxy: StartProxy, storage: StorageConfig, relay: Relay, upstream: FakeUpstream,
    caplog: pytest.LogCaptureFixture,
) -> None:
    proxy = await start(start_proxy, storage, relay, upstream)
    client = proxy.client()
    first = await client.chat.completions.create(model="small", messages=[user("one")])
    answer = first.choices[0].message.content or ""
    assert await ready(proxy) == 200

    await relay.cut()
    history = [user("one"), assistant(answer), user("two")]
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model="small", messages=history, stream=stream)
        assert caught.value.status_code == 503
        body = caught.value.response.json()
        assert body == {"error": {"message": body["error"]["message"], "type": "server_error",
                                  "code": "store_unavailable", "param": None}}
    assert len(upstream.chat_requests()) == 1  # nothing was paid for while the store was away
    assert await ready(proxy) == 503
    async with aiohttp.ClientSession() as http:  # the session API says the same
        async with http.get(f"{proxy.url}/sessions", headers={"Authorization": f"Bearer {PROXY_KEY}"}) as response:
            assert response.status == 503
            assert (await response.json())["error"]["code"] == "store_unavailable"
        # The log names the route, never the path: ids in it are the client's text.
        async with http.get(f"{proxy.url}/responses/resp_client-text", headers={"Authorization": f"Bearer {PROXY_KEY}"}) \
                as response:
            assert response.status == 503
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("store unavailable on GET")]
    assert any(line.startswith("store unavailable on GET /v1/responses/{response_id}: ") for line in logged), logged
    assert not any("client-text" in line for line in logged)

    relay.restore()
    assert await ready(proxy) == 200  # the pool reconnected on its own
    second = await client.chat.completions.with_raw_response.create(model="small", messages=history)
    assert second.headers["X-Memproxy-Stored"] == "true"
    assert second.headers["X-Memproxy-Reconcile"] == "continue"
    reply = second.parse().choices[0].message.content or ""
    # Memory continues: the next turn sends only its new message, the rest comes from the store.
    third = await client.chat.completions.create(model="small", messages=[user("three")],
                                                 extra_headers={"X-Memproxy-History": "new"})
    assert third.choices[0].message.content
    assert [m["content"] for m in upstream.last().messages] == ["one", answer, "two", reply, "three"]
    assert stored(storage)[:4] == [("user", "one"), ("assistant", answer), ("user", "two"), ("assistant", reply)]


async def test_readiness_needs_memproxys_tables_not_only_a_database_that_answers(
    start_proxy: StartProxy, storage: StorageConfig, relay: Relay, upstream: FakeUpstream,
) -> None:
    proxy = await start(start_proxy, storage, relay, upstream)
    assert await ready(proxy) == 200
    execute(storage, "ALTER TABLE sessions RENAME TO sessions_away")  # as if the schema were dropped
    try:
        assert await ready(proxy) == 503
    finally:
        execute(storage, "ALTER TABLE sessions_away RENAME TO sessions")
    assert await ready(proxy) == 200


async def test_passthrough_forwards_without_memory_and_stores_nothing(
    start_proxy: StartProxy, storage: StorageConfig, relay: Relay, upstream: FakeUpstream,
) -> None:
    proxy = await start(start_proxy, storage, relay, upstream, on_failure="passthrough")
    client = proxy.client()
    first = await client.chat.completions.create(model="small", messages=[user("one")])
    answer = first.choices[0].message.content or ""

    await relay.cut()
    history = [user("one"), assistant(answer), user("two")]
    raw = await client.chat.completions.with_raw_response.create(model="small", messages=history)
    assert raw.http_response.status_code == 200
    assert raw.headers["X-Memproxy-Memory"] == "unavailable"
    assert raw.headers["X-Memproxy-Stored"] == "false"
    assert "X-Memproxy-Reconcile" not in raw.headers
    unstored = raw.parse().choices[0].message.content or ""
    assert upstream.last().messages == history  # as the client sent it
    chunks = await client.chat.completions.create(model="small", messages=[user("streamed")], stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
    assert upstream.last().messages == [user("streamed")]
    assert stored(storage) == [("user", "one"), ("assistant", answer)]

    relay.restore()
    history += [assistant(unstored), user("three")]
    after = await client.chat.completions.with_raw_response.create(model="small", messages=history)
    assert "X-Memproxy-Memory" not in after.headers
    assert after.headers["X-Memproxy-Stored"] == "true"
    reply = after.parse().choices[0].message.content or ""
    assert stored(storage) == [("user", "one"), ("assistant", answer), ("user", "two"), ("assistant", unstored),
                               ("user", "three"), ("assistant", reply)]


async def test_a_response_forwarded_without_memory_says_it_is_not_kept(
    start_proxy: StartProxy, storage: StorageConfig, relay: Relay, upstream: FakeUpstream,
) -> None:
    """With `on_failure: passthrough`, a Response answered while the store is cut is kept nowhere:
    plain or streamed, it says `store: false` (as one whose recording failed does), so that no
    client goes on from it by `previous_response_id` into a 400 once the store is back."""
    proxy = await start(start_proxy, storage, relay, upstream, on_failure="passthrough")
    client = proxy.client(session=None)
    await relay.cut()
    raw = await client.responses.with_raw_response.create(model="small", input="hello")
    assert (raw.headers["X-Memproxy-Memory"], raw.headers["X-Memproxy-Stored"]) == ("unavailable", "false")
    plain = raw.parse()
    assert plain.store is False
    events = [event async for event in await client.responses.create(model="small", input="hello", stream=True)]
    said = [event.response.store for event in events if event.type in ("response.created", "response.completed")]
    assert said == [False, False]
    relay.restore()
    assert stored(storage) == []
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(plain.id)


async def test_a_store_lost_while_the_provider_answers_keeps_the_answer(
    start_proxy: StartProxy, storage: StorageConfig, relay: Relay, upstream: FakeUpstream,
) -> None:
    proxy = await start(start_proxy, storage, relay, upstream)
    client = proxy.client()
    gate = threading.Event()
    upstream.enqueue(Reply(content="answered", gate=gate))
    pending = asyncio.ensure_future(client.chat.completions.with_raw_response.create(
        model="small", messages=[user("one")]))
    try:
        await asyncio.to_thread(upstream.wait_for_request)
        await relay.cut()  # planned with the store up; it is gone when the answer comes
    finally:
        gate.set()
    raw = await pending
    assert raw.parse().choices[0].message.content == "answered"
    assert raw.headers["X-Memproxy-Stored"] == "false"
    relay.restore()
    assert stored(storage) == []
    # A stream in the same position ends with the store's error event after its content, no [DONE].
    gate = threading.Event()
    upstream.enqueue(Reply(content="streamed answer", gate=gate))
    stream_started = asyncio.ensure_future(client.chat.completions.create(
        model="small", messages=[user("one")], stream=True))
    try:
        await asyncio.to_thread(upstream.wait_for_request)
        await relay.cut()
    finally:
        gate.set()
    stream = await stream_started
    received = ""
    with pytest.raises(openai.APIError) as caught:
        async for chunk in stream:
            received += (chunk.choices[0].delta.content or "") if chunk.choices else ""
    assert received == "streamed answer"
    assert "store" in str(caught.value).lower()
    relay.restore()
    assert stored(storage) == []


def test_on_failure_is_error_by_default_and_checked() -> None:
    base = "models:\n  - {name: small, model: openai/small, context_window: 2000}\n"
    assert parse_config(base, {}).storage.on_failure == "error"
    assert parse_config(base + "storage: {on_failure: passthrough}\n", {}).storage.on_failure == "passthrough"
    with pytest.raises(ConfigError) as caught:
        parse_config(base + "storage: {on_failure: ignore}\n", {})
    assert caught.value.key == "storage.on_failure"
