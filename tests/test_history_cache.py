"""The history cache's cost estimate, and the copies that keep what it holds unchanged (its bound,
`storage.history_cache_mb`, is `test_session_cache`'s)."""

from __future__ import annotations

import json
import time
import tracemalloc
from typing import Any

import pytest

from memproxy.messages import AUDIO_EXPIRY_MARGIN, detached, wire_form
from memproxy.store.history_cache import message_cost


def test_a_message_costs_at_least_its_overhead_and_grows_with_its_text() -> None:
    assert message_cost("{}", None) < message_cost("{}", "{}")
    assert message_cost('"x"', None) < message_cost('"xx"', None) < message_cost('"漢字"', None)


@pytest.mark.parametrize("message", [
    {"role": "user", "content": "hello"},
    {"role": "user", "content": " ".join(f"word{i}" for i in range(400))},
    {"role": "user", "content": "漢字" * 500},
    {"role": "user", "content": "\U0001F600 smile " * 300},  # four bytes a character
    {"role": "user", "content": [{"type": "text", "text": "a"} for _ in range(2000)]},  # a valid request
    {"role": "user", "content": "x", "extra": [{} for _ in range(20000)]},  # kept as sent
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in range(300)]},
])
def test_the_estimate_is_what_a_message_takes_decoded_at_least(message: dict[str, Any]) -> None:
    """The cache's budget holds only if no message takes more decoded than its estimate: one of 2,000
    one-letter parts took 4.9 times it, and the cache 313 MB of a 64 MB budget."""
    text = json.dumps(message, ensure_ascii=False, separators=(",", ":"))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        decoded = json.loads(text)
        taken = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert decoded == message
    assert taken <= message_cost(text, None)


def test_messages_are_handed_on_without_copies_but_detached_for_code_that_changes_them() -> None:
    stored = {"role": "user", "content": [{"type": "image_url", "image_url": "https://example.invalid/i.png"}]}
    assert wire_form(stored) is stored
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert wire_form({"role": "assistant", "content": None, "tool_calls": [call]}) == {"role": "assistant",
                                                                                     "tool_calls": [call]}
    # Neither text nor a call (a refusal): OpenAI requires `content`, so it goes with empty text.
    assert wire_form({"role": "assistant", "content": None, "refusal": "no"}) == {"role": "assistant",
                                                                                "refusal": "no", "content": ""}
    # An answer's audio goes back by its id, as OpenAI takes it: not its data, transcript or expiry;
    # once the provider has forgotten it (or is about to), as what it said.
    soon = time.time() + AUDIO_EXPIRY_MARGIN
    spoken = {"role": "assistant", "content": None,
              "audio": {"id": "audio_1", "data": "AAAA", "transcript": "Hello", "expires_at": int(soon) + 60}}
    assert wire_form(spoken) == {"role": "assistant", "audio": {"id": "audio_1"}}
    assert spoken["audio"]["data"] == "AAAA"  # the stored message is not changed
    for expired in (int(soon) - 60, 9):
        forgotten = {**spoken, "audio": {**spoken["audio"], "expires_at": expired}}
        assert wire_form(forgotten) == {"role": "assistant", "content": "Hello"}
        assert forgotten["audio"]["id"] == "audio_1"
    copy = detached(stored)
    copy["content"][0]["image_url"] = {"url": "changed"}  # as litellm rewrites content parts in place
    copy["content"].append({"type": "text", "text": "more"})
    assert stored == {"role": "user", "content": [{"type": "image_url", "image_url": "https://example.invalid/i.png"}]}
