"""Every error path answers the one OpenAI shape `{"error": {"message", "type", "code", "param"}}`
with its status, calls no upstream when the request itself is at fault, and stores nothing."""

from __future__ import annotations

import json
import re
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import aiohttp
import openai
import pytest

from conftest import PROXY_KEY, Proxy, replace_model
from db import rows, table_rows
from fake_upstream import FakeUpstream, Reply
from memproxy.config import Config

pytestmark = [pytest.mark.both_stores, pytest.mark.both_transports]

TABLES = ("sessions", "turns", "messages")
USER: Any = {"role": "user", "content": "hi"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def stored_rows(config: Config) -> dict[str, list[tuple[Any, ...]]]:
    """Everything in the store, read by a connection of its own."""
    return table_rows(config, *TABLES)


def assert_shape(body: Any, *, type: str, code: str | None, param: str | None) -> None:
    assert isinstance(body, dict) and set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "code", "param"}
    assert isinstance(error["message"], str) and error["message"]
    assert (error["type"], error["code"], error["param"]) == (type, code, param)


def chat(**changes: Any) -> dict[str, Any]:
    return {"model": "small", "messages": [USER], **changes}


# (id, body: raw bytes or a JSON value, extra headers, status, type, code, param)
BAD_REQUESTS: list[tuple[str, Any, dict[str, str], int, str, str | None, str | None]] = [
    ("invalid-json", b'{"model": "small", "messages": [', {}, 400, "invalid_request_error", None, None),
    ("not-utf8", b'\xff\xfe{"model"}', {}, 400, "invalid_request_error", None, None),
    ("empty-body", b"", {}, 400, "invalid_request_error", None, None),
    ("body-is-array", [chat()], {}, 400, "invalid_request_error", None, None),
    ("body-is-string", "hello", {}, 400, "invalid_request_error", None, None),
    ("messages-missing", {"model": "small"}, {}, 400, "invalid_request_error", None, "messages"),
    ("messages-empty", chat(messages=[]), {}, 400, "invalid_request_error", None, "messages"),
    ("messages-not-array", chat(messages={"role": "user", "content": "hi"}), {}, 400,
     "invalid_request_error", None, "messages"),
    ("message-not-object", chat(messages=[USER, "hi"]), {}, 400, "invalid_request_error", None,
     "messages[1]"),
    ("bad-role", chat(messages=[{"role": "wizard", "content": "hi"}]), {}, 400, "invalid_request_error",
     None, "messages[0].role"),
    ("role-missing", chat(messages=[{"content": "hi"}]), {}, 400, "invalid_request_error", None,
     "messages[0].role"),
    ("user-content-missing", chat(messages=[{"role": "user"}]), {}, 400, "invalid_request_error", None,
     "messages[0].content"),
    ("content-not-text", chat(messages=[{"role": "user", "content": 42}]), {}, 400,
     "invalid_request_error", None, "messages[0].content"),
    ("content-part-without-type", chat(messages=[{"role": "user", "content": [{"text": "hi"}]}]), {}, 400,
     "invalid_request_error", None, "messages[0].content[0]"),
    ("tool-without-tool-call-id",
     chat(messages=[USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                    {"role": "tool", "content": "42"}]),
     {}, 400, "invalid_request_error", None, "messages[2].tool_call_id"),
    ("tool-calls-not-array",
     chat(messages=[USER, {"role": "assistant", "content": None, "tool_calls": CALL}]),
     {}, 400, "invalid_request_error", None, "messages[1].tool_calls"),
    ("tool-call-without-id",
     chat(messages=[USER, {"role": "assistant", "content": None,
                           "tool_calls": [{"type": "function", "function": {"name": "f"}}]}]),
     {}, 400, "invalid_request_error", None, "messages[1].tool_calls[0]"),
    ("tool-call-without-function-name",
     chat(messages=[USER, {"role": "assistant", "content": None,
                           "tool_calls": [{"id": "c", "type": "function", "function": {}}]}]),
     {}, 400, "invalid_request_error", None, "messages[1].tool_calls[0]"),
    ("tool-calls-on-user", chat(messages=[{"role": "user", "content": "x", "tool_calls": [CALL]}]), {}, 400,
     "invalid_request_error", None, "messages[0].tool_calls"),
    ("stream-not-bool", chat(stream="yes"), {}, 400, "invalid_request_error", None, "stream"),
    ("tools-not-array", chat(tools={"type": "function"}), {}, 400, "invalid_request_error", None, "tools"),
    ("model-missing", {"messages": [USER]}, {}, 400, "invalid_request_error", None, "model"),
    ("model-not-string", chat(model=7), {}, 400, "invalid_request_error", None, "model"),
    ("unknown-model", chat(model="gpt-nonexistent"), {}, 404, "invalid_request_error", "model_not_found",
     "model"),
    ("max-tokens-not-int", chat(max_tokens="lots"), {}, 400, "invalid_request_error", None, "max_tokens"),
    ("max-completion-tokens-bool", chat(max_completion_tokens=True), {}, 400, "invalid_request_error", None,
     "max_completion_tokens"),
    ("n-zero", chat(n=0), {}, 400, "invalid_request_error", None, "n"),
    ("n-string", chat(n="2"), {}, 400, "invalid_request_error", None, "n"),
    ("temperature-string", chat(temperature="hot"), {}, 400, "invalid_request_error", None, "temperature"),
    ("top-p-string", chat(top_p="high"), {}, 400, "invalid_request_error", None, "top_p"),
    ("seed-fraction", chat(seed=1.5), {}, 400, "invalid_request_error", None, "seed"),
    ("stop-number", chat(stop=5), {}, 400, "invalid_request_error", None, "stop"),
    ("logprobs-string", chat(logprobs="yes"), {}, 400, "invalid_request_error", None, "logprobs"),
    ("max-tokens-over-window", chat(max_tokens=5000), {}, 400, "invalid_request_error",
     "context_length_exceeded", "max_tokens"),
    ("session-id-bad-chars", chat(), {"X-Session-Id": "has space"}, 400, "invalid_request_error",
     "invalid_session_id", "X-Session-Id"),
    ("session-id-too-long", chat(), {"X-Session-Id": "x" * 129}, 400, "invalid_request_error",
     "invalid_session_id", "X-Session-Id"),
    ("session-id-empty", chat(), {"X-Session-Id": ""}, 400, "invalid_request_error", "invalid_session_id",
     "X-Session-Id"),
    ("proxy-key-missing", chat(), {"Authorization": ""}, 401, "authentication_error", "invalid_api_key",
     None),
    ("proxy-key-wrong", chat(), {"Authorization": "Bearer not-the-proxy-key"}, 401, "authentication_error",
     "invalid_api_key", None),
    ("history-mode-unknown", chat(), {"X-Memproxy-History": "sometimes"}, 400, "invalid_request_error", None,
     "X-Memproxy-History"),
]


@pytest.mark.parametrize(
    "raw, headers, status, error_type, code, param",
    [case[1:] for case in BAD_REQUESTS],
    ids=[case[0] for case in BAD_REQUESTS],
)
async def test_bad_request_is_openai_shaped_and_stores_nothing(
    proxy: Proxy, upstream: FakeUpstream, config: Config,
    raw: Any, headers: dict[str, str], status: int, error_type: str, code: str | None, param: str | None,
) -> None:
    data = raw if isinstance(raw, bytes) else json.dumps(raw).encode()
    async with aiohttp.ClientSession() as http:
        async with http.post(
            proxy.server.make_url("/v1/chat/completions"), data=data,
            headers={"Authorization": f"Bearer {PROXY_KEY}", "Content-Type": "application/json",
                     "X-Session-Id": "s1", **headers},
        ) as response:
            assert response.status == status
            assert response.content_type == "application/json"
            assert_shape(await response.json(), type=error_type, code=code, param=param)
    assert upstream.received == []
    assert stored_rows(config) == {table: [] for table in TABLES}


async def test_an_output_reserve_that_leaves_no_input_room_says_so(proxy: Proxy, upstream: FakeUpstream) -> None:
    """`max_tokens` below the window but with the safety margin over it: the 400 said the model
    "allows -19" input tokens. It says the output's reserve leaves no room, and to lower it."""
    async with aiohttp.ClientSession() as http:
        async with http.post(proxy.server.make_url("/v1/chat/completions"), json=chat(max_completion_tokens=1999),
                             headers={"Authorization": f"Bearer {PROXY_KEY}", "X-Session-Id": "s1"}) as response:
            assert response.status == 400
            body = await response.json()
    assert_shape(body, type="invalid_request_error", code="context_length_exceeded", param="messages")
    message = body["error"]["message"]
    assert "leaves no room for input" in message and not re.search(r"-\d", message)
    assert upstream.received == []


@pytest.mark.parametrize("field, value", [("max_tokens", "lots"), ("temperature", "hot"), ("n", 0),
                                          ("stop", {"at": "."}), ("stream", "yes"), ("tools", {"type": "function"}),
                                          # litellm refused these in its own code: a 502, which SDKs retry
                                          ("tool_choice", 5), ("response_format", "json"),
                                          ("web_search_options", "x"), ("stream_options", "x"),
                                          ("modalities", "text"), ("reasoning_effort", 1)])
async def test_a_parameter_of_the_wrong_type_is_refused_without_a_session_too(
    proxy: Proxy, upstream: FakeUpstream, field: str, value: Any
) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(proxy.server.make_url("/v1/chat/completions"), json=chat(**{field: value}),
                             headers={"Authorization": f"Bearer {PROXY_KEY}"}) as response:
            assert response.status == 400
            body = await response.json()
            assert_shape(body, type="invalid_request_error", code=None, param=field)
            assert field in body["error"]["message"]
    assert upstream.received == []


@pytest.mark.parametrize("session", [None, "s1"], ids=["without-session", "with-session"])
async def test_parameters_of_the_right_type_or_null_go_upstream_as_sent(
    proxy: Proxy, upstream: FakeUpstream, session: str | None
) -> None:
    """`null` is the default everywhere: `stream: null` is no stream, `tools: null` no tools (an
    SDK call with `tools=tools or None` sends them so)."""
    sent = {"max_tokens": None, "temperature": 0, "top_p": 0.5, "n": 1, "seed": 7, "stop": ["."], "user": "u1",
            "presence_penalty": -1.5, "logprobs": False, "future_parameter": {"any": "shape"}, "stream": None,
            "tools": None, "functions": None}
    session_header = {"X-Session-Id": session} if session else {}
    async with aiohttp.ClientSession() as http:
        async with http.post(proxy.server.make_url("/v1/chat/completions"), json=chat(**sent),
                             headers={"Authorization": f"Bearer {PROXY_KEY}", **session_header}) as response:
            assert response.status == 200
            assert response.content_type == "application/json"
    received = upstream.last().body
    assert {k: received.get(k) for k in sent} == sent


async def test_bad_requests_leave_an_existing_session_unchanged(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    client = proxy.client()
    await client.chat.completions.create(model="small", messages=[USER])
    before = stored_rows(config)
    assert len(before["messages"]) == 2
    async with aiohttp.ClientSession() as http:
        for _, raw, headers, status, *_ in BAD_REQUESTS:
            data = raw if isinstance(raw, bytes) else json.dumps(raw).encode()
            async with http.post(
                proxy.server.make_url("/v1/chat/completions"), data=data,
                headers={"Authorization": f"Bearer {PROXY_KEY}", "X-Session-Id": "s1", **headers},
            ) as response:
                assert response.status == status
    assert stored_rows(config) == before
    assert len(upstream.chat_requests()) == 1
    # The session carries on as if nothing had happened.
    await client.chat.completions.create(model="small", messages=[{"role": "user", "content": "next"}])
    assert upstream.last().messages == [USER, {"role": "assistant", "content": "reply 1"},
                                        {"role": "user", "content": "next"}]


async def test_body_over_the_limit_is_413(
    start_proxy: Callable[[Config], Any], upstream: FakeUpstream, config: Config
) -> None:
    config = replace(config, server=replace(config.server, max_body_bytes=4096))
    proxy: Proxy = await start_proxy(config)
    big = chat(messages=[{"role": "user", "content": "x" * 5000}])
    small = chat(messages=[{"role": "user", "content": "x" * 3000}])
    async with aiohttp.ClientSession() as http:
        url = proxy.server.make_url("/v1/chat/completions")
        headers = {"Authorization": f"Bearer {PROXY_KEY}", "X-Session-Id": "s1"}
        async with http.post(url, json=big, headers=headers) as response:
            assert response.status == 413
            assert_shape(await response.json(), type="invalid_request_error", code="request_too_large",
                         param=None)
        assert upstream.received == []
        assert stored_rows(config) == {table: [] for table in TABLES}
        async with http.post(url, json=small, headers=headers) as response:
            assert response.status == 200  # the limit is the configured one, not a lower one
    assert len(upstream.chat_requests()) == 1


@pytest.mark.parametrize("method, path, status, error_type, code, allow", [
    ("GET", "/v1/nothing-here", 404, "not_found_error", "not_found", None),
    ("POST", "/v1/engines/small/completions", 404, "not_found_error", "not_found", None),
    ("GET", "/nothing-here", 404, "not_found_error", "not_found", None),
    ("GET", "/v1/chat/completions", 405, "invalid_request_error", "method_not_allowed", "POST"),
    ("DELETE", "/v1/chat/completions", 405, "invalid_request_error", "method_not_allowed", "POST"),
    ("POST", "/v1/models", 405, "invalid_request_error", "method_not_allowed", "GET,HEAD"),
    ("GET", "/v1/embeddings", 405, "invalid_request_error", "method_not_allowed", "POST"),
    ("POST", "/healthz", 405, "invalid_request_error", "method_not_allowed", "GET,HEAD"),
])
async def test_unknown_route_and_wrong_method_are_json(
    proxy: Proxy, upstream: FakeUpstream, config: Config, method: str, path: str, status: int,
    error_type: str, code: str, allow: str | None,
) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.request(method, proxy.server.make_url(path), json=chat(),
                                headers={"Authorization": f"Bearer {PROXY_KEY}", "X-Session-Id": "s1"}
                                ) as response:
            assert response.status == status
            assert response.content_type == "application/json"
            assert_shape(await response.json(), type=error_type, code=code, param=None)
            if allow is not None:  # a 405 names the methods that are allowed
                assert sorted(response.headers["Allow"].split(",")) == sorted(allow.split(","))
    assert upstream.received == []
    assert stored_rows(config) == {table: [] for table in TABLES}


# --- upstream errors -------------------------------------------------------------------------------

UPSTREAM_STATUSES = [
    (400, openai.BadRequestError, "invalid_request_error"),
    (401, openai.AuthenticationError, "authentication_error"),
    (403, openai.PermissionDeniedError, "permission_error"),
    (404, openai.NotFoundError, "not_found_error"),
    (429, openai.RateLimitError, "rate_limit_error"),
    (500, openai.InternalServerError, "upstream_error"),
    (503, openai.InternalServerError, "upstream_error"),
]


UPSTREAM_CODES = {400: "upstream_bad_request", 401: "upstream_unauthorized", 403: "upstream_forbidden",
                  404: "upstream_not_found", 429: "rate_limit_exceeded"}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("status, exc_type, error_type", UPSTREAM_STATUSES,
                         ids=[str(s[0]) for s in UPSTREAM_STATUSES])
async def test_upstream_error_keeps_its_status(
    proxy: Proxy, upstream: FakeUpstream, config: Config, stream: bool, status: int,
    exc_type: type[openai.APIStatusError], error_type: str,
) -> None:
    upstream.enqueue(Reply(status=status, error_message=f"provider says {status}"))
    client = proxy.client()
    with pytest.raises(exc_type) as caught:
        await client.chat.completions.create(model="small", messages=[USER], stream=stream)
    error = caught.value
    assert error.status_code == status  # a stream that fails before its first chunk is a plain HTTP error
    assert error.response.headers["content-type"].startswith("application/json")
    body = error.response.json()
    assert_shape(body, type=error_type, code=body["error"]["code"], param=None)
    assert body["error"]["code"] == UPSTREAM_CODES.get(status, "upstream_error")
    assert body["error"]["message"] == f"provider says {status}"  # litellm's prefixes are stripped
    assert len(upstream.chat_requests()) == 1  # the proxy does not retry on its own
    assert stored_rows(config) == {table: [] for table in TABLES}
    # A retry of the failed turn is stored once.
    await client.chat.completions.create(model="small", messages=[USER])
    assert rows(config, "SELECT role FROM messages WHERE active = 1 ORDER BY seq") == [("user",), ("assistant",)]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_a_rate_limit_says_when_to_retry_as_the_provider_said(
    proxy: Proxy, upstream: FakeUpstream, stream: bool
) -> None:
    """The openai SDKs time a retry by `retry-after`(-ms); the `x-ratelimit-*` headers say what is
    left. They come with the provider's 429, and no other header of the provider's does."""
    backoff = {"retry-after": "7", "retry-after-ms": "6500", "x-ratelimit-remaining-requests": "0",
               "x-ratelimit-reset-tokens": "12ms"}
    upstream.enqueue(Reply(status=429, headers={**backoff, "set-cookie": "provider=1", "x-request-id": "req_9"}))
    with pytest.raises(openai.RateLimitError) as caught:
        await proxy.client().chat.completions.create(model="small", messages=[USER], stream=stream)
    headers = caught.value.response.headers
    assert {name: headers.get(name) for name in backoff} == backoff
    assert "set-cookie" not in headers and "x-request-id" not in headers


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_upstream_error_names_the_parameter_the_provider_named(
    proxy: Proxy, upstream: FakeUpstream, stream: bool
) -> None:
    upstream.enqueue(Reply(status=400, error_message="temperature must be at most 2", error_param="temperature"))
    with pytest.raises(openai.BadRequestError) as caught:
        await proxy.client().chat.completions.create(model="small", messages=[USER], stream=stream, temperature=3)
    assert caught.value.response.json()["error"]["param"] == "temperature"
    assert caught.value.param == "temperature"


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_upstream_timeout_is_504(
    start_proxy: Callable[[Config], Any], upstream: FakeUpstream, config: Config, stream: bool
) -> None:
    config = replace_model(config, timeout_seconds=0.5)
    proxy: Proxy = await start_proxy(config)
    gate = threading.Event()
    upstream.enqueue(Reply(content="too late", gate=gate))
    try:
        with pytest.raises(openai.APIStatusError) as caught:
            await proxy.client().chat.completions.create(model="small", messages=[USER], stream=stream)
    finally:
        gate.set()
    assert caught.value.status_code == 504
    assert_shape(caught.value.response.json(), type="upstream_error", code="upstream_timeout", param=None)
    assert len(upstream.chat_requests()) == 1
    assert stored_rows(config) == {table: [] for table in TABLES}


async def test_an_answer_trickled_past_the_timeout_is_504_on_either_transport(
    start_proxy: Callable[[Config], Any], upstream: FakeUpstream, config: Config, transport: str,
) -> None:
    """`timeout_seconds` bounds a plain call whole: litellm's own timeout bounds each read, so a
    provider sending a byte every 0.2 s held the request (and the session's lock) for minutes."""
    config = replace_model(config, timeout_seconds=0.5)
    proxy: Proxy = await start_proxy(config)
    upstream.enqueue(Reply(content="slowly " * 20, trickle=0.2))
    with pytest.raises(openai.APIStatusError) as caught:
        await proxy.client().chat.completions.create(model="small", messages=[USER])
    assert caught.value.status_code == 504
    assert_shape(caught.value.response.json(), type="upstream_error", code="upstream_timeout", param=None)
    assert stored_rows(config) == {table: [] for table in TABLES}


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A port on which nothing listens, held for the test: bound but not listening, it refuses every
    connection, and no other test's server (xdist runs several at once) can take it meanwhile."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_unreachable_upstream_is_502(
    start_proxy: Callable[[Config], Any], upstream: FakeUpstream, config: Config, stream: bool, closed_port: int
) -> None:
    config = replace_model(config, api_base=f"http://127.0.0.1:{closed_port}/v1")
    proxy: Proxy = await start_proxy(config)
    with pytest.raises(openai.APIStatusError) as caught:
        await proxy.client().chat.completions.create(model="small", messages=[USER], stream=stream)
    assert caught.value.status_code == 502
    assert_shape(caught.value.response.json(), type="upstream_error", code="upstream_unreachable", param=None)
    # Why, in the system's words, but not where: the operator's upstream host stays the operator's.
    message = caught.value.response.json()["error"]["message"]
    assert "Connection refused" in message and str(closed_port) not in message and "0x" not in message, message
    assert upstream.received == []
    assert stored_rows(config) == {table: [] for table in TABLES}


async def read_sse(proxy: Proxy, body: dict[str, Any]) -> tuple[int, list[str]]:
    async with aiohttp.ClientSession() as http:
        async with http.post(proxy.server.make_url("/v1/chat/completions"), json=body,
                             headers={"Authorization": f"Bearer {PROXY_KEY}", "X-Session-Id": "s1"}
                             ) as response:
            raw = (await response.read()).decode()
            return response.status, [e[len("data: "):] for e in raw.split("\n\n") if e]


async def test_upstream_cut_mid_stream_ends_with_an_error_event_and_stores_nothing(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    upstream.enqueue(Reply(content="a long answer that never ends", cut_stream=True))
    status, events = await read_sse(proxy, chat(stream=True))
    assert status == 200  # the status went out with the first chunk; the error comes as the last event
    assert json.loads(events[1])["choices"][0]["delta"]["content"] == "a long an"
    assert "[DONE]" not in events
    last = json.loads(events[-1])
    assert_shape(last, type="upstream_error", code=last["error"]["code"], param=None)
    assert stored_rows(config) == {table: [] for table in TABLES}
    # The SDK sees the error event as an error, not as a short answer.
    upstream.enqueue(Reply(content="a long answer that never ends", cut_stream=True))
    stream = await proxy.client().chat.completions.create(model="small", messages=[USER], stream=True)
    with pytest.raises(openai.APIError):
        async for _ in stream:
            pass
    assert stored_rows(config) == {table: [] for table in TABLES}


async def test_upstream_stalled_mid_stream_past_the_timeout_stores_nothing(
    start_proxy: Callable[[Config], Any], upstream: FakeUpstream, config: Config
) -> None:
    config = replace_model(config, timeout_seconds=0.5)
    proxy: Proxy = await start_proxy(config)
    gate = threading.Event()
    upstream.enqueue(Reply(content="a long answer that stalls", gate_after_first_chunk=gate))
    try:
        status, events = await read_sse(proxy, chat(stream=True))
    finally:
        gate.set()
    assert status == 200
    assert json.loads(events[1])["choices"][0]["delta"]["content"] == "a long a"
    assert "[DONE]" not in events
    last = json.loads(events[-1])
    assert_shape(last, type="upstream_error", code="upstream_timeout", param=None)  # not "unreachable"
    assert stored_rows(config) == {table: [] for table in TABLES}


@pytest.mark.parametrize("how", ["done", "cut"])
async def test_a_stream_that_brings_no_chunk_is_a_502_before_anything_is_sent(
    proxy: Proxy, upstream: FakeUpstream, config: Config, how: str
) -> None:
    """A stream that ends (with [DONE] alone, or a closed connection) before its first chunk is the
    README's 502 on either transport, before any byte of a 200: before, memproxy's own client sent a
    200 and then an error event, and litellm's path a 500."""
    upstream.enqueue(Reply(content="never sent", no_chunks=how))
    async with aiohttp.ClientSession() as http:
        async with http.post(proxy.server.make_url("/v1/chat/completions"), json=chat(stream=True),
                             headers={"Authorization": f"Bearer {PROXY_KEY}", "X-Session-Id": "s1"}) as response:
            status, body = response.status, await response.json()
    assert status == 502, body
    assert_shape(body, type="upstream_error", code="upstream_incomplete", param=None)
    assert stored_rows(config) == {table: [] for table in TABLES}


@pytest.mark.parametrize("done", [False, True])
async def test_a_stream_the_upstream_ends_before_its_answer_is_not_passed_off_as_whole(
    proxy: Proxy, upstream: FakeUpstream, config: Config, done: bool
) -> None:
    """The upstream closes its stream cleanly mid-answer (no finish reason; with or without the
    closing [DONE]): an error event ends the client's stream and nothing is stored, on litellm's
    path too, whose stream wrapper ends such a stream with a finish reason of its own, and whose
    HTTP handler reads [DONE] as one."""
    upstream.enqueue(Reply(content="The capital of France is Paris", end_stream_early=not done, done_early=done))
    status, events = await read_sse(proxy, chat(stream=True))
    assert status == 200 and "[DONE]" not in events
    assert not any(c.get("finish_reason") for e in events[:-1] for c in json.loads(e)["choices"])
    last = json.loads(events[-1])
    assert_shape(last, type=last["error"]["type"], code="upstream_incomplete", param=None)
    assert stored_rows(config) == {table: [] for table in TABLES}


async def test_a_stream_whose_last_text_chunk_carries_its_finish_reason_is_whole(
    proxy: Proxy, upstream: FakeUpstream, config: Config
) -> None:
    """vLLM, Ollama and llama.cpp send the finish reason on the chunk with the answer's last text.
    litellm's stream wrapper relays that text and ends the stream with a finish chunk of its own, as
    it ends one the provider broke off: this one the provider finished, so it ends with [DONE] and
    is stored."""
    upstream.enqueue(Reply(content="The capital of France is Paris", finish_with_text=True))
    status, events = await read_sse(proxy, chat(stream=True))
    assert status == 200 and events[-1] == "[DONE]", events[-1]
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["delta"].get("content") or "" for e in chunks for c in e["choices"]) \
        == "The capital of France is Paris"
    assert [c["finish_reason"] for e in chunks for c in e["choices"] if c["finish_reason"]] == ["stop"]
    assert rows(config, "SELECT role FROM messages WHERE active = 1 ORDER BY seq") == [("user",), ("assistant",)]
