"""The benchmark's fake provider: one OpenAI-compatible HTTP server that every path talks to.

Run as its own process (`python bench/upstream.py`), so its CPU is apart from the proxy's and the
load generator's; it prints `listening on http://127.0.0.1:PORT` once ready. Its behaviour is set at
run time through `POST /_control` (JSON), so one server serves every phase:

- `delay_ms`: a fixed wait before answering (0 exposes the proxies' CPU cost, 50 is a fast model);
- `chunks`, `pace_ms`: a stream sends its first content at `delay_ms`, then `chunks - 1` more
  content chunks `pace_ms` apart (a paced SSE stream, as a model emits tokens);
- `replies`: {sha256(last user message): reply}, so a replayed conversation gets its recorded
  answers back whoever sits in front;
- `count_tokens`: count the prompt tokens of every request received (memproxy's own counter),
  split into chat and summariser requests; `GET /_stats` returns the counts;
- `keep_last`: keep the body of the last chat request as received; `GET /_last` returns it (the
  long-session sweep sends it again on the direct path, to weigh what serialising it costs).

Summariser requests (memproxy's, told apart by their instructions) get a short generic summary, so a
replay can fold history without a model.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import time
from typing import Any

from aiohttp import web

SUMMARIZER_OPENING = "You keep the running summary of a conversation"
SUMMARY = (
    "Earlier in this conversation the two of them caught up on their lives: work and family, friends they "
    "share, things they had done lately and plans they were making, and how they felt about all of it. They "
    "encouraged each other, shared a few photos and stories, asked after each other's projects and promised "
    "to keep in touch. Nothing that was said needs an action from the assistant; the details are in the "
    "conversation itself."
)
ANSWER = "Paris is the capital of France; it has been the seat of government for centuries."


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class FakeProvider:
    def __init__(self) -> None:
        self.delay = 0.0
        self.chunks = 10
        self.pace = 0.005
        self.replies: dict[str, str] = {}
        self.counter: Any = None
        self.keep_last = False  # keep the last chat request's body (`GET /_last`)
        self.last = b""
        self.stats = {"requests": 0, "chat_requests": 0, "chat_prompt_tokens": 0,
                      "summary_requests": 0, "summary_prompt_tokens": 0, "summary_completion_tokens": 0}

    async def control(self, request: web.Request) -> web.Response:
        settings = await request.json()
        if "delay_ms" in settings:
            self.delay = float(settings["delay_ms"]) / 1000
        if "chunks" in settings:
            self.chunks = max(1, int(settings["chunks"]))
        if "pace_ms" in settings:
            self.pace = float(settings["pace_ms"]) / 1000
        if "replies" in settings:
            self.replies = dict(settings["replies"])
        if "count_tokens" in settings:
            self.counter = _counter(settings["count_tokens"]) if settings["count_tokens"] else None
        if "keep_last" in settings:
            self.keep_last, self.last = bool(settings["keep_last"]), b""
        if settings.get("reset_stats"):
            self.stats = dict.fromkeys(self.stats, 0)
        return web.json_response({"ok": True})

    async def get_stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats)

    async def get_last(self, request: web.Request) -> web.Response:
        return web.Response(body=self.last, content_type="application/json")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "bench-model", "object": "model"}]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw)
        if self.keep_last:
            self.last = raw
        messages = body.get("messages") or []
        self.stats["requests"] += 1
        summarising = bool(messages) and str(messages[0].get("content", "")).startswith(SUMMARIZER_OPENING)
        if summarising:
            text = _summary(messages)
            self.stats["summary_requests"] += 1
            if self.counter is not None:
                self.stats["summary_prompt_tokens"] += _prompt_tokens(self.counter, messages)
                self.stats["summary_completion_tokens"] += self.counter.text(text)
        else:
            text = self._reply(messages)
            self.stats["chat_requests"] += 1
            if self.counter is not None:
                self.stats["chat_prompt_tokens"] += _prompt_tokens(self.counter, messages)
        if self.delay:
            await asyncio.sleep(self.delay)
        if body.get("stream"):
            return await self._stream(request, body, text)
        usage = {"prompt_tokens": 20, "completion_tokens": 17, "total_tokens": 37}
        return web.json_response({
            "id": f"chatcmpl-{self.stats['requests']}", "object": "chat.completion",
            "created": int(time.time()), "model": body.get("model"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": "stop", "logprobs": None}],
            "usage": usage,
        })

    def _reply(self, messages: list[dict[str, Any]]) -> str:
        if self.replies and messages:
            last = messages[-1].get("content")
            if isinstance(last, str) and digest(last) in self.replies:
                return self.replies[digest(last)]
        return ANSWER

    async def _stream(self, request: web.Request, body: dict[str, Any], text: str) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        base = {"id": f"chatcmpl-{self.stats['requests']}", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": body.get("model")}

        def event(delta: dict[str, Any], finish: str | None = None) -> bytes:
            chunk = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            return f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n".encode()

        step = max(1, -(-len(text) // self.chunks))
        pieces = [text[i : i + step] for i in range(0, len(text), step)] or [""]
        await response.write(event({"role": "assistant", "content": ""}) + event({"content": pieces[0]}))
        for piece in pieces[1:]:
            if self.pace:
                await asyncio.sleep(self.pace)
            await response.write(event({"content": piece}))
        await response.write(event({}, "stop") + b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _counter(encoding: str) -> Any:
    from memproxy.tokens import TiktokenCounter  # only a replay counts tokens; the server stays light

    return TiktokenCounter(encoding)


def _prompt_tokens(counter: Any, messages: list[dict[str, Any]]) -> int:
    from memproxy.tokens import request_tokens

    return int(request_tokens(counter, messages, []))


def _summary(messages: list[dict[str, Any]]) -> str:
    """A stand-in for a model's summary: the same generic ~100 tokens whatever the transcript, so a
    replay can fold history without a model, and no line of the dialog (no dialog id a recall score
    looks for) reaches the upstream by way of the summary."""
    return SUMMARY


def make_app(provider: FakeProvider) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/chat/completions", provider.chat)
    app.router.add_post("/chat/completions", provider.chat)
    app.router.add_get("/v1/models", provider.models)
    app.router.add_post("/_control", provider.control)
    app.router.add_get("/_stats", provider.get_stats)
    app.router.add_get("/_last", provider.get_last)
    return app


async def serve(port: int) -> None:
    runner = web.AppRunner(make_app(FakeProvider()), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port, backlog=4096)
    await site.start()
    print(f"listening on http://127.0.0.1:{runner.addresses[0][1]}", flush=True)
    try:
        await asyncio.Event().wait()  # until the bench terminates this process
    finally:
        await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description="The benchmark's fake OpenAI-compatible provider.")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    try:
        asyncio.run(serve(args.port))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
