"""Reasoning is stored and shown, but not resent (issue 15, item 4).

An assistant message's `reasoning_content` (DeepSeek, litellm's reasoning models), `reasoning` and
`thinking_blocks` are kept in the store and in what the client receives, but once their exchange is
over they are not sent upstream again: the fake provider here refuses, as DeepSeek does, any request
that sends `reasoning_content` back. Inside an unfinished tool-call exchange (the client answers the
calls, no new user message) the assistant message goes verbatim, reasoning included, as Anthropic's
extended thinking with tool use requires. New messages are counted without their reasoning; messages
whose stored form still holds it (trimming off) are sent without it and counted with it: never under.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from admin_api import Api
from conftest import Proxy, make_config
from db import rows
from fake_upstream import FakeUpstream, Reply
from helpers import Conversation, tool, user
from memproxy.config import Config, StorageConfig

pytestmark = [pytest.mark.both_stores, pytest.mark.both_transports]

THOUGHT = "Let me think step by step about the user's question before I answer it. " * 20
CALL = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "weather"}'}}
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object",
                                                                           "properties": {"q": {"type": "string"}}}}}]


def reasoning_in(messages: list[dict[str, Any]]) -> list[str]:
    return [m["reasoning_content"] for m in messages if "reasoning_content" in m]


def stored_bodies(config: Config) -> list[dict[str, Any]]:
    return [json.loads(r[0]) for r in rows(config, "SELECT body FROM messages WHERE active = 1 ORDER BY seq")]


@pytest.fixture(params=["trimming on", "trimming off"])
def config(request: pytest.FixtureRequest, storage: StorageConfig, upstream: FakeUpstream, transport: str) -> Config:
    """Trimming on: the compact form leaves the reasoning out. Off: the stored body goes, less it."""
    trim = 1000 if request.param == "trimming on" else 0
    return make_config(storage, upstream.url, transport, tool_output_max_tokens=trim)


@pytest.mark.parametrize("stream", [False, True])
async def test_reasoning_is_stored_and_shown_but_not_resent(proxy: Proxy, upstream: FakeUpstream, config: Config,
                                                           stream: bool) -> None:
    upstream.refuse_reasoning = True
    talk = Conversation(proxy, upstream)
    first = Reply(content="The answer is 4.", reasoning_content=THOUGHT)
    await talk.exchange([user("what is 2 + 2?")], first, stream=stream)
    talk.remember([user("what is 2 + 2?")], first)

    stored = stored_bodies(config)
    assert [m["role"] for m in stored] == ["user", "assistant"]
    assert stored[1]["reasoning_content"] == THOUGHT  # kept, and visible to the admin API

    received, _ = await talk.exchange([user("and 3 + 3?")], Reply(content="6"), stream=stream)
    assert [m["role"] for m in received.messages] == ["user", "assistant", "user"]
    assert received.messages[1]["content"] == "The answer is 4."
    assert reasoning_in(received.messages) == []  # else the fake, like DeepSeek, answers 400


async def test_the_client_receives_the_reasoning(proxy: Proxy, upstream: FakeUpstream) -> None:
    upstream.enqueue(Reply(content="4", reasoning_content=THOUGHT))
    completion = await proxy.client().chat.completions.create(model="small", messages=[user("2 + 2?")])  # type: ignore[list-item]
    assert (completion.choices[0].message.model_extra or {}).get("reasoning_content") == THOUGHT


async def test_an_unfinished_tool_exchange_sends_its_reasoning(proxy: Proxy, upstream: FakeUpstream) -> None:
    talk = Conversation(proxy, upstream, tools=TOOLS)
    calling = Reply(content=None, tool_calls=[CALL], reasoning_content="I should look the weather up.")
    await talk.exchange([user("weather?")], calling)
    talk.remember([user("weather?")], calling)

    # The client runs the call and sends its result: the exchange goes on, reasoning and all.
    result = tool("call_1", "sunny")
    received, _ = await talk.exchange([result], Reply(content="It is sunny."))
    assert [m["role"] for m in received.messages] == ["user", "assistant", "tool"]
    assert reasoning_in(received.messages) == ["I should look the weather up."]
    talk.remember([result], Reply(content="It is sunny."))

    # A new question ends it: the calls and results still go, the reasoning no more.
    received, _ = await talk.exchange([user("and tomorrow?")], Reply(content="Rain."))
    assert [m["role"] for m in received.messages] == ["user", "assistant", "tool", "assistant", "user"]
    assert received.messages[1]["tool_calls"][0]["id"] == "call_1"
    assert reasoning_in(received.messages) == []


async def test_new_reasoning_is_counted_out_of_the_budget(proxy: Proxy, upstream: FakeUpstream,
                                                          config: Config) -> None:
    """A message with reasoning is stored with a compact form without it, whether trimming is on or
    off, and the context preview counts what is sent: the answer without its thought."""
    talk = Conversation(proxy, upstream)
    reply = Reply(content="Four.", reasoning_content=THOUGHT)
    await talk.exchange([user("2 + 2?")], reply)
    (tokens, compact_tokens, compact), = rows(
        config, "SELECT tokens, compact_tokens, compact_body FROM messages WHERE seq = 1 AND active = 1")
    assert compact is not None and "reasoning_content" not in json.loads(compact)
    assert compact_tokens < tokens - 100  # the thought is some 300 tokens

    async with aiohttp.ClientSession() as http:
        preview = await Api(http, proxy).post("/sessions/s1/context", json={"messages": [user("next")]})
    assert reasoning_in(preview["messages"]) == []
    assert len(preview["messages"]) == 3  # everything fits: the budget is what is counted
    assert preview["tokens"] < tokens  # the answer counted without its thought
