"""The decoded history of recently served sessions, kept between turns (`storage.history_cache_mb`).

A turn's plan needs every stored message the budget could send (`TurnStore.load`); with a large
window that is the whole conversation, already read, decoded and counted on the turn before. The
store keeps each session's messages as it last read them and, on the next turn, reads only what is
not cached: the messages after the cached ones, and any before them that a larger room reaches.

The cache can never serve a stale history, because it is checked against the database in the same
statement that reads the rest, on every turn: stored messages are never rewritten (an edit or a
regenerate supersedes them, a clear deactivates them, a fork or an import writes new rows, a
deletion removes them), so the cached messages are still the session's active history exactly when
the newest of them, by its row id, is still active at its position in the same session. "The same
session" is told by the row's incarnation (a random number each session row gets as it is inserted),
not its row id nor its creation time: SQLite hands a deleted row's id (`INTEGER PRIMARY KEY` without
`AUTOINCREMENT`) to the next row inserted, and an import keeps the exported creation time, so a
session deleted by another process and imported again under its id, then continued, can hold new
messages under the very ids the cache names.
Messages the message cap has deleted since are dropped by position (the cap deletes the oldest
first). That check is the whole
of it: another replica's turns, edits and forks on a shared PostgreSQL store are seen the same way.

Bounded: each entry costs about its messages' stored JSON plus a fixed overhead per message for the
decoded objects; past the budget the least recently used sessions are evicted
(`memproxy.store.session_cache`).
"""

from __future__ import annotations

import sys
from typing import NamedTuple

from .base import StoredMessage

# What a decoded message takes: measured with tracemalloc on chat messages of 5 to 400 words, its
# dicts, strings, `StoredMessage` and chain hash take about 650 bytes plus its JSON text's length
# (ASCII). Its text is counted as the JSON text's own size in memory (`sys.getsizeof`: 1, 2 or 4
# bytes a character, by its widest), which its decoded strings never exceed. A message of many
# small parts (2,000 one-letter text parts, 20,000 empty objects in a field) decodes to many
# objects, each costing far more than its few characters of JSON: each object and string is
# counted too.
MESSAGE_OVERHEAD = 500
OBJECT_BYTES = 200  # a decoded JSON object (a dict), per "{"
ARRAY_BYTES = 60  # a list, per "["
QUOTE_BYTES = 25  # half a decoded string (its object), per '"'
DEFAULT_HISTORY_CACHE_BYTES = 64 << 20


class Cached(NamedTuple):
    messages: list[StoredMessage]  # active positions, oldest first
    costs: list[int]  # each message's, in bytes as estimated (`message_cost`)
    last_id: int  # the row id of the newest of them
    incarnation: int  # the session row's (`SessionState.incarnation`): one deleted and created again is another


def message_cost(body_text: str, compact_text: str | None) -> int:
    """What a message read from its stored JSON (and its compact form's) takes decoded, in bytes: at
    least as much, whatever its shape (tests/test_history_cache.py measures it)."""
    return MESSAGE_OVERHEAD + _decoded(body_text) + (_decoded(compact_text) if compact_text else 0)


def _decoded(text: str) -> int:
    return (sys.getsizeof(text) + OBJECT_BYTES * text.count("{") + ARRAY_BYTES * text.count("[")
            + QUOTE_BYTES * text.count('"'))
