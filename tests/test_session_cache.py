"""The bound of the store's caches (`storage.history_cache_mb`, `storage.recall_cache_mb`): one
least-recently-used map by session within a byte budget (`memproxy.store.session_cache`)."""

from __future__ import annotations

from memproxy.store.session_cache import SessionCache


def test_the_least_recently_used_sessions_go_first_past_the_budget() -> None:
    cache: SessionCache[str] = SessionCache(budget_bytes=1000)
    cache.put(("t", "a"), "a", 400)
    cache.put(("t", "b"), "b", 400)
    assert cache.get(("t", "a")) == "a"  # now a is the more recently used
    cache.put(("t", "c"), "c", 400)
    assert cache.get(("t", "b")) is None and cache.get(("t", "a")) == "a" and cache.get(("t", "c")) == "c"
    assert (len(cache), cache.used) == (2, 800)


def test_a_value_put_again_or_too_large_for_the_budget_is_not_counted_twice() -> None:
    cache: SessionCache[list[int]] = SessionCache(budget_bytes=1000)
    grown = [1]
    cache.put(("t", "a"), grown, 400)
    grown.append(2)  # grown in place, then put again at its new cost
    cache.put(("t", "a"), grown, 600)
    assert (len(cache), cache.used) == (1, 600)
    cache.put(("t", "a"), grown, 1200)  # larger than the whole budget: not kept, the old one gone too
    assert (len(cache), cache.used) == (0, 0)
    cache.put(("t", "b"), [3], 300)
    cache.discard(("t", "b"))
    cache.discard(("t", "b"))
    assert (len(cache), cache.used) == (0, 0)
    off: SessionCache[list[int]] = SessionCache(budget_bytes=0)  # a cache set to 0 MiB
    off.put(("t", "a"), [1], 600)
    assert len(off) == 0 and off.get(("t", "a")) is None
