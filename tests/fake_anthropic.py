"""A fake of Anthropic's Messages API: a real HTTP server that records what it receives.

It speaks the API as litellm's `anthropic/` provider calls it: `POST {api_base}/v1/messages` with
`x-api-key` and `anthropic-version` headers, the system prompt as a top-level `system` field (a list
of text blocks), messages whose content is a list of `text`, `tool_use` and `tool_result` blocks, and
tools as `{name, description, input_schema}`. It answers as the API does: a `message` object whose
content is blocks, `stop_reason` `end_turn` or `tool_use`, usage as `input_tokens`/`output_tokens`; a
stream is the API's server-sent events (`message_start`, `content_block_start`, `text_delta` and
`input_json_delta` deltas, `content_block_stop`, `message_delta` with the stop reason and usage,
`message_stop`), with a `ping` in between as the API sends.

It refuses, with a 400 in Anthropic's error shape, what the API refuses that a proxy might send: no
messages, a `system` role among the messages, a first message that is not the user's (Bedrock and
Vertex refuse it; the first-party API did until late 2024), an empty text block, a `tool_use` whose
`tool_result` is not in the next message, a `tool_result` without its `tool_use` in the message
before, a field it does not know (an OpenAI parameter sent untranslated), no `max_tokens`, a
`max_tokens` that with the input exceeds the model's window (`window`; the input counted low, one
token a word, so a refusal is certain); and a request without `x-api-key` or `anthropic-version`. The messages quoted are the API's own.

Like `fake_upstream.FakeUpstream` it runs on 127.0.0.1, port 0, in a thread with its own event loop.
Replies come from a script (`enqueue`), else `reply N`; the summariser's requests (told apart by
memproxy's instructions, here in `system`) go to `summarizer` when set.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

import fake_upstream
from fake_upstream import SUMMARIZER_OPENING
from threaded_server import ThreadedServer

Block = dict[str, Any]


@dataclass
class ToolUse:
    name: str
    input: dict[str, Any]
    id: str = ""  # given one (`toolu_...`) when empty


@dataclass
class Reply:
    text: str | None = None
    tool_uses: list[ToolUse] = field(default_factory=list)
    status: int = 200
    error_type: str = "api_error"
    error_message: str = "Internal server error"
    input_tokens: int | None = None  # else a count of the request's characters / 4
    output_tokens: int = 7
    stop_reason: str | None = None  # else end_turn, or tool_use when it uses tools


@dataclass
class Received(fake_upstream.Received):
    """A Messages API request: the system prompt is a field of its own, not a message."""

    @property
    def system(self) -> str:
        """The top-level system prompt's text, blocks joined by blank lines."""
        system = self.body.get("system")
        if isinstance(system, list):
            return "\n\n".join(str(block.get("text", "")) for block in system)
        return str(system or "")

    @property
    def is_summary(self) -> bool:
        return self.system.startswith(SUMMARIZER_OPENING)


@dataclass
class FakeAnthropic:
    received: list[Received] = field(default_factory=list)
    summarizer: Callable[[Received], Reply] | None = None
    _script: deque[Reply] = field(default_factory=deque)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _server: ThreadedServer = field(default_factory=lambda: ThreadedServer("fake-anthropic"))
    port: int = 0
    window: int = 200_000  # the context window of every Claude model memproxy's tests name

    @property
    def url(self) -> str:
        """What memproxy's `api_base` is set to: litellm adds `/v1/messages`."""
        return f"http://127.0.0.1:{self.port}"

    def enqueue(self, *replies: Reply) -> None:
        with self._lock:
            self._script.extend(replies)

    def requests(self) -> list[Received]:
        """Every request that reached `/v1/messages`, refused ones included."""
        with self._lock:
            return list(self.received)

    def chat_requests(self) -> list[Received]:
        with self._lock:
            return [r for r in self.received if not r.is_summary]

    def summary_requests(self) -> list[Received]:
        with self._lock:
            return [r for r in self.received if r.is_summary]

    def reset(self) -> None:
        with self._lock:
            self.received.clear()
            self._script.clear()
            self.summarizer = None
            self.window = 200_000

    def start(self) -> FakeAnthropic:
        app = web.Application()
        app.router.add_post("/v1/messages", self._messages)
        self.port = self._server.start(app)
        return self

    def stop(self) -> None:
        self._server.stop()

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        received = Received(request.path, dict(request.headers), body)
        with self._lock:
            self.received.append(received)
        if "x-api-key" not in request.headers:
            return _error(401, "authentication_error", "x-api-key header is required")
        if "anthropic-version" not in request.headers:
            return _error(400, "invalid_request_error", "anthropic-version: header is required")
        refusal = refused(body, self.window)
        if refusal is not None:
            return _error(400, "invalid_request_error", refusal)
        with self._lock:
            if received.is_summary and self.summarizer is not None:
                reply = self.summarizer(received)
            else:
                number = len([r for r in self.received if not r.is_summary])
                reply = self._script.popleft() if self._script else Reply(text=f"reply {number}")
        if reply.status != 200:
            return _error(reply.status, reply.error_type, reply.error_message)
        number = next(self._ids)
        content: list[Block] = [{"type": "text", "text": reply.text}] if reply.text else []
        for i, use in enumerate(reply.tool_uses):
            content.append({"type": "tool_use", "id": use.id or f"toolu_{number:04d}{i:02d}", "name": use.name,
                            "input": use.input})
        stop = reply.stop_reason or ("tool_use" if reply.tool_uses else "end_turn")
        input_tokens = reply.input_tokens if reply.input_tokens is not None else len(json.dumps(body)) // 4
        message = {"id": f"msg_{number:04d}", "type": "message", "role": "assistant", "model": body["model"],
                   "content": content, "stop_reason": stop, "stop_sequence": None,
                   "usage": {"input_tokens": input_tokens, "output_tokens": reply.output_tokens}}
        if body.get("stream"):
            return await _stream(request, message)
        return web.json_response(message, headers={"request-id": f"req_{number:04d}"})


# The Messages API's request fields.
_FIELDS = frozenset({"model", "messages", "max_tokens", "system", "metadata", "stop_sequences", "stream",
                     "temperature", "top_p", "top_k", "tools", "tool_choice", "thinking", "service_tier",
                     "container", "mcp_servers", "context_management"})


def refused(body: dict[str, Any], window: int = 200_000) -> str | None:
    """Why the Messages API would answer this body 400, in its words; None if it would not."""
    unknown = sorted(set(body) - _FIELDS)
    if unknown:  # the API takes no field it does not know
        return f"{unknown[0]}: Extra inputs are not permitted"
    if not isinstance(body.get("max_tokens"), int):
        return "max_tokens: Field required"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "messages: at least one message is required"
    for i, message in enumerate(messages):
        if message.get("role") not in ("user", "assistant"):
            return (f"messages.{i}.role: Input should be 'user' or 'assistant'" if message.get("role") != "system"
                    else 'messages: Unexpected role "system". The Messages API accepts a top-level `system` '
                         'parameter, not "system" as an input message role.')
        for j, block in enumerate(_blocks(message)):
            if block.get("type") == "text" and not block.get("text"):
                return f"messages.{i}.content.{j}: text content blocks must be non-empty"
    if messages[0]["role"] != "user":
        return 'messages: first message must use the "user" role'
    words = sum(len(str(b.get("text", "")).split()) for m in messages for b in _blocks(m))
    words += len(Received("", {}, body).system.split())
    if words + body["max_tokens"] > window:
        return (f"input length and `max_tokens` exceed context limit: {words} + {body['max_tokens']} > {window}, "
                "decrease input length or `max_tokens` and try again")
    for i, message in enumerate(messages):
        uses = [b["id"] for b in _blocks(message) if b.get("type") == "tool_use"]
        following = _blocks(messages[i + 1]) if i + 1 < len(messages) else []
        answered = {b.get("tool_use_id") for b in following if b.get("type") == "tool_result"}
        missing = [u for u in uses if u not in answered]
        if missing:
            return (f"messages.{i}: `tool_use` ids were found without `tool_result` blocks immediately after: "
                    f"{', '.join(missing)}. Each `tool_use` block must have a corresponding `tool_result` block "
                    "in the next message.")
        previous = ({b["id"] for b in _blocks(messages[i - 1]) if b.get("type") == "tool_use"}
                    if i > 0 and messages[i - 1]["role"] == "assistant" else set())
        for j, block in enumerate(_blocks(message)):
            if block.get("type") == "tool_result" and block.get("tool_use_id") not in previous:
                return (f"messages.{i}.content.{j}: unexpected `tool_use_id` found in `tool_result` blocks: "
                        f"{block.get('tool_use_id')}. Each `tool_result` block must have a corresponding "
                        "`tool_use` block in the previous message.")
    return None


def _blocks(message: dict[str, Any]) -> list[Block]:
    content = message.get("content")
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [b for b in content or [] if isinstance(b, dict)]


def _error(status: int, kind: str, message: str) -> web.Response:
    return web.json_response({"type": "error", "error": {"type": kind, "message": message}}, status=status)


async def _stream(request: web.Request, message: dict[str, Any]) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)

    async def send(event: str, data: dict[str, Any]) -> None:
        await response.write(f"event: {event}\ndata: {json.dumps({'type': event, **data})}\n\n".encode())

    usage = message["usage"]
    await send("message_start", {"message": {**message, "content": [], "stop_reason": None,
                                             "usage": {"input_tokens": usage["input_tokens"], "output_tokens": 1}}})
    for index, block in enumerate(message["content"]):
        if block["type"] == "text":
            await send("content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}})
            if index == 0:
                await send("ping", {})
            text = block["text"]
            step = max(1, len(text) // 3)
            for start in range(0, len(text), step):
                await send("content_block_delta", {"index": index,
                                                   "delta": {"type": "text_delta", "text": text[start:start + step]}})
        else:
            await send("content_block_start", {"index": index, "content_block": {
                "type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}})
            arguments = json.dumps(block["input"])
            half = len(arguments) // 2
            for part in (arguments[:half], arguments[half:]):
                await send("content_block_delta", {"index": index,
                                                   "delta": {"type": "input_json_delta", "partial_json": part}})
        await send("content_block_stop", {"index": index})
    await send("message_delta", {"delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
                                 "usage": {"output_tokens": usage["output_tokens"]}})
    await send("message_stop", {})
    await response.write_eof()
    return response
