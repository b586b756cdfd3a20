"""Assembling the assistant message from a stream of chunks, as the client sees it.

Only choice 0 is recorded (the one a client continues with when it asks for n > 1). A stream counts
as complete only once choice 0 has a finish reason; anything cut before that is never stored.
"""

from __future__ import annotations

from typing import Any

from .messages import Message, assistant_message


def hiding_usage(chunk: dict[str, Any]) -> dict[str, Any] | None:
    """A chunk as the client sees it when the usage was asked for memproxy's own accounting, not
    by the client: without its `usage` field, and None for the chunk that holds only the usage
    (litellm's holds an empty choice), which the client never sees."""
    if "usage" not in chunk:
        return chunk
    if chunk["usage"] is not None and not any(c.get("delta") or c.get("text") or c.get("finish_reason")
                                              for c in chunk.get("choices") or []):
        return None
    return {k: v for k, v in chunk.items() if k != "usage"}


class StreamAssembler:
    def __init__(self) -> None:
        self._content: list[str] = []
        self._calls: dict[int, dict[str, Any]] = {}
        self._extra: dict[str, Any] = {}
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    @property
    def complete(self) -> bool:
        return self.finish_reason is not None

    def add(self, chunk: dict[str, Any]) -> None:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if delta.get("content"):
                self._content.append(delta["content"])
            for key in ("refusal", "reasoning_content"):
                if delta.get(key):
                    self._extra[key] = self._extra.get(key, "") + delta[key]
            for call in delta.get("tool_calls") or []:
                self._add_call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def _add_call(self, delta: dict[str, Any]) -> None:
        call = self._calls.setdefault(
            int(delta.get("index", len(self._calls))),
            {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
        )
        if delta.get("id"):
            call["id"] = delta["id"]
        if delta.get("type"):
            call["type"] = delta["type"]
        function = delta.get("function") or {}
        if function.get("name"):
            call["function"]["name"] += function["name"]
        if function.get("arguments"):
            call["function"]["arguments"] += function["arguments"]

    def message(self) -> Message:
        raw: Message = {"role": "assistant", "content": "".join(self._content) or None, **self._extra}
        if self._calls:
            raw["tool_calls"] = [self._calls[i] for i in sorted(self._calls)]
        return assistant_message(raw)
