"""`server.max_body_bytes_in_flight`: the request bodies a process holds at once are bounded, and a
request beyond the bound is a 503 `server_busy` with `Retry-After`, refused before its body is read,
with nothing stored or sent upstream (`memproxy.bodies.BodyBudget`)."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from conftest import OTHER_KEY, PROXY_KEY, Proxy
from fake_upstream import FakeUpstream, Reply
from memproxy.app import create_app
from memproxy.config import Config
from test_errors import assert_shape

LARGEST = 64 * 1024  # server.max_body_bytes in these tests


def limited(config: Config, in_flight: int) -> Config:
    return replace(config, server=replace(config.server, max_body_bytes=LARGEST, max_body_bytes_in_flight=in_flight))


def padded(text: str, size: int) -> bytes:
    """A chat body of exactly `size` bytes: JSON's whitespace after it makes up the length, so the
    body is large on the wire and small once parsed (the model's window is not what is tested)."""
    raw = json.dumps({"model": "small", "messages": [{"role": "user", "content": text}]}).encode()
    assert len(raw) <= size
    return raw + b" " * (size - len(raw))


async def post(http: aiohttp.ClientSession, proxy: Proxy, data: bytes | AsyncIterator[bytes], session: str,
               key: str = PROXY_KEY, **headers: str) -> tuple[int, dict[str, str], Any]:
    async with http.post(proxy.server.make_url("/v1/chat/completions"), data=data, headers={
            "Authorization": f"Bearer {key}", "X-Session-Id": session, "Content-Type": "application/json",
            **headers}) as response:
        return response.status, dict(response.headers), await response.json()


async def chunked(data: bytes) -> AsyncIterator[bytes]:
    """A body sent without a Content-Length (`Transfer-Encoding: chunked`)."""
    yield data


async def stored(http: aiohttp.ClientSession, proxy: Proxy, session: str) -> list[str]:
    async with http.get(proxy.server.make_url(f"/v1/sessions/{session}"),
                        headers={"Authorization": f"Bearer {PROXY_KEY}"}) as response:
        if response.status == 404:
            return []
        assert response.status == 200
        return [m["message"]["content"] for m in (await response.json())["messages"]]


@contextlib.asynccontextmanager
async def held(upstream: FakeUpstream, send: Callable[[], Any]) -> AsyncIterator[None]:
    """`send()` held at the upstream for the block (its body read, its bytes still charged), then
    answered: 200 "held answer"."""
    gate = threading.Event()
    upstream.enqueue(Reply(content="held answer", gate=gate))
    task = asyncio.ensure_future(send())
    try:
        await asyncio.to_thread(upstream.wait_for_request)
        yield
    finally:
        gate.set()
        status, _, body = await task
    assert (status, body["choices"][0]["message"]["content"]) == (200, "held answer")


@pytest.mark.both_stores
async def test_a_request_beyond_the_bytes_in_flight_is_refused_until_they_are_done(
    start_proxy: Callable[[Config], Any], config: Config, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    proxy: Proxy = await start_proxy(limited(config, LARGEST))
    async with held(upstream, lambda: post(http, proxy, padded("first", 40_000), "s1")):
        status, headers, body = await post(http, proxy, padded("second", 30_000), "s2")
        assert status == 503 and headers.get("Retry-After") == "1"
        assert_shape(body, type="server_error", code="server_busy", param=None)
        assert "max_body_bytes_in_flight" in body["error"]["message"]
        # Bytes, not requests: a small one fits beside the held one.
        upstream.enqueue(Reply(content="small answer"))
        status, _, body = await post(http, proxy, padded("small", 1_000), "s3")
        assert (status, body["choices"][0]["message"]["content"]) == (200, "small answer")
    assert await stored(http, proxy, "s2") == []  # refused: nothing stored, nothing sent
    assert [r.messages[-1]["content"] for r in upstream.chat_requests()] == ["first", "small"]
    upstream.enqueue(Reply(content="second answer"))
    status, _, body = await post(http, proxy, padded("second", 30_000), "s2")  # the retry, once the bytes are free
    assert (status, body["choices"][0]["message"]["content"]) == (200, "second answer")
    assert await stored(http, proxy, "s2") == ["second", "second answer"]


async def test_a_body_of_unknown_length_is_charged_the_most_a_body_may_be(
    start_proxy: Callable[[Config], Any], config: Config, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    proxy: Proxy = await start_proxy(limited(config, LARGEST + 500))
    async with held(upstream, lambda: post(http, proxy, padded("first", 1_000), "s1")):
        status, _, body = await post(http, proxy, chunked(padded("chunked", 1_000)), "s2")
        assert status == 503 and body["error"]["code"] == "server_busy"
        upstream.enqueue(Reply(content="sized answer"))
        status, _, _ = await post(http, proxy, padded("sized", 1_000), "s3")
        assert status == 200
    # Once read, a chunked body is charged its size: a near-largest request fits beside it.
    async with held(upstream, lambda: post(http, proxy, chunked(padded("chunked", 1_000)), "s2")):
        upstream.enqueue(Reply(content="beside it"))
        assert (await post(http, proxy, padded("large", LARGEST - 2_000), "s4"))[0] == 200


async def test_a_compressed_body_is_charged_as_inflated(
    start_proxy: Callable[[Config], Any], config: Config, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """aiohttp inflates a gzip body (up to max_body_bytes): 40 kB in 200 bytes is charged the most
    a body may be until read, then its 40 kB, never its 200 bytes on the wire."""
    proxy: Proxy = await start_proxy(limited(config, LARGEST + 500))
    inflated = padded("zipped", 40_000)
    zipped = gzip.compress(inflated)
    assert len(zipped) < 1_000
    async with held(upstream, lambda: post(http, proxy, zipped, "s1", **{"Content-Encoding": "gzip"})):
        assert (await post(http, proxy, padded("second", 30_000), "s2"))[0] == 503
        upstream.enqueue(Reply(content="fits"))
        assert (await post(http, proxy, padded("third", 20_000), "s3"))[0] == 200
    assert upstream.chat_requests()[0].messages[-1]["content"] == "zipped"


async def test_the_bytes_are_given_back_whatever_the_answer(
    start_proxy: Callable[[Config], Any], config: Config, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """A refused body, an upstream error and a body too large each give their bytes back: had any
    kept them, the near-largest request at the end would not fit."""
    proxy: Proxy = await start_proxy(limited(config, LARGEST))
    assert (await post(http, proxy, b"{not json" + b" " * 20_000, "s1"))[0] == 400
    upstream.enqueue(Reply(status=500))
    assert (await post(http, proxy, padded("fails upstream", 20_000), "s1"))[0] == 500  # relayed
    assert (await post(http, proxy, padded("too large", LARGEST + 1), "s1"))[0] == 413
    upstream.enqueue(Reply(content="fits"))
    assert (await post(http, proxy, padded("largest", LARGEST - 1_000), "s1"))[0] == 200


async def test_a_caller_without_a_valid_key_is_refused_as_such_before_any_charge(
    start_proxy: Callable[[Config], Any], config: Config, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    proxy: Proxy = await start_proxy(limited(config, LARGEST))
    async with held(upstream, lambda: post(http, proxy, padded("first", 40_000), "s1")):
        status, _, body = await post(http, proxy, padded("who", 30_000), "s2", key="not-a-key")
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        status, _, body = await post(http, proxy, padded("other tenant", 30_000), "s2", key=OTHER_KEY)
        assert status == 503  # the budget is the process's, whoever's the bytes are


async def test_zero_sets_no_limit(
    start_proxy: Callable[[Config], Any], config: Config, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    proxy: Proxy = await start_proxy(limited(config, 0))
    async with held(upstream, lambda: post(http, proxy, padded("first", 60_000), "s1")):
        upstream.enqueue(Reply(content="beside it"))
        assert (await post(http, proxy, padded("second", 60_000), "s2"))[0] == 200


async def test_a_route_that_takes_no_key_is_charged_nothing(
    config: Config, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """Only an authenticated request is charged: a body sent to a route that takes no key (whose
    body nothing reads) cannot take the budget from the tenants, however large and slow it is."""
    app = create_app(limited(config, LARGEST))
    entered, release = asyncio.Event(), asyncio.Event()

    async def hold(request: web.Request) -> web.Response:
        entered.set()
        await release.wait()
        return web.Response(text="held")

    app.router.add_post("/held", hold)  # a route outside /v1/, as /healthz is
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    try:
        async def unknown_caller() -> int:
            async with http.post(server.make_url("/held"), data=b" " * (LARGEST - 100)) as response:
                return response.status

        holding = asyncio.ensure_future(unknown_caller())
        await entered.wait()
        upstream.enqueue(Reply(content="served"))
        async with http.post(server.make_url("/v1/chat/completions"), data=padded("tenant", 30_000), headers={
                "Authorization": f"Bearer {PROXY_KEY}", "Content-Type": "application/json"}) as response:
            assert response.status == 200
        release.set()
        assert await holding == 200
    finally:
        release.set()
        await server.close()
