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
    """Choice 0's message from its deltas: everything `assistant_message` keeps of a message that
    came whole. Text fields are concatenated; tool calls and a legacy `function_call` are built from
    their name and argument pieces; audio from its data and transcript pieces; Anthropic's thinking
    blocks (through litellm) from their text pieces, each closed by its signature, as litellm's own
    `stream_chunk_builder` closes them (a block without a signature is of no use to send back)."""

    def __init__(self) -> None:
        self._content: list[str] = []
        self._calls: dict[int, dict[str, Any]] = {}
        self._extra: dict[str, Any] = {}
        self._thinking: list[dict[str, Any]] = []
        self._thinking_text: list[str] = []
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
            for key in ("refusal", "reasoning_content", "reasoning"):
                if isinstance(delta.get(key), str) and delta[key]:
                    self._extra[key] = self._extra.get(key, "") + delta[key]
            for call in delta.get("tool_calls") or []:
                self._add_call(call)
            if isinstance(delta.get("function_call"), dict):
                _merge(self._extra.setdefault("function_call", {}), delta["function_call"], ("name", "arguments"))
            if isinstance(delta.get("audio"), dict):
                _merge(self._extra.setdefault("audio", {}), delta["audio"], ("data", "transcript"))
            for block in delta.get("thinking_blocks") or []:
                if isinstance(block, dict):
                    self._add_thinking(block)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def _add_thinking(self, block: dict[str, Any]) -> None:
        if block.get("type") == "redacted_thinking":
            self._thinking_text = []
            if block.get("data"):
                self._thinking.append({"type": "redacted_thinking", "data": block["data"]})
            return
        thinking = block.get("thinking")
        text = thinking if isinstance(thinking, str) else ""
        if not block.get("signature"):
            self._thinking_text.append(text)
            return
        # The signature's piece holds the block's whole text in litellm 1.100 (its Anthropic
        # handler repeats what its pieces said), a last piece of it elsewhere.
        said = "".join(self._thinking_text)
        whole = text if text.startswith(said) else said + text
        self._thinking.append({"type": "thinking", "thinking": whole, "signature": block["signature"]})
        self._thinking_text = []

    def _add_call(self, delta: dict[str, Any]) -> None:
        call = self._calls.setdefault(
            int(delta.get("index", len(self._calls))),
            {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
        )
        if delta.get("id"):
            call["id"] = delta["id"]
        if delta.get("type"):
            call["type"] = delta["type"]
        _merge(call["function"], delta.get("function") or {}, ("name", "arguments"))
        if isinstance(delta.get("custom"), dict):  # a custom tool's call: its name and input
            _merge(call.setdefault("custom", {}), delta["custom"], ("name", "input"))

    def message(self) -> Message:
        raw: Message = {"role": "assistant", "content": "".join(self._content) or None, **self._extra}
        if self._calls:
            raw["tool_calls"] = [self._calls[i] for i in sorted(self._calls)]
        if self._thinking:
            raw["thinking_blocks"] = self._thinking
        return assistant_message(raw)


def _merge(whole: dict[str, Any], delta: dict[str, Any], pieces: tuple[str, ...]) -> None:
    """`delta` into `whole`: its `pieces` fields concatenated, the others as last sent."""
    for name, value in delta.items():
        if name in pieces and isinstance(value, str):
            whole[name] = whole.get(name, "") + value
        elif value is not None:
            whole[name] = value
