"""memproxy's own OpenAI client (`transport: openai`), against providers that answer in ways the fake
upstream does not: other SSE framings, an error event inside a stream, error pages that are not JSON,
broken JSON, and a base URL and key taken from the environment. Each provider here is a real HTTP
server on 127.0.0.1 that plays back raw bytes and records what it received."""

from __future__ import annotations

import json
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from conftest import PROXY_KEY, Proxy, replace_model
from test_errors import closed_port  # noqa: F401  (a fixture)
from db import rows
from memproxy.config import Config, ModelConfig
from memproxy.provider import transport as route_of

USER: Any = {"role": "user", "content": "hi"}


@dataclass
class Raw:
    """One scripted answer: a status, a content type and the body, written in the pieces given."""

    pieces: list[bytes]
    status: int = 200
    content_type: str = "text/event-stream"


@dataclass
class RawProvider:
    script: deque[Raw] = field(default_factory=deque)
    received: list[tuple[dict[str, str], dict[str, Any]]] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.received.append((dict(request.headers), await request.json()))
        raw = self.script.popleft()
        response = web.StreamResponse(status=raw.status, headers={"Content-Type": raw.content_type})
        await response.prepare(request)
        for piece in raw.pieces:
            await response.write(piece)
        await response.write_eof()
        return response


@pytest.fixture
def transport() -> str:
    """Every test here is of memproxy's own client."""
    return "openai"


@pytest.fixture
async def provider() -> AsyncIterator[tuple[RawProvider, str]]:
    raw = RawProvider()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", raw.handle)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    yield raw, str(server.make_url("/v1"))
    await server.close()


@pytest.fixture
async def raw_proxy(start_proxy: Callable[[Config], Any], config: Config,
                    provider: tuple[RawProvider, str]) -> Proxy:
    proxy: Proxy = await start_proxy(replace_model(config, api_base=provider[1]))
    return proxy


def chunk(content: str | None = None, finish: str | None = None) -> dict[str, Any]:
    delta = {"content": content} if content is not None else {}
    return {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "small",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def stored(config: Config) -> list[tuple[Any, ...]]:
    return rows(config, "SELECT role FROM messages WHERE active = 1 ORDER BY seq")


async def test_sse_framings_other_servers_use_are_read(
    raw_proxy: Proxy, provider: tuple[RawProvider, str], config: Config
) -> None:
    """CRLF line ends, `data:` with no space, comments and event names, and events split across
    writes all decode; the turn is stored as the client saw it."""
    raw, _ = provider
    first = json.dumps(chunk("Hel")).encode()
    raw.script.append(Raw([
        b": keep-alive\r\n\r\n",
        b"event: message\r\ndata:" + first[:10], first[10:] + b"\r\n\r\n",
        b"data: " + json.dumps(chunk("lo")).encode() + b"\n\n",
        b"data: " + json.dumps(chunk(finish="stop")).encode() + b"\n\n",
        b"data: [DONE]\n\n",
    ]))
    stream = await raw_proxy.client().chat.completions.create(model="small", messages=[USER], stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == "Hello"
    assert stored(config) == [("user",), ("assistant",)]
    assert rows(config, "SELECT body FROM messages WHERE seq = 1")[0][0].count("Hello") == 1


async def test_error_event_inside_a_stream_ends_it_with_that_error_and_stores_nothing(
    raw_proxy: Proxy, provider: tuple[RawProvider, str], config: Config
) -> None:
    raw, _ = provider
    error = {"error": {"message": "model overloaded", "type": "server_error", "code": "overloaded"}}
    raw.script.append(Raw([b"data: " + json.dumps(chunk("par")).encode() + b"\n\n",
                           b"data: " + json.dumps(error).encode() + b"\n\n"]))
    client = raw_proxy.client()
    stream = await client.chat.completions.create(model="small", messages=[USER], stream=True)
    with pytest.raises(openai.APIError) as caught:
        async for _ in stream:
            pass
    assert "model overloaded" in str(caught.value)
    assert stored(config) == []


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_error_page_that_is_not_json_keeps_its_status_and_text(
    raw_proxy: Proxy, provider: tuple[RawProvider, str], config: Config, stream: bool
) -> None:
    raw, _ = provider
    raw.script.append(Raw([b"<html>502 Bad Gateway</html>"], status=502, content_type="text/html"))
    with pytest.raises(openai.APIStatusError) as caught:
        await raw_proxy.client().chat.completions.create(model="small", messages=[USER], stream=stream)
    assert caught.value.status_code == 502
    assert caught.value.response.json()["error"] == {
        "message": "<html>502 Bad Gateway</html>", "type": "upstream_error", "code": "upstream_error",
        "param": None}
    assert stored(config) == []


@pytest.mark.parametrize("body", [b'{"choices": [', b'{"object": "list"}', b"[]"],
                         ids=["broken", "no-choices", "array"])
async def test_an_answer_that_is_not_a_completion_is_502_and_stores_nothing(
    raw_proxy: Proxy, provider: tuple[RawProvider, str], config: Config, body: bytes
) -> None:
    raw, _ = provider
    raw.script.append(Raw([body], content_type="application/json"))
    with pytest.raises(openai.APIStatusError) as caught:
        await raw_proxy.client().chat.completions.create(model="small", messages=[USER])
    assert caught.value.status_code == 502
    assert caught.value.response.json()["error"]["type"] == "upstream_error"
    assert stored(config) == []


async def test_base_url_and_key_default_to_the_openai_environment(
    start_proxy: Callable[[Config], Any], config: Config, provider: tuple[RawProvider, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    raw, url = provider
    monkeypatch.setenv("OPENAI_BASE_URL", url)
    monkeypatch.setenv("OPENAI_API_KEY", "key-from-env")
    proxy: Proxy = await start_proxy(replace_model(config, api_base=None, api_key=None))
    answer = {"id": "x", "object": "chat.completion", "created": 1, "model": "small",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "yes"},
                           "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
              "provider_field": {"kept": True}}
    raw.script.append(Raw([json.dumps(answer).encode()], content_type="application/json"))
    async with aiohttp.ClientSession() as http:
        async with http.post(proxy.server.make_url("/v1/chat/completions"),
                             json={"model": "small", "messages": [USER]},
                             headers={"Authorization": f"Bearer {PROXY_KEY}"}) as response:
            body = await response.json()
    headers, sent = raw.received[-1]
    assert headers["Authorization"] == "Bearer key-from-env"
    assert headers["User-Agent"].startswith("memproxy/")
    assert sent == {"model": "small", "messages": [USER]}
    assert body == answer  # the provider's answer, fields memproxy does not know included


@pytest.mark.parametrize("bypass", [False, True], ids=["through-proxy", "no-proxy"])
async def test_proxy_environment_is_honoured(
    start_proxy: Callable[[Config], Any], config: Config, provider: tuple[RawProvider, str],
    monkeypatch: pytest.MonkeyPatch, bypass: bool, closed_port: int,
) -> None:
    """HTTP_PROXY routes the call through a proxy (here the raw server plays it, in front of a
    provider address that does not answer); NO_PROXY exempts the provider's host."""
    raw, url = provider
    for name in ("http_proxy", "https_proxy", "no_proxy", "HTTPS_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", url.removesuffix("/v1"))
    if bypass:
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    proxy: Proxy = await start_proxy(replace_model(config, api_base=f"http://127.0.0.1:{closed_port}/v1"))
    answer = {"id": "x", "object": "chat.completion", "created": 1, "model": "small",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "via proxy"},
                           "finish_reason": "stop"}]}
    raw.script.append(Raw([json.dumps(answer).encode()], content_type="application/json"))
    client = proxy.client()
    if bypass:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model="small", messages=[USER])
        assert caught.value.status_code == 502 and raw.received == []
        return
    response = await client.chat.completions.create(model="small", messages=[USER])
    assert response.choices[0].message.content == "via proxy"
    assert [sent["messages"] for _, sent in raw.received] == [[USER]]


@pytest.mark.parametrize(
    "model, configured, chosen",
    [("openai/gpt-4o", "auto", "openai"), ("anthropic/claude-3-5-sonnet", "auto", "litellm"),
     ("gpt-4o", "auto", "litellm"), ("openai/gpt-4o", "litellm", "litellm"),
     ("hosted_vllm/m", "openai", "openai")],
)
def test_transport_auto_is_the_own_client_for_openai_models_only(
    model: str, configured: str, chosen: str
) -> None:
    assert route_of(replace(ModelConfig(name="m", model=model), transport=configured)) == chosen


def test_litellm_is_the_default_transport_for_every_model() -> None:
    for model in ("openai/gpt-4o", "gpt-4o", "anthropic/claude-sonnet-4-5", "hosted_vllm/m"):
        assert route_of(ModelConfig(name="m", model=model)) == "litellm"
