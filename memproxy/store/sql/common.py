"""What the turn and admin halves of the SQL store share: the backend, timed reads, and the
session row's lock, creation and deletion.

Writes that must not interleave take the session's row lock first (`FOR UPDATE` on PostgreSQL; on
SQLite the whole write transaction is exclusive): recording a turn, saving a summary, merging
metadata, clearing. Every deletion of sessions goes through `_forget`, which first adds what they
spent to their tenant's rollup.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from typing import Any

from ...timing import charge_store
from ..errors import StoreConflict
from .codec import ADD_TO_ROLLUP, USAGE_COLUMNS, USAGE_SUMS
from .script import Backend, Row, Script, statement

CHUNK = 500  # ids per statement, well under every placeholder limit
# Whether what a cache in memory holds of session `s` (its history, its recall index) is still its
# active history: the same row, by its incarnation (`new_incarnation`: a session deleted and imported
# again keeps its creation time, and SQLite may reuse the deleted rows' ids), with the newest cached
# message, by position and row id, still active. Its `?`s: that incarnation, position and row id.
# Stored rows are never rewritten, so that one message stands for all before it
# (`memproxy.store.history_cache`).
CACHE_HOLDS = ("(s.incarnation = ? AND EXISTS (SELECT 1 FROM messages c WHERE c.session_pk = s.pk AND c.active = 1"
               " AND c.seq = ? AND c.id = ?))")


def new_incarnation() -> int:
    """What tells a session row from one inserted before or after it under the same id: random, and
    never the 0 of the rows stored before sessions had one."""
    return secrets.randbits(52) or 1


class SQLBase:
    """The backend, and what both halves of the store use: timed reads, one-statement writes, the
    session row's lock (`_locked`), a new session (`_new_session`), deleting sessions (`_forget`)."""

    def __init__(self, backend: Backend) -> None:
        self._db = backend

    async def close(self) -> None:
        await self._db.close()

    async def _fetch(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        """A read, its time charged to the request's `store` part."""
        started = time.perf_counter()
        try:
            return await self._db.fetch(sql, params)
        finally:
            charge_store(started)

    async def _one(self, sql: str, params: Sequence[Any] = ()) -> Row | None:
        rows = await self._fetch(sql, params)
        return rows[0] if rows else None

    async def ping(self) -> None:
        """The store answers, and holds memproxy's tables (`SELECT 1` alone answers on a
        PostgreSQL whose memproxy schema was dropped, where every request would fail)."""
        await self._fetch("SELECT 1 FROM sessions LIMIT 1")

    def _locked(self, tenant: str, session_id: str, expired_before: float | None = None) -> Script[Row | None]:
        """The session's row (pk, length, head_hash, head_cum, head_compact_cum), locked for the
        rest of the write. One last active before `expired_before` is started afresh first, as a
        turn would start it: deleted (`_forget`) and created anew, empty, so nothing of its past
        comes back."""
        rows = yield ("SELECT pk, length, head_hash, head_cum, head_compact_cum, updated_at FROM sessions"
                      " WHERE tenant = ? AND session_id = ?" + self._db.row_lock, (tenant, session_id))
        if not rows:
            return None
        if expired_before is not None and rows[0][5] < expired_before:
            yield from self._forget("pk = ?", (rows[0][0],))
            return (yield from self._new_session(tenant, session_id))
        return rows[0][:5]

    def _forget(self, where: str, params: Sequence[Any]) -> Script[int]:
        """Delete the sessions `where` selects, first adding what they spent to their tenants'
        rollup (`tenant_usage`); returns how many. The rows are locked before they are summed, so
        two deletions racing on one session count it once."""
        rows = yield f"SELECT pk FROM sessions WHERE {where} ORDER BY pk" + self._db.row_lock, params
        pks = [row[0] for row in rows]
        for i in range(0, len(pks), CHUNK):
            chunk = pks[i : i + CHUNK]
            marks = ",".join("?" * len(chunk))
            yield (f"INSERT INTO tenant_usage (tenant, {USAGE_COLUMNS}) SELECT s.tenant, {USAGE_SUMS}"
                   f" FROM sessions s LEFT JOIN turns t ON t.session_pk = s.pk WHERE s.pk IN ({marks})"
                   f" GROUP BY s.tenant {ADD_TO_ROLLUP}", chunk)
            yield f"DELETE FROM sessions WHERE pk IN ({marks})", chunk
        return len(pks)

    def _new_session(self, tenant: str, session_id: str) -> Script[Row]:
        """A session record with nothing in it yet, locked like `_locked`'s row. If another writer
        creates it meanwhile (PostgreSQL waits for theirs to commit), theirs is the one."""
        now = time.time()
        created = yield ("INSERT INTO sessions (tenant, session_id, created_at, updated_at, incarnation)"
                         " VALUES (?, ?, ?, ?, ?)"
                         " ON CONFLICT (tenant, session_id) DO NOTHING"
                         " RETURNING pk, length, head_hash, head_cum, head_compact_cum",
                         (tenant, session_id, now, now, new_incarnation()))
        row = created[0] if created else (yield from self._locked(tenant, session_id))
        if row is None:
            raise StoreConflict("the session was deleted while it was being written; retry")
        return row

    async def _write_one(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        """One statement in a write of its own; the rows it returns."""
        return await self._db.write(statement(sql, params))
