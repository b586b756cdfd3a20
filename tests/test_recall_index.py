"""The in-memory recall index's own parts (`memproxy.store.recall_index`): postings and lines. Its
bound (`storage.recall_cache_mb`) is `test_session_cache`'s; that it answers as the store's index
does, whatever happens to a session, is
`test_recall_store.test_the_index_in_memory_answers_as_the_stores_index_does`."""

from __future__ import annotations

from memproxy.store.base import RecalledMessage
from memproxy.store.recall_index import SessionIndex


def indexed(words: list[list[str]], first: int = 0) -> SessionIndex:
    index = SessionIndex(incarnation=1, first=first)
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
