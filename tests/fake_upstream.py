"""A fake OpenAI-compatible provider: a real HTTP server that records what it receives.

It runs on 127.0.0.1, port 0, in a thread with its own event loop, so it serves the in-process proxy,
a proxy running as a subprocess, and the synchronous SDK alike. Replies come from a script
(`enqueue`); with an empty script it answers `reply N`. Streams are sent as SSE in several chunks,
tool calls as argument deltas, and a reply can fail, be cut mid-stream, or wait on a gate so a test
can hold a request in flight without sleeping.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import BodyPartReader, web

from threaded_server import ThreadedServer

SUMMARIZER_OPENING = "You keep the running summary of a conversation"


@dataclass
class Reply:
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    status: int = 200
    error_message: str = "upstream failure"
    error_param: str | None = None  # the parameter the error names, as OpenAI's say which one
    cut_stream: bool = False  # close the connection after the first content chunk
    end_stream_early: bool = False  # end the stream cleanly after the first content chunk: no finish, no [DONE]
    done_early: bool = False  # the same, but with the closing `data: [DONE]` (a gateway giving up)
    finish_reason: str | None = None  # the answer's, if not "stop" (or "tool_calls" for calls)
    finish_with_text: bool = False  # stream: the finish reason on the last text chunk (vLLM, Ollama, llama.cpp)
    no_chunks: str | None = None  # a stream without one chunk: "done" ([DONE] alone) or "cut" (the connection closed)
    # Where the request asks for `logprobs`: choice 0's `logprobs.content` (a stream: with its first piece).
    logprobs: list[dict[str, Any]] | None = None
    gate: threading.Event | None = None  # wait for it before answering
    usage: dict[str, int] | None = None
    gate_after_first_chunk: threading.Event | None = None  # stream: hold the rest until set
    gate_before_end: threading.Event | None = None  # stream: hold what follows the finish reason (usage, [DONE])
    choices: list[str] | None = None  # n > 1, not streamed: contents of choices 1, 2, ... (else `content`)
    # The content's JSON text, sent exactly so: a string with the escapes a provider may send
    # (`'"a\\ud800"'`, a lone surrogate) or any other JSON value (a malformed answer); overrides
    # `content`. A stream sends it whole, in one chunk.
    raw_content: str | None = None
    reasoning_content: str | None = None  # what the model thought first, as DeepSeek and litellm send it
    refusal: str | None = None  # the message's `refusal` (OpenAI's structured outputs); streamed in one delta
    headers: dict[str, str] | None = None  # an error response's headers (`retry-after`...)
    refusal_null: bool = False  # the message says `refusal: null`, as OpenAI's answers do
    # The Responses fake's: output items sent before the others (a built-in tool's call, as is).
    output_items: list[dict[str, Any]] | None = None
    no_choices: bool = False  # a chat completion whose `choices` is empty (not streamed)
    trickle: float | None = None  # not streamed: the body a byte at a time, this many seconds apart


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]

    @property
    def messages(self) -> list[dict[str, Any]]:
        return list(self.body.get("messages", []))

    @property
    def is_summary(self) -> bool:
        """A request from memproxy's summariser, told apart by its instructions."""
        first = (self.body.get("messages") or [{}])[0]
        # litellm may send a system message in another role to models that want that (o-series).
        return first.get("role") in ("system", "developer", "user") \
            and str(first.get("content", "")).startswith(SUMMARIZER_OPENING)


@dataclass
class FakeUpstream:
    received: list[Received] = field(default_factory=list)
    arrived: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))
    _script: deque[Reply] = field(default_factory=deque)
    # Answers summariser requests when set (else they take the next scripted reply like any other).
    summarizer: Callable[[Received], Reply] | None = None
    # Answers the other chat requests when set and nothing is scripted (else "reply N").
    responder: Callable[[Received], Reply] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: ThreadedServer = field(default_factory=lambda: ThreadedServer("fake-upstream"))
    port: int = 0
    # Refuse a request that sends an assistant message's `reasoning_content` back, as DeepSeek does.
    refuse_reasoning: bool = False
    # A provider with a tokenizer of its own: `tokens(body)` counts a chat request's prompt as it
    # does, which its usage reports, and a request whose prompt and `max_tokens` pass `window` is
    # refused with OpenAI's `context_length_exceeded` (None: neither).
    tokens: Callable[[dict[str, Any]], int] | None = None
    window: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def enqueue(self, *replies: Reply) -> None:
        with self._lock:
            self._script.extend(replies)

    def wait_for_request(self, timeout: float = 30.0) -> None:
        if not self.arrived.acquire(timeout=timeout):
            raise TimeoutError("the fake upstream received no request")

    def chat_requests(self) -> list[Received]:
        """The chat requests the proxy forwarded (summariser requests are listed apart)."""
        with self._lock:
            return [r for r in self.received if r.path.endswith("/chat/completions") and not r.is_summary]

    def summary_requests(self) -> list[Received]:
        with self._lock:
            return [r for r in self.received if r.is_summary]

    def last(self) -> Received:
        return self.chat_requests()[-1]

    def requests_to(self, path: str) -> list[Received]:
        """The requests to one of the other endpoints (`/v1/embeddings`, ...)."""
        with self._lock:
            return [r for r in self.received if r.path == path]

    def reset(self) -> None:
        with self._lock:
            self.received.clear()
            self._script.clear()
            self.summarizer = None
            self.responder = None
            self.refuse_reasoning = False
            self.tokens = None
            self.window = 0
        while self.arrived.acquire(blocking=False):
            pass

    def start(self) -> FakeUpstream:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/embeddings", self._embeddings)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/moderations", self._moderations)
        app.router.add_post("/v1/images/generations", self._images)
        app.router.add_post("/v1/images/edits", self._image_edits)
        app.router.add_post("/v1/audio/transcriptions", self._transcriptions)
        app.router.add_post("/v1/audio/speech", self._speech)
        self.port = self._server.start(app)
        return self

    def stop(self) -> None:
        self._server.stop()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": []})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        received = Received(request.path, dict(request.headers), body)
        with self._lock:
            self.received.append(received)
            number = len([r for r in self.received
                          if r.path.endswith("/chat/completions") and not r.is_summary])
            if received.is_summary and self.summarizer is not None:
                reply = self.summarizer(received)
            else:
                reply = self._script.popleft() if self._script else (
                    self.responder(received) if self.responder is not None else Reply(content=f"reply {number}"))
        self.arrived.release()
        refusal = _reasoning_model_refusal(body)
        if refusal is not None:
            return web.json_response({"error": {"message": refusal, "type": "invalid_request_error",
                                                "code": "unsupported_parameter", "param": None}}, status=400)
        if self.refuse_reasoning and any("reasoning_content" in m for m in received.messages):
            return web.json_response({"error": {
                "message": "The reasoning_content is an intermediate result for display purposes only and will"
                           " not be included in the context for inference. Please remove the reasoning_content"
                           " from your input messages.",
                "type": "invalid_request_error", "code": "invalid_request_error", "param": None}}, status=400)
        if reply.gate is not None:
            gate = reply.gate
            await asyncio.get_running_loop().run_in_executor(None, gate.wait, 30)
        if reply.status != 200:
            return web.json_response(
                {"error": {"message": reply.error_message, "type": "upstream", "code": None,
                           "param": reply.error_param}},
                status=reply.status, headers=reply.headers,
            )
        usage = reply.usage or {"prompt_tokens": 10 * number, "completion_tokens": 5, "total_tokens": 10 * number + 5}
        if self.tokens is not None:
            prompt = self.tokens(body)
            asked = body.get("max_completion_tokens") or body.get("max_tokens") or 0
            if prompt + asked > self.window:
                return web.json_response({"error": {
                    "message": f"This model's maximum context length is {self.window} tokens. However, you "
                               f"requested {prompt + asked} tokens ({prompt} in the messages, {asked} in the "
                               "completion). Please reduce the length of the messages or completion.",
                    "type": "invalid_request_error", "code": "context_length_exceeded", "param": "messages"}},
                    status=400)
            usage = {"prompt_tokens": prompt, "completion_tokens": 5, "total_tokens": prompt + 5}
        if body.get("stream"):
            return await self._stream(request, body, reply, usage, number)
        message: dict[str, Any] = {"role": "assistant",
                                   "content": _RAW if reply.raw_content is not None else reply.content}
        if reply.tool_calls:
            message["tool_calls"] = reply.tool_calls
        if reply.reasoning_content is not None:
            message["reasoning_content"] = reply.reasoning_content
        if reply.refusal is not None or reply.refusal_null:
            message["refusal"] = reply.refusal
        extra = reply.choices or []
        choices = [
            {"index": i, "message": message if i == 0 or i > len(extra) else {**message, "content": extra[i - 1]},
             "finish_reason": reply.finish_reason or ("tool_calls" if reply.tool_calls else "stop"),
             "logprobs": {"content": reply.logprobs, "refusal": None} if i == 0 and reply.logprobs and body.get("logprobs")
             else None}
            for i in range(0 if reply.no_choices else int(body.get("n") or 1))
        ]
        text = _raw(json.dumps({
            "id": f"chatcmpl-{number}", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model"), "choices": choices, "usage": usage,
        }), reply)
        if reply.trickle is not None:  # a provider that never stalls long enough for a read timeout
            data = text.encode()
            response = web.StreamResponse(headers={"Content-Type": "application/json",
                                                   "Content-Length": str(len(data))})
            await response.prepare(request)
            for i in range(len(data)):
                await response.write(data[i:i + 1])
                await asyncio.sleep(reply.trickle)
            await response.write_eof()
            return response
        return web.Response(text=text, content_type="application/json")

    async def _stream(
        self, request: web.Request, body: dict[str, Any], reply: Reply, usage: dict[str, int], number: int
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        base = {"id": f"chatcmpl-{number}", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": body.get("model")}

        # As OpenAI streams: asked for usage, every chunk carries `usage` (null until the last).
        usage_field = {"usage": None} if (body.get("stream_options") or {}).get("include_usage") else {}

        async def send(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> None:
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            if logprobs is not None:
                choice["logprobs"] = {"content": logprobs, "refusal": None}  # as OpenAI's say
            chunk = {**base, "choices": [choice], **usage_field}
            await response.write(f"data: {_raw(json.dumps(chunk), reply)}\n\n".encode())

        if reply.no_chunks is not None:
            if reply.no_chunks == "done":
                await response.write(b"data: [DONE]\n\n")
                await response.write_eof()
            else:
                assert request.transport is not None
                request.transport.close()
            return response
        await send({"role": "assistant", "content": ""})
        if reply.reasoning_content is not None:
            await send({"reasoning_content": reply.reasoning_content})
        text = _RAW if reply.raw_content is not None else reply.content or ""
        pieces = [text[i : i + max(1, len(text) // 3)] for i in range(0, len(text), max(1, len(text) // 3))]
        if reply.raw_content is not None:
            pieces = [_RAW]
        finish = reply.finish_reason or ("tool_calls" if reply.tool_calls else "stop")
        for i, piece in enumerate(pieces):
            last = reply.finish_with_text and i == len(pieces) - 1
            await send({"content": piece}, finish if last else None,
                       logprobs=reply.logprobs if i == 0 and body.get("logprobs") else None)
            if last:
                break
            if reply.cut_stream and i == 0:
                assert request.transport is not None
                request.transport.close()
                return response
            if (reply.end_stream_early or reply.done_early) and i == 0:
                if reply.done_early:
                    await response.write(b"data: [DONE]\n\n")
                await response.write_eof()
                return response
            if reply.gate_after_first_chunk is not None and i == 0:
                gate = reply.gate_after_first_chunk
                await asyncio.get_running_loop().run_in_executor(None, gate.wait, 30)
        if reply.refusal:
            await send({"refusal": reply.refusal})
        for index, call in enumerate(reply.tool_calls or []):
            # A function's arguments, or a custom tool's input, in two pieces.
            kind, given = ("custom", "input") if call.get("type") == "custom" else ("function", "arguments")
            args = call[kind].get(given, "")
            half = len(args) // 2
            await send({"tool_calls": [{"index": index, "id": call["id"], "type": kind,
                                        kind: {"name": call[kind]["name"], given: args[:half]}}]})
            await send({"tool_calls": [{"index": index, kind: {given: args[half:]}}]})
        if not reply.finish_with_text:
            await send({}, finish)
        if reply.gate_before_end is not None:
            gate = reply.gate_before_end
            await asyncio.get_running_loop().run_in_executor(None, gate.wait, 30)
        if (body.get("stream_options") or {}).get("include_usage"):
            await response.write(f"data: {json.dumps({**base, 'choices': [], 'usage': usage})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


    # --- the other OpenAI endpoints: each records the request and answers as OpenAI does, or with
    # the next scripted reply's error status; `content` is the text of a completion.

    async def _take(self, received: Received) -> Reply:
        with self._lock:
            self.received.append(received)
            reply = self._script.popleft() if self._script else Reply()
        self.arrived.release()
        if reply.gate is not None:
            gate = reply.gate
            await asyncio.get_running_loop().run_in_executor(None, gate.wait, 30)
        return reply

    async def _json_endpoint(self, request: web.Request) -> tuple[dict[str, Any], Reply, web.Response | None]:
        body = await request.json()
        reply = await self._take(Received(request.path, dict(request.headers), body))
        return body, reply, _error(reply)

    async def _embeddings(self, request: web.Request) -> web.Response:
        body, reply, error = await self._json_endpoint(request)
        if error is not None:
            return error
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        if inputs and isinstance(inputs[0], int):
            inputs = [inputs]  # one input given as tokens
        tokens = sum(len(str(i).split()) for i in inputs)
        dimensions = int(body.get("dimensions") or 3)
        data = [{"object": "embedding", "index": i, "embedding": [0.5 + i] * dimensions}
                for i in range(len(inputs))]
        return web.json_response({"object": "list", "data": data, "model": body["model"],
                                  "usage": reply.usage or {"prompt_tokens": tokens, "total_tokens": tokens}})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body, reply, error = await self._json_endpoint(request)
        if error is not None:
            return error
        text = reply.content if reply.content is not None else "a completion"
        usage = reply.usage or {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
        base = {"id": "cmpl-1", "object": "text_completion", "created": int(time.time()), "model": body["model"]}
        if not body.get("stream"):
            return web.json_response({**base, "choices": [
                {"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"}], "usage": usage})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for piece, finish in [(text[: len(text) // 2], None), (text[len(text) // 2 :], "stop")]:
            chunk = {**base, "choices": [{"index": 0, "text": piece, "logprobs": None, "finish_reason": finish}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if reply.cut_stream:
                assert request.transport is not None
                request.transport.close()
                return response
            if reply.end_stream_early:
                await response.write_eof()
                return response
        if (body.get("stream_options") or {}).get("include_usage"):
            await response.write(f"data: {json.dumps({**base, 'choices': [], 'usage': usage})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _moderations(self, request: web.Request) -> web.Response:
        body, reply, error = await self._json_endpoint(request)
        if error is not None:
            return error
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        categories = ("harassment", "hate", "self-harm", "sexual", "violence")
        results = [{"flagged": "attack" in str(i), "categories": {c: c == "violence" and "attack" in str(i)
                                                                   for c in categories},
                    "category_scores": {c: 0.9 if c == "violence" and "attack" in str(i) else 0.01
                                        for c in categories}}
                   for i in inputs]
        return web.json_response({"id": "modr-1", "model": body.get("model") or "omni-moderation-latest",
                                  "results": results})

    async def _images(self, request: web.Request) -> web.Response:
        body, reply, error = await self._json_endpoint(request)
        if error is not None:
            return error
        data = [{"b64_json": "iVBORw0KGgo=", "revised_prompt": body["prompt"]}
                for _ in range(int(body.get("n") or 1))]
        return web.json_response({"created": int(time.time()), "data": data})

    async def _image_edits(self, request: web.Request) -> web.Response:
        """Records the fields by name, and `files`: [(field, filename, bytes, content type)];
        answers one image per `n`, its `revised_prompt` the prompt, with usage in image tokens."""
        fields: dict[str, str] = {}
        files: list[tuple[str, str | None, bytes, str | None]] = []
        async for part in await request.multipart():
            if not isinstance(part, BodyPartReader):
                continue
            data = bytes(await part.read())
            if part.filename is not None:
                files.append((part.name or "", part.filename, data, part.headers.get("Content-Type")))
            else:
                fields[part.name or ""] = data.decode()
        reply = await self._take(Received(request.path, dict(request.headers), {**fields, "files": files}))
        error = _error(reply)
        if error is not None:
            return error
        data = [{"b64_json": "iVBORw0KGgo=", "revised_prompt": fields.get("prompt")}
                for _ in range(int(fields.get("n") or 1))]
        return web.json_response({"created": int(time.time()), "data": data,
                                  "usage": {"input_tokens": 50 * len(files), "output_tokens": 100,
                                            "total_tokens": 50 * len(files) + 100,
                                            "input_tokens_details": {"text_tokens": 0,
                                                                     "image_tokens": 50 * len(files)}}})

    async def _transcriptions(self, request: web.Request) -> web.Response:
        fields: dict[str, Any] = {}
        async for part in await request.multipart():
            if not isinstance(part, BodyPartReader):
                continue
            data = await part.read()
            if part.filename is not None:
                fields[part.name or "file"] = {"filename": part.filename, "bytes": bytes(data),
                                               "content_type": part.headers.get("Content-Type")}
            else:
                fields[part.name or ""] = data.decode()
        reply = await self._take(Received(request.path, dict(request.headers), fields))
        error = _error(reply)
        if error is not None:
            return error
        text = reply.content if reply.content is not None else f"heard {len(fields['file']['bytes'])} bytes"
        if fields.get("response_format") == "text":
            return web.Response(text=text)
        return web.json_response({"text": text, **({"usage": reply.usage} if reply.usage else {})})

    async def _speech(self, request: web.Request) -> web.StreamResponse:
        body, reply, error = await self._json_endpoint(request)
        if error is not None:
            return error
        audio = speech_audio(body["input"])
        if not reply.cut_stream:
            return web.Response(body=audio, content_type="audio/mpeg")
        response = web.StreamResponse(headers={"Content-Type": "audio/mpeg"})  # chunked: no length
        await response.prepare(request)
        await response.write(audio[: len(audio) // 2])
        assert request.transport is not None
        request.transport.close()
        return response


def speech_audio(text: str) -> bytes:
    """The fake's spoken `text`: some bytes that are not UTF-8, as audio is not."""
    return b"ID3\xff\xfb" + text.encode() * 100


def _error(reply: Reply) -> web.Response | None:
    if reply.status == 200:
        return None
    return web.json_response({"error": {"message": reply.error_message, "type": "upstream", "code": None,
                                        "param": reply.error_param}}, status=reply.status, headers=reply.headers)
def _reasoning_model_refusal(body: dict[str, Any]) -> str | None:
    """What OpenAI's reasoning models (o1, o3, o4-mini, GPT-5) refuse that other models take, in the
    API's words; None for anything else."""
    if not re.match(r"(o\d|gpt-5)", str(body.get("model", ""))):
        return None
    if "max_tokens" in body:
        return ("Unsupported parameter: 'max_tokens' is not supported with this model. "
                "Use 'max_completion_tokens' instead.")
    if body.get("temperature", 1) != 1:
        return (f"Unsupported value: 'temperature' does not support {body['temperature']} with this model. "
                "Only the default (1) value is supported.")
    return None


_RAW = "@@raw-content@@"  # where a reply's `raw_content` goes, in the JSON text about to be sent


def _raw(text: str, reply: Reply) -> str:
    return text if reply.raw_content is None else text.replace(f'"{_RAW}"', reply.raw_content)
