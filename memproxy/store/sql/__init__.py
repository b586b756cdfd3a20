"""The Store, written once in the SQL that SQLite and PostgreSQL share.

One module a concern, imported one way: `script` (statements, write scripts and the `Backend` that
runs them) and `codec` (values as the columns store them, rows as dataclasses) under `common` (the
base both halves stand on: timed reads, the session row's lock, creation and deletion), under
`turns` (what a chat turn and the summariser need, `TurnStore`), `recall` (the full-text index,
for recall and search) and `admin` (what managing sessions needs, `AdminStore`). `SQLStore` is all
of them; each backend subclasses it with its `Backend`.
"""

from __future__ import annotations

from ..history_cache import DEFAULT_HISTORY_CACHE_BYTES
from ..recall_index import DEFAULT_RECALL_CACHE_BYTES
from ..session_cache import SessionCache
from .admin import SQLAdmin
from .recall import SQLRecall, backfill_recall
from .script import Backend, Outcome, Row, Script, Step, run_script_async
from .turns import QUERIES, SQLTurns

__all__ = ["QUERIES", "Backend", "Outcome", "Row", "SQLAdmin", "SQLRecall", "SQLStore", "SQLTurns", "Script",
           "Step", "backfill_recall", "run_script_async"]


class SQLStore(SQLTurns, SQLRecall, SQLAdmin):
    """The whole `Store`: the turn half and the admin half over one backend, with what each keeps
    in memory between calls (at most the given bytes; 0: nothing)."""

    def __init__(self, backend: Backend, history_cache_bytes: int = DEFAULT_HISTORY_CACHE_BYTES,
                 recall_cache_bytes: int = DEFAULT_RECALL_CACHE_BYTES) -> None:
        super().__init__(backend)
        self._history = SessionCache(history_cache_bytes)
        self._recall_index = SessionCache(recall_cache_bytes)
        self._stem_cache = {}
        self._stem_chars = 0
        self._too_big = {}
        self._common = {}
