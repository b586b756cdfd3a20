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
from typing import NamedTuple

from ...searchtext import session_key
from ..base import COMMON_WORD_POSITIONS, Postings, RecalledMessage, SearchHit, SessionState
from ..recall_index import MESSAGE_OVERHEAD, Checked, SessionIndex
from ..session_cache import SessionCache
from .codec import recall_text, search_text, text_in, text_out
from .common import CACHE_HOLDS, SQLBase
from .script import Row, Script, Step

_END = 2_147_483_647  # past any position
# What recall reads of a message (`RecalledMessage`), its session's key first (`messages m`).
_LINE_COLUMNS = ("m.session_pk, m.seq, m.role, m.unit_start, m.recall_text, m.recall_tokens,"
                 " coalesce(m.compact_tokens, m.tokens), m.created_at")
_OTHER_SESSIONS = 50  # the most of an end user's other sessions recall looks in, newest first
_SEARCHED_SESSIONS = 1000  # the most sessions a search across sessions looks in, newest first
_CHUNK = 100  # sessions a search statement looks in
_STEMS_KEPT = 200_000  # words whose stems are kept (`SQLRecall._stems`)...
_STEM_CHARS_KEPT = 2_000_000  # ...and their characters: at most some 30 MB, however long the words
_LEAST_BYTES_PER_TOKEN = 16  # what a session's index in memory costs at least, a token of its messages
_TOO_BIG_KEPT = 10_000  # sessions remembered as too big for the index in memory (`SQLRecall._too_big`)
# The session's index in memory (`memproxy.store.recall_index`), checked and brought up to date in
# one statement. `h`, worked out once (as `load`'s head query does: not again for every message):
# the session's row id and incarnation, and whether the index still holds (`CACHE_HOLDS`). Row
# 0: the session's first active position, whether the index holds, whether the message at position
# `before` starts a unit (null: none there), and the session's incarnation. Then the active
# messages not indexed yet before `before`: after the index where it holds, from the start where
# it does not.
_INDEX_READ = (
    f"WITH h AS MATERIALIZED (SELECT s.pk, s.incarnation, CASE WHEN {CACHE_HOLDS} THEN 1 ELSE 0 END AS holds"
    " FROM sessions s WHERE s.pk = ?)"
    " SELECT 0, (SELECT min(seq) FROM messages WHERE session_pk = h.pk AND active = 1), h.holds, NULL,"
    " (SELECT unit_start FROM messages WHERE session_pk = h.pk AND active = 1 AND seq = ?),"
    " NULL, NULL, NULL, h.incarnation, NULL FROM h"
    " UNION ALL SELECT 1, m.seq, m.id, m.role, m.unit_start, m.recall_text, m.recall_tokens,"
    " coalesce(m.compact_tokens, m.tokens), m.created_at, m.search_text FROM h JOIN messages m"
    " ON m.session_pk = h.pk AND m.active = 1 WHERE m.seq >= CASE WHEN h.holds = 1 THEN ? ELSE 0 END"
    " AND m.seq < ? ORDER BY 1, 2")


class _Indexed(NamedTuple):
    """A session's index as one call may use it: its messages from `low` (the first active
    position) to before `before`, and whether the message at `before` starts a unit."""

    entry: SessionIndex
    low: int
    before: int
    next_starts_unit: bool | None  # None: no active message there


class SQLRecall(SQLBase):
    """`TurnStore.recall_postings`, `TurnStore.recall_messages` and `AdminStore.search`. Within one
    session (the default scope) both answer from the session's index in memory where they can
    (`memproxy.store.recall_index`, `storage.recall_cache_mb`); across an end user's sessions,
    from the store's index."""

    _recall_index: SessionCache[SessionIndex]  # `SQLStore` sets them
    _stem_cache: dict[str, tuple[str, ...]]
    _stem_chars: int  # the characters of the words in `_stem_cache`
    # Sessions whose index was found larger than the whole cache (by incarnation, and the length
    # it had then): recall asks the store's own index for them instead of building theirs again
    # every turn (a 10,000-message session of 400-word messages: 5 s a turn), until they shrink.
    _too_big: dict[tuple[str, str], tuple[int, int]]
    # For those sessions: the words their store index holds too many positions of to rank by (by
    # incarnation, the length the session had when the first was found, the words). A session
    # only grows by turns, and a word's positions with it, so each is asked of the store once: until
    # the session is created again, or cleared or edited back to fewer messages than it had then.
    # (A message cap deletes the oldest messages as the session grows: a word it leaves with just
    # under the limit stays noted, among the session's most common words all the same.)
    _common: dict[tuple[str, str], tuple[int, int, set[str]]]

    async def recall_postings(self, session: SessionState, words: Sequence[str], before: int,
                              end_user: str | None = None, checked: object = None,
                              active_since: float | None = None) -> Postings:
        indexed = None
        if end_user is None and words:
            if isinstance(checked, Checked):
                # The question's words and those of the messages the index lacks, stemmed at once.
                await self._stems([*words, *(w for row in checked.rows for w in _words(row[8]))])
                indexed = await self._from_checked(session, checked, before)
            if indexed is None:
                indexed = await self._indexed(session, before)
        if indexed is not None:
            stems = await self._stems(words)
            held: list[dict[str, list[int]]] = []
            for word in words:
                positions = indexed.entry.positions(stems[word], indexed.low, indexed.before)
                held.append({session.session_id: positions} if 0 < len(positions) <= COMMON_WORD_POSITIONS else {})
            return Postings({session.session_id: max(before, 0)}, held, indexed)
        scope = [(session.pk, session.session_id, before)]
        if end_user is not None and words:
            rows = await self._fetch(
                "SELECT pk, session_id, length FROM sessions WHERE tenant = ? AND end_user = ? AND pk <> ?"
                " AND updated_at >= ? ORDER BY updated_at DESC LIMIT ?",
                (session.tenant, text_in(end_user), session.pk, active_since or 0.0, _OTHER_SESSIONS))
            scope += [(int(r[0]), str(r[1]), int(r[2])) for r in rows]
        names = {pk: name for pk, name, _ in scope}
        found: list[dict[str, list[int]]] = [{} for _ in words]
        common = self._common_words(session) if end_user is None else set()
        asked = [i for i, word in enumerate(words) if word not in common]
        if asked:
            sql, params = self._db.postings([(pk, session_key(session.tenant, name), end)
                                             for pk, name, end in scope], [words[i] for i in asked])
            rows = await self._fetch(sql, params)
            # A word read at the limit is too common to rank by (`COMMON_WORD_POSITIONS`): counted,
            # its positions are not parsed at all, and within one session it is not asked again.
            counts = [0] * len(asked)
            for i, _, positions in rows:
                counts[int(i)] += _count(positions)
            for i, pk, positions in rows:
                if positions and counts[int(i)] <= COMMON_WORD_POSITIONS:
                    found[asked[int(i)]][names[int(pk)]] = _positions(positions)
            if end_user is None:
                self._note_common(session, {words[asked[i]] for i, n in enumerate(counts) if n > COMMON_WORD_POSITIONS})
        return Postings({name: max(end, 0) for _, name, end in scope}, found)

    def _common_words(self, session: SessionState) -> set[str]:
        """The words found too common in the session's store index (`_common`), while they can be."""
        noted = self._common.get((session.tenant, session.session_id))
        if noted is None or noted[0] != session.incarnation or session.length < noted[1]:
            return set()
        return noted[2]

    def _note_common(self, session: SessionState, words: set[str]) -> None:
        if not words:
            return
        known = self._common_words(session)
        if known:
            known.update(words)  # the noted set itself: still valid from the length it was noted at
            return
        if len(self._common) >= _TOO_BIG_KEPT:
            self._common.clear()
        self._common[(session.tenant, session.session_id)] = (session.incarnation, session.length, set(words))

    async def recall_messages(self, session: SessionState, spans: Sequence[tuple[str, int, int]], before: int,
                              end_user: str | None = None, found: Postings | None = None) -> list[RecalledMessage]:
        if end_user is None:
            checked = found.source if found is not None else None
            if isinstance(checked, _Indexed) and checked.entry.incarnation == session.incarnation \
                    and checked.before == max(before, 0):
                indexed: _Indexed | None = checked
            else:
                indexed = await self._indexed(session, before) if spans else None
            if indexed is not None:
                return _lines(indexed, [(first, last) for sid, first, last in spans if sid == session.session_id])
        pks = {session.session_id: session.pk}
        others = sorted({sid for sid, _, _ in spans} - {session.session_id})
        if others and end_user is not None:  # only the sessions `recall_postings` looks in
            marks = ", ".join("?" * len(others))
            pks.update((str(r[1]), int(r[0])) for r in await self._fetch(
                f"SELECT pk, session_id FROM sessions WHERE tenant = ? AND end_user = ? AND session_id IN ({marks})",
                (session.tenant, text_in(end_user), *others)))
        wanted = [(pks[sid], first, last) for sid, first, last in spans if sid in pks]
        if not wanted:
            return []
        # Each span's positions, and the one after it, which says whether its last unit goes on.
        positions: dict[int, set[int]] = {}
        for pk, first, last in wanted:
            positions.setdefault(pk, set()).update(range(first, last + 2))
        rows = await self._fetch(" UNION ALL ".join(
            f"SELECT {_LINE_COLUMNS} FROM messages m WHERE m.session_pk = ? AND m.active = 1"
            f" AND m.seq IN ({', '.join('?' * len(seqs))})" for seqs in positions.values()),
            [v for pk, seqs in positions.items() for v in (pk, *sorted(seqs))])
        read = {(int(r[0]), int(r[1])): r for r in rows}
        keep: dict[tuple[int, int], Row] = {}
        grow: list[tuple[int, int, int]] = []
        for pk, first, last in wanted:
            after = read.get((pk, last + 1))
            if _starts_unit(read.get((pk, first))) and (after is None or _starts_unit(after)):
                keep.update((key, read[key]) for key in ((pk, seq) for seq in range(first, last + 1)) if key in read)
            else:
                grow.append((pk, first, last))
        if grow:
            # A span that starts inside a unit, or whose last unit goes on past it (a tool call and
            # its results), grows to whole units: from the unit start at or before its first
            # position to the next unit start after its last.
            values = ", ".join(["(CAST(? AS BIGINT), CAST(? AS BIGINT), CAST(? AS BIGINT))"] * len(grow))
            rows = await self._fetch(
                f"WITH wanted (pk, first, last) AS (VALUES {values}),"
                " spans (pk, lo, hi) AS (SELECT w.pk,"
                " coalesce((SELECT seq FROM messages WHERE session_pk = w.pk AND active = 1 AND unit_start = 1"
                " AND seq <= w.first ORDER BY seq DESC LIMIT 1), 0),"
                " coalesce((SELECT seq FROM messages WHERE session_pk = w.pk AND active = 1 AND unit_start = 1"
                f" AND seq > w.last ORDER BY seq LIMIT 1), {_END}) FROM wanted w)"
                f" SELECT DISTINCT {_LINE_COLUMNS}"
                " FROM spans s JOIN messages m ON m.session_pk = s.pk AND m.active = 1 AND m.seq >= s.lo AND m.seq < s.hi",
                [v for span in grow for v in span])
            keep.update(((int(r[0]), int(r[1])), r) for r in rows)
        names = {pk: sid for sid, pk in pks.items()}
        return [RecalledMessage(names[pk], seq, str(r[2]), bool(r[3]), text_out(r[4]) or "",
                                None if r[5] is None else int(r[5]), int(r[6]), float(r[7]))
                for (pk, seq), r in sorted(keep.items()) if pk != session.pk or seq < before]

    async def _indexed(self, session: SessionState, before: int) -> _Indexed | None:
        """The session's index, checked against the store and brought up to `before` in one
        statement (None: the cache is off, or the session is gone)."""
        if self._recall_index.budget <= 0:
            return None
        key = (session.tenant, session.session_id)
        index = self._recall_index.get(key)
        if index is None:
            # Not built where it would not be kept: what it costs at least, by the session's tokens
            # (measured: 24 bytes a token on 400-word messages, 50 on LoCoMo's short turns).
            if session.length * MESSAGE_OVERHEAD + session.head_compact_cum * _LEAST_BYTES_PER_TOKEN \
                    > self._recall_index.budget:
                return None
            too_big = self._too_big.get(key)
            if too_big is not None:
                if too_big[0] == session.incarnation and session.length >= too_big[1]:
                    return None
                del self._too_big[key]  # another session under the id, or cleared: it may fit now
        held = (index.incarnation, index.end - 1, index.ids[-1]) if index else (-1, -1, -1)
        end = index.end if index else 0
        # Up to the head, not just `before`: the turns after this one find the index current
        # with what their load read (`Checked`).
        rows = await self._fetch(_INDEX_READ, (*held, session.pk, before, end, max(before, session.length)))
        if not rows or rows[0][0] != 0:
            self._recall_index.discard(key)
            return None
        _, low, holds, _, next_start, _, _, _, incarnation, _ = rows[0]
        new = [row[1:] for row in rows[1:]]
        if not holds or index is None:
            index = SessionIndex(int(incarnation), int(new[0][0]) if new else 0)
        if not await self._extend(session, index, new):
            return None
        if index.cost > self._recall_index.budget:
            if len(self._too_big) >= _TOO_BIG_KEPT:
                self._too_big.clear()
            self._too_big[key] = (index.incarnation, session.length)
        return _Indexed(index, max(int(low if low is not None else 0), index.first), max(before, 0),
                        None if next_start is None else bool(next_start))

    async def _from_checked(self, session: SessionState, checked: Checked, before: int) -> _Indexed | None:
        """The session's index as this turn's `load` checked it, brought up to the head with the
        messages that read (None: it cannot serve `before`, and `_indexed` must)."""
        index = checked.entry
        if index.incarnation != session.incarnation:
            return None
        new = [row for row in checked.rows if row[0] >= index.end]  # a turn beside this one may have added some
        if new and new[0][0] != index.end:  # the load read from later on: the index's own read fills the gap
            return None
        if not await self._extend(session, index, new) or index.end < before:
            return None
        line = index.line(before)
        return _Indexed(index, max(checked.low, index.first), max(before, 0),
                        None if line is None else line.unit_start)

    async def _extend(self, session: SessionState, index: SessionIndex, new: Sequence[Row]) -> bool:
        """`new` added to the session's index and the index cached; rows as `_INDEX_READ` reads them,
        less their part (False: not the contiguous positions after the index's newest, and the
        index is dropped)."""
        key = (session.tenant, session.session_id)
        if not new:
            return True
        if int(new[0][0]) != index.end or int(new[-1][0]) != index.end + len(new) - 1:
            self._recall_index.discard(key)
            return False
        terms = [_words(row[8]) for row in new]
        stems = await self._stems(sorted({w for ws in terms for w in ws}))
        for row, words in zip(new, terms):
            if int(row[0]) != index.end:  # a turn beside this one added it while the stems were read
                continue
            line = RecalledMessage(session.session_id, int(row[0]), str(row[2]), bool(row[3]),
                                   text_out(row[4]) or "", None if row[5] is None else int(row[5]),
                                   int(row[6]), float(row[7]))
            index.add(int(row[1]), line, [stem for w in words for stem in stems[w]])
        self._recall_index.put(key, index, index.cost)
        return True

    async def _stems(self, words: Sequence[str]) -> dict[str, tuple[str, ...]]:
        """`words` as the store's index stems them (`Backend.stems`), those asked before from memory.
        A number is its own stem in both stores' stemmers (tests/test_recall_store.py checks it):
        a turn's new messages and question bring new numbers every turn, and asking costs a
        statement (SQLite's probe: 0.1 ms however few the words)."""
        cache = self._stem_cache
        missing = [w for w in dict.fromkeys(words) if w not in cache]
        numbers = [w for w in missing if w.isascii() and w.isdigit()]
        if numbers:
            self._make_room_for_stems(numbers)
            cache.update((w, (w,)) for w in numbers)
            missing = [w for w in missing if w not in cache]
        if missing:
            self._make_room_for_stems(missing)
            cache.update(zip(missing, await self._db.stems(missing)))
        return {w: cache[w] for w in words}

    def _make_room_for_stems(self, words: Sequence[str]) -> None:
        """The stem cache emptied where `words` would take it past its bounds, in words and in
        characters (a word may be 200 characters of four bytes each: text with no spaces)."""
        size = sum(map(len, words))
        if len(self._stem_cache) + len(words) > _STEMS_KEPT or self._stem_chars + size > _STEM_CHARS_KEPT:
            self._stem_cache.clear()
            self._stem_chars = 0
        self._stem_chars += size

    async def search(self, tenant: str | None, words: Sequence[str], limit: int,
                     session: SessionState | None = None, active_since: float | None = None) -> list[SearchHit]:
        if not words or limit <= 0:
            return []
        if session is not None:
            if session.updated_at < (active_since or 0.0):
                return []
            sessions = [(session.pk, session.tenant, session.session_id)]
        else:
            where, params = ("", ()) if tenant is None else (" AND tenant = ?", (tenant,))
            rows = await self._fetch(f"SELECT pk, tenant, session_id FROM sessions WHERE updated_at >= ?{where}"
                                     " ORDER BY updated_at DESC LIMIT ?",
                                     (active_since or 0.0, *params, _SEARCHED_SESSIONS))
            sessions = [(int(r[0]), str(r[1]), str(r[2])) for r in rows]
        found: list[SearchHit] = []
        for i in range(0, len(sessions), _CHUNK):
            chunk = sessions[i : i + _CHUNK]
            names = {pk: (t, name) for pk, t, name in chunk}
            hits_sql, hits_params = self._hits_of([(pk, session_key(t, name), _END) for pk, t, name in chunk],
                                                  words, limit)
            rows = await self._fetch(
                f"WITH hits (pk, seq, score) AS ({hits_sql}) SELECT h.pk, h.seq, h.score, m.body, m.created_at"
                " FROM hits h JOIN messages m ON m.session_pk = h.pk AND m.active = 1 AND m.seq = h.seq",
                hits_params)
            found += [SearchHit(*names[int(r[0])], int(r[1]), float(r[2]), json.loads(r[3]), float(r[4]))
                      for r in rows]
        found.sort(key=lambda h: (-h.score, h.tenant, h.session_id, h.seq))
        return found[:limit]

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


def _words(text: str | None) -> set[str]:
    """The distinct words of a `search_text` (`key_word key_word ...`), without the key."""
    return {token.split("_", 1)[1] for token in (text or "").split() if "_" in token}


def _lines(indexed: _Indexed, spans: Sequence[tuple[int, int]]) -> list[RecalledMessage]:
    """`TurnStore.recall_messages` for one session, from its index: each span's messages, grown to
    whole units where it starts inside one or its last unit goes on past it, before `before`."""
    index, low, before = indexed.entry, indexed.low, indexed.before
    lines, offset = index.lines, index.first

    def starts(seq: int) -> bool | None:
        if seq == before:
            return indexed.next_starts_unit
        return lines[seq - offset].unit_start if low <= seq < before and seq - offset < len(lines) else None

    runs: list[tuple[int, int]] = []
    for first, last in spans:
        lo, hi = first, last + 1
        if not (starts(first) and starts(hi) is not False):
            while lo > low and not starts(lo):
                lo -= 1
            while hi < before and not starts(hi):
                hi += 1
        lo, hi = max(lo, low), min(hi, before, offset + len(lines))
        if lo < hi:
            runs.append((lo, hi))
    runs.sort()
    out: list[RecalledMessage] = []
    end = -1  # the position after the last one taken
    for lo, hi in runs:
        if hi > end:
            out += lines[max(lo, end) - offset : hi - offset]
            end = hi
    return out


def _starts_unit(row: Row | None) -> bool:
    return row is not None and bool(row[3])


def _count(value: object) -> int:
    """How many positions `_positions` would parse out of `value`."""
    if isinstance(value, str):
        return value.count(",") + 1 if value else 0
    return len(value) if isinstance(value, (list, tuple)) else 0


def _positions(value: object) -> list[int]:
    """Positions as a backend aggregates them (a list, or SQLite's comma-separated text), ascending."""
    if isinstance(value, str):
        return sorted(map(int, value.split(","))) if value else []
    return sorted(int(v) for v in value) if isinstance(value, (list, tuple)) else []


# What a recall line stored before lines were made one line may hold between its words: a line's
# end, as a model or tiktoken reads one, and a tab (`str.split` splits on all of them).
_LINE_BREAKS = ("\n", "\r", "\t", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029")


def backfill_recall(fts: bool) -> Script[None]:
    """The search text and recall lines of messages that lack them, in a migration's transaction
    (`memproxy.store.migrations.fills_recall`): every message stored before the index existed
    (`0009_recall`); then, at each `<number>_..._recall_repair`, what earlier releases left short:
    a `recall_text` missing (a store migrated by `0009_recall` as first released, with no such
    column) or spanning lines (stored before lines were made one line), a `search_text` missing
    (written by a release before `0009_recall` that kept serving after another migrated, or set
    aside by the repair for being indexed otherwise before: `scripts_recall_repair`). Their
    `recall_tokens` become null (counted when recalled); `fts`: SQLite's FTS5 table, which its
    triggers fill only as rows are inserted, gets each active message given its search text."""
    stale = " OR ".join(["recall_text IS NULL", "search_text IS NULL", *(["recall_text LIKE ?"] * len(_LINE_BREAKS))])
    breaks = tuple(f"%{c}%" for c in _LINE_BREAKS)
    sessions = yield "SELECT pk, tenant, session_id FROM sessions ORDER BY pk", ()
    for pk, tenant, session_id in sessions:
        rows = yield (f"SELECT id, seq, active, body, compact_body, created_at, search_text FROM messages"
                      f" WHERE session_pk = ? AND ({stale})", (pk, *breaks))
        for message_id, seq, active, body, compact, created_at, words in rows:
            decoded = json.loads(body)
            line = recall_text(decoded, json.loads(compact) if compact else None)
            if words is not None:
                yield "UPDATE messages SET recall_text = ?, recall_tokens = NULL WHERE id = ?", (line, message_id)
                continue
            words = search_text(tenant, session_id, decoded, float(created_at))
            yield ("UPDATE messages SET recall_text = ?, recall_tokens = NULL, search_text = ? WHERE id = ?",
                   (line, words, message_id))
            if fts and int(active) == 1:
                yield ("INSERT INTO messages_fts (rowid, search_text) VALUES (?, ?)",
                       (int(pk) * 4294967296 + int(seq), words))
