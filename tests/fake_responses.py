"""A fake provider that speaks only the Responses API (`POST /v1/responses`), as OpenAI's does: a
real HTTP server recording what it receives, answering from the same script of `Reply`s as the chat
fake (`fake_upstream.FakeUpstream`), as a Response object or as its stream of events. It has no
chat completions endpoint: a model that reaches it must go through the Responses API.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

from aiohttp import web

from fake_upstream import FakeUpstream, Received, Reply


class FakeResponsesUpstream(FakeUpstream):
    def start(self) -> FakeResponsesUpstream:
        app = web.Application()
        app.router.add_post("/v1/responses", self._responses)
        self.port = self._server.start(app)
        return self

    def responses_requests(self) -> list[Received]:
        with self._lock:
            return [r for r in self.received if r.path == "/v1/responses"]

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        received = Received(request.path, dict(request.headers), body)
        with self._lock:
            self.received.append(received)
            number = len([r for r in self.received if r.path == "/v1/responses"])
            reply = self._script.popleft() if self._script else Reply(content=f"reply {number}")
        self.arrived.release()
        if reply.gate is not None:
            gate: threading.Event = reply.gate
            await asyncio.get_running_loop().run_in_executor(None, gate.wait, 30)
        if reply.status != 200:
            return web.json_response(
                {"error": {"message": reply.error_message, "type": "upstream", "code": None, "param": None}},
                status=reply.status)
        usage = {"input_tokens": 10 * number, "output_tokens": 5, "total_tokens": 10 * number + 5,
                 "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}
        output = _output(reply, number)
        response = {"id": f"resp_upstream_{number}", "object": "response", "created_at": int(time.time()),
                    "status": "completed", "model": body.get("model"), "output": output, "usage": usage,
                    "parallel_tool_calls": True, "tool_choice": "auto", "tools": body.get("tools") or [],
                    "error": None, "incomplete_details": None, "instructions": None, "metadata": {},
                    "temperature": 1.0, "top_p": 1.0}
        if body.get("background") and not body.get("stream"):
            # As OpenAI answers a background request: at once, queued, nothing said yet (the answer
            # would come to a later `GET /v1/responses/{id}`, which this fake does not serve).
            return web.json_response({**response, "status": "queued", "output": [], "usage": None,
                                      "background": True})
        if not body.get("stream"):
            return web.json_response(response)
        return await self._stream(request, response, reply)

    async def _stream(self, request: web.Request, response: dict[str, Any], reply: Reply) -> web.StreamResponse:
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        sequence = 0

        async def send(kind: str, **fields: Any) -> None:
            nonlocal sequence
            event = {"type": kind, "sequence_number": sequence, **fields}
            sequence += 1
            await stream.write(f"event: {kind}\ndata: {json.dumps(event)}\n\n".encode())

        started = {**response, "status": "in_progress", "output": [], "usage": None}
        await send("response.created", response=started)
        await send("response.in_progress", response=started)
        for index, item in enumerate(response["output"]):
            if item["type"] == "message" and item["content"][0]["type"] == "output_text":
                text = item["content"][0]["text"]
                await send("response.output_item.added", output_index=index,
                           item={**item, "status": "in_progress", "content": []})
                part = {"type": "output_text", "text": "", "annotations": []}
                await send("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                           part=part)
                for piece in (text[: len(text) // 2], text[len(text) // 2:]):
                    await send("response.output_text.delta", item_id=item["id"], output_index=index,
                               content_index=0, delta=piece, logprobs=[])
                    if reply.cut_stream:
                        assert request.transport is not None
                        request.transport.close()
                        return stream
                await send("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                           text=text, logprobs=[])
                await send("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                           part={**part, "text": text})
            elif item["type"] == "function_call":
                await send("response.output_item.added", output_index=index,
                           item={**item, "arguments": "", "status": "in_progress"})
                await send("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                           delta=item["arguments"])
                await send("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                           arguments=item["arguments"])
            else:
                await send("response.output_item.added", output_index=index, item=item)
            await send("response.output_item.done", output_index=index, item=item)
        await send("response.completed", response=response)
        await stream.write_eof()
        return stream


def _output(reply: Reply, number: int) -> list[dict[str, Any]]:
    output: list[dict[str, Any]] = [dict(item) for item in reply.output_items or []]
    if reply.reasoning_content is not None:
        output.append({"type": "reasoning", "id": f"rs_{number}",
                       "summary": [{"type": "summary_text", "text": reply.reasoning_content}]})
    if reply.content:
        output.append({"type": "message", "id": f"msg_{number}", "role": "assistant", "status": "completed",
                       "content": [{"type": "output_text", "text": reply.content, "annotations": []}]})
    elif reply.refusal:
        output.append({"type": "message", "id": f"msg_{number}", "role": "assistant", "status": "completed",
                       "content": [{"type": "refusal", "refusal": reply.refusal}]})
    for i, call in enumerate(reply.tool_calls or []):
        output.append({"type": "function_call", "id": f"fc_{number}_{i}", "call_id": call["id"],
                       "name": call["function"]["name"], "arguments": call["function"].get("arguments", ""),
                       "status": "completed"})
    return output
