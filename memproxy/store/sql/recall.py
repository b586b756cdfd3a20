"""The store's half of recall and search: the full-text index, looked up one session at a time.

Every active message's words are indexed with its session's key before each (`key_word`,
`memproxy.searchtext`), so each session has document lists of its own: a lookup costs what the
session holds, whatever the rest of the store holds. How a session's index is asked is the
backend's (`Backend.hits`: SQLite's FTS5 ranked by BM25, PostgreSQL's tsvector ranked by
`ts_rank`); what is done with the hits is shared: `recall` reads, in one statement, the hits and the
messages to send for them (each hit with its neighbours, extended to whole units: a unit starts at
a message that is not a tool result), and `search` the hits with their messages.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from ...searchtext import session_key
from ..base import Recall, RecalledMessage, RecallHit, SearchHit, SessionState, StoredMessage
from .codec import search_text
from .common import SQLBase
from .script import Row, Script, Step

_END = 2_147_483_647  # past any position
_OTHER_SESSIONS = 50  # the most of an end user's other sessions recall looks in, newest first
_SEARCHED_SESSIONS = 1000  # the most sessions a search across sessions looks in, newest first
_CHUNK = 100  # sessions a search statement looks in


class SQLRecall(SQLBase):
    """`TurnStore.recall` and `AdminStore.search`."""

    async def recall(self, session: SessionState, words: Sequence[str], before: int, limit: int, around: int,
                     end_user: str | None = None) -> Recall:
        if not words or limit <= 0:
            return Recall([], [])
        scope = [(session.pk, session.session_id, before)]
        if end_user is not None:
            rows = await self._fetch(
                "SELECT pk, session_id, length FROM sessions WHERE tenant = ? AND end_user = ? AND pk <> ?"
                " ORDER BY updated_at DESC LIMIT ?", (session.tenant, end_user, session.pk, _OTHER_SESSIONS))
            scope += [(int(r[0]), str(r[1]), int(r[2])) for r in rows]
        names = {pk: name for pk, name, _ in scope}
        hits_sql, hits_params = self._hits(session.tenant, scope, words, limit)
        # The hits (part 0), then the messages of each hit's span (part 1): from the unit start
        # `around` positions before it to the next unit start `around` positions after it, never
        # at or after `before` in this session.
        rows = await self._fetch(
            f"WITH hits (pk, seq, score) AS ({hits_sql}),"
            " spans (pk, lo, hi) AS (SELECT h.pk,"
            " coalesce((SELECT seq FROM messages WHERE session_pk = h.pk AND active = 1 AND unit_start = 1"
            " AND seq <= h.seq - ? ORDER BY seq DESC LIMIT 1), 0),"
            " coalesce((SELECT seq FROM messages WHERE session_pk = h.pk AND active = 1 AND unit_start = 1"
            f" AND seq > h.seq + ? ORDER BY seq LIMIT 1), {_END}) FROM hits h)"
            " SELECT 0, pk, seq, score, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM hits"
            " UNION ALL SELECT DISTINCT 1, m.session_pk, m.seq, CAST(NULL AS REAL), m.body, m.tokens, m.cum_before,"
            " m.unit_start, m.chain_hash, m.compact_body, m.compact_tokens, m.compact_cum_before, m.created_at"
            " FROM spans s JOIN messages m ON m.session_pk = s.pk AND m.active = 1 AND m.seq >= s.lo AND m.seq < s.hi"
            " WHERE m.session_pk <> ? OR m.seq < ?",
            (*hits_params, around, around, session.pk, before))
        hits = sorted((RecallHit(names[int(r[1])], int(r[2]), float(r[3])) for r in rows if r[0] == 0),
                      key=lambda h: -h.score)
        messages = [RecalledMessage(names[int(r[1])], float(r[12]), _stored(r)) for r in rows if r[0] == 1]
        return Recall(hits, messages)

    async def search(self, tenant: str | None, words: Sequence[str], limit: int,
                     session: SessionState | None = None) -> list[SearchHit]:
        if not words or limit <= 0:
            return []
        if session is not None:
            sessions = [(session.pk, session.tenant, session.session_id)]
        else:
            where, params = ("", ()) if tenant is None else (" WHERE tenant = ?", (tenant,))
            rows = await self._fetch(f"SELECT pk, tenant, session_id FROM sessions{where}"
                                     " ORDER BY updated_at DESC LIMIT ?", (*params, _SEARCHED_SESSIONS))
            sessions = [(int(r[0]), str(r[1]), str(r[2])) for r in rows]
        found: list[SearchHit] = []
        for i in range(0, len(sessions), _CHUNK):
            chunk = sessions[i : i + _CHUNK]
            names = {pk: name for pk, _, name in chunk}
            hits_sql, hits_params = self._hits_of([(pk, session_key(t, name), _END) for pk, t, name in chunk],
                                                  words, limit)
            rows = await self._fetch(
                f"WITH hits (pk, seq, score) AS ({hits_sql}) SELECT h.pk, h.seq, h.score, m.body, m.created_at"
                " FROM hits h JOIN messages m ON m.session_pk = h.pk AND m.active = 1 AND m.seq = h.seq",
                hits_params)
            found += [SearchHit(names[int(r[0])], int(r[1]), float(r[2]), json.loads(r[3]), float(r[4]))
                      for r in rows]
        found.sort(key=lambda h: (-h.score, h.session_id, h.seq))
        return found[:limit]

    def _hits(self, tenant: str, scope: list[tuple[int, str, int]], words: Sequence[str], limit: int) -> Step:
        return self._hits_of([(pk, session_key(tenant, name), before) for pk, name, before in scope], words, limit)

    def _hits_of(self, scope: list[tuple[int, str, int]], words: Sequence[str], limit: int) -> Step:
        """One SELECT of (session key, position, score) over the sessions of `scope` (key, search
        key, positions before), the best `limit` overall."""
        selects: list[str] = []
        params: list[object] = []
        for pk, key, before in scope:
            sql, values = self._db.hits(pk, key, words, before, limit)
            selects.append(f"SELECT * FROM ({sql}) AS s{len(selects)}")
            params += values
        if len(selects) == 1:
            return selects[0], params
        return f"SELECT * FROM ({' UNION ALL '.join(selects)}) AS u ORDER BY 3 DESC LIMIT ?", [*params, limit]


def _stored(row: Row) -> StoredMessage:
    """A part-1 row of `recall`: a message, from its fifth column on."""
    return StoredMessage(seq=int(row[2]), body=json.loads(row[4]), tokens=row[5], cum_before=row[6],
                         unit_start=bool(row[7]), chain_hash=row[8],
                         compact_body=json.loads(row[9]) if row[9] else None, compact_tokens=row[10],
                         compact_cum_before=row[11])


def backfill_search(fts: bool) -> Script[None]:
    """The `search_text` of messages stored before the index existed (migration 0009_recall), in
    its transaction; `fts`: SQLite's FTS5 table, which its triggers fill only for later rows."""
    sessions = yield "SELECT pk, tenant, session_id FROM sessions ORDER BY pk", ()
    for pk, tenant, session_id in sessions:
        rows = yield "SELECT id, body, created_at FROM messages WHERE session_pk = ? AND search_text IS NULL", (pk,)
        for message_id, body, created_at in rows:
            yield ("UPDATE messages SET search_text = ? WHERE id = ?",
                   (search_text(tenant, session_id, json.loads(body), float(created_at)), message_id))
    if fts:
        yield ("INSERT INTO messages_fts (rowid, search_text) SELECT session_pk * 4294967296 + seq, search_text"
               " FROM messages WHERE active = 1 AND search_text IS NOT NULL"), ()
