"""The SQL store's half that serves a chat turn and the summariser (`TurnStore`): the indexed
reads a turn plans on, the turn written in one transaction, summaries and their leases, and the
message cap.

A turn planned against a history that has since moved is appended after the new head if it only
continued that history, and refused with `StoreConflict` otherwise (an edit or regenerate whose fork
point may be gone).
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import time
from collections.abc import Sequence

from ...messages import chain_hash
from ...timing import charge_store
from ..base import (MIXED_COUNTS, EndpointUsage, KeptAnswer, Loaded, SessionState, Snapshot, StoredMessage,
                    StoredResponse, Summary, SummaryCall, Totals, TurnRecord, UsageTotals, mandatory_start)
from ..errors import SessionDeleted, StoreConflict
from ..history_cache import Cached, message_cost
from ..recall_index import Checked, SessionIndex
from ..session_cache import SessionCache
from .codec import (TURN_COLUMNS, column_marks, dumps, recall_text, rollup_step, search_text, sent_values, text_in,
                    to_summary)
from .common import CACHE_HOLDS, CHUNK, SQLBase, new_incarnation
from .script import Outcome, Row, Script, Step

# A turn's statements name its session by tenant and id, so none needs another's answer (a batch).
_SESSION_PK = "(SELECT pk FROM sessions WHERE tenant = ? AND session_id = ?)"


def _marks(session: str, before: str, full: str, compact: str) -> list[str]:
    """What a fit needs to know of a session's active history before reading the messages it may
    send, as four scalar subqueries over SQL expressions for the session's key, a position and two
    running totals: the newest unit start and the newest user message before `before` (the first
    walks back through one unit's tool results at most), and the first unit starts whose running
    total before them reaches `full` (as stored) and `compact` (in compact form). Each one index
    lookup."""
    active = f"FROM messages WHERE session_pk = {session} AND active = 1"
    return [f"(SELECT seq {active} AND unit_start = 1 AND seq < {before} ORDER BY seq DESC LIMIT 1)",
            f"(SELECT seq {active} AND role = 'user' AND seq < {before} ORDER BY seq DESC LIMIT 1)",
            f"(SELECT seq {active} AND unit_start = 1 AND cum_before >= {full} ORDER BY cum_before LIMIT 1)",
            f"(SELECT seq {active} AND unit_start = 1 AND compact_cum_before >= {compact}"
            " ORDER BY compact_cum_before LIMIT 1)"]


# A session `s`'s marks at its head, for a room of `?` tokens (`load`).
_HEAD_MARKS = _marks("s.pk", "s.length", "s.head_cum - ?", "s.head_compact_cum - ?")
_MESSAGE_FIELDS = 9  # the columns of `active_range`, which `_stored` reads
_SESSION_FIELDS = 14  # the columns of `get_session`, which `_session` reads
_SUMMARY_FIELDS = 10  # `to_summary`'s columns, then the running totals where the summary ends
_RECALL_FIELDS = 6  # `load`'s last columns: the recall index's check, what it reads of a message

# A branch, superseded or not, walked back from its last message by each message's parent (the
# active message before it when it was written). Not a turn's query (not in `QUERIES`): only a
# Response continuing one whose answer an edit superseded reads it; bounded by the session, then
# by primary key.
_BRANCH = ("WITH RECURSIVE chain (id, parent_id) AS (SELECT id, parent_id FROM messages WHERE id ="
           " (SELECT id FROM messages WHERE session_pk = ? AND seq = ? AND chain_hash = ?"
           " ORDER BY active DESC, id DESC LIMIT 1)"
           " UNION ALL SELECT m.id, m.parent_id FROM messages m JOIN chain c ON m.id = c.parent_id)"
           " SELECT m.seq, m.body, m.tokens, m.cum_before, m.unit_start, m.chain_hash, m.compact_body,"
           " m.compact_tokens, m.compact_cum_before FROM chain c JOIN messages m ON m.id = c.id ORDER BY m.seq")

# The queries that serve a turn; each is answered from an index (tests/test_store_contract.py checks
# the SQLite plans, tests/test_postgres.py the PostgreSQL ones), so their cost does not grow with the
# length of a session's history.
# A kept response with its session, whether its answer is still active, and the session's head.
_GET_RESPONSE = ("SELECT r.id, s.session_id, r.seq, r.chain_hash, r.body, {input_items}, r.created_at,"
                 " EXISTS (SELECT 1 FROM messages m WHERE m.session_pk = r.session_pk AND m.active = 1"
                 " AND m.seq = r.seq AND m.chain_hash = r.chain_hash), s.head_hash"
                 " FROM responses r JOIN sessions s ON s.pk = r.session_pk WHERE r.tenant = ? AND r.id = ?")

QUERIES = {
    "get_session": "SELECT s.pk, s.tenant, s.session_id, s.length, s.head_hash, s.head_cum, s.head_compact_cum,"
    " s.system_prompt, s.created_at, s.updated_at, s.summary_version, m.body, s.tokenizer, s.incarnation"
    " FROM sessions s"
    " LEFT JOIN messages m ON m.session_pk = s.pk AND m.active = 1 AND m.seq = s.length - 1"
    " WHERE s.tenant = ? AND s.session_id = ?",
    "matched_prefix": "SELECT max(seq) FROM messages WHERE session_pk = ? AND active = 1"
    " AND chain_hash IN ({marks})",
    "totals_at": "SELECT cum_before, compact_cum_before FROM messages"
    " WHERE session_pk = ? AND active = 1 AND seq = ?",
    "user_positions": "SELECT seq FROM messages WHERE session_pk = ? AND active = 1 AND role = 'user'"
    " AND seq < ? ORDER BY seq DESC LIMIT ?",
    # What a turn's fit needs to know before reading the messages it may send (`Store.snapshot`).
    "snapshot_marks": "SELECT " + ", ".join(_marks("?", "?", "?", "?")),
    "active_range": "SELECT seq, body, tokens, cum_before, unit_start, chain_hash, compact_body,"
    " compact_tokens, compact_cum_before FROM messages"
    " WHERE session_pk = ? AND active = 1 AND seq >= ? AND seq < ? ORDER BY seq",
    "current_summary": "SELECT s.version, s.text, s.covers, s.covers_hash, s.tokens, s.replaced_tokens,"
    " s.model, s.created_at FROM summaries s JOIN messages m ON m.session_pk = s.session_pk"
    " AND m.active = 1 AND m.seq = s.covers - 1 AND m.chain_hash = s.covers_hash"
    " WHERE s.session_pk = ? AND s.covers <= ? ORDER BY s.version DESC LIMIT 1",
    # The summary in use, one version, with the totals at the position it covers up to.
    "snapshot_summary": "SELECT s.version, s.text, s.covers, s.covers_hash, s.tokens, s.replaced_tokens,"
    " s.model, s.created_at, m.cum_before + m.tokens,"
    " m.compact_cum_before + coalesce(m.compact_tokens, m.tokens) FROM summaries s JOIN messages m"
    " ON m.session_pk = s.session_pk AND m.active = 1 AND m.seq = s.covers - 1 AND m.chain_hash = s.covers_hash"
    " WHERE s.session_pk = ? AND s.covers <= ? ORDER BY s.version DESC LIMIT 1",
    "chain_hash_at": "SELECT chain_hash FROM messages WHERE session_pk = ? AND active = 1 AND seq = ?",
    # A session's kept responses whose answers are active, for its conversation items' ids.
    "kept_answers": "SELECT r.id, r.seq, r.body FROM responses r JOIN messages m ON m.session_pk = r.session_pk"
    " AND m.active = 1 AND m.seq = r.seq AND m.chain_hash = r.chain_hash WHERE r.session_pk = ? ORDER BY r.seq",
    "get_response": _GET_RESPONSE.format(input_items="r.input_items"),
    # The same without its input items (a full-history client's whole history): `item_reference`s.
    "get_response_output": _GET_RESPONSE.format(input_items="'[]'"),
    # `load`: a session and its snapshot at the head, in one statement (one read of one state, one
    # trip), its rows told apart by the first column. `h`, worked out once (materialised: a planner
    # that folded it into the message scans would work it out again for every message of the
    # session): the session's row id, where the messages to read start, and whether the cached
    # history (`memproxy.store.history_cache`) still holds (`CACHE_HOLDS`). 0: the session row with
    # its newest message, its marks (`_HEAD_MARKS`), its newest summary with the totals where it
    # ends (null if that history has changed since), where the messages to read start, its first
    # active position, and whether the cache holds. 1: the messages any room up to `?` could send,
    # in order (from the earliest of the last unit start and the first unit starts whose tails fit;
    # all of them when the whole history fits), less those the cache holds when it holds: each part
    # an index range whose bounds are known before it is read. Last in every row
    # (`_RECALL_FIELDS`): whether the session's recall index (`memproxy.store.recall_index`) still
    # holds, by the same check as the cache's, in row 0; what the index reads of a message, in the
    # others.
    "head": "WITH h AS MATERIALIZED (SELECT s.pk, {start} AS lo, CASE WHEN {cached} THEN 1 ELSE 0 END AS holds"
    " FROM sessions s WHERE s.tenant = ? AND s.session_id = ?)"
    " SELECT 0, {message_nulls}, s.pk, s.tenant, s.session_id, s.length, s.head_hash, s.head_cum,"
    " s.head_compact_cum, s.system_prompt, s.created_at, s.updated_at, s.summary_version, hm.body, s.tokenizer,"
    " s.incarnation, {all_marks},"
    " su.version, su.text, su.covers, su.covers_hash, su.tokens, su.replaced_tokens, su.model, su.created_at,"
    " sm.cum_before + sm.tokens, sm.compact_cum_before + coalesce(sm.compact_tokens, sm.tokens), h.lo,"
    " (SELECT min(seq) FROM messages WHERE session_pk = s.pk AND active = 1), h.holds,"
    " CASE WHEN {cached} THEN 1 ELSE 0 END, NULL, NULL, NULL, NULL, NULL FROM h JOIN sessions s ON s.pk = h.pk"
    " LEFT JOIN messages hm ON hm.session_pk = s.pk AND hm.active = 1 AND hm.seq = s.length - 1"
    " LEFT JOIN summaries su ON su.session_pk = s.pk AND su.version = s.summary_version"
    " LEFT JOIN messages sm ON sm.session_pk = su.session_pk AND sm.active = 1 AND sm.seq = su.covers - 1"
    " AND sm.chain_hash = su.covers_hash"
    " UNION ALL {messages} AND m.seq >= CASE WHEN h.holds = 1 AND ? + 1 > h.lo THEN ? + 1 ELSE h.lo END"
    " UNION ALL {messages} AND m.seq >= h.lo AND m.seq < CASE WHEN h.holds = 1 THEN ? ELSE 0 END"
    " ORDER BY 1, 2",
    # What recording a turn looks up as it writes: the newest chat turn (its messages' turn; chat
    # turns on a session are written one at a time, under its row's lock, a summariser call's
    # `summary` turn is not), a message's parent, and what an edit supersedes.
    "newest_chat_turn": f"SELECT id FROM turns WHERE session_pk = {_SESSION_PK} AND kind <> 'summary'"
    " ORDER BY id DESC LIMIT 1",
    "message_id": f"SELECT id FROM messages WHERE session_pk = {_SESSION_PK} AND active = 1 AND seq = ?",
    "supersede": f"UPDATE messages SET active = 0 WHERE session_pk = {_SESSION_PK} AND active = 1 AND seq >= ?",
}
_NULLS = ", ".join(["NULL"] * (_SESSION_FIELDS + len(_HEAD_MARKS) + _SUMMARY_FIELDS + 3))
QUERIES["head"] = QUERIES["head"].format(
    messages="SELECT 1, m.seq, m.body, m.tokens, m.cum_before, m.unit_start, m.chain_hash, m.compact_body,"
    f" m.compact_tokens, m.compact_cum_before, m.id, {_NULLS}, NULL, m.role, m.recall_text, m.recall_tokens,"
    " m.search_text, m.created_at FROM h JOIN messages m ON m.session_pk = h.pk AND m.active = 1",
    all_marks=", ".join(_HEAD_MARKS), message_nulls=", ".join(["NULL"] * (_MESSAGE_FIELDS + 1)),
    start=f"CASE WHEN s.head_cum <= ? THEN 0 ELSE (SELECT min(column1) FROM (VALUES (coalesce({_HEAD_MARKS[0]},"
    f" s.length)), (coalesce({_HEAD_MARKS[2]}, s.length)), (coalesce({_HEAD_MARKS[3]}, s.length))) v) END",
    cached=CACHE_HOLDS)


class SQLTurns(SQLBase):
    """The `TurnStore` methods."""

    _history: SessionCache[Cached]  # `SQLStore` sets them
    _recall_index: SessionCache[SessionIndex]

    async def get_session(self, tenant: str, session_id: str) -> SessionState | None:
        row = await self._one(QUERIES["get_session"], (tenant, session_id))
        return None if row is None else _session(row)

    async def load(self, tenant: str, session_id: str, room: int) -> Loaded | None:
        key = (tenant, session_id)
        cached = self._history.get(key)
        first, last, last_id, incarnation = (cached.messages[0].seq, cached.messages[-1].seq, cached.last_id,
                                             cached.incarnation) if cached else (-1, -1, -1, -1)
        held = (incarnation, last, last_id)
        index = self._recall_index.get(key)
        indexed = (index.incarnation, index.end - 1, index.ids[-1]) if index and index.ids else (-1, -1, -1)
        rows = await self._fetch(QUERIES["head"], (room, room, room, *held, *key, room, room, *indexed,
                                                   last, last, first))
        if not rows:
            self._history.discard(key)
            return None
        # The first row: its part (0), the message columns and id (null), then the session's own
        # columns, its four marks, its newest summary (`to_summary`'s columns, then two totals),
        # where the messages to read start, its first active position, whether the cache holds,
        # and whether the recall index does.
        head = rows[0][2 + _MESSAGE_FIELDS : -_RECALL_FIELDS + 1]
        index_holds = bool(head[-1])
        head = head[:-1]
        session = _session(head)
        last_unit, last_user = (None if v is None else int(v) for v in head[_SESSION_FIELDS:_SESSION_FIELDS + 2])
        summary = head[_SESSION_FIELDS + len(_HEAD_MARKS):-3]
        start, first_active, holds = head[-3:]
        stored = self._with_cached(key, session.incarnation, cached if holds else None,
                                   max(int(start), first_active or 0), rows[1:])
        # The newest summary is the one in use unless the history it covers has changed since (an
        # edit), or it covers more than there is: then an older one may be, and only `snapshot` tells.
        in_use = summary[0] is not None and summary[8] is not None and summary[2] <= session.length
        recall = None
        if index is not None and index_holds:
            # The messages after the index's newest, as it reads them (`Checked`): its next turn's
            # recall indexes them without a statement of its own.
            recall = Checked(index, int(first_active or 0), [
                (r[1], r[1 + _MESSAGE_FIELDS], r[-5], r[5], r[-4], r[-3],
                 r[3] if r[8] is None else r[8], r[-1], r[-2]) for r in rows[1:] if r[1] >= index.end])
        return Loaded(session=session, room=room, last_unit=last_unit, last_user=last_user,
                      start=stored[0].seq if stored else session.length, messages=stored,
                      summary=to_summary(summary) if in_use else None,
                      summary_totals=Totals(int(summary[8]), int(summary[9])) if in_use else None,
                      summary_known=session.summary_version == 0 or in_use, recall=recall)

    def _with_cached(self, key: tuple[str, str], incarnation: int, cached: Cached | None, start: int,
                     rows: list[Row]) -> list[StoredMessage]:
        """`load`'s messages from `start` on: the rows read, with the cached ones between them where
        the cache still holds (the rows are then those before and after it); cached again."""
        fields = slice(1, 1 + _MESSAGE_FIELDS)
        read = [(_stored(row[fields]), row[1 + _MESSAGE_FIELDS], message_cost(row[2], row[7])) for row in rows]
        if cached is None:
            before, kept, kept_costs, after = [], [], [], read
        else:
            first, last = cached.messages[0].seq, cached.messages[-1].seq
            before = [r for r in read if r[0].seq < first]
            after = [r for r in read if r[0].seq > last]
            i = bisect.bisect_left(cached.messages, start, key=lambda m: m.seq)
            kept, kept_costs = cached.messages[i:], cached.costs[i:]
        messages = [r[0] for r in before] + kept + [r[0] for r in after]
        if messages:
            last_id = after[-1][1] if after else (cached.last_id if kept and cached else read[-1][1])
            costs = [r[2] for r in before] + kept_costs + [r[2] for r in after]
            self._history.put(key, Cached(messages, costs, last_id, incarnation), sum(costs))
        else:
            self._history.discard(key)
        return messages

    async def matched_prefix(self, session: SessionState, hashes: Sequence[str]) -> int:
        best = -1
        for i in range(0, len(hashes), CHUNK):
            chunk = list(hashes[i : i + CHUNK])
            sql = QUERIES["matched_prefix"].format(marks=",".join("?" * len(chunk)))
            row = await self._one(sql, (session.pk, *chunk))
            if row is not None and row[0] is not None:
                best = max(best, int(row[0]))
        return best + 1

    async def totals_at(self, session: SessionState, seq: int) -> Totals:
        if seq >= session.length:
            return Totals(session.head_cum, session.head_compact_cum)
        row = await self._one(QUERIES["totals_at"], (session.pk, seq))
        if row is None:
            raise LookupError(f"no active message at position {seq}")
        return Totals(int(row[0]), int(row[1]))

    async def user_positions(self, session: SessionState, before: int, limit: int) -> list[int]:
        rows = await self._fetch(QUERIES["user_positions"], (session.pk, before, limit))
        return [int(row[0]) for row in rows]

    async def snapshot(self, session: SessionState, base: int, whole_last_unit: bool, room: int) -> Snapshot:
        base_totals = await self.totals_at(session, base)  # no trip unless `base` is before the head
        if base_totals.full <= room:
            # The whole history fits as stored (most sessions): read it, and find the marks in it.
            messages = await self.active_range(session, 0, base)
            last_unit = next((m.seq for m in reversed(messages) if m.unit_start), None)
            last_user = next((m.seq for m in reversed(messages) if m.body.get("role") == "user"), None)
            must_start = mandatory_start(base, whole_last_unit, last_unit)
            start = 0
        else:
            marks = await self._one(QUERIES["snapshot_marks"], (
                session.pk, base, session.pk, base, session.pk, base_totals.full - room,
                session.pk, base_totals.compact - room))
            assert marks is not None  # scalar subqueries: always one row
            last_unit, last_user, fits, fits_compact = (None if v is None else int(v) for v in marks)
            must_start = mandatory_start(base, whole_last_unit, last_unit)
            # A unit start before both of the first that fit costs more than `room` either way.
            start = min(must_start, base if fits is None else fits, base if fits_compact is None else fits_compact)
            messages = await self.active_range(session, start, base)
        summary, summary_totals = None, None
        if session.summary_version:  # a session never summarised needs no summary query
            row = await self._one(QUERIES["snapshot_summary"], (session.pk, must_start))
            if row is not None:
                summary, summary_totals = to_summary(row), Totals(int(row[8]), int(row[9]))
        return Snapshot(base=base, base_totals=base_totals, must_start=must_start, last_user=last_user,
                        summary=summary, summary_totals=summary_totals, start=start, messages=messages)

    async def active_range(self, session: SessionState, start: int, stop: int) -> list[StoredMessage]:
        if start >= stop:
            return []
        rows = await self._fetch(QUERIES["active_range"], (session.pk, start, stop))
        return [_stored(r) for r in rows]

    async def branch(self, session: SessionState, seq: int, chain_hash: str) -> list[StoredMessage] | None:
        rows = await self._fetch(_BRANCH, (session.pk, seq, chain_hash))
        # A cap deletes superseded messages first and cuts their children's links: a walk that
        # stops short of position 0, or skips one, found a branch no longer stored whole.
        if [r[0] for r in rows] != list(range(seq + 1)):
            return None
        return [_stored(r) for r in rows]

    async def current_summary(self, session: SessionState, upto: int) -> Summary | None:
        row = await self._one(QUERIES["current_summary"], (session.pk, upto))
        return None if row is None else to_summary(row)

    async def newest_summary_version(self, session: SessionState) -> int:
        row = await self._one("SELECT coalesce(max(version), 0) FROM summaries WHERE session_pk = ?", (session.pk,))
        assert row is not None  # an aggregate: always one row
        return int(row[0])

    async def record_turn(self, turn: TurnRecord) -> None:
        started = time.perf_counter()
        try:
            now = time.time()
            if turn.expired_before is None:
                try:  # usually the session is where the turn was planned: one batch writes it all
                    return await self._db.write_batch(self._planned_turn(turn, now), _head_moved)
                except _HeadMoved:
                    pass
            if not await self._db.write(self._record_turn(turn, now)):
                raise SessionDeleted("the session was deleted while this turn was in flight")
        finally:
            charge_store(started)

    def _planned_turn(self, turn: TurnRecord, now: float) -> list[Step]:
        """The turn as one batch, valid only if the session is still where the turn was planned: its
        first statement moves the session's head only from there (a new session: inserts it only if
        none exists), and returns nothing otherwise (`_head_moved`: the batch is rolled back)."""
        placement, head = _placement(turn)
        first = self._insert_head(turn, head, now) if turn.expected_length == 0 else self._move_head(turn, head, now)
        return [first, *self._turn_rows(turn, placement, now)]

    def _record_turn(self, turn: TurnRecord, now: float) -> Script[bool]:
        """A turn whose session moved meanwhile (another writer's turn or its creation), or idled past
        its TTL: its row is locked and read first, and the turn continues it, rebased (`_rebased`),
        or is refused. False: the session was deleted meanwhile; what the turn cost, paid for, goes
        to the tenant's usage of deleted sessions, and nothing else is written."""
        row = yield from self._locked(turn.tenant, turn.session_id, turn.expired_before)
        if row is None:
            if turn.expected_length != 0:
                yield rollup_step(turn.tenant, UsageTotals(
                    sessions=0, turns=1, prompt_tokens=turn.usage.prompt_tokens or 0,
                    completion_tokens=turn.usage.completion_tokens or 0, cost=turn.cost,
                    context_tokens=turn.context_tokens, full_tokens=turn.full_tokens))  # as its row would have summed
                return False
            row = yield from self._new_session(turn.tenant, turn.session_id)
        pk = int(row[0])
        if (row[1], row[2]) != (turn.expected_length, turn.expected_head_hash):
            turn = yield from self._rebased(turn, pk, row)
        placement, head = _placement(turn)
        yield self._move_head(turn, head, now, pk)
        for step in self._turn_rows(turn, placement, now):
            yield step
        return True

    @staticmethod
    def _turn_rows(turn: TurnRecord, placement: list[Placed], now: float) -> list[Step]:
        """What a turn writes once its session's row is moved: the messages it supersedes, the turn,
        its messages. No statement needs another's answer, so they can go in one batch: each looks
        up the session, the turn and a message's parent (the active message before it) itself."""
        session = (turn.tenant, turn.session_id)
        steps: list[Step] = []
        if turn.base < turn.expected_length:
            steps.append((QUERIES["supersede"], (*session, turn.base)))
        steps.append((
            f"INSERT INTO turns (session_pk, {TURN_COLUMNS}) VALUES ({_SESSION_PK}, {column_marks(TURN_COLUMNS)})",
            (*session, now, text_in(turn.model), turn.kind, turn.context_tokens, turn.usage.prompt_tokens,
             turn.usage.completion_tokens, turn.latency_ms, turn.cost, turn.full_tokens, *sent_values(turn.sent))))
        for message, (seq, cum, compact_tokens, compact_cum) in zip(turn.messages, placement):
            steps.append((
                "INSERT INTO messages (session_pk, turn_id, parent_id, seq, role, body, tokens, cum_before,"
                " unit_start, chain_hash, created_at, compact_body, compact_tokens, compact_cum_before, search_text,"
                f" recall_text, recall_tokens) VALUES ({_SESSION_PK}, ({QUERIES['newest_chat_turn']}),"
                f" ({QUERIES['message_id']}), ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (*session, *session, *session, seq - 1, seq, message.body.get("role"), dumps(message.body),
                 message.tokens, cum, int(message.unit_start), message.chain_hash, now,
                 None if message.compact_body is None else dumps(message.compact_body), compact_tokens,
                 compact_cum, search_text(*session, message.body, now),
                 recall_text(message.body, message.compact_body), message.recall_tokens)))
        if turn.metadata is not None:
            steps.append((f"UPDATE sessions SET metadata = ? WHERE pk = {_SESSION_PK}", (dumps(turn.metadata), *session)))
        if turn.response is not None and placement:
            # A Responses API answer points at the turn's last message, where it landed (a rebased
            # turn's too: `placement` and the hashes are the rebased ones).
            kept = turn.response
            steps.append((
                "INSERT INTO responses (tenant, id, session_pk, seq, chain_hash, body, input_items, created_at)"
                f" VALUES (?, ?, {_SESSION_PK}, ?, ?, ?, ?, ?)",
                (turn.tenant, kept.id, *session, placement[-1][0], turn.messages[-1].chain_hash,
                 dumps(kept.body), dumps(kept.input_items), now)))
        return steps

    @staticmethod
    def _insert_head(turn: TurnRecord, head: Head, now: float) -> Step:
        """A new session inserted with the turn's head, returning its key; nothing if one exists."""
        return (
            "INSERT INTO sessions (tenant, session_id, created_at, updated_at, length, head_hash, head_cum,"
            " head_compact_cum, system_prompt, title, end_user, tokenizer, incarnation)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (tenant, session_id) DO NOTHING RETURNING pk",
            (turn.tenant, turn.session_id, now, now, *head, dumps(turn.system) if turn.system else None,
             text_in(turn.title), text_in(turn.end_user), turn.tokenizer, new_incarnation()))

    @staticmethod
    def _move_head(turn: TurnRecord, head: Head, now: float, pk: int | None = None) -> Step:
        """The session's row moved to `head` (length, hash, running totals), with the turn's system
        prompt and title, returning its key: the row `pk` (locked already), or without one, the
        session only if it is still where the turn was planned (the statement checks it, and on
        PostgreSQL locks it); nothing if it had moved."""
        where, params = ("pk = ?", [pk]) if pk is not None else (
            "tenant = ? AND session_id = ? AND length = ? AND head_hash = ?",
            [turn.tenant, turn.session_id, turn.expected_length, turn.expected_head_hash])
        # The counter of the session's counts: the turn's where they are all its own (the first, one
        # that replaces the whole chain, or one of the same counter), else a mix (`*`).
        return (
            "UPDATE sessions SET length = ?, head_hash = ?, head_cum = ?, head_compact_cum = ?,"
            " updated_at = ?, system_prompt = coalesce(?, system_prompt),"
            " title = coalesce(title, ?), end_user = coalesce(?, end_user), tokenizer = CASE"
            " WHEN CAST(? AS TEXT) IS NULL THEN tokenizer WHEN ? = 0 OR tokenizer IS NULL OR tokenizer = ? THEN ?"
            f" ELSE '{MIXED_COUNTS}' END WHERE {where} RETURNING pk",
            (*head, now, dumps(turn.system) if turn.system else None, text_in(turn.title),
             text_in(turn.end_user), turn.tokenizer, turn.base, turn.tokenizer, turn.tokenizer, *params))

    def _rebased(self, turn: TurnRecord, pk: int, head: Row) -> Script[TurnRecord]:
        """A turn planned on a history that another writer has since extended. If it only continued
        that history (and what it continued is still there), it goes after the other writer's turn,
        its chained hashes and running totals recomputed on the new head: overlapping turns on one
        session are all kept, however many replicas race. An edit or regenerate is refused instead:
        the point it forked from may be gone; and so is a pinned turn, whose history is fixed, and
        one that opens with tool results: they answer the call at its base, and after another
        writer's turn they would follow a message that made no call."""
        _, length, head_hash, head_cum, head_compact_cum = head
        continues_unit = bool(turn.messages) and not turn.messages[0].unit_start
        if turn.pinned or continues_unit or turn.base != turn.expected_length or length < turn.base:
            raise StoreConflict("the session changed while this turn was in flight; retry it")
        if turn.base:
            found = yield QUERIES["chain_hash_at"], (pk, turn.base - 1)
            if not found or found[0][0] != turn.base_hash:
                raise StoreConflict("the session changed while this turn was in flight; retry it")
        chain, messages = head_hash, []
        for message in turn.messages:
            chain = chain_hash(chain, message.body)
            messages.append(dataclasses.replace(message, chain_hash=chain))
        return dataclasses.replace(turn, base=length, base_hash=head_hash,
                                   base_totals=Totals(head_cum, head_compact_cum), messages=messages)

    async def get_response(self, tenant: str, response_id: str, with_input: bool = True) -> StoredResponse | None:
        row = await self._one(QUERIES["get_response" if with_input else "get_response_output"], (tenant, response_id))
        if row is None:
            return None
        return StoredResponse(id=row[0], tenant=tenant, session_id=row[1], seq=row[2], chain_hash=row[3],
                              body=json.loads(row[4]), input_items=json.loads(row[5]), created_at=row[6],
                              active=bool(row[7]), head=row[8] == row[3])

    async def kept_answers(self, session: SessionState) -> list[KeptAnswer]:
        rows = await self._fetch(QUERIES["kept_answers"], (session.pk,))
        answers = []
        for response_id, seq, body in rows:
            output = json.loads(body).get("output")
            answers.append(KeptAnswer(response_id, seq, output if isinstance(output, list) else []))
        return answers

    async def delete_response(self, tenant: str, response_id: str) -> bool:
        rows = await self._write_one("DELETE FROM responses WHERE tenant = ? AND id = ? RETURNING id",
                                     (tenant, response_id))
        return bool(rows)

    async def add_endpoint_usage(self, usage: EndpointUsage) -> None:
        # A cost stays unknown (null) only while neither part knows one, as in `tenant_usage`.
        await self._write_one(
            "INSERT INTO endpoint_usage (tenant, endpoint, calls, prompt_tokens, completion_tokens, cost)"
            " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (tenant, endpoint) DO UPDATE SET"
            " calls = endpoint_usage.calls + excluded.calls,"
            " prompt_tokens = endpoint_usage.prompt_tokens + excluded.prompt_tokens,"
            " completion_tokens = endpoint_usage.completion_tokens + excluded.completion_tokens,"
            " cost = CASE WHEN endpoint_usage.cost IS NULL AND excluded.cost IS NULL THEN NULL"
            " ELSE coalesce(endpoint_usage.cost, 0) + coalesce(excluded.cost, 0) END",
            (usage.tenant, usage.endpoint, usage.calls, usage.prompt_tokens, usage.completion_tokens, usage.cost))

    async def record_summary_call(self, session: SessionState, call: SummaryCall) -> None:
        await self._db.write(self._summary_call(session, call))

    def _summary_call(self, session: SessionState, call: SummaryCall) -> Script[None]:
        """The call, paid for, as a turn of its session; of a session deleted meanwhile (its row id
        perhaps another session's since: the incarnation tells), in the tenant's usage of deleted
        sessions. The row is locked first: a deletion holding it (another replica's) is waited for
        and then seen, where an insert alone found the row, waited for it on its foreign key and
        failed once the deletion committed, the call counted nowhere."""
        same = yield ("SELECT pk FROM sessions WHERE pk = ? AND incarnation = ?" + self._db.row_lock,
                      (session.pk, session.incarnation))
        if same:
            yield ("INSERT INTO turns (session_pk, created_at, model, kind, context_tokens, prompt_tokens,"
                   " completion_tokens, latency_ms, cost, full_tokens) VALUES (?, ?, ?, 'summary', ?, ?, ?, ?, ?, 0)",
                   (session.pk, time.time(), text_in(call.model), call.context_tokens, call.usage.prompt_tokens,
                    call.usage.completion_tokens, call.latency_ms, call.cost))
        else:
            yield rollup_step(session.tenant, UsageTotals(
                sessions=0, turns=0, summary_calls=1, prompt_tokens=call.usage.prompt_tokens or 0,
                completion_tokens=call.usage.completion_tokens or 0, cost=call.cost,
                context_tokens=call.context_tokens, full_tokens=0))  # as its row would have summed

    async def save_summary(self, session: SessionState, expected_version: int, summary: Summary) -> None:
        await self._db.write(self._save_summary(session, expected_version, summary, time.time()))

    def _save_summary(self, session: SessionState, expected_version: int, summary: Summary,
                      now: float) -> Script[None]:
        yield from self._locked(session.tenant, session.session_id)
        same = yield "SELECT 1 FROM sessions WHERE pk = ? AND incarnation = ?", (session.pk, session.incarnation)
        if not same:  # another row since, perhaps another tenant's under the same pk
            raise StoreConflict("the session was deleted (or deleted and made again) since it was read")
        [(version,)] = yield "SELECT coalesce(max(version), 0) FROM summaries WHERE session_pk = ?", (session.pk,)
        if version != expected_version:
            raise StoreConflict("another summary of this session was saved meanwhile")
        covered = yield ("SELECT 1 FROM messages WHERE session_pk = ? AND active = 1 AND seq = ? AND chain_hash = ?",
                         (session.pk, summary.covers - 1, summary.covers_hash))
        if not covered:
            raise StoreConflict("the history this summary covers has changed since it was read")
        yield ("INSERT INTO summaries (session_pk, version, text, covers, covers_hash, tokens, replaced_tokens,"
               " model, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
               (session.pk, expected_version + 1, text_in(summary.text), summary.covers, summary.covers_hash,
                summary.tokens, summary.replaced_tokens, text_in(summary.model), now))
        yield "UPDATE sessions SET summary_version = ? WHERE pk = ?", (expected_version + 1, session.pk)

    async def take_summary_lease(self, session: SessionState, holder: str, seconds: float) -> bool:
        now = time.time()
        taken = await self._write_one(
            "INSERT INTO summary_leases (session_pk, holder, expires_at) VALUES (?, ?, ?)"
            " ON CONFLICT (session_pk) DO UPDATE SET holder = excluded.holder,"
            " expires_at = excluded.expires_at"
            " WHERE summary_leases.expires_at < ? OR summary_leases.holder = excluded.holder"
            " RETURNING holder",
            (session.pk, holder, now + seconds, now))
        return bool(taken)

    async def release_summary_lease(self, session: SessionState, holder: str) -> None:
        await self._write_one("DELETE FROM summary_leases WHERE session_pk = ? AND holder = ?", (session.pk, holder))

    async def cap_messages(self, session: SessionState, keep: int) -> int:
        return await self._db.write(self._cap_messages(session, keep))

    async def touch(self, session: SessionState, now: float) -> None:
        await self._write_one("UPDATE sessions SET updated_at = ? WHERE pk = ? AND incarnation = ? AND updated_at < ?",
                              (now, session.pk, session.incarnation, now))

    def _cap_messages(self, session: SessionState, keep: int) -> Script[int]:
        locked = yield from self._locked(session.tenant, session.session_id)
        if locked is None or locked[0] != session.pk:
            return 0
        # The summary in use is read under the lock: read before it, an edit recorded meanwhile
        # could make it stale and its `covers` would reach into the new branch, still to be sent.
        summary = yield QUERIES["current_summary"], (session.pk, locked[1])
        covers = to_summary(summary[0]).covers if summary else 0
        [(count,)] = yield "SELECT count(*) FROM messages WHERE session_pk = ?", (session.pk,)
        excess = int(count) - keep
        if excess <= 0:
            return 0
        # Superseded messages first, then what the summary in use stands for (its last message
        # stays: it proves the summary still matches the history).
        rows = yield ("SELECT id FROM messages WHERE session_pk = ? AND (active = 0 OR seq < ?)"
                      " ORDER BY active, id LIMIT ?", (session.pk, covers - 1, excess))
        ids = [r[0] for r in rows]
        if not ids:
            return 0
        marks = ",".join("?" * len(ids))
        yield f"UPDATE messages SET parent_id = NULL WHERE parent_id IN ({marks})", ids
        yield f"DELETE FROM messages WHERE id IN ({marks})", ids
        return len(ids)


def _session(row: Row) -> SessionState:
    """A `get_session` row."""
    return SessionState(
        pk=row[0], tenant=row[1], session_id=row[2], length=row[3], head_hash=row[4],
        head_cum=row[5], head_compact_cum=row[6], system=json.loads(row[7]) if row[7] else None,
        created_at=row[8], updated_at=row[9], summary_version=row[10],
        head_message=json.loads(row[11]) if row[11] else None, tokenizer=row[12], incarnation=int(row[13]),
    )


def _stored(row: Row) -> StoredMessage:
    """An `active_range` row."""
    return StoredMessage(seq=row[0], body=json.loads(row[1]), tokens=row[2], cum_before=row[3],
                         unit_start=bool(row[4]), chain_hash=row[5],
                         compact_body=json.loads(row[6]) if row[6] else None, compact_tokens=row[7],
                         compact_cum_before=row[8])


Head = tuple[int, str, int, int]  # a session's length, head hash and running totals (full, compact)
Placed = tuple[int, int, int, int]  # a message's seq, running total before it, compact tokens and running total


class _HeadMoved(Exception):
    """The session is not where the turn was planned: its batch is rolled back."""


def _head_moved(outcomes: list[Outcome]) -> None:
    """Accepts a planned turn's batch (`SQLTurns._planned_turn`) if its first statement moved the head."""
    if not isinstance(outcomes[0], BaseException) and not outcomes[0]:
        raise _HeadMoved
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome


def _placement(turn: TurnRecord) -> tuple[list[Placed], Head]:
    """Where each of the turn's messages goes (seq, running total before it, its compact tokens and
    compact running total), and the session's head after them (length, hash, running totals)."""
    seq, head_hash = turn.base, turn.base_hash
    cum, compact_cum = turn.base_totals.full, turn.base_totals.compact
    placed = []
    for message in turn.messages:
        compact_tokens = message.compacted_tokens
        placed.append((seq, cum, compact_tokens, compact_cum))
        seq, head_hash = seq + 1, message.chain_hash
        cum, compact_cum = cum + message.tokens, compact_cum + compact_tokens
    return placed, (seq, head_hash, cum, compact_cum)

