"""The message a stream is stored as (`memproxy.streaming.StreamAssembler`): everything a whole
answer keeps (`memproxy.messages.assistant_message`), built from the pieces each field streams in,
so that the next turn sends back what a non-streamed answer would have let it send."""

from __future__ import annotations

from typing import Any

import pytest

from memproxy.streaming import StreamAssembler


def chunk(delta: dict[str, Any], finish: str | None = None, index: int = 0) -> dict[str, Any]:
    return {"object": "chat.completion.chunk", "choices": [{"index": index, "delta": delta, "finish_reason": finish}]}


def assembled(*chunks: dict[str, Any]) -> StreamAssembler:
    assembler = StreamAssembler()
    for c in chunks:
        assembler.add(c)
    return assembler


def test_a_legacy_function_call_and_a_reasoning_field_are_assembled() -> None:
    stream = assembled(
        chunk({"role": "assistant", "reasoning": "I need "}), chunk({"reasoning": "the weather."}),
        chunk({"function_call": {"name": "get_weather", "arguments": ""}}),
        chunk({"function_call": {"arguments": '{"city": '}}), chunk({"function_call": {"arguments": '"Paris"}'}}),
        chunk({"content": "ignored"}, index=1), chunk({}, "function_call"))
    assert stream.complete
    assert stream.message() == {"role": "assistant", "content": None, "reasoning": "I need the weather.",
                                "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def test_streamed_audio_is_assembled_from_its_pieces() -> None:
    stream = assembled(chunk({"role": "assistant", "audio": {"id": "audio_1", "transcript": "Hel", "data": "AA"}}),
                       chunk({"audio": {"transcript": "lo", "data": "BB", "expires_at": 9}}), chunk({}, "stop"))
    assert stream.message() == {"role": "assistant", "content": None,
                                "audio": {"id": "audio_1", "transcript": "Hello", "data": "AABB", "expires_at": 9}}


@pytest.mark.parametrize("signed", [
    {"type": "thinking", "thinking": "I should call the tool.", "signature": "S1"},  # litellm 1.100: the whole text
    {"type": "thinking", "thinking": "", "signature": "S1"},  # the signature alone
], ids=["whole-text-with-signature", "signature-alone"])
def test_thinking_blocks_are_closed_by_their_signatures(signed: dict[str, Any]) -> None:
    """Anthropic's thinking through litellm: a block's text in pieces, closed by its signature;
    a redacted block whole. A tool call's next turn must send them back as they were."""
    call = {"index": 0, "id": "toolu_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    stream = assembled(
        chunk({"role": "assistant", "reasoning_content": "I should ",
               "thinking_blocks": [{"type": "thinking", "thinking": "I should "}]}),
        chunk({"reasoning_content": "call the tool.",
               "thinking_blocks": [{"type": "thinking", "thinking": "call the tool."}]}),
        chunk({"thinking_blocks": [signed]}),
        chunk({"thinking_blocks": [{"type": "redacted_thinking", "data": "opaque"}]}),
        chunk({"tool_calls": [call]}), chunk({}, "tool_calls"))
    message = stream.message()
    assert message["thinking_blocks"] == [
        {"type": "thinking", "thinking": "I should call the tool.", "signature": "S1"},
        {"type": "redacted_thinking", "data": "opaque"}]
    assert message["reasoning_content"] == "I should call the tool."
    assert [c["id"] for c in message["tool_calls"]] == ["toolu_1"]


def test_a_stream_without_a_finish_reason_is_not_complete() -> None:
    assert not assembled(chunk({"role": "assistant", "content": "The capital of"})).complete
