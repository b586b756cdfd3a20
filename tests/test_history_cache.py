"""The history cache's bound (`storage.history_cache_mb`), and the copies that keep what it holds unchanged."""

from __future__ import annotations

from memproxy.messages import detached, wire_form
from memproxy.store.base import StoredMessage
from memproxy.store.history_cache import Cached, HistoryCache, message_cost


def entry(size: int, cost: int) -> Cached:
    messages = [StoredMessage(seq=i, body={"role": "user", "content": "x"}, tokens=1, cum_before=i, unit_start=True,
                              chain_hash=str(i)) for i in range(size)]
    return Cached(messages, [cost // size] * size, last_id=size, session_created=1.0)


def test_the_least_recently_used_sessions_go_first_past_the_budget() -> None:
    cache = HistoryCache(budget_bytes=1000)
    cache.put(("t", "a"), entry(2, 400))
    cache.put(("t", "b"), entry(2, 400))
    assert cache.get(("t", "a")) is not None  # now a is the more recently used
    cache.put(("t", "c"), entry(2, 400))
    assert cache.get(("t", "b")) is None and cache.get(("t", "a")) is not None and cache.get(("t", "c")) is not None
    assert cache.used == 800 <= cache.budget


def test_an_entry_replaced_or_too_large_for_the_budget_is_not_counted_twice() -> None:
    cache = HistoryCache(budget_bytes=1000)
    cache.put(("t", "a"), entry(2, 400))
    cache.put(("t", "a"), entry(3, 600))
    assert (len(cache), cache.used) == (1, 600)
    cache.put(("t", "a"), entry(3, 1200))  # larger than the whole budget: not kept, the old one gone too
    assert (len(cache), cache.used) == (0, 0)
    off = HistoryCache(budget_bytes=0)  # history_cache_mb: 0
    off.put(("t", "a"), entry(1, 600))
    assert len(off) == 0


def test_a_message_costs_at_least_its_overhead_and_grows_with_its_text() -> None:
    assert message_cost("{}", None) < message_cost("{}", "{}") < message_cost("x" * 100, None)


def test_messages_are_handed_on_without_copies_but_detached_for_code_that_changes_them() -> None:
    stored = {"role": "user", "content": [{"type": "image_url", "image_url": "https://example.invalid/i.png"}]}
    assert wire_form(stored) is stored
    assert wire_form({"role": "assistant", "content": None, "tool_calls": []}) == {"role": "assistant", "tool_calls": []}
    copy = detached(stored)
    copy["content"][0]["image_url"] = {"url": "changed"}  # as litellm rewrites content parts in place
    copy["content"].append({"type": "text", "text": "more"})
    assert stored == {"role": "user", "content": [{"type": "image_url", "image_url": "https://example.invalid/i.png"}]}
