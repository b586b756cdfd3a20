"""The API surface: the small endpoints, pass-through of every request parameter, auth, and streaming
relayed chunk by chunk. The real proxy runs as a real server; the `openai` SDK is the client."""

from __future__ import annotations

import asyncio
import gc
import json
import threading
from typing import Any

import aiohttp
import openai
import pytest

from conftest import OTHER_KEY, PROXY_KEY, Proxy, replace_model
from db import rows
from fake_upstream import FakeUpstream, Reply
from helpers import complete
from memproxy.config import Config
from memproxy.typedefs import STORE

pytestmark = [pytest.mark.both_stores, pytest.mark.both_transports]

TOOLS: Any = [{  # the SDK types these as TypedDicts; the test only needs the JSON
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]
RESPONSE_FORMAT: dict[str, Any] = {
    "type": "json_schema",
    "json_schema": {"name": "answer", "strict": True,
                    "schema": {"type": "object", "properties": {"text": {"type": "string"}},
                               "required": ["text"], "additionalProperties": False}},
}


def auth(key: str = PROXY_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# --- the small endpoints ---------------------------------------------------------------------------


async def test_models_lists_configured_names(proxy: Proxy, upstream: FakeUpstream) -> None:
    client = proxy.client()
    page = await client.models.list()
    assert [m.id for m in page.data] == ["small", "big"]
    assert all(m.object == "model" for m in page.data)
    assert upstream.received == []  # the list is the config's, not the provider's


async def test_models_needs_the_proxy_key(proxy: Proxy) -> None:
    with pytest.raises(openai.AuthenticationError) as caught:
        await proxy.client(key="not-a-proxy-key").models.list()
    assert caught.value.status_code == 401


async def test_healthz_answers_without_auth(proxy: Proxy, upstream: FakeUpstream) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(proxy.server.make_url("/healthz")) as response:
            assert response.status == 200
            assert await response.json() == {"status": "ok"}
    assert upstream.received == []


async def test_readyz_reports_the_store(proxy: Proxy) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(proxy.server.make_url("/readyz")) as response:
            assert response.status == 200
            assert await response.json() == {"status": "ready"}
        await proxy.app[STORE].close()  # the store going away is what readiness is about
        async with http.get(proxy.server.make_url("/readyz")) as response:
            assert response.status == 503
            body = await response.json()
    assert body == {"error": {"message": body["error"]["message"], "type": "server_error",
                              "code": "store_unavailable", "param": None}}


# --- every parameter passes through ----------------------------------------------------------------

PASS_THROUGH: dict[str, Any] = {
    "tools": TOOLS,
    "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    "parallel_tool_calls": False,
    "response_format": RESPONSE_FORMAT,
    "temperature": 0.25,
    "top_p": 0.5,
    "seed": 1234,
    "n": 2,
    "stop": ["END", "STOP"],
    "user": "user-77",
    "metadata": {"purpose": "test", "ticket": "42"},
    "logit_bias": {"50256": -100},
    "reasoning_effort": "low",
    "presence_penalty": 0.5,
    "frequency_penalty": 0.25,
    "max_completion_tokens": 77,
    "logprobs": True,
    "top_logprobs": 2,
    "store": False,
    "service_tier": "auto",
    "prompt_cache_key": "cache-1",
    "prompt_cache_retention": "24h",
    "safety_identifier": "hashed-user",
    "verbosity": "low",
    "modalities": ["text"],
    "prediction": {"type": "content", "content": "It is sunny."},
    "web_search_options": {"search_context_size": "low"},
}
EXTRA: dict[str, Any] = {"vendor_option": {"nested": [1, 2, 3]}, "top_k": 5}


@pytest.mark.parametrize("session", ["s1", None], ids=["with-session", "without-session"])
async def test_every_parameter_reaches_upstream_unchanged(
    proxy: Proxy, upstream: FakeUpstream, session: str | None
) -> None:
    client = proxy.client(session=session)
    response = await client.chat.completions.create(
        model="small", messages=[{"role": "user", "content": "weather in Paris?"}],
        extra_body=EXTRA, **PASS_THROUGH,
    )
    assert len(response.choices) == 2  # n=2 went upstream and both choices came back
    sent = upstream.last().body
    for name, value in {**PASS_THROUGH, **EXTRA}.items():
        assert sent.get(name) == value, name
    assert sent["model"] == "small"
    assert sent["messages"] == [{"role": "user", "content": "weather in Paris?"}]


async def test_an_answer_has_only_what_the_provider_sent(proxy: Proxy, upstream: FakeUpstream,
                                                         http: aiohttp.ClientSession) -> None:
    upstream.enqueue(Reply(content="Hello."))
    async with http.post(f"{proxy.url}/chat/completions", json={"model": "small", "messages": [{"role": "user", "content": "hi"}]},
                         headers={"Authorization": f"Bearer {PROXY_KEY}", "X-Session-Id": "s1"}) as response:
        body = await response.json()
    [choice] = body["choices"]
    assert set(choice) <= {"index", "message", "finish_reason", "logprobs"}, choice
    assert choice["message"] == {"role": "assistant", "content": "Hello."}


async def test_an_answer_says_refusal_null_where_the_provider_did(
        proxy: Proxy, upstream: FakeUpstream, http: aiohttp.ClientSession) -> None:
    upstream.enqueue(Reply(content="Hello.", refusal_null=True))
    async with http.post(f"{proxy.url}/chat/completions", json={"model": "small", "messages": [{"role": "user", "content": "hi"}]},
                         headers={"Authorization": f"Bearer {PROXY_KEY}", "X-Session-Id": "s1"}) as response:
        [choice] = (await response.json())["choices"]
    assert choice["message"] == {"role": "assistant", "content": "Hello.", "refusal": None}


async def test_a_refusal_reaches_the_client_and_is_resent_as_a_valid_message(
        proxy: Proxy, upstream: FakeUpstream, http: aiohttp.ClientSession) -> None:
    """A refusal comes back where OpenAI's clients look for it (`message.refusal`, with `content:
    null`), and the next turn sends it back with text, as OpenAI requires of an assistant message
    that calls no tool."""
    no = "I can't help with that."
    upstream.enqueue(Reply(content=None, refusal=no))
    question = {"role": "user", "content": "something forbidden"}
    async with http.post(f"{proxy.url}/chat/completions", json={"model": "small", "messages": [question]},
                         headers={"Authorization": f"Bearer {PROXY_KEY}", "X-Session-Id": "refused"}) as response:
        [choice] = (await response.json())["choices"]
    assert choice["message"] == {"role": "assistant", "content": None, "refusal": no}
    assert choice["logprobs"] is None and choice["finish_reason"] == "stop"
    history = [question, choice["message"], {"role": "user", "content": "then something else"}]
    _, headers = await complete(proxy.client(session="refused"), history)
    assert headers["X-Memproxy-Reconcile"] == "continue"
    assert upstream.last().messages[:2] == [question, {"role": "assistant", "content": "", "refusal": no}]


async def test_a_streamed_refusal_reaches_the_client_and_the_store(proxy: Proxy, upstream: FakeUpstream) -> None:
    """A refusal streamed as OpenAI streams it (a delta holding `refusal` alone) reaches a chat
    stream as that delta and a Responses stream as a `refusal` part, and is stored: on the litellm
    transport its wrapper used to drop the chunk, an empty answer sent and stored."""
    no = "I can't help with that."
    upstream.enqueue(Reply(content=None, refusal=no), Reply(content="Fine."), Reply(content=None, refusal=no))
    client = proxy.client(session="refused-streamed")
    question = {"role": "user", "content": "something forbidden"}
    stream = await client.chat.completions.create(model="small", messages=[question], stream=True)
    deltas = [choice.delta async for chunk in stream for choice in chunk.choices]
    assert "".join(d.refusal or "" for d in deltas) == no and not "".join(d.content or "" for d in deltas)
    await complete(client, [{"role": "user", "content": "then something else"}])
    assert upstream.last().messages[1] == {"role": "assistant", "content": "", "refusal": no}
    events = [e async for e in await client.responses.create(model="small", input="again", stream=True)]
    [done] = [e for e in events if e.type == "response.output_item.done"]
    assert [part.model_dump() for part in done.item.content] == [{"type": "refusal", "refusal": no}]


async def test_answers_and_chunks_carry_the_null_fields_openai_sends(
        proxy: Proxy, upstream: FakeUpstream, http: aiohttp.ClientSession) -> None:
    """A client may test `content === null` beside tool calls, or `finish_reason !== null` to find
    the end of a stream: the keys are there, null, as in OpenAI's answers."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    upstream.enqueue(Reply(tool_calls=[call]), Reply(content="streamed answer"))
    body = {"model": "small", "messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS}
    auth = {"Authorization": f"Bearer {PROXY_KEY}"}
    async with http.post(f"{proxy.url}/chat/completions", json=body, headers=auth) as response:
        [choice] = (await response.json())["choices"]
    assert choice["message"]["content"] is None and choice["message"]["tool_calls"][0]["id"] == "call_1"
    async with http.post(f"{proxy.url}/chat/completions", json={**body, "stream": True}, headers=auth) as response:
        lines = [line for line in (await response.text()).splitlines() if line.startswith("data: {")]
    choices = [c for line in lines for c in json.loads(line[6:])["choices"]]
    assert choices and all("finish_reason" in c for c in choices)
    assert [c["finish_reason"] for c in choices][-1] == "stop" and choices[0]["finish_reason"] is None



@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
async def test_logprobs_come_back_with_the_null_fields_openai_sends(
        proxy: Proxy, upstream: FakeUpstream, http: aiohttp.ClientSession, stream: bool) -> None:
    """OpenAI's logprobs say `"refusal": null` beside the content's tokens: a client may test
    `logprobs.refusal !== null` before it reads them, so the key is there, as the provider sent it."""
    tokens = [{"token": "Hi", "logprob": -0.25, "bytes": [72, 105], "top_logprobs": []}]
    upstream.enqueue(Reply(content="Hi", logprobs=tokens))
    body = {"model": "small", "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "stream": stream}
    async with http.post(f"{proxy.url}/chat/completions", json=body,
                         headers={"Authorization": f"Bearer {PROXY_KEY}", "X-Session-Id": "s1"}) as response:
        text = await response.text()
    if stream:
        chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        logprobs = [c["logprobs"] for chunk in chunks for c in chunk["choices"] if c.get("logprobs") is not None]
    else:
        logprobs = [json.loads(text)["choices"][0]["logprobs"]]
    assert logprobs == [{"content": tokens, "refusal": None}]


async def test_stream_parameters_reach_upstream_unchanged(proxy: Proxy, upstream: FakeUpstream) -> None:
    upstream.enqueue(Reply(content="streamed answer"))
    client = proxy.client()
    stream = await client.chat.completions.create(
        model="small", messages=[{"role": "user", "content": "hi"}], stream=True,
        stream_options={"include_usage": True}, tools=TOOLS, tool_choice="auto", seed=7, temperature=0,
        user="u-1", metadata={"k": "v"}, max_tokens=50, extra_body={"vendor_option": True},
    )
    chunks = [chunk async for chunk in stream]
    sent = upstream.last().body
    assert sent["stream"] is True
    assert sent["stream_options"] == {"include_usage": True}
    assert sent["tools"] == TOOLS
    assert (sent["tool_choice"], sent["seed"], sent["temperature"]) == ("auto", 7, 0)
    assert (sent["user"], sent["metadata"], sent["vendor_option"]) == ("u-1", {"k": "v"}, True)
    assert sent["max_tokens"] == 50
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "streamed answer"
    usage = [c.usage for c in chunks if c.usage is not None]
    assert usage and usage[-1].completion_tokens == 5  # the usage chunk asked for came through


async def test_tool_calls_come_back_to_the_client(proxy: Proxy, upstream: FakeUpstream) -> None:
    call: dict[str, Any] = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    upstream.enqueue(Reply(tool_calls=[call]), Reply(tool_calls=[call]))
    client = proxy.client()
    response = await client.chat.completions.create(
        model="small", messages=[{"role": "user", "content": "weather?"}], tools=TOOLS)
    assert response.choices[0].finish_reason == "tool_calls"
    assert response.choices[0].message.tool_calls is not None
    assert response.choices[0].message.tool_calls[0].model_dump() == call
    stream = await proxy.client(session="s2").chat.completions.create(
        model="small", messages=[{"role": "user", "content": "weather?"}], tools=TOOLS,
        stream=True)
    arguments = ""
    async for chunk in stream:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            assert delta.function is not None
            arguments += delta.function.arguments or ""
    assert arguments == call["function"]["arguments"]



GRAMMAR_TOOL: Any = [{"type": "custom", "custom": {"name": "grammar", "description": "An arithmetic expression."}}]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
async def test_a_custom_tools_call_is_taken_and_sent_back_as_it_came(
        proxy: Proxy, upstream: FakeUpstream, stream: bool) -> None:
    """OpenAI's custom tools (GPT-5's free-form input) are called `{"type": "custom", "custom":
    {"name", "input"}}`: a client resending one in its history is not refused, and one the model
    made is stored and sent back so, not as a function of no name."""
    call: dict[str, Any] = {"id": "call_1", "type": "custom", "custom": {"name": "grammar", "input": "2 + 3"}}
    question = {"role": "user", "content": "add two and three"}
    upstream.enqueue(Reply(tool_calls=[call]), Reply(content="5"), Reply(content="done"))
    client = proxy.client(session="custom")
    if stream:
        chunks = await client.chat.completions.create(model="small", messages=[question], tools=GRAMMAR_TOOL,
                                                      stream=True)
        async for _ in chunks:
            pass
    else:
        await client.chat.completions.create(model="small", messages=[question], tools=GRAMMAR_TOOL)
    result = {"role": "tool", "tool_call_id": "call_1", "content": "5"}
    await client.chat.completions.create(model="small", messages=[result], tools=GRAMMAR_TOOL)
    assert upstream.last().messages[1] == {"role": "assistant", "tool_calls": [call]}
    history = [question, {"role": "assistant", "content": None, "tool_calls": [call]}, result,
               {"role": "assistant", "content": "5"}, {"role": "user", "content": "thanks"}]
    await proxy.client(session=None).chat.completions.create(model="small", messages=history, tools=GRAMMAR_TOOL)
    assert upstream.last().messages[1]["tool_calls"] == [call]


FUNCTIONS: Any = [{"name": "get_weather", "parameters": {"type": "object", "properties": {}}}]


async def test_a_legacy_function_result_of_null_content_is_taken_and_sent_back_as_text(
        proxy: Proxy, upstream: FakeUpstream, http: aiohttp.ClientSession) -> None:
    """A legacy function result's `content` is required but nullable (a function that returned
    nothing): OpenAI takes `null`, so memproxy does, and sends it as empty text, now and on every
    later turn (litellm leaves a null out, and OpenAI requires the key). Left out, it is a 400."""
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "function_call": {"name": "get_weather", "arguments": "{}"}}]
    sent_as = {"role": "function", "name": "get_weather", "content": ""}
    client = proxy.client(session="legacy")
    upstream.enqueue(Reply(content="No weather today."), Reply(content="You are welcome."))
    await complete(client, [*history, {"role": "function", "name": "get_weather", "content": None}],
                   functions=FUNCTIONS)
    assert upstream.last().messages[2] == sent_as
    _, headers = await complete(client, [{"role": "user", "content": "thanks"}], functions=FUNCTIONS)
    assert upstream.last().messages[2] == sent_as and len(upstream.last().messages) == 5
    async with http.post(f"{proxy.url}/chat/completions", json={
            "model": "small", "messages": [{"role": "function", "name": "get_weather"}]},
            headers={"Authorization": f"Bearer {PROXY_KEY}", "X-Session-Id": "legacy"}) as response:
        assert response.status == 400
        assert (await response.json())["error"]["param"] == "messages[0].content"
    assert len(upstream.chat_requests()) == 2


async def test_the_openai_sdks_parse_results_are_not_sent_upstream(
        proxy: Proxy, upstream: FakeUpstream, config: Config) -> None:
    """An app on `client.chat.completions.parse` keeps each answer as `model_dump()`, with the SDK's
    `parsed` and each tool call's `parsed_arguments`. Pointed at memproxy with that history (a new
    session stores the client's messages as sent), they went to the provider on this turn and every
    later one: fields no chat API defines, which a provider that checks its input refuses."""
    answer = {"role": "assistant", "content": '{"text":"Hi Ada."}', "refusal": None, "annotations": None,
              "audio": None, "function_call": None, "tool_calls": None, "parsed": {"text": "Hi Ada."}}
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city":"Paris"}', "parsed_arguments": {"city": "Paris"}}}
    calls = {"role": "assistant", "content": None, "refusal": None, "parsed": None, "tool_calls": [call]}
    history = [{"role": "user", "content": "I am Ada."}, answer, {"role": "user", "content": "Weather?"}, calls,
               {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]
    client = proxy.client(session="parsed")
    upstream.enqueue(Reply(content='{"text":"It is 18C."}'), Reply(content='{"text":"Bye."}'))
    await complete(client, history, tools=TOOLS, response_format=RESPONSE_FORMAT)
    await complete(client, [{"role": "user", "content": "Bye."}], tools=TOOLS, response_format=RESPONSE_FORMAT)
    wanted = [{"role": "user", "content": "I am Ada."}, {"role": "assistant", "content": '{"text":"Hi Ada."}'},
              {"role": "user", "content": "Weather?"},
              {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
              {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]
    first, second = upstream.chat_requests()
    assert first.messages == wanted
    assert second.messages == [*wanted, {"role": "assistant", "content": '{"text":"It is 18C."}'},
                               {"role": "user", "content": "Bye."}]


def breakpoints(messages: list[dict[str, Any]]) -> list[str]:
    """The texts of the content parts that carry a prompt-caching breakpoint, in order."""
    return [part["text"] for m in messages if isinstance(m["content"], list)
            for part in m["content"] if "cache_control" in part]


async def test_stored_cache_breakpoints_never_take_a_request_past_four(
        proxy: Proxy, upstream: FakeUpstream, http: aiohttp.ClientSession) -> None:
    """Anthropic (and OpenRouter and Bedrock on to it) refuse a request with more than four
    `cache_control` breakpoints. A client that marks its newest message each turn, as Cline and
    Anthropic's docs do, had every stored message keep its mark: within a few turns every
    request of the session was refused. The oldest stored marks go; the system prompt's, the tools'
    and the new message's stay, and the preview shows the request as sent."""
    mark = {"type": "ephemeral"}
    system = {"role": "system", "content": [{"type": "text", "text": "rules", "cache_control": mark}]}
    tools = [{**TOOLS[0], "cache_control": mark}]
    client = proxy.client(session="cached")
    for i in range(5):
        upstream.enqueue(Reply(content=f"answer {i}"))
        new = {"role": "user", "content": [{"type": "text", "text": f"question {i}", "cache_control": mark}]}
        await complete(client, [system, new] if i == 0 else [new], tools=tools)
    sent = upstream.last().messages
    assert breakpoints(sent) == ["rules", "question 3", "question 4"]  # and the tool's: four
    assert [part["text"] for part in sent[1]["content"]] == ["question 0"]  # the stored message, unmarked
    following = {"role": "user", "content": [{"type": "text", "text": "question 5", "cache_control": mark}]}
    async with http.post(f"{proxy.url}/sessions/cached/context", headers=auth(), json={
            "model": "small", "messages": [following], "tools": tools}) as response:
        assert breakpoints((await response.json())["messages"]) == ["rules", "question 4", "question 5"]


# --- auth --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("headers", [
    {},
    {"Authorization": "Bearer wrong-key-123"},
    {"Authorization": f"Basic {PROXY_KEY}"},
    {"Authorization": "Bearer "},
    {"Authorization": f"Bearer:{PROXY_KEY}"},
    {"Authorization": PROXY_KEY},
    {"Authorization": f"Bearer {PROXY_KEY}x"},
    {"Authorization": f"Bearer {PROXY_KEY[:-1]}"},
], ids=["missing", "wrong", "not-bearer", "empty", "no-space", "no-scheme", "longer", "prefix"])
async def test_bad_proxy_key_is_401(proxy: Proxy, upstream: FakeUpstream, headers: dict[str, str]) -> None:
    body = {"model": "small", "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as http:
        async with http.post(proxy.server.make_url("/v1/chat/completions"), json=body,
                             headers={**headers, "X-Session-Id": "s1"}) as response:
            assert response.status == 401
            assert response.content_type == "application/json"
            error = await response.json()
    assert error == {"error": {"message": error["error"]["message"], "type": "authentication_error",
                               "code": "invalid_api_key", "param": None}}
    assert error["error"]["message"]
    assert upstream.received == []


@pytest.mark.parametrize("key", [PROXY_KEY.encode() + b"\xe9", b"\xff\xfe", "cl\u00e9".encode()],
                         ids=["latin-1", "not-utf-8", "utf-8"])
async def test_a_key_of_bytes_no_configured_key_has_is_401(proxy: Proxy, upstream: FakeUpstream, key: bytes) -> None:
    """A key is compared as the bytes sent. One that is not UTF-8 reached the comparison as text
    that could not be encoded back: an unhandled error, a 500 for a caller without a key."""
    body = json.dumps({"model": "small", "messages": [{"role": "user", "content": "hi"}]}).encode()
    reader, writer = await asyncio.open_connection(proxy.server.host, proxy.server.port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
                 b"Content-Type: application/json\r\nAuthorization: Bearer " + key + b"\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    answer = await reader.read()
    writer.close()
    await writer.wait_closed()
    head, _, error = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 401 "), answer
    assert json.loads(error)["error"]["code"] == "invalid_api_key"
    assert upstream.received == []


@pytest.mark.parametrize("header", [f"Bearer {PROXY_KEY}", f"bearer {PROXY_KEY}", f"BEARER  {PROXY_KEY} "])
async def test_good_proxy_key_is_accepted(proxy: Proxy, upstream: FakeUpstream, header: str) -> None:
    body = {"model": "small", "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as http:
        async with http.post(proxy.server.make_url("/v1/chat/completions"), json=body,
                             headers={"Authorization": header}) as response:
            assert response.status == 200
            assert (await response.json())["choices"][0]["message"]["content"] == "reply 1"
    assert len(upstream.chat_requests()) == 1


async def test_wrong_key_through_the_sdk(proxy: Proxy, upstream: FakeUpstream) -> None:
    with pytest.raises(openai.AuthenticationError) as caught:
        await proxy.client(key="sk-not-the-proxy-key").chat.completions.create(
            model="small", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.status_code == 401
    assert caught.value.code == "invalid_api_key"
    assert upstream.received == []


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("key", [PROXY_KEY, OTHER_KEY])
async def test_proxy_key_is_never_forwarded(
    proxy: Proxy, upstream: FakeUpstream, stream: bool, key: str
) -> None:
    for session in ("s1", None):
        response = await proxy.client(session=session, key=key).chat.completions.create(
            model="small", messages=[{"role": "user", "content": "hi"}], stream=stream)
        if stream:
            async for _ in response:  # type: ignore[union-attr]
                pass
    requests = upstream.chat_requests()
    assert len(requests) == 2
    for received in requests:
        headers = {k.lower(): v for k, v in received.headers.items()}
        assert headers["authorization"] == "Bearer upstream-secret"
        everything = json.dumps(received.headers) + json.dumps(received.body)
        assert key not in everything
        assert "X-Session-Id".lower() not in headers  # memory headers stay at the proxy


@pytest.mark.parametrize("stream", [False, True])
async def test_a_models_own_headers_go_upstream_and_a_clients_never_do(
    start_proxy: Any, config: Config, upstream: FakeUpstream, stream: bool
) -> None:
    mine = {"HTTP-Referer": "https://app.example", "X-Gateway-Key": "gw-secret-1"}
    proxy = await start_proxy(replace_model(config, headers=mine))
    client = proxy.client(session="s1", **{"X-Client-Header": "from-the-client"})
    for model in ("small", "big"):
        response = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], stream=stream,
            extra_headers={"X-Gateway-Key": "the-clients-own"}, extra_body={"extra_headers": {"X-Evil": "1"}})
        if stream:
            async for _ in response:  # type: ignore[union-attr]
                pass
    small, big = ({k.lower(): v for k, v in r.headers.items()} for r in upstream.chat_requests())
    assert (small["http-referer"], small["x-gateway-key"]) == ("https://app.example", "gw-secret-1")
    assert small["authorization"] == big["authorization"] == "Bearer upstream-secret"
    assert not {"http-referer", "x-gateway-key"} & set(big)  # another model's are its own
    for headers in (small, big):
        assert not {"x-client-header", "x-evil"} & set(headers)


async def test_a_tool_choice_litellm_refuses_is_a_400_not_a_retried_502(
    proxy: Proxy, config: Config, upstream: FakeUpstream, transport: str
) -> None:
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}
    choice = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [{"type": "function",
                                                                                   "name": "lookup"}]}}
    client = proxy.client(session="s1")
    if transport == "litellm":  # litellm refuses it in its own code: said as the client's error, nothing stored
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="small", messages=[{"role": "user", "content": "hi"}],
                                                 tools=[tool], tool_choice=choice)  # type: ignore[arg-type]
        assert (caught.value.code, caught.value.param) == (None, "tool_choice")
        assert upstream.received == [] and rows(config, "SELECT * FROM messages") == []
    else:  # memproxy's own client relays it as sent
        await client.chat.completions.create(model="small", messages=[{"role": "user", "content": "hi"}],
                                             tools=[tool], tool_choice=choice)  # type: ignore[arg-type]
        assert upstream.last().body["tool_choice"] == choice
    await client.chat.completions.create(  # the form litellm takes goes through on both
        model="small", messages=[{"role": "user", "content": "hi"}], tools=[tool],
        tool_choice={"type": "function", "function": {"name": "lookup"}})
    assert upstream.last().body["tool_choice"] == {"type": "function", "function": {"name": "lookup"}}


# --- streaming ------------------------------------------------------------------------------------


async def test_stream_is_relayed_as_sse_chunks_ending_with_done(proxy: Proxy, upstream: FakeUpstream) -> None:
    upstream.enqueue(Reply(content="one two three four five six"))
    body = {"model": "small", "stream": True, "messages": [{"role": "user", "content": "count"}]}
    async with aiohttp.ClientSession() as http:
        async with http.post(proxy.server.make_url("/v1/chat/completions"), json=body,
                             headers={**auth(), "X-Session-Id": "s1"}) as response:
            assert response.status == 200
            assert response.content_type == "text/event-stream"
            assert response.headers["X-Session-Id"] == "s1"
            raw = (await response.read()).decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    contents = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
    assert len([c for c in contents if c]) >= 3
    assert "".join(c or "" for c in contents) == "one two three four five six"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_stream_reaches_the_client_before_the_upstream_finishes(
    proxy: Proxy, upstream: FakeUpstream
) -> None:
    release = threading.Event()
    upstream.enqueue(Reply(content="first second third", gate_after_first_chunk=release))
    client = proxy.client()
    try:
        stream = await client.chat.completions.create(
            model="small", stream=True, messages=[{"role": "user", "content": "go"}])
        chunks = stream.__aiter__()
        received = ""
        while not received:
            # The upstream holds the rest of its answer until `release`: if the proxy buffered the
            # stream, no content could arrive here and this would time out.
            chunk = await asyncio.wait_for(chunks.__anext__(), timeout=20)
            received += (chunk.choices[0].delta.content or "") if chunk.choices else ""
        assert not release.is_set()
        assert "first second third".startswith(received)
        assert received != "first second third"
    finally:
        release.set()
    rest = "".join([(c.choices[0].delta.content or "") async for c in chunks if c.choices])
    assert received + rest == "first second third"
    await stream.close()


async def test_what_start_up_loaded_is_out_of_the_collectors_sight_while_serving(proxy: Proxy) -> None:
    # litellm's import leaves some 300,000 objects that live as long as the process: frozen, a full
    # collection does not walk them (a pause of a few hundred ms per collection otherwise).
    assert gc.get_freeze_count() > 0
    answer = await proxy.client().chat.completions.create(model="small", messages=[{"role": "user", "content": "hi"}])
    assert answer.choices[0].message.content


async def test_what_the_client_sent_is_stored_and_resent_as_sent_whatever_the_transport_changes(
        proxy: Proxy, upstream: FakeUpstream, config: Config) -> None:
    # litellm rewrites content parts in place (it drops an image's `format`); the messages it is
    # given are copies, so neither the stored turn nor the history cached for the next turn changes.
    image = {"type": "image_url", "image_url": {"url": "https://example.invalid/a.png", "format": "image/png"}}
    sent = {"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}
    client = proxy.client()
    await client.chat.completions.create(model="small", messages=[sent])  # type: ignore[list-item]
    await client.chat.completions.create(model="small", messages=[{"role": "user", "content": "and now?"}])
    stored = [json.loads(body) for (body,) in rows(config, "SELECT body FROM messages ORDER BY seq")]
    assert stored[0] == sent
    assert len(upstream.chat_requests()) == 2
    first_time, second_time = (request.messages[0] for request in upstream.chat_requests())
    assert first_time == second_time  # as the transport sends it, the same on both turns


async def test_a_content_part_litellm_cannot_take_is_a_400_there_and_passed_on_by_the_own_client(
    proxy: Proxy, upstream: FakeUpstream, config: Config, transport: str
) -> None:
    """litellm refuses a user message's part of a type it does not know before any provider sees it,
    as a connection error (a 502, which SDKs retry): through it, a 400 naming the part, nothing
    stored. memproxy's own client passes the part on for the server to judge. A media part without
    its field is refused on either: stored, it would fail every later turn that sends it."""
    client = proxy.client(session="parts")
    odd: Any = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "foo", "foo": 1}]}]
    if transport == "litellm":
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="small", messages=odd)
        assert refused.value.body["param"] == "messages[0].content[1].type"  # type: ignore[index]
        assert upstream.received == []
    else:
        await client.chat.completions.create(model="small", messages=odd)
        assert upstream.last().messages[-1] == odd[0]
    before = len(upstream.received)
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model="small", messages=[{"role": "user", "content": [  # type: ignore[list-item]
            {"type": "image_url"}]}])
    assert refused.value.body["param"] == "messages[0].content[0].image_url"  # type: ignore[index]
    assert len(upstream.received) == before
