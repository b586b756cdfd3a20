"""The history cache's cost estimate, and the copies that keep what it holds unchanged (its bound,
`storage.history_cache_mb`, is `test_session_cache`'s)."""

from __future__ import annotations

import time

from memproxy.messages import AUDIO_EXPIRY_MARGIN, detached, wire_form
from memproxy.store.history_cache import message_cost


def test_a_message_costs_at_least_its_overhead_and_grows_with_its_text() -> None:
    assert message_cost("{}", None) < message_cost("{}", "{}") < message_cost("x" * 100, None)


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
