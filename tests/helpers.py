"""What many test modules share: a bounded wait, and a way to hold a conversation with the proxy.

- `until(condition, what)`: poll a condition with a deadline, for an effect nothing announces (a
  background fold, a sweep, a write halfway). Never a sleep as synchronisation: the wait ends as soon
  as the condition holds, and fails with `what` when the deadline passes.
- `complete`, `chat`, `stream_chat`: one request through the official SDK, plain dicts as messages
  (as most apps send them), with the response headers; `send_turn`: one turn of a session on a proxy.
- `Conversation`: one session driven like a client, turn after turn. It enqueues the fake
  provider's reply, sends the request ("full" resends the history, "new" only the new messages),
  checks that exactly one chat request reached the provider and hands back that request and the
  response headers; `remember` then adds the turn to the history the client would echo. Modules
  check what was sent by their own rules (the budget, compaction, summaries) in a subclass.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import openai
from openai import AsyncStream
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from conftest import PROXY_KEY, Proxy
from fake_upstream import FakeUpstream, Received, Reply

Message = dict[str, Any]


async def until(condition: Callable[[], bool], what: str, timeout: float = 10.0, interval: float = 0.01) -> None:
    """Wait until `condition()` holds, polling every `interval` seconds; fail after `timeout`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        await asyncio.sleep(interval)


def user(text: str) -> Message:
    return {"role": "user", "content": text}


def pinned_question(kept: Sequence[Message], history: Sequence[Message], new: Sequence[Message]) -> int | None:
    """Where, in `history`, the question of an agent loop sent ahead of the kept turns is (memory's
    `fit`: the latest stored user message, where the newest exchange did not fit whole), if
    `kept` (the stored messages a request sent, in order) opens with it; None if it does not."""
    if not kept or any(m.get("role") == "user" for m in new):
        return None
    users = [i for i, m in enumerate(history) if m.get("role") == "user"]
    if not users or users[-1] >= len(history) - len(kept):  # none, or sent among the newest messages
        return None
    question = users[-1]
    same = {k: v for k, v in kept[0].items() if v is not None} == \
        {k: v for k, v in history[question].items() if v is not None}
    return question if same else None


def assistant(text: str | None, calls: list[str] | None = None) -> Message:
    """An assistant message; `calls`: the ids of tool calls it makes (function `f`, no arguments)."""
    message: Message = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [{"id": c, "type": "function", "function": {"name": "f", "arguments": "{}"}}
                                 for c in calls]
    return message


def tool(call_id: str, text: str) -> Message:
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def assistant_from(reply: Reply) -> Message:
    """The assistant message as a client echoes it back (and as the proxy stores it)."""
    if reply.tool_calls:
        return {"role": "assistant", "content": reply.content, "tool_calls": reply.tool_calls}
    return {"role": "assistant", "content": reply.content}


# --- one request -----------------------------------------------------------------------------------


async def complete(
    client: openai.AsyncOpenAI, messages: Sequence[Message], **params: Any
) -> tuple[ChatCompletion, httpx.Headers]:
    """One non-streaming request: the completion and the response headers."""
    sent: Any = list(messages)
    raw = await client.chat.completions.with_raw_response.create(model=params.pop("model", "small"),
                                                                 messages=sent, **params)
    return raw.parse(), raw.headers


async def chat(
    client: openai.AsyncOpenAI, messages: Sequence[Message], **params: Any
) -> tuple[str, httpx.Headers]:
    """One non-streaming turn: the reply text and the response headers."""
    completion, headers = await complete(client, messages, **params)
    return completion.choices[0].message.content or "", headers


async def stream_chat(
    client: openai.AsyncOpenAI, messages: Sequence[Message], **params: Any
) -> tuple[AsyncStream[ChatCompletionChunk], httpx.Headers]:
    """One streaming request: the stream of chunks and the response headers."""
    sent: Any = list(messages)
    raw = await client.chat.completions.with_raw_response.create(model=params.pop("model", "small"),
                                                                 messages=sent, stream=True, **params)
    return raw.parse(), raw.headers


async def send_turn(proxy: Proxy, session: str, messages: Sequence[Message], key: str = PROXY_KEY,
                    model: str = "small", **headers: str) -> httpx.Headers:
    """One turn of `session` on `proxy`, with a client of its own: the response headers."""
    _, found = await complete(proxy.client(session=session, key=key, **headers), messages, model=model)
    return found


# --- a conversation --------------------------------------------------------------------------------


class Conversation:
    """One session driven like a client: style "full" resends the history, "new" only new messages.

    `history` is the conversation as the client knows it (and as the proxy stores it).
    """

    def __init__(self, proxy: Proxy, upstream: FakeUpstream, session: str = "s1", *, style: str = "new",
                 system: Sequence[Message] = (), tools: Sequence[dict[str, Any]] = (), model: str = "small",
                 **headers: str) -> None:
        self.proxy = proxy
        self.upstream = upstream
        self.session = session
        self.client = proxy.client(session=session, **headers)
        self.style = style
        self.system = list(system)
        self.tools = list(tools)
        self.model = model
        self.history: list[Message] = []

    def request(self, new: Sequence[Message]) -> list[Message]:
        """The messages the client sends with `new`."""
        return [*self.system, *(self.history if self.style == "full" else []), *new]

    async def exchange(self, new: Sequence[Message], reply: Reply, *, stream: bool = False,
                       **params: Any) -> tuple[Received, httpx.Headers]:
        """Send one request whose answer is `reply`: what the provider received, and the response
        headers. The history is left as it was (see `remember`)."""
        self.upstream.enqueue(reply)
        before = len(self.upstream.chat_requests())
        if self.tools:
            params["tools"] = self.tools
        messages: Any = self.request(new)
        raw = await self.client.chat.completions.with_raw_response.create(
            model=self.model, messages=messages, stream=stream, **params)
        if stream:
            async for _ in raw.parse():  # type: ignore[union-attr]
                pass
        else:
            raw.parse()
        requests = self.upstream.chat_requests()
        assert len(requests) == before + 1, "not exactly one chat request reached the provider"
        return requests[-1], raw.headers

    def remember(self, new: Sequence[Message], reply: Reply) -> None:
        """The turn joins the history: the new messages, then the answer as the client echoes it."""
        self.history += [*new, assistant_from(reply)]
