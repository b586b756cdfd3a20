"""The in-memory recall index's own parts (`memproxy.store.recall_index`): postings, lines and the
bound (`storage.recall_cache_mb`). That it answers as the store's index does, whatever happens to a
session, is `test_recall_store.test_the_index_in_memory_answers_as_the_stores_index_does`."""

from __future__ import annotations

from memproxy.store.base import RecalledMessage
from memproxy.store.recall_index import RecallCache, SessionIndex


def indexed(words: list[list[str]], first: int = 0) -> SessionIndex:
    index = SessionIndex(created=1.0, first=first)
    for n, stems in enumerate(words):
        seq = first + n
        index.add(100 + seq, RecalledMessage("s", seq, "user", True, f"line {seq}", 3, 4, 1.0), stems)
    return index


def test_positions_are_those_of_any_stem_between_low_and_before_in_order() -> None:
    index = indexed([["harbour"], ["keeper", "harbour"], [], ["keeper"], ["harbour", "harbour"]], first=10)
    assert (index.first, index.end, index.ids[-1]) == (10, 15, 114)
    assert index.positions(["harbour"], 0, 100) == [10, 11, 14]  # a stem twice in a message: once
    assert index.positions(["harbour", "keeper"], 11, 14) == [11, 13]
    assert index.positions(["keeper", "harbour"], 0, 100) == [10, 11, 13, 14]
    assert index.positions(["zzz"], 0, 100) == [] and index.positions([], 0, 100) == []
    assert index.line(12) is not None and index.line(12).text == "line 12"  # type: ignore[union-attr]
    assert index.line(9) is None and index.line(15) is None


def test_the_least_recently_used_sessions_go_first_and_growth_is_counted() -> None:
    one, other = indexed([["a"]] * 3), indexed([["a"]] * 3)
    cache = RecallCache(budget_bytes=one.cost * 5)
    cache.put(("t", "a"), one)
    cache.put(("t", "b"), other)
    assert cache.used == one.cost + other.cost
    grown = cache.get(("t", "a"))
    assert grown is not None  # now the more recently used
    grown.add(200, RecalledMessage("s", 3, "user", True, "more", 1, 1, 1.0), ["b"])
    cache.put(("t", "a"), grown)  # grown in place: counted at its new cost, once
    assert cache.used == grown.cost + other.cost
    cache.put(("t", "c"), indexed([["a"]] * 9))  # past the budget: b, the least recently used, goes
    assert cache.get(("t", "b")) is None and cache.get(("t", "a")) is grown
    assert cache.used <= cache.budget and len(cache) == 2
    off = RecallCache(budget_bytes=0)  # recall_cache_mb: 0
    off.put(("t", "a"), indexed([["a"]]))
    assert (len(off), off.used) == (0, 0)
    cache.discard(("t", "a"))
    cache.discard(("t", "a"))
    assert cache.used == cache.get(("t", "c")).cost  # type: ignore[union-attr]
