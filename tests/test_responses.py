"""The Responses API with memory: `POST /v1/responses` (plain and streamed), `GET` and `DELETE
/v1/responses/{id}`, `GET /v1/responses/{id}/input_items`, driven by the official SDK
(`client.responses.create` / `.stream`) and the OpenAI Agents SDK on its default Responses model,
through a real proxy to two fake providers: one that speaks only chat completions (the bridge,
`responses_api: bridge`) and one that speaks only the Responses API (`responses_api: native`).
What each provider received proves the memory; what the client got proves the wire."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import aiohttp
import openai
import pytest

from conftest import OTHER_KEY, PROXY_KEY, Proxy
from fake_responses import FakeResponsesUpstream
from fake_upstream import FakeUpstream, Reply
from helpers import until
from memproxy.config import Config, ModelConfig
from memproxy.typedefs import SUMMARIZER
from summaries import fact_summariser
from test_budget import words
from test_endpoints import assert_error

pytestmark = [pytest.mark.both_stores]

WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def responses_server() -> Iterator[FakeResponsesUpstream]:
    fake = FakeResponsesUpstream().start()
    yield fake
    fake.stop()


@pytest.fixture
def native_upstream(responses_server: FakeResponsesUpstream) -> FakeResponsesUpstream:
    responses_server.reset()
    return responses_server


@pytest.fixture
def config(config: Config, native_upstream: FakeResponsesUpstream) -> Config:
    native = ModelConfig(name="native", model="openai/gpt-4o-mini", api_base=native_upstream.url,
                         api_key="upstream-secret", context_window=2000, max_output_tokens=256,
                         responses_api="native")
    return replace(config, models=(*config.models, native))


class Upstream:
    """One of the two providers, seen the same way: the model that reaches it, its script, and the
    conversation its newest request carried as (role, text) pairs."""

    def __init__(self, wire: str, chat: FakeUpstream, native: FakeResponsesUpstream) -> None:
        self.wire = wire
        self.model = "small" if wire == "bridge" else "native"
        self.fake: FakeUpstream = chat if wire == "bridge" else native
        self.chat = chat  # the summariser's provider, whichever wire
        self._native = native

    def enqueue(self, *replies: Reply) -> None:
        self.fake.enqueue(*replies)

    def requests(self) -> list[dict[str, Any]]:
        if self.wire == "bridge":
            return [r.body for r in self.fake.chat_requests()]
        return [r.body for r in self._native.responses_requests()]

    def conversation(self, index: int = -1) -> list[tuple[str, str]]:
        body = self.requests()[index]
        if self.wire == "bridge":
            return [pair for m in body["messages"] for pair in _chat_pairs(m)]
        return [pair for item in body["input"] for pair in _item_pairs(item)]


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content)
    return str(content or "")


def _chat_pairs(message: dict[str, Any]) -> list[tuple[str, str]]:
    pairs = []
    if message.get("content"):
        pairs.append((message["role"], _text(message["content"])))
    for call in message.get("tool_calls") or []:
        pairs.append(("call", f"{call['function']['name']} {call['function']['arguments']}"))
    return pairs


def _item_pairs(item: dict[str, Any]) -> list[tuple[str, str]]:
    kind = item.get("type", "message")
    if kind == "function_call":
        return [("call", f"{item['name']} {item['arguments']}")]
    if kind == "function_call_output":
        return [("tool", item["output"])]
    return [(item["role"], _text(item["content"]))]


@pytest.fixture(params=["bridge", "native"])
def wire(request: pytest.FixtureRequest, upstream: FakeUpstream, native_upstream: FakeResponsesUpstream) -> Upstream:
    return Upstream(request.param, upstream, native_upstream)


async def call(proxy: Proxy, method: str, path: str, key: str = PROXY_KEY, **kwargs: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http:
        async with http.request(method, f"{proxy.url}{path}", headers={"Authorization": f"Bearer {key}"},
                                **kwargs) as response:
            return response.status, await response.json(content_type=None)


async def session_messages(proxy: Proxy, session: str) -> dict[str, Any]:
    status, body = await call(proxy, "GET", f"/sessions/{session}")
    assert status == 200, body
    result: dict[str, Any] = body
    return result


# --- sessions ---------------------------------------------------------------------------------------


async def test_a_session_header_gives_responses_memory(proxy: Proxy, wire: Upstream) -> None:
    client = proxy.client("resp-s1")
    wire.enqueue(Reply(content="Hello Ada."), Reply(content="You are Ada."))
    first = await client.responses.create(model=wire.model, input="My name is Ada.", instructions="Be brief.")
    assert first.id.startswith("resp_") and first.output_text == "Hello Ada." and first.status == "completed"
    assert first.usage is not None and first.usage.output_tokens == 5
    raw = await client.responses.with_raw_response.create(model=wire.model, input="What is my name?")
    second = raw.parse()
    assert second.output_text == "You are Ada."
    assert raw.headers["X-Memproxy-Reconcile"] == "append" and raw.headers["X-Session-Id"] == "resp-s1"
    # The provider saw the first turn, and the session's system prompt, though the client sent neither.
    assert wire.conversation() == [("system", "Be brief."), ("user", "My name is Ada."),
                                   ("assistant", "Hello Ada."), ("user", "What is my name?")]
    stored = await session_messages(proxy, "resp-s1")
    assert [m["message"]["content"] for m in stored["messages"]] == [
        "My name is Ada.", "Hello Ada.", "What is my name?", "You are Ada."]


async def test_a_models_own_headers_reach_its_provider_on_either_wire(
        start_proxy: Any, config: Config, wire: Upstream) -> None:
    mine = {"HTTP-Referer": "https://app.example", "X-Gateway-Key": "gw-secret-1"}
    proxy = await start_proxy(replace(config, models=tuple(replace(m, headers=mine) for m in config.models)))
    wire.enqueue(Reply(content="Hello."))
    await proxy.client("resp-headers").responses.create(model=wire.model, input="hi")
    [received] = wire.fake.received
    headers = {k.lower(): v for k, v in received.headers.items()}
    assert (headers["http-referer"], headers["x-gateway-key"]) == ("https://app.example", "gw-secret-1")
    assert headers["authorization"] == "Bearer upstream-secret"


async def test_parameters_chat_completions_take_too_reach_a_chat_provider(proxy: Proxy, upstream: FakeUpstream) -> None:
    """Through the bridge to a chat-completions provider, the Responses parameters that chat
    completions take as well arrive, under their chat names."""
    client = proxy.client("resp-params")
    await client.responses.create(
        model="small", input="hi", top_logprobs=2, include=["message.output_text.logprobs"], service_tier="flex",
        prompt_cache_key="k1", prompt_cache_retention="24h", safety_identifier="u-9", text={"verbosity": "low"})
    sent = upstream.last().body
    assert (sent["top_logprobs"], sent["logprobs"], sent["service_tier"]) == (2, True, "flex")
    assert (sent["prompt_cache_key"], sent["safety_identifier"], sent["verbosity"]) == ("k1", "u-9", "low")
    assert sent["prompt_cache_retention"] == "24h"


async def test_a_bridged_response_echoes_what_openais_does(proxy: Proxy, upstream: FakeUpstream) -> None:
    """The Response echoes the request's parameters as OpenAI's does (those it was given, their
    defaults where it was not), streamed or not: among them `top_logprobs`, `max_tool_calls`,
    `prompt_cache_key`, `safety_identifier` and `service_tier`, `metadata` as `{}` when none was
    given, `background: false` (memproxy answers in the foreground) and when it completed."""
    client = proxy.client("echoes")
    asked = await client.responses.create(model="small", input="hi", top_logprobs=2, max_tool_calls=3,
                                          prompt_cache_key="k1", safety_identifier="u-9", service_tier="flex",
                                          background=True)
    assert (asked.top_logprobs, asked.max_tool_calls, asked.prompt_cache_key, asked.safety_identifier,
            asked.service_tier, asked.background) == (2, 3, "k1", "u-9", "flex", False)
    assert asked.completed_at is not None and asked.completed_at >= asked.created_at
    async with client.responses.stream(model="small", input="again") as stream:
        created = [event.response async for event in stream if event.type == "response.created"]
        final = await stream.get_final_response()
    for response in (*created, final):
        assert (response.metadata, response.service_tier, response.background, response.top_logprobs) == (
            {}, "default", False, None)
    assert created[0].completed_at is None and final.completed_at is not None


@pytest.mark.both_transports
async def test_a_reasoning_models_parameters_reach_it_in_the_chat_form_it_takes(
    start_proxy: Any, config: Config, upstream: FakeUpstream, transport: str
) -> None:
    """What the AI SDK sends a reasoning model (`max_output_tokens`, `reasoning` with a summary) and
    a structured output's description, through the bridge on either transport: chat completions'
    `max_completion_tokens` (the fake refuses `max_tokens`, as OpenAI does), `reasoning_effort` as
    a string, `json_schema.description` kept."""
    thinker = ModelConfig(name="thinker", model="openai/o4-mini", api_base=upstream.url, api_key="upstream-secret",
                          context_window=8000, max_output_tokens=256, transport=transport)
    proxy: Proxy = await start_proxy(replace(config, models=(*config.models, thinker)))
    answer = await proxy.client("thinking").responses.create(
        model="thinker", input="hi", max_output_tokens=200, reasoning={"effort": "low", "summary": "auto"},
        text={"format": {"type": "json_schema", "name": "person", "description": "A person",
                         "schema": {"type": "object", "properties": {}}, "strict": True}})
    assert answer.output_text
    sent = upstream.last().body
    assert (sent.get("max_completion_tokens"), "max_tokens" in sent, sent["reasoning_effort"]) == (200, False, "low")
    assert sent["response_format"]["json_schema"]["description"] == "A person"
    await proxy.client("thinking-2").responses.create(model="thinker", input="hi", reasoning={"summary": "auto"})
    assert "reasoning_effort" not in upstream.last().body  # a summary alone has no chat form


async def test_previous_response_id_chains_have_memory_and_fork(proxy: Proxy, wire: Upstream) -> None:
    client = proxy.client(session=None)
    wire.enqueue(Reply(content="Hi Ada."), Reply(content="Ada."), Reply(content="Hi Bob."))
    first = await client.responses.create(model=wire.model, input="I am Ada.", instructions="Be brief.")
    raw = await client.responses.with_raw_response.create(model=wire.model, input="Who am I?",
                                                          previous_response_id=first.id, instructions="Be a pirate.")
    second = raw.parse()
    assert raw.headers["X-Session-Id"] == first.id  # the chain's session is named by its first response
    assert second.previous_response_id == first.id
    assert wire.conversation() == [("system", "Be a pirate."), ("user", "I am Ada."), ("assistant", "Hi Ada."),
                                   ("user", "Who am I?")]

    # Continuing from the first response again forks: the provider sees only what led to it, under
    # its instructions, not those of the branch it supersedes.
    raw = await client.responses.with_raw_response.create(model=wire.model, input="No, I am Bob.",
                                                          previous_response_id=first.id)
    assert raw.parse().output_text == "Hi Bob."
    assert raw.headers["X-Memproxy-Reconcile"] == "edit" and raw.headers["X-Memproxy-Superseded"] == "2"
    assert wire.conversation() == [("system", "Be brief."), ("user", "I am Ada."), ("assistant", "Hi Ada."),
                                   ("user", "No, I am Bob.")]
    # Nothing is forgotten: the superseded branch is kept, and continuing from it, as OpenAI allows,
    # makes it the active one again, under its own instructions; the other branch is kept in turn.
    bob = raw.parse()
    shown = await session_messages(proxy, first.id)
    assert [m["message"]["content"] for branch in shown["superseded"] for m in branch["messages"]] == [
        "Who am I?", "Ada."]
    wire.enqueue(Reply(content="Still Ada."), Reply(content="Bob again."))
    raw = await client.responses.with_raw_response.create(model=wire.model, input="Sure?",
                                                          previous_response_id=second.id)
    assert raw.parse().output_text == "Still Ada."
    assert raw.headers["X-Memproxy-Reconcile"] == "edit" and raw.headers["X-Memproxy-Superseded"] == "2"
    assert wire.conversation() == [("system", "Be a pirate."), ("user", "I am Ada."), ("assistant", "Hi Ada."),
                                   ("user", "Who am I?"), ("assistant", "Ada."), ("user", "Sure?")]
    shown = await session_messages(proxy, first.id)
    assert [m["message"]["content"] for m in shown["messages"]] == [
        "I am Ada.", "Hi Ada.", "Who am I?", "Ada.", "Sure?", "Still Ada."]
    assert [m["message"]["content"] for branch in shown["superseded"] for m in branch["messages"]] == [
        "Who am I?", "Ada.", "No, I am Bob.", "Hi Bob."]
    assert (await client.responses.retrieve(second.id)).output_text == "Ada."
    # And back to the other branch.
    await client.responses.create(model=wire.model, input="Really?", previous_response_id=bob.id)
    assert wire.conversation() == [("system", "Be brief."), ("user", "I am Ada."), ("assistant", "Hi Ada."),
                                   ("user", "No, I am Bob."), ("assistant", "Hi Bob."), ("user", "Really?")]


async def test_a_fork_goes_on_under_the_instructions_its_chain_had(proxy: Proxy, wire: Upstream) -> None:
    """A fork from a response whose request gave no instructions (it went on under the session's,
    its chain's) goes on under those, not under the instructions a later turn of the branch it
    supersedes set: the provider saw that branch's "Be a pirate." on a fork made before it."""
    client = proxy.client(session=None)
    first = await client.responses.create(model=wire.model, input="I am Ada.", instructions="Be brief.")
    second = await client.responses.create(model=wire.model, input="Hello.", previous_response_id=first.id)
    await client.responses.create(model=wire.model, input="Arr?", previous_response_id=second.id,
                                  instructions="Be a pirate.")
    assert wire.conversation()[0] == ("system", "Be a pirate.")
    await client.responses.create(model=wire.model, input="Who am I?", previous_response_id=second.id)
    assert wire.conversation() == [("system", "Be brief."), ("user", "I am Ada."), ("assistant", "reply 1"),
                                   ("user", "Hello."), ("assistant", "reply 2"), ("user", "Who am I?")]


async def test_conversation_names_the_session(proxy: Proxy, wire: Upstream) -> None:
    client = proxy.client(session=None)
    await client.responses.create(model=wire.model, input="Remember 42.", conversation="conv_7")
    reply = await client.responses.create(model=wire.model, input="Which number?", conversation={"id": "conv_7"})
    assert reply.conversation is not None and reply.conversation.id == "conv_7"
    assert wire.conversation()[0] == ("user", "Remember 42.")
    # The header and the conversation must agree.
    with pytest.raises(openai.BadRequestError) as refused:
        await proxy.client("other").responses.create(model=wire.model, input="x", conversation="conv_7")
    assert refused.value.body["param"] == "conversation"  # type: ignore[index]
    agreed = await proxy.client("conv_7").responses.create(model=wire.model, input="Again?",
                                                           conversation="conv_7")
    assert agreed.output_text
    assert len(wire.requests()) == 3


async def test_a_tool_round_trip_through_previous_response_id(proxy: Proxy, wire: Upstream) -> None:
    client = proxy.client(session=None)
    wire.enqueue(Reply(tool_calls=[{"id": "call_w1", "type": "function",
                                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]),
                 Reply(content="Sunny in Paris."))
    first = await client.responses.create(model=wire.model, input="Weather in Paris?", tools=[WEATHER_TOOL])
    [call_item] = [item for item in first.output if item.type == "function_call"]
    assert (call_item.call_id, call_item.name, json.loads(call_item.arguments)) == (
        "call_w1", "get_weather", {"city": "Paris"})
    second = await client.responses.create(
        model=wire.model, previous_response_id=first.id, tools=[WEATHER_TOOL],
        input=[{"type": "function_call_output", "call_id": "call_w1", "output": "sunny"}])
    assert second.output_text == "Sunny in Paris."
    assert wire.conversation() == [("user", "Weather in Paris?"), ("call", 'get_weather {"city":"Paris"}'),
                                   ("tool", "sunny")]
    body = wire.requests()[-1]
    if wire.wire == "bridge":  # the tool went as a chat tool; the call and its result as a chat unit
        assert body["tools"][0]["function"]["name"] == "get_weather"
        assert body["messages"][1]["tool_calls"][0]["id"] == "call_w1"
        assert body["messages"][2] == {"role": "tool", "tool_call_id": "call_w1", "content": "sunny"}
    else:
        assert body["tools"][0]["name"] == "get_weather" and body["store"] is False


async def test_an_image_a_tool_returned_reaches_a_responses_provider_every_turn(
        proxy: Proxy, native_upstream: FakeResponsesUpstream) -> None:
    """A `function_call_output` may hold parts (text, images, files), not only text. Stored as the
    tool result's content parts, they go back to a native provider as the output's parts, on the
    turn that brings them and every turn after: only its text went, the image was lost."""
    client = proxy.client("tool-image")
    native_upstream.enqueue(Reply(tool_calls=[{"id": "call_m", "type": "function",
                                               "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]))
    await client.responses.create(model="native", input="Weather map?", tools=[WEATHER_TOOL])
    parts = [{"type": "input_text", "text": "the map"}, {"type": "input_image", "image_url": "https://maps.example/o.png"}]
    await client.responses.create(model="native", tools=[WEATHER_TOOL], input=[
        {"type": "function_call_output", "call_id": "call_m", "output": parts}])
    await client.responses.create(model="native", input="And tomorrow?")
    for received in native_upstream.responses_requests()[1:]:
        [output] = [item for item in received.body["input"] if item["type"] == "function_call_output"]
        assert [{k: part[k] for k in ("type", "text", "image_url") if k in part} for part in output["output"]] == parts


async def test_a_conversation_step_that_resends_its_input_before_the_tool_result(proxy: Proxy, wire: Upstream) -> None:
    """The Vercel AI SDK with `conversation` set: the second step of its tool loop sends the step's
    user message again and then the function's output, not the call (the conversation holds it)."""
    client = proxy.client(session=None)
    wire.enqueue(Reply(tool_calls=[{"id": "call_c1", "type": "function",
                                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]),
                 Reply(content="Sunny in Paris."))
    asked = {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]}
    await client.responses.create(model=wire.model, input=[asked], tools=[WEATHER_TOOL], conversation="conv_tools")
    second = await client.responses.create(model=wire.model, tools=[WEATHER_TOOL], conversation="conv_tools", input=[
        asked, {"type": "function_call_output", "call_id": "call_c1", "output": "sunny"}])
    assert second.output_text == "Sunny in Paris."
    assert wire.conversation() == [("user", "Weather in Paris?"), ("call", 'get_weather {"city":"Paris"}'),
                                   ("tool", "sunny")]
    stored = await session_messages(proxy, "conv_tools")
    assert len(stored["messages"]) == 4 and not stored.get("superseded")


async def test_item_references_to_kept_items_are_read_as_those_items(proxy: Proxy, wire: Upstream) -> None:
    """How the Vercel AI SDK resends a history by default (`store` left true): each earlier answer
    as `{"type": "item_reference", "id": ...}`, the id of an item of a response memproxy kept."""
    client = proxy.client("refs")
    wire.enqueue(Reply(tool_calls=[{"id": "call_r1", "type": "function",
                                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]),
                 Reply(content="Sunny in Paris."), Reply(content="You asked about Paris."))
    asked = {"role": "user", "content": "Weather in Paris?"}
    result = {"type": "function_call_output", "call_id": "call_r1", "output": "sunny"}
    first = await client.responses.create(model=wire.model, input=[asked], tools=[WEATHER_TOOL])
    [called] = [item for item in first.output if item.type == "function_call"]
    second = await client.responses.create(model=wire.model, tools=[WEATHER_TOOL], input=[
        asked, {"type": "item_reference", "id": called.id}, result])
    [answered] = [item for item in second.output if item.type == "message"]
    # An input item it was given is kept too (`input_items` lists it with an id of memproxy's).
    [asked_item] = (await client.responses.input_items.list(first.id)).data
    third = await client.responses.create(model=wire.model, tools=[WEATHER_TOOL], input=[
        {"type": "item_reference", "id": asked_item.id}, {"type": "item_reference", "id": called.id}, result,
        {"type": "item_reference", "id": answered.id}, {"role": "user", "content": "What did I ask?"}])
    assert third.output_text == "You asked about Paris."
    assert wire.conversation() == [("user", "Weather in Paris?"), ("call", 'get_weather {"city":"Paris"}'),
                                   ("tool", "sunny"), ("assistant", "Sunny in Paris."), ("user", "What did I ask?"),
                                   ]
    stored = await session_messages(proxy, "refs")
    assert len(stored["messages"]) == 6 and not stored.get("superseded")  # each turn went on from the last

    # A reference to no item kept, or to another tenant's, is a 404 that sends and stores nothing.
    sent = len(wire.requests())
    for key, item_id in ((PROXY_KEY, "msg_" + "0" * 24 + "_0"), (PROXY_KEY, "msg_not_ours"), (OTHER_KEY, answered.id)):
        with pytest.raises(openai.NotFoundError) as missing:
            await proxy.client("refs", key=key).responses.create(model=wire.model, input=[
                {"role": "user", "content": "again"}, {"type": "item_reference", "id": item_id}])
        assert missing.value.body["param"] == "input[1]"  # type: ignore[index]
    assert len(wire.requests()) == sent
    assert len((await session_messages(proxy, "refs"))["messages"]) == 6


async def test_a_reference_to_an_item_memory_cannot_keep_is_refused_as_the_item_is(
    proxy: Proxy, native_upstream: FakeResponsesUpstream
) -> None:
    """A native provider's built-in tool item (a web search) is kept in its response, but memory
    cannot replay it: by reference, as sent whole, a 400 naming it, never silently dropped."""
    client = proxy.client("builtin-refs")
    native_upstream.enqueue(Reply(content="A proxy.", output_items=[
        {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search", "query": "x"}}]))
    first = await client.responses.create(model="native", input="look it up")
    [searched] = [item for item in first.output if item.type == "web_search_call"]
    sent = len(native_upstream.responses_requests())
    for given in ({"type": "item_reference", "id": searched.id}, searched.model_dump(exclude_none=True)):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(model="native", input=[
                {"role": "user", "content": "look it up"}, given, {"role": "user", "content": "and?"}])  # type: ignore[list-item]
        assert refused.value.body["param"] == "input[1].type"  # type: ignore[index]
    assert len(native_upstream.responses_requests()) == sent


async def test_a_custom_tools_call_goes_back_to_a_native_provider_as_it_came(
    proxy: Proxy, native_upstream: FakeResponsesUpstream
) -> None:
    """GPT-5's free-form tools (Codex sends `apply_patch` as one): the model's `custom_tool_call` and
    the client's `custom_tool_call_output` for it are kept, and sent back as they came, whether the
    client goes on by `previous_response_id` or resends the items; through the bridge, which would
    make the tool a function taking JSON, a 400 naming it."""
    tools: Any = [{"type": "custom", "name": "apply_patch", "description": "Applies a patch"}]
    patch = "*** Begin Patch\n*** Add File: a.txt\n+hello \"world\"\n*** End Patch"
    made = {"type": "custom_tool_call", "call_id": "call_p1", "name": "apply_patch", "input": patch}
    output = {"type": "custom_tool_call_output", "call_id": "call_p1", "output": "applied"}
    native_upstream.enqueue(Reply(output_items=[{**made, "id": "ctc_1"}]), Reply(content="Patched."),
                            Reply(content="Patched again."))
    client = proxy.client("custom-tools")
    first = await client.responses.create(model="native", input="add a.txt", tools=tools)
    [call] = [item for item in first.output if item.type == "custom_tool_call"]
    assert (call.call_id, call.name, call.input) == ("call_p1", "apply_patch", patch)
    second = await client.responses.create(model="native", previous_response_id=first.id, tools=tools,
                                           input=[output])  # type: ignore[list-item]
    assert second.output_text == "Patched."
    resent = await proxy.client("custom-tools-whole").responses.create(model="native", tools=tools, input=[
        {"role": "user", "content": "add a.txt"}, call.model_dump(exclude_none=True), output])  # type: ignore[list-item]
    assert resent.output_text == "Patched again."
    for request in native_upstream.responses_requests()[-2:]:
        assert [i for i in request.body["input"] if i.get("type") != "message"] == [made, output]
    stored = await session_messages(proxy, "custom-tools")
    assert [m["message"].get("tool_calls") for m in stored["messages"]][1] == [
        {"id": "call_p1", "type": "custom", "custom": {"name": "apply_patch", "input": patch}}]
    # The session's items, as the Conversations API lists them: the call and its output as they came.
    listed = [item.model_dump(exclude_none=True) async for item in client.conversations.items.list("custom-tools", order="asc")]
    assert [i["type"] for i in listed] == ["message", "custom_tool_call", "custom_tool_call_output", "message"]
    assert {k: listed[1][k] for k in made} == made and listed[2]["call_id"] == "call_p1"
    with pytest.raises(openai.BadRequestError) as refused:
        await proxy.client("custom-bridge").responses.create(model="small", input="add a.txt", tools=tools)
    assert refused.value.body["param"] == "tools[0]"  # type: ignore[index]


@pytest.mark.parametrize("tool", [{"type": "image_generation"}, {"type": "file_search", "vector_store_ids": ["vs_1"]},
                                  {"type": "code_interpreter", "container": {"type": "auto"}},
                                  {"type": "mcp", "server_label": "docs", "server_url": "https://mcp.example"}])
async def test_a_built_in_tool_is_refused_on_the_bridge_and_web_search_goes(
        proxy: Proxy, upstream: FakeUpstream, tool: dict[str, Any]) -> None:
    """OpenAI's built-in tools run in its Responses API only. Through the bridge, litellm dropped
    some without a word (the model answered as if it had no image tool) and sent the others to a
    chat provider that has no such tool: each is a 400 naming it, before anything is sent or
    stored. Web search goes, as chat completions' `web_search_options`."""
    client = proxy.client("built-in")
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(model="small", input="Go.", tools=[WEATHER_TOOL, tool])  # type: ignore[list-item]
    assert refused.value.body["param"] == "tools[1]"  # type: ignore[index]
    assert upstream.received == []
    status, _ = await call(proxy, "GET", "/sessions/built-in")
    assert status == 404
    await client.responses.create(model="small", input="Search.", tools=[{"type": "web_search"}])
    assert "web_search_options" in upstream.last().body


# --- streams ----------------------------------------------------------------------------------------


async def test_a_stream_is_the_sdks_to_assemble_and_is_kept(proxy: Proxy, wire: Upstream) -> None:
    client = proxy.client("stream-s")
    wire.enqueue(Reply(content="Streamed answer."),
                 Reply(content="Calling.", tool_calls=[{"id": "call_s1", "type": "function",
                                                        "function": {"name": "get_weather",
                                                                     "arguments": '{"city":"Oslo"}'}}]))
    kinds = []
    async with client.responses.stream(model=wire.model, input="Say something.") as stream:
        async for event in stream:
            kinds.append(event.type)
        final = await stream.get_final_response()
    assert final.output_text == "Streamed answer."
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    status, kept = await call(proxy, "GET", f"/responses/{final.id}")
    assert status == 200 and kept["output"][0]["content"][0]["text"] == "Streamed answer."

    # With a tool call, streamed with `stream=True`; the next turn sees both turns.
    events = await client.responses.create(model=wire.model, input="Weather?", tools=[WEATHER_TOOL], stream=True)
    seen = [event async for event in events]
    done = seen[-1]
    assert done.type == "response.completed"
    calls = [item for item in done.response.output if item.type == "function_call"]
    assert [(c.call_id, c.arguments) for c in calls] == [("call_s1", '{"city":"Oslo"}')]
    deltas = "".join(e.delta for e in seen if e.type == "response.function_call_arguments.delta")
    assert deltas == '{"city":"Oslo"}'
    await client.responses.create(model=wire.model, input=[
        {"type": "function_call_output", "call_id": "call_s1", "output": "cold"}], tools=[WEATHER_TOOL])
    assert wire.conversation() == [("user", "Say something."), ("assistant", "Streamed answer."),
                                   ("user", "Weather?"), ("assistant", "Calling."),
                                   ("call", 'get_weather {"city":"Oslo"}'), ("tool", "cold")]


async def test_a_streamed_item_is_added_empty_and_grows_by_its_deltas(proxy: Proxy, wire: Upstream) -> None:
    """`response.output_item.added` shows the item as it was opened (a message with no content
    yet), as OpenAI's does: the SDK's stream helper appends each `content_part.added` to it and
    each delta to that part, and gives the text so far as each delta's `snapshot`."""
    wire.enqueue(Reply(content="Hi there, Ada."))
    added, snapshots = [], []
    async with proxy.client("snapshots").responses.stream(model=wire.model, input="Go.") as stream:
        async for event in stream:
            if event.type == "response.output_item.added":
                added.append(event.item)
            elif event.type == "response.output_text.delta":
                snapshots.append(event.snapshot)
        final = await stream.get_final_response()
    assert [(item.type, item.content) for item in added] == [("message", [])]  # type: ignore[union-attr]
    assert len(snapshots) > 1 and snapshots[-1] == final.output_text == "Hi there, Ada."


async def test_each_streamed_event_is_named_by_its_type(proxy: Proxy, wire: Upstream) -> None:
    """Every event of a stream says its type on its `event:` line too, as OpenAI's do: clients that
    dispatch on the event's name (an `EventSource` listener, SSE parsers keyed by event) see
    `response.output_text.delta`. litellm's native events hold their type as an enum, whose text is
    `ResponsesAPIStreamEvents.OUTPUT_TEXT_DELTA`."""
    wire.enqueue(Reply(content="Named events."))
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{proxy.url}/responses", json={"model": wire.model, "input": "Go.", "stream": True},
                             headers={"Authorization": f"Bearer {PROXY_KEY}", "X-Session-Id": "named"}) as response:
            raw = (await response.read()).decode()
    events = [dict(line.split(": ", 1) for line in block.split("\n")) for block in raw.split("\n\n") if block]
    assert [e["event"] for e in events] == [json.loads(e["data"])["type"] for e in events]
    assert events[-1]["event"] == "response.completed"


async def test_a_call_without_arguments_gives_an_empty_object(proxy: Proxy, upstream: FakeUpstream) -> None:
    """A chat provider that gives a parameterless call's arguments as "" (llama.cpp, older vLLM
    parsers): the bridge's `function_call` says `{}`, as OpenAI's Responses API always does, plain
    and streamed (clients parse the arguments as JSON: LangChain made an invalid call of "")."""
    client = proxy.client("no-args")
    bare = {"id": "call_t", "type": "function", "function": {"name": "get_time", "arguments": ""}}
    upstream.enqueue(Reply(tool_calls=[bare]), Reply(tool_calls=[bare]))
    plain = await client.responses.create(model="small", input="Time?", tools=[WEATHER_TOOL])
    assert [(i.call_id, i.arguments) for i in plain.output if i.type == "function_call"] == [("call_t", "{}")]
    events = [e async for e in await client.responses.create(model="small", input="Time again?", tools=[WEATHER_TOOL],
                                                               stream=True)]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == "{}"
    assert [i.arguments for i in events[-1].response.output if i.type == "function_call"] == ["{}"]


async def test_a_cut_stream_ends_with_an_error_event_and_stores_nothing(proxy: Proxy, wire: Upstream) -> None:
    client = proxy.client("cut-s")
    wire.enqueue(Reply(content="This will be cut off.", cut_stream=True))
    with pytest.raises(openai.APIError):
        async with client.responses.stream(model=wire.model, input="Go.") as stream:
            async for _ in stream:
                pass
    status, _ = await call(proxy, "GET", "/sessions/cut-s")
    assert status == 404


async def test_a_stream_litellm_fakes_for_a_native_model_is_openais_stream(
        start_proxy: Any, config: Config, native_upstream: FakeResponsesUpstream) -> None:
    """A model litellm does not know to stream (o1-pro) is streamed by litellm from a plain call,
    with events unlike OpenAI's: unnumbered, and each item and part added whole before its text
    comes again as deltas, which the SDK's stream helper appended to it (every delta's `snapshot`
    read the answer twice over). Relayed, they are numbered from 0 and add what they open empty."""
    pro = ModelConfig(name="pro", model="openai/o1-pro", api_base=native_upstream.url, api_key="upstream-secret",
                      context_window=8000, max_output_tokens=256, responses_api="native")
    proxy: Proxy = await start_proxy(replace(config, models=(*config.models, pro)))
    native_upstream.enqueue(Reply(content="Hello there, Ada.", tool_calls=[
        {"id": "call_o", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]))
    events, texts, arguments = [], [], []
    async with proxy.client("faked").responses.stream(model="pro", input="Go.", tools=[WEATHER_TOOL]) as stream:
        async for event in stream:
            events.append(event)
            if event.type == "response.output_text.delta":
                texts.append(event.snapshot)
            elif event.type == "response.function_call_arguments.delta":
                arguments.append(event.snapshot)
        final = await stream.get_final_response()
    assert native_upstream.responses_requests()[-1].body.get("stream") is not True  # litellm faked the stream
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert texts[-1] == final.output_text == "Hello there, Ada." and arguments[-1] == '{"city":"Oslo"}'
    added = [event.item for event in events if event.type == "response.output_item.added"]
    assert [(item.type, item.status) for item in added] == [("message", "in_progress"), ("function_call", "in_progress")]


async def test_the_error_ending_a_cut_stream_is_numbered_after_the_events_before_it(
    proxy: Proxy, wire: Upstream
) -> None:
    """Events are numbered one after another (`sequence_number`), the error event that ends a cut
    stream too: on the native wire the events before it are the provider's, numbered by it."""
    wire.enqueue(Reply(content="This will be cut off.", cut_stream=True))
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{proxy.url}/responses", json={"model": wire.model, "input": "Go.", "stream": True},
                             headers={"Authorization": f"Bearer {PROXY_KEY}", "X-Session-Id": "numbered"}) as response:
            raw = (await response.read()).decode()
    events = [json.loads(block.split("data: ", 1)[1]) for block in raw.split("\n\n") if block]
    assert events[-1]["type"] == "error"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


async def test_a_streamed_response_whose_session_is_deleted_meanwhile_says_it_is_not_kept(
    proxy: Proxy, wire: Upstream
) -> None:
    """The session is deleted while a streamed turn is upstream: the answer, paid for, ends as
    usual, but nothing of it is kept, so its Response says `store: false`, as a plain one does."""
    client = proxy.client("gone-s")
    await client.responses.create(model=wire.model, input="First.")
    gate = threading.Event()
    wire.enqueue(Reply(content="A late answer.", gate=gate))

    async def streamed() -> list[Any]:
        async with client.responses.stream(model=wire.model, input="Second.") as stream:
            return [event async for event in stream]

    task = asyncio.create_task(streamed())
    try:
        await until(lambda: len(wire.requests()) == 2, "the turn is upstream")
        status, _ = await call(proxy, "DELETE", "/sessions/gone-s")
        assert status == 200
    finally:
        gate.set()
    [completed] = [event for event in await task if event.type == "response.completed"]
    assert completed.response.output_text == "A late answer."
    assert completed.response.store is False
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(completed.response.id)


# --- kept responses ---------------------------------------------------------------------------------


async def test_a_kept_response_is_not_streamed_again(proxy: Proxy, upstream: FakeUpstream) -> None:
    """`GET /v1/responses/{id}?stream=true` (the SDK's `retrieve(id, stream=True)` and
    `responses.stream(response_id=...)`, which resume a background response's events) is a 400
    naming `stream`: memproxy keeps no events. Answered with the object, the SDK read an empty
    stream and said nothing (`get_final_response` found no `response.completed`)."""
    client = proxy.client("not-again")
    kept = await client.responses.create(model="small", input="hi")
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.retrieve(kept.id, stream=True)
    assert refused.value.body["param"] == "stream"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        async with client.responses.stream(response_id=kept.id) as stream:
            await stream.get_final_response()
    assert (await client.responses.retrieve(kept.id, stream=False)).output_text == kept.output_text


async def test_get_delete_and_input_items(proxy: Proxy, wire: Upstream) -> None:
    client = proxy.client(session=None)
    created = await client.responses.create(model=wire.model, input=[
        {"role": "user", "content": "first"}, {"type": "message", "role": "user",
                                               "content": [{"type": "input_text", "text": "second"}]}])
    got = await client.responses.retrieve(created.id)
    assert got.model_dump() == created.model_dump()
    items = await client.responses.input_items.list(created.id, order="asc")
    # Listed in OpenAI's form, the short form too: a typed message with its text as a part.
    assert [(item.type, item.content[0].type, item.content[0].text)  # type: ignore[union-attr]
            for item in items.data] == [("message", "input_text", "first"), ("message", "input_text", "second")]
    assert all(item.id for item in items.data)
    newest = await client.responses.input_items.list(created.id, limit=1)
    assert len(newest.data) == 1 and newest.has_more

    # Another tenant sees none of it.
    other = proxy.client(session=None, key=OTHER_KEY)
    with pytest.raises(openai.NotFoundError):
        await other.responses.retrieve(created.id)
    with pytest.raises(openai.BadRequestError) as refused:
        await other.responses.create(model=wire.model, input="x", previous_response_id=created.id)
    assert refused.value.code == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        await other.responses.delete(created.id)

    await client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(created.id)
    status, body = await call(proxy, "GET", f"/responses/{created.id}/input_items")
    assert status == 404
    assert_error(body, type="invalid_request_error", code="not_found", param="response_id")


async def test_an_id_no_store_holds_is_not_found(proxy: Proxy, upstream: FakeUpstream) -> None:
    """A NUL in a response id (PostgreSQL refuses one in text as an error, not a miss) or an id
    longer than any: not found, on every route that names one, never a 503 that says the store is down."""
    for bad in ("resp_%00x", "resp_" + "a" * 300):
        for method, path in (("GET", f"/responses/{bad}"), ("DELETE", f"/responses/{bad}"),
                             ("GET", f"/responses/{bad}/input_items")):
            status, body = await call(proxy, method, path)
            assert status == 404, (method, path, body)
            assert_error(body, type="invalid_request_error", code="not_found", param="response_id")
    status, body = await call(proxy, "POST", "/responses",
                              json={"model": "small", "input": "x", "previous_response_id": "resp_\x00x"})
    assert status == 400
    assert_error(body, type="invalid_request_error", code="previous_response_not_found",
                 param="previous_response_id")
    assert upstream.chat_requests() == []


async def test_a_background_request_is_answered_in_the_foreground(proxy: Proxy, wire: Upstream) -> None:
    """`background: true` is taken and answered at once, on either wire: a native provider is not
    asked to queue it, whose empty `queued` Response memproxy would keep as the answer for good
    (a client polling `GET` until the status leaves `queued` would never see one)."""
    wire.enqueue(Reply(content="Done at once."))
    client = proxy.client("background")
    answered = await client.responses.create(model=wire.model, input="Take your time.", background=True)
    assert (answered.status, answered.output_text) == ("completed", "Done at once.")
    assert (await client.responses.retrieve(answered.id)).status == "completed"
    assert "background" not in wire.requests()[-1]


async def test_store_false_keeps_nothing(proxy: Proxy, wire: Upstream) -> None:
    client = proxy.client(session=None)
    raw = await client.responses.with_raw_response.create(model=wire.model, input="Private.", store=False)
    unkept = raw.parse()
    assert unkept.store is False and unkept.output_text and "X-Session-Id" not in raw.headers
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(unkept.id)
    status, body = await call(proxy, "POST", "/responses",
                              json={"model": wire.model, "input": "x", "previous_response_id": unkept.id})
    assert status == 400
    assert_error(body, type="invalid_request_error", code="previous_response_not_found",
                 param="previous_response_id")
    status, listed = await call(proxy, "GET", "/sessions")
    assert status == 200 and listed["data"] == []


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x"}, "model"),
    ({"model": "small"}, "input"),
    ({"model": "small", "input": []}, "input"),
    ({"model": "small", "input": [{"type": "web_search_call"}]}, "input[0].type"),
    ({"model": "small", "input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
    ({"model": "small", "input": [{"type": "function_call", "call_id": 1, "name": "f", "arguments": "{}"}]},
     "input[0].call_id"),
    ({"model": "small", "input": "x", "stream": "yes"}, "stream"),
    ({"model": "small", "input": "x", "temperature": "hot"}, "temperature"),
    ({"model": "small", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": "small", "input": "x", "conversation": 7}, "conversation"),
    ({"model": "small", "input": "x", "conversation": "c", "previous_response_id": "resp_x"}, "conversation"),
    ({"model": "small", "input": "x", "tools": [7]}, "tools"),
    ({"model": "small", "input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text"),
    # A part memory would drop or empty on the way is refused, never sent changed and stored so:
    # an unknown kind, an image with neither URL nor file, and on the bridge (model "small") an
    # image by file id and audio, which a chat-completions provider cannot take as the bridge gives them.
    ({"model": "small", "input": [{"role": "user", "content": [{"type": "bogus_part"}]}]}, "input[0].content[0].type"),
    ({"model": "small", "input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0]"),
    ({"model": "small", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what is it?"}, {"type": "input_image", "file_id": "file-abc123"}]}]},
     "input[0].content[1]"),
    ({"model": "small", "input": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]}, "input[0].content[0]"),
    ({"model": "small", "input": [{"role": "user", "content": [
        {"type": "input_file", "file_url": "https://example.invalid/report.pdf"}]}]}, "input[0].content[0]"),
    # Fields of the wrong type were dropped or emptied (a file of `file_data: 5` went as an empty
    # part and was stored so).
    ({"model": "small", "input": [{"role": "user", "content": [{"type": "input_file", "file_data": 5}]}]},
     "input[0].content[0]"),
    ({"model": "small", "input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input[0].content[0]"),
    ({"model": "small", "input": "x", "tool_choice": 5}, "tool_choice"),
    ({"model": "small", "input": "x", "text": 5}, "text"),
    ({"model": "small", "input": "x", "reasoning": 5}, "reasoning"),
    ({"model": "small", "input": "x", "reasoning": {"effort": 5}}, "reasoning.effort"),
    ({"model": "small", "input": "x", "metadata": 5}, "metadata"),
    ({"model": "small", "input": "x", "truncation": 5}, "truncation"),
    ({"model": "small", "input": "x", "top_logprobs": "x"}, "top_logprobs"),
])
async def test_bad_input_is_an_openai_error_and_stores_nothing(
        proxy: Proxy, upstream: FakeUpstream, body: dict[str, Any], param: str) -> None:
    status, answer = await call(proxy, "POST", "/responses", json=body)
    assert status == 400
    assert_error(answer, type="invalid_request_error", code=None, param=param)
    assert upstream.received == []
    status, listed = await call(proxy, "GET", "/sessions")
    assert listed["data"] == []


async def test_an_unknown_model_and_an_admin_key_are_refused(proxy: Proxy) -> None:
    status, body = await call(proxy, "POST", "/responses", json={"model": "nope", "input": "x"})
    assert status == 404
    assert_error(body, type="invalid_request_error", code="model_not_found", param="model")


async def test_reasoning_is_kept_and_shown_but_not_resent(proxy: Proxy, wire: Upstream) -> None:
    client = proxy.client("reasoning-s")
    wire.enqueue(Reply(content="42.", reasoning_content="Six times seven."), Reply(content="Yes."))
    first = await client.responses.create(model=wire.model, input="Six times seven?")
    [reasoning] = [item for item in first.output if item.type == "reasoning"]
    assert [s.text for s in reasoning.summary] == ["Six times seven."]
    # A client that sends its history back, reasoning item included, is recognised (`continue`).
    history: Any = [{"role": "user", "content": "Six times seven?"},
                    *[item.model_dump(exclude_none=True) for item in first.output],
                    {"role": "user", "content": "Sure?"}]
    raw = await client.responses.with_raw_response.create(model=wire.model, input=history)
    assert raw.headers["X-Memproxy-Reconcile"] == "continue"
    assert wire.conversation() == [("user", "Six times seven?"), ("assistant", "42."), ("user", "Sure?")]
    body = wire.requests()[-1]
    assert "Six times seven." not in json.dumps(body)  # the finished exchange's reasoning stays home
    stored = await session_messages(proxy, "reasoning-s")
    assert stored["messages"][1]["message"]["reasoning_content"] == "Six times seven."


async def test_reasoning_resent_as_a_think_message_of_its_own_is_that_answers(proxy: Proxy, wire: Upstream) -> None:
    """pydantic-ai's Responses model, for a model it does not know to reason, resends a reasoning
    item as an assistant message holding only `<think>...</think>`, right before the answer: read
    as the answer's reasoning, the history is the one stored (`continue`), not an edit of it."""
    client = proxy.client("think-s")
    wire.enqueue(Reply(content="Hello Ada.", reasoning_content="The user says their name."), Reply(content="Ada."))
    first = await client.responses.create(model=wire.model, input="My name is Ada.")
    assert [item.type for item in first.output] == ["reasoning", "message"]
    history: Any = [{"role": "user", "content": "My name is Ada."},
                    {"role": "assistant", "content": "<think>\nThe user says their name.\n</think>"},
                    {"role": "assistant", "content": "Hello Ada."}, {"role": "user", "content": "My name?"}]
    raw = await client.responses.with_raw_response.create(model=wire.model, input=history)
    assert (raw.headers["X-Memproxy-Reconcile"], raw.headers["X-Memproxy-Superseded"]) == ("continue", "0")
    assert wire.conversation() == [("user", "My name is Ada."), ("assistant", "Hello Ada."), ("user", "My name?")]
    stored = await session_messages(proxy, "think-s")
    assert [m["message"]["content"] for m in stored["messages"]] == ["My name is Ada.", "Hello Ada.", "My name?", "Ada."]


async def test_responses_turns_are_summarised_and_recalled_like_chat(
        start_proxy: Any, config: Config, wire: Upstream) -> None:
    """A long Responses session on a 2,000-token window: older turns are folded into a rolling
    summary (written by the summariser on the chat provider), and a question about a turn left out
    brings it back through recall."""
    memory = replace(config.memory, summaries=True, overflow="summarize", recall_tokens=None)
    proxy = await start_proxy(replace(config, memory=memory))
    summariser = wire.chat
    summariser.summarizer = fact_summariser
    client = proxy.client("long-responses")
    headers: Any = None
    await client.responses.create(model=wire.model, input="My locker code is ZEBRA-7731, remember it.")
    for turn in range(12):
        raw = await client.responses.with_raw_response.create(
            model=wire.model, input=f"Note FACT-{turn}: {words(60, turn)}")
        headers = raw.headers
        await proxy.app[SUMMARIZER].wait_idle()
    assert headers is not None and int(headers["X-Memproxy-Stored-Omitted"]) > 0
    assert summariser.summary_requests(), "no summary was written"
    raw = await client.responses.with_raw_response.create(model=wire.model, input="What is my locker code ZEBRA?")
    assert int(raw.headers["X-Memproxy-Summary-Version"]) >= 1
    sent = json.dumps(wire.requests()[-1])
    assert "Known facts" in sent  # the summary went in front of the kept turns
    assert int(raw.headers["X-Memproxy-Recalled"]) >= 1 and "ZEBRA-7731" in sent


# --- one session, both APIs ---------------------------------------------------------------------------


async def test_one_session_continued_from_chat_then_responses_and_back(
        proxy: Proxy, upstream: FakeUpstream) -> None:
    client = proxy.client("both-apis")
    upstream.enqueue(Reply(content="Noted: blue."), Reply(content="Blue."), Reply(content="Still blue."))
    await client.chat.completions.create(model="small", messages=[{"role": "user", "content": "I like blue."}])
    answer = await client.responses.create(model="small", input="Which colour do I like?")
    assert answer.output_text == "Blue."
    assert [m["content"] for m in upstream.last().messages] == ["I like blue.", "Noted: blue.",
                                                                "Which colour do I like?"]
    # Back on chat, resending the whole history as a chat client does: recognised, not duplicated.
    raw = await client.chat.completions.with_raw_response.create(model="small", messages=[
        {"role": "user", "content": "I like blue."}, {"role": "assistant", "content": "Noted: blue."},
        {"role": "user", "content": "Which colour do I like?"}, {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Sure?"}])
    assert raw.headers["X-Memproxy-Reconcile"] == "continue"
    assert len(upstream.last().messages) == 5


PDF = "data:application/pdf;base64," + base64.b64encode(b"%PDF-1.4 /Type /Page").decode()


async def test_a_file_reaches_either_provider_whole(proxy: Proxy, wire: Upstream) -> None:
    """An `input_file` with its data goes to a chat provider as a chat `file` part with its
    `filename` (OpenAI's chat API requires it beside `file_data`; litellm's bridge dropped it), and
    a chat `file` part, stored from a chat turn, to a Responses provider as an `input_file`."""
    client = proxy.client(f"file-{wire.wire}")
    wire.chat.enqueue(Reply(content="Read."))
    await client.chat.completions.create(model="small", messages=[{"role": "user", "content": [
        {"type": "text", "text": "Keep this."}, {"type": "file", "file": {"file_id": "file-abc"}}]}])
    wire.enqueue(Reply(content="Both read."))
    await client.responses.create(model=wire.model, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "And this."}, {"type": "input_file", "filename": "b.pdf", "file_data": PDF}]}])
    body = wire.requests()[-1]
    if wire.wire == "bridge":
        files = [p for m in body["messages"] if isinstance(m["content"], list) for p in m["content"]
                 if p["type"] == "file"]
        assert files == [{"type": "file", "file": {"file_id": "file-abc"}},
                         {"type": "file", "file": {"filename": "b.pdf", "file_data": PDF}}]
    else:
        files = [p for item in body["input"] if isinstance(item.get("content"), list) for p in item["content"]
                 if p["type"] not in ("input_text", "output_text")]
        assert files == [{"type": "input_file", "file_id": "file-abc"},
                         {"type": "input_file", "filename": "b.pdf", "file_data": PDF}]


async def test_a_spoken_or_refused_answer_goes_to_a_responses_provider_as_what_it_said(
        proxy: Proxy, native_upstream: FakeResponsesUpstream, upstream: FakeUpstream) -> None:
    """Stored from chat turns, an answer with no text (a refusal) still goes to a Responses provider
    as what it said: left out, the input held two user messages in a row."""
    client = proxy.client("refused-native")
    upstream.enqueue(Reply(refusal="I cannot help with locks."))
    await client.chat.completions.create(model="small", messages=[{"role": "user", "content": "Pick a lock?"}])
    native_upstream.enqueue(Reply(content="A joke, then."))
    await client.responses.create(model="native", input="Then a joke.")
    pairs = Upstream("native", upstream, native_upstream).conversation()
    assert pairs == [("user", "Pick a lock?"), ("assistant", "I cannot help with locks."), ("user", "Then a joke.")]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_refusal_is_a_refusal_part_and_is_remembered(
        start_proxy: Any, config: Config, wire: Upstream, stream: bool) -> None:
    """A model that declines answers with a refusal part (OpenAI's `ResponseOutputRefusal`; streamed,
    `response.refusal.delta` and `.done`), and the turn keeps it: before, the bridge answered an
    empty output and a native answer was stored empty, so the next turn held two questions in a row.
    A bridged stream goes through memproxy's own client: litellm's stream chunks carry no refusal
    (README, Providers)."""
    own = ModelConfig(name="own", model="openai/small", api_base=wire.chat.url, api_key="upstream-secret",
                      context_window=2000, max_output_tokens=256, transport="openai")
    proxy: Proxy = await start_proxy(replace(config, models=(*config.models, own)))
    model = "own" if wire.wire == "bridge" and stream else wire.model
    no = "I can't help with that."
    wire.enqueue(Reply(content=None, refusal=no), Reply(content="Because it is unsafe."))
    client = proxy.client("resp-refusal")
    if stream:
        async with client.responses.stream(model=model, input="Do the bad thing.") as events:
            kinds = [event.type async for event in events]
            response = await events.get_final_response()
        if wire.wire == "bridge":
            assert kinds.count("response.refusal.delta") == 1 and "response.refusal.done" in kinds
    else:
        response = await client.responses.create(model=model, input="Do the bad thing.")
    [item] = response.output
    assert item.type == "message" and [part.model_dump() for part in item.content] == [
        {"type": "refusal", "refusal": no}]
    assert (await session_messages(proxy, "resp-refusal"))["messages"][1]["message"]["refusal"] == no
    await client.responses.create(model=model, input="Why not?")
    if wire.wire == "bridge":
        sent = wire.requests()[-1]["messages"]
        assert [(m["role"], m.get("refusal")) for m in sent] == [("user", None), ("assistant", no), ("user", None)]
    else:
        assert wire.conversation() == [("user", "Do the bad thing."), ("assistant", no), ("user", "Why not?")]


async def test_a_lone_surrogate_in_a_streamed_answer_is_sent_as_its_escape(proxy: Proxy, upstream: FakeUpstream) -> None:
    """A provider's answer may hold a lone surrogate (as a JSON escape). A Responses stream sends it
    as that escape, as the chat stream does: written as bytes that are not UTF-8, the SDK's decoder
    failed mid-stream."""
    upstream.enqueue(Reply(raw_content='"smile \\ud83d"'))
    async with proxy.client("surrogate").responses.stream(model="small", input="Smile?") as events:
        response = await events.get_final_response()
    assert response.output_text == "smile \ud83d"


@pytest.mark.parametrize("stream", [False, True])
async def test_an_answer_cut_short_says_why(proxy: Proxy, upstream: FakeUpstream, stream: bool) -> None:
    """A chat answer that ended at its length or at the provider's content filter is an incomplete
    Response, with OpenAI's reason for each (before, a filtered answer read as completed), and the
    message it was cut in says it is incomplete too, as OpenAI's does (it said completed)."""
    for finish, reason in (("length", "max_output_tokens"), ("content_filter", "content_filter")):
        upstream.enqueue(Reply(content="It was a dark", finish_reason=finish))
        client = proxy.client(f"cut-{finish}")
        if stream:
            events = [event async for event in await client.responses.create(model="small", input="A story?",
                                                                              stream=True)]
            assert events[-1].type == "response.incomplete"
            response = events[-1].response  # type: ignore[union-attr]
            [done] = [event.item for event in events if event.type == "response.output_item.done"]
            assert done.status == "incomplete"  # type: ignore[union-attr]
        else:
            response = await client.responses.create(model="small", input="A story?")
        assert (response.status, response.incomplete_details.reason) == ("incomplete", reason)  # type: ignore[union-attr]
        assert [item.status for item in response.output] == ["incomplete"]  # type: ignore[union-attr]
        assert (await client.responses.retrieve(response.id)).output[0].status == "incomplete"  # type: ignore[union-attr]


@pytest.mark.parametrize("stream", [False, True])
async def test_logprobs_asked_for_come_back_on_the_text(proxy: Proxy, upstream: FakeUpstream, stream: bool) -> None:
    """Asked for (`include: message.output_text.logprobs`, `top_logprobs`), the chat answer's token
    logprobs come back on the output text (streamed, on each delta and the done event): before, they
    were paid for upstream and dropped."""
    tokens = [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105], "top_logprobs": [
                  {"token": "Hi", "logprob": -0.1, "bytes": [72, 105]}]},
              {"token": " there", "logprob": -0.5, "bytes": [32, 116, 104, 101, 114, 101], "top_logprobs": []}]
    upstream.enqueue(Reply(content="Hi there", logprobs=tokens))
    client = proxy.client("logprobs")
    asked: Any = {"model": "small", "input": "Greet me.", "top_logprobs": 1,
                  "include": ["message.output_text.logprobs"]}
    if stream:
        events = [event async for event in await client.responses.create(**asked, stream=True)]
        deltas = [p.model_dump() for e in events if e.type == "response.output_text.delta" for p in e.logprobs]
        [done] = [e for e in events if e.type == "response.output_text.done"]
        assert deltas == tokens and [p.model_dump() for p in done.logprobs] == tokens
        response = events[-1].response  # type: ignore[union-attr]
    else:
        response = await client.responses.create(**asked)
    assert upstream.last().body["logprobs"] is True
    assert [p.model_dump() for p in response.output[0].content[0].logprobs] == tokens  # type: ignore[union-attr]


# --- the OpenAI Agents SDK on its default Responses model -------------------------------------------


async def test_resent_items_of_a_kept_response_go_on_in_its_session(proxy: Proxy, wire: Upstream) -> None:
    """Without a session header, `previous_response_id` or `conversation`, a kept response starts a
    session of its own; the next request that resends its items (the Vercel AI SDK's references,
    the Agents SDK's `to_input_list`) goes on in that session instead of storing the history again."""
    client = proxy.client(None)
    wire.enqueue(Reply(content="Hello Ada."), Reply(content="You are Ada."), Reply(content="Still Ada."))
    first = await client.responses.create(model=wire.model, input="My name is Ada.")
    [answer] = first.output
    second = await client.responses.create(model=wire.model, input=[
        {"role": "user", "content": "My name is Ada."}, {"type": "item_reference", "id": answer.id},
        {"role": "user", "content": "What is my name?"}])
    [answer2] = second.output
    third = await client.responses.create(model=wire.model, input=[
        {"role": "user", "content": "My name is Ada."}, answer.model_dump(exclude_none=True),
        {"role": "user", "content": "What is my name?"}, answer2.model_dump(exclude_none=True),
        {"role": "user", "content": "Sure?"}])
    assert third.output_text == "Still Ada."
    stored = await session_messages(proxy, first.id)  # the first response's session holds all three turns
    assert [m["message"]["content"] for m in stored["messages"]] == [
        "My name is Ada.", "Hello Ada.", "What is my name?", "You are Ada.", "Sure?", "Still Ada."]
    status, listed = await call(proxy, "GET", "/sessions")
    assert status == 200 and [s["id"] for s in listed["data"]] == [first.id]
    # Another tenant resending the same items starts a session of its own and reads nothing of it.
    other = proxy.client(None, key=OTHER_KEY)
    wire.enqueue(Reply(content="Who?"))
    fourth = await other.responses.create(model=wire.model, input=[answer.model_dump(exclude_none=True),
                                                                    {"role": "user", "content": "Who am I?"}])
    assert wire.conversation()[-2:] == [("assistant", "Hello Ada."), ("user", "Who am I?")]
    assert len((await session_messages(proxy, first.id))["messages"]) == 6
    assert fourth.id != first.id


async def test_openai_agents_sdk_on_its_responses_model(proxy: Proxy, wire: Upstream) -> None:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"rainy in {city}"

    agent = agents.Agent(name="assistant", instructions="You help with weather.", tools=[get_weather],
                         model=agents.OpenAIResponsesModel(model=wire.model, openai_client=proxy.client("agent-s")))
    wire.enqueue(Reply(tool_calls=[{"id": "call_a1", "type": "function",
                                    "function": {"name": "get_weather", "arguments": '{"city":"Lima"}'}}]),
                 Reply(content="It is rainy in Lima."), Reply(content="You asked about Lima."))
    first = await agents.Runner.run(agent, "Weather in Lima?")
    assert first.final_output == "It is rainy in Lima."
    # Within the run the SDK resent the whole run's items: recognised, so the call is stored once.
    assert wire.conversation() == [("system", "You help with weather."), ("user", "Weather in Lima?"),
                                   ("call", 'get_weather {"city":"Lima"}'), ("tool", "rainy in Lima")]
    second = await agents.Runner.run(agent, "Which city did I ask about?")
    assert second.final_output == "You asked about Lima."
    assert wire.conversation() == [("system", "You help with weather."), ("user", "Weather in Lima?"),
                                   ("call", 'get_weather {"city":"Lima"}'), ("tool", "rainy in Lima"),
                                   ("assistant", "It is rainy in Lima."), ("user", "Which city did I ask about?")]
    # Streamed, the SDK assembles the answer from the events.
    wire.enqueue(Reply(content="Still Lima."))
    streamed = agents.Runner.run_streamed(agent, "And now?")
    async for _ in streamed.stream_events():
        pass
    assert streamed.final_output == "Still Lima."
    assert wire.conversation()[-2:] == [("assistant", "You asked about Lima."), ("user", "And now?")]
    stored = await session_messages(proxy, "agent-s")
    assert [m["message"]["role"] for m in stored["messages"]] == [
        "user", "assistant", "tool", "assistant", "user", "assistant", "user", "assistant"]
