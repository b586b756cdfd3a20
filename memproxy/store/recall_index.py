"""Recently recalled sessions' full-text index, kept in memory between turns (`storage.recall_cache_mb`).

Recall asks, every turn, where the question's words occur among the session's older messages and
then reads the best of them (`TurnStore.recall_postings`, `TurnStore.recall_messages`). Asked of
the store's index each time, that is two full-text lookups and a read of a hundred rows, most of
a turn's recall time on a long session, for messages that have not changed since the turn
before. So the store keeps each session's older messages as recall reads them, with an inverted
index of their words stemmed exactly as the store's own index stems them (`Backend.stems`), and
on each call reads only what is new.

It can never answer from a stale session, by the same check as the history cache
(`memproxy.store.history_cache`), made in the statement that reads what is new: stored rows are
never rewritten, so the indexed messages are still the session's active ones exactly when the same
session row (by its incarnation) still has the newest of them, by row id, active at its position.
Where that fails (an edit of an indexed message, a clear, a deletion, a fork or an import under
the same id), the session is indexed afresh. Messages the message cap has deleted since are
passed over by position (the cap deletes the oldest first).

Bounded: each session costs about its messages' text and their postings; past the budget the least
recently used sessions are evicted (`memproxy.store.session_cache`).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .base import RecalledMessage

DEFAULT_RECALL_CACHE_BYTES = 64 << 20
# What an indexed message takes (tracemalloc, LoCoMo turns): its `RecalledMessage` and row id about
# 400 bytes plus its text (up to 4 bytes a character, 2 on average), and 40 bytes a distinct word.
MESSAGE_OVERHEAD = 400
TEXT_FACTOR = 2
POSTING_BYTES = 40


@dataclass
class SessionIndex:
    """One session's active messages from position `first` on, and where each stem occurs."""

    incarnation: int  # the session row's (`SessionState.incarnation`): one deleted and created again is another
    first: int  # the position of `lines[0]`
    ids: list[int] = field(default_factory=list)  # each message's row id
    lines: list[RecalledMessage] = field(default_factory=list)
    postings: dict[str, list[int]] = field(default_factory=dict)  # stem -> positions, ascending
    cost: int = 0  # estimated bytes

    @property
    def end(self) -> int:
        """The position after the last indexed one."""
        return self.first + len(self.lines)

    def add(self, row_id: int, line: RecalledMessage, stems: Sequence[str]) -> None:
        """Index the message at position `end`."""
        seq = self.end
        self.ids.append(row_id)
        self.lines.append(line)
        for stem in stems:
            positions = self.postings.get(stem)
            if positions is None:
                self.postings[stem] = [seq]
            elif positions[-1] != seq:
                positions.append(seq)
        self.cost += MESSAGE_OVERHEAD + TEXT_FACTOR * len(line.text) + POSTING_BYTES * len(stems)

    def positions(self, stems: Sequence[str], low: int, before: int) -> list[int]:
        """Where any of `stems` occurs from position `low` to before `before`, ascending."""
        found: set[int] | list[int] = []
        for stem in stems:
            held = self.postings.get(stem)
            if held:
                part = held[bisect.bisect_left(held, low) : bisect.bisect_left(held, before)]
                found = part if not found else {*found, *part}
        return found if isinstance(found, list) else sorted(found)

    def line(self, seq: int) -> RecalledMessage | None:
        """The message at position `seq`, if indexed."""
        i = seq - self.first
        return self.lines[i] if 0 <= i < len(self.lines) else None


class Checked(NamedTuple):
    """A session's index as `TurnStore.load` checked it in its own statement (`Loaded.recall`):
    still the session's, its first active position, and the active messages after the index's
    newest that the load read, as `SQLRecall` indexes them (position, row id, role, unit start,
    line, line tokens, compact tokens, creation time, search text), ascending."""

    entry: SessionIndex
    low: int
    rows: list[tuple[Any, ...]]
