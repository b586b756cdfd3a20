"""The Store, written once in the SQL that SQLite and PostgreSQL share.

A `Backend` supplies reads that see only committed data, write scripts, and the dialect's row lock.
Every write is a script: a generator of statements, each `yield` answered with that statement's
rows, run in one transaction. The same code runs statement by statement on PostgreSQL and whole in
one trip to SQLite's writer thread, so no write there holds the thread across trips to the event
loop, and writes queue on the thread instead of on a lock. Statements use `?` placeholders (the
PostgreSQL backend numbers them), `RETURNING` for new ids and for what a statement changed, and
`CAST(? AS TEXT) IS NULL` where a parameter may be null, so one text serves both.

Writes that must not interleave take the session's row lock first (`FOR UPDATE` on PostgreSQL; on
SQLite the whole write transaction is exclusive): recording a turn, saving a summary, merging
metadata, clearing. A turn planned against a history that has since moved is appended after the new
head if it only continued that history, and refused with `Conflict` otherwise (an edit or regenerate
whose fork point may be gone). Every deletion of sessions goes through `_forget`, which first adds
what they spent to their tenant's rollup.

Every JSON string round-trips through both databases. JSON columns hold `json.dumps` text, where a NUL
is already the escape `\u0000` (PostgreSQL's text cannot hold the character itself); a lone surrogate
(a provider may send one) cannot be encoded as UTF-8, so such a value is written with every non-ASCII
character escaped (`_dumps`). The plain text columns that take free text (a session's `title`, a
summary's `text`, model names) hold it as it is unless it has one of those characters, or starts like an escaped
one: then it is `_ESCAPED` followed by its JSON string (`_text_in`, `_text_out`). Rows written before
read back unchanged, so no migration was needed.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import Any, Protocol, TypeVar, overload

from ..messages import chain_hash
from ..timing import charge_store
from .base import (
    MessageRecord,
    SentContext,
    SessionInfo,
    SessionState,
    Snapshot,
    StoredMessage,
    Summary,
    SummaryCall,
    Totals,
    TurnInfo,
    TurnRecord,
    UsageTotals,
)
from .errors import StoreConflict

Row = Sequence[Any]
T = TypeVar("T")
Step = tuple[str, Sequence[Any]]
Script = Generator[Step, list[Row], T]  # statements out, their rows back in, a result at the end
_LOOKUP_ROWS = 256  # a longer range (a summary's first fold of a long history) is no lookup

# The queries that serve a turn; each is answered from an index (tests/test_store_contract.py checks
# the SQLite plans, tests/test_postgres.py the PostgreSQL ones), so their cost does not grow with the
# length of a session's history.
QUERIES = {
    "get_session": "SELECT pk, tenant, session_id, length, head_hash, head_cum, head_compact_cum,"
    " system_prompt, created_at, updated_at, summary_version FROM sessions"
    " WHERE tenant = ? AND session_id = ?",
    "matched_prefix": "SELECT max(seq) FROM messages WHERE session_pk = ? AND active = 1"
    " AND chain_hash IN ({marks})",
    "totals_at": "SELECT cum_before, compact_cum_before FROM messages"
    " WHERE session_pk = ? AND active = 1 AND seq = ?",
    "user_positions": "SELECT seq FROM messages WHERE session_pk = ? AND active = 1 AND role = 'user'"
    " AND seq < ? ORDER BY seq DESC LIMIT ?",
    # What a turn's fit needs to know before reading the messages it may send (`Store.snapshot`):
    # the last unit start before `base` (it walks back through one unit's tool results at most),
    # the newest user message, and the first unit start whose tail fits the room, as stored and in
    # compact form. One trip, four index lookups.
    "snapshot_marks": "SELECT"
    " (SELECT seq FROM messages WHERE session_pk = ? AND active = 1 AND unit_start = 1 AND seq < ?"
    " ORDER BY seq DESC LIMIT 1),"
    " (SELECT seq FROM messages WHERE session_pk = ? AND active = 1 AND role = 'user' AND seq < ?"
    " ORDER BY seq DESC LIMIT 1),"
    " (SELECT seq FROM messages WHERE session_pk = ? AND active = 1 AND unit_start = 1 AND cum_before >= ?"
    " ORDER BY cum_before LIMIT 1),"
    " (SELECT seq FROM messages WHERE session_pk = ? AND active = 1 AND unit_start = 1"
    " AND compact_cum_before >= ? ORDER BY compact_cum_before LIMIT 1)",
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
    "message_id": "SELECT id FROM messages WHERE session_pk = ? AND active = 1 AND seq = ?",
    "chain_hash_at": "SELECT chain_hash FROM messages WHERE session_pk = ? AND active = 1 AND seq = ?",
    "supersede": "UPDATE messages SET active = 0 WHERE session_pk = ? AND active = 1 AND seq >= ?",
}

# The columns an export carries, as they are named in the tables and in the export records.
_SESSION_COLUMNS = ("created_at, updated_at, length, head_hash, head_cum, head_compact_cum, system_prompt,"
                    " title, metadata")
# Turns of chat, not summariser calls (`turns` rows of kind `summary`), in a LEFT JOIN on turns `t`.
_CHAT_TURNS = "coalesce(sum(CASE WHEN t.kind <> 'summary' THEN 1 ELSE 0 END), 0)"
# What a chat turn's request was made of (`SentContext`), in the order of its fields.
_SENT_COLUMNS = "summary_version, first_sent, included, omitted, unsummarised_omitted, marker, trimmed, deduplicated"
_TURN_COLUMNS = ("created_at, model, kind, context_tokens, prompt_tokens, completion_tokens, latency_ms,"
                 f" cost, full_tokens, {_SENT_COLUMNS}")
# A tenant's usage summed over turns `t` of sessions `s` (LEFT JOIN), in the order of `tenant_usage`.
_USAGE_SUMS = (f"count(DISTINCT s.pk), {_CHAT_TURNS},"
               " coalesce(sum(CASE WHEN t.kind = 'summary' THEN 1 ELSE 0 END), 0),"
               " coalesce(sum(t.prompt_tokens), 0), coalesce(sum(t.completion_tokens), 0), sum(t.cost),"
               " coalesce(sum(t.context_tokens), 0), coalesce(sum(coalesce(t.full_tokens, t.context_tokens)), 0)")
_USAGE_COLUMNS = "sessions, turns, summary_calls, prompt_tokens, completion_tokens, cost, context_tokens, full_tokens"
_ROLLUP_SUMS = ", ".join("sum(cost)" if c == "cost" else f"coalesce(sum({c}), 0)" for c in _USAGE_COLUMNS.split(", "))
# Adds an inserted `tenant_usage` row to the tenant's existing one; a cost stays unknown (null)
# only while neither part knows one.
_ADD_TO_ROLLUP = ("ON CONFLICT (tenant) DO UPDATE SET "
                  + ", ".join(f"{c} = tenant_usage.{c} + excluded.{c}" for c in _USAGE_COLUMNS.split(", ")
                              if c != "cost")
                  + ", cost = CASE WHEN tenant_usage.cost IS NULL AND excluded.cost IS NULL THEN NULL"
                  " ELSE coalesce(tenant_usage.cost, 0) + coalesce(excluded.cost, 0) END")
_CHUNK = 500  # ids per statement, well under every placeholder limit
_MESSAGE_COLUMNS = ("seq, active, role, body, tokens, cum_before, unit_start, chain_hash, created_at,"
                    " compact_body, compact_tokens, compact_cum_before")
_SUMMARY_COLUMNS = "version, text, covers, covers_hash, tokens, replaced_tokens, model, created_at"
_JSON_COLUMNS = frozenset({"system_prompt", "metadata", "body", "compact_body"})
# Free text, kept as it is where it can be (`_text_in`); a model name only an import can make odd.
_TEXT_COLUMNS = frozenset({"title", "text", "model"})


class Backend(Protocol):
    row_lock: str  # appended to a SELECT that must lock the rows it reads

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        """A read outside any transaction: it sees committed data only."""
        ...

    async def lookup(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        """The same, for one of the `QUERIES` serving a turn: answered from an index, its cost bounded
        by the request rather than the history, so a backend may answer it on the event loop."""
        ...

    async def write(self, script: Script[T]) -> T:
        """Run a script in one write transaction, rolled back if it raises."""
        ...

    async def close(self) -> None: ...


def run_script(script: Script[T], fetch: Callable[[str, Sequence[Any]], list[Row]]) -> T:
    """Drive a script with a synchronous `fetch`."""
    try:
        step = next(script)
        while True:
            step = script.send(fetch(*step))
    except StopIteration as done:
        result: T = done.value
        return result


async def run_script_async(script: Script[T], fetch: Callable[[str, Sequence[Any]], Awaitable[list[Row]]]) -> T:
    """Drive a script statement by statement with an asynchronous `fetch` (in a transaction)."""
    try:
        step = next(script)
        while True:
            step = script.send(await fetch(*step))
    except StopIteration as done:
        result: T = done.value
        return result


class SQLStore:
    def __init__(self, backend: Backend) -> None:
        self._db = backend

    async def close(self) -> None:
        await self._db.close()

    async def _fetch(self, sql: str, params: Sequence[Any] = (), lookup: bool = False) -> list[Row]:
        """`lookup`: one of the `QUERIES` that serve a turn (`Backend.lookup`)."""
        started = time.perf_counter()
        try:
            return await (self._db.lookup if lookup else self._db.fetch)(sql, params)
        finally:
            charge_store(started)

    async def _one(self, sql: str, params: Sequence[Any] = (), lookup: bool = False) -> Row | None:
        rows = await self._fetch(sql, params, lookup)
        return rows[0] if rows else None

    async def ping(self) -> None:
        await self._fetch("SELECT 1")

    # --- serving a turn ------------------------------------------------------------------------

    async def get_session(self, tenant: str, session_id: str) -> SessionState | None:
        row = await self._one(QUERIES["get_session"], (tenant, session_id), lookup=True)
        if row is None:
            return None
        return SessionState(
            pk=row[0], tenant=row[1], session_id=row[2], length=row[3], head_hash=row[4],
            head_cum=row[5], head_compact_cum=row[6], system=json.loads(row[7]) if row[7] else None,
            created_at=row[8], updated_at=row[9], summary_version=row[10],
        )

    async def matched_prefix(self, session: SessionState, hashes: Sequence[str]) -> int:
        best = -1
        for i in range(0, len(hashes), _CHUNK):
            chunk = list(hashes[i : i + _CHUNK])
            sql = QUERIES["matched_prefix"].format(marks=",".join("?" * len(chunk)))
            row = await self._one(sql, (session.pk, *chunk), lookup=True)
            if row is not None and row[0] is not None:
                best = max(best, int(row[0]))
        return best + 1

    async def totals_at(self, session: SessionState, seq: int) -> Totals:
        if seq >= session.length:
            return Totals(session.head_cum, session.head_compact_cum)
        row = await self._one(QUERIES["totals_at"], (session.pk, seq), lookup=True)
        if row is None:
            raise LookupError(f"no active message at position {seq}")
        return Totals(int(row[0]), int(row[1]))

    async def user_positions(self, session: SessionState, before: int, limit: int) -> list[int]:
        rows = await self._fetch(QUERIES["user_positions"], (session.pk, before, limit), lookup=True)
        return [int(row[0]) for row in rows]

    async def snapshot(self, session: SessionState, base: int, whole_last_unit: bool, room: int) -> Snapshot:
        base_totals = await self.totals_at(session, base)  # no trip unless `base` is before the head
        if base_totals.full <= room:
            # The whole history fits as stored (most sessions): read it, and find the marks in it.
            messages = await self.active_range(session, 0, base)
            last_unit = next((m.seq for m in reversed(messages) if m.unit_start), None)
            last_user = next((m.seq for m in reversed(messages) if m.body.get("role") == "user"), None)
            must_start = base if not whole_last_unit or last_unit is None else last_unit
            start = 0
        else:
            marks = await self._one(QUERIES["snapshot_marks"], (
                session.pk, base, session.pk, base, session.pk, base_totals.full - room,
                session.pk, base_totals.compact - room), lookup=True)
            assert marks is not None  # scalar subqueries: always one row
            last_unit, last_user, fits, fits_compact = (None if v is None else int(v) for v in marks)
            must_start = base if not whole_last_unit or last_unit is None else last_unit
            # A unit start before both of the first that fit costs more than `room` either way.
            start = min(must_start, base if fits is None else fits, base if fits_compact is None else fits_compact)
            messages = await self.active_range(session, start, base)
        summary, summary_totals = None, None
        if session.summary_version:  # a session never summarised needs no summary query
            row = await self._one(QUERIES["snapshot_summary"], (session.pk, must_start), lookup=True)
            if row is not None:
                summary, summary_totals = _summary(row), Totals(int(row[8]), int(row[9]))
        return Snapshot(base=base, base_totals=base_totals, must_start=must_start, last_user=last_user,
                        summary=summary, summary_totals=summary_totals, start=start, messages=messages)

    async def active_range(self, session: SessionState, start: int, stop: int) -> list[StoredMessage]:
        if start >= stop:
            return []
        rows = await self._fetch(QUERIES["active_range"], (session.pk, start, stop),
                                 lookup=stop - start <= _LOOKUP_ROWS)
        return [
            StoredMessage(seq=r[0], body=json.loads(r[1]), tokens=r[2], cum_before=r[3],
                          unit_start=bool(r[4]), chain_hash=r[5],
                          compact_body=json.loads(r[6]) if r[6] else None, compact_tokens=r[7],
                          compact_cum_before=r[8])
            for r in rows
        ]

    async def current_summary(self, session: SessionState, upto: int) -> Summary | None:
        row = await self._one(QUERIES["current_summary"], (session.pk, upto), lookup=True)
        return None if row is None else _summary(row)

    async def summary_history(self, session: SessionState) -> list[Summary]:
        rows = await self._fetch(
            f"SELECT {_SUMMARY_COLUMNS} FROM summaries WHERE session_pk = ? ORDER BY version", (session.pk,))
        return [_summary(row) for row in rows]

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
        for i in range(0, len(pks), _CHUNK):
            chunk = pks[i : i + _CHUNK]
            marks = ",".join("?" * len(chunk))
            yield (f"INSERT INTO tenant_usage (tenant, {_USAGE_COLUMNS}) SELECT s.tenant, {_USAGE_SUMS}"
                   f" FROM sessions s LEFT JOIN turns t ON t.session_pk = s.pk WHERE s.pk IN ({marks})"
                   f" GROUP BY s.tenant {_ADD_TO_ROLLUP}", chunk)
            yield f"DELETE FROM sessions WHERE pk IN ({marks})", chunk
        return len(pks)

    def _new_session(self, tenant: str, session_id: str) -> Script[Row]:
        """A session record with nothing in it yet, locked like `_locked`'s row. If another writer
        creates it meanwhile (PostgreSQL waits for theirs to commit), theirs is the one."""
        now = time.time()
        created = yield ("INSERT INTO sessions (tenant, session_id, created_at, updated_at) VALUES (?, ?, ?, ?)"
                         " ON CONFLICT (tenant, session_id) DO NOTHING"
                         " RETURNING pk, length, head_hash, head_cum, head_compact_cum",
                         (tenant, session_id, now, now))
        row = created[0] if created else (yield from self._locked(tenant, session_id))
        if row is None:
            raise StoreConflict("the session was deleted while it was being written; retry")
        return row

    async def _write_one(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        """One statement in a write of its own; the rows it returns."""
        return await self._db.write(_statement(sql, params))

    async def record_turn(self, turn: TurnRecord) -> None:
        started = time.perf_counter()
        try:
            await self._db.write(self._record_turn(turn, time.time()))
        finally:
            charge_store(started)

    def _record_turn(self, turn: TurnRecord, now: float) -> Script[None]:
        """A turn in as few statements as it takes (each is a round trip on PostgreSQL). Usually the
        session is where the turn was planned, and one statement both checks that and moves its row to
        the new head (a new session: inserts it with its head). Otherwise (the session moved
        meanwhile, was created by another writer, or idled past its TTL) its row is locked and read
        first, and the turn continues it, rebased (`_rebased`), or is refused."""
        placement = _placement(turn)
        pk = None
        if turn.expired_before is None:
            pk = yield from (self._insert_head(turn, placement[1], now) if turn.expected_length == 0
                             else self._move_head(turn, placement[1], now))
        if pk is None:
            row = yield from self._locked(turn.tenant, turn.session_id, turn.expired_before)
            if row is None:
                if turn.expected_length != 0:
                    raise StoreConflict("the session was deleted while this turn was in flight")
                row = yield from self._new_session(turn.tenant, turn.session_id)
            pk = int(row[0])
            if (row[1], row[2]) != (turn.expected_length, turn.expected_head_hash):
                turn = yield from self._rebased(turn, pk, row)
                placement = _placement(turn)
            yield from self._move_head(turn, placement[1], now, pk)
        if turn.base < turn.expected_length:
            yield QUERIES["supersede"], (pk, turn.base)
        [(turn_id,)] = yield (
            f"INSERT INTO turns (session_pk, {_TURN_COLUMNS}) VALUES (?, {_marks(_TURN_COLUMNS)}) RETURNING id",
            (pk, now, _text_in(turn.model), turn.kind, turn.context_tokens, turn.usage.prompt_tokens,
             turn.usage.completion_tokens, turn.latency_ms, turn.cost, turn.full_tokens,
             *_sent_values(turn.sent)))
        parent_id = None  # the first message's parent, the message before `base`, is looked up in its insert
        for message, (seq, cum, compact_tokens, compact_cum) in zip(turn.messages, placement[0]):
            [(parent_id,)] = yield (
                "INSERT INTO messages (session_pk, turn_id, parent_id, seq, role, body, tokens,"
                " cum_before, unit_start, chain_hash, created_at, compact_body, compact_tokens,"
                f" compact_cum_before) VALUES (?, ?, coalesce(?, ({QUERIES['message_id']})),"
                " ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING id",
                (pk, turn_id, parent_id, pk, turn.base - 1, seq, message.body.get("role"),
                 _dumps(message.body), message.tokens, cum, int(message.unit_start), message.chain_hash, now,
                 None if message.compact_body is None else _dumps(message.compact_body),
                 compact_tokens, compact_cum))

    def _insert_head(self, turn: TurnRecord, head: Head, now: float) -> Script[int | None]:
        """A new session inserted with the turn's head; None if one exists already."""
        created = yield (
            "INSERT INTO sessions (tenant, session_id, created_at, updated_at, length, head_hash, head_cum,"
            " head_compact_cum, system_prompt, title) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT (tenant, session_id) DO NOTHING RETURNING pk",
            (turn.tenant, turn.session_id, now, now, *head, _dumps(turn.system) if turn.system else None,
             _text_in(turn.title)))
        return int(created[0][0]) if created else None

    def _move_head(self, turn: TurnRecord, head: Head, now: float, pk: int | None = None) -> Script[int | None]:
        """The session's row moved to `head` (length, hash, running totals), with the turn's system
        prompt and title: the row `pk` (locked already), or without one, the session
        only if it is still where the turn was planned (the statement checks it, and on PostgreSQL
        locks it). The session's key, or None if it had moved."""
        where, params = ("pk = ?", [pk]) if pk is not None else (
            "tenant = ? AND session_id = ? AND length = ? AND head_hash = ?",
            [turn.tenant, turn.session_id, turn.expected_length, turn.expected_head_hash])
        moved = yield (
            "UPDATE sessions SET length = ?, head_hash = ?, head_cum = ?, head_compact_cum = ?,"
            " updated_at = ?, system_prompt = coalesce(?, system_prompt),"
            f" title = coalesce(title, ?) WHERE {where} RETURNING pk",
            (*head, now, _dumps(turn.system) if turn.system else None, _text_in(turn.title), *params))
        return int(moved[0][0]) if moved else None

    def _rebased(self, turn: TurnRecord, pk: int, head: Row) -> Script[TurnRecord]:
        """A turn planned on a history that another writer has since extended. If it only continued
        that history (and what it continued is still there), it goes after the other writer's turn,
        its chained hashes and running totals recomputed on the new head: overlapping turns on one
        session are all kept, however many replicas race. An edit or regenerate is refused instead:
        the point it forked from may be gone."""
        _, length, head_hash, head_cum, head_compact_cum = head
        if turn.base != turn.expected_length or length < turn.base:
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

    async def record_summary_call(self, session: SessionState, call: SummaryCall) -> None:
        await self._write_one(
            "INSERT INTO turns (session_pk, created_at, model, kind, context_tokens, prompt_tokens,"
            " completion_tokens, latency_ms, cost, full_tokens)"
            " SELECT pk, ?, ?, 'summary', ?, ?, ?, ?, ?, 0 FROM sessions WHERE pk = ?",
            (time.time(), _text_in(call.model), call.context_tokens, call.usage.prompt_tokens,
             call.usage.completion_tokens, call.latency_ms, call.cost, session.pk))

    async def save_summary(self, session: SessionState, expected_version: int, summary: Summary) -> None:
        await self._db.write(self._save_summary(session, expected_version, summary, time.time()))

    def _save_summary(self, session: SessionState, expected_version: int, summary: Summary,
                      now: float) -> Script[None]:
        yield from self._locked(session.tenant, session.session_id)
        [(version,)] = yield "SELECT coalesce(max(version), 0) FROM summaries WHERE session_pk = ?", (session.pk,)
        if version != expected_version:
            raise StoreConflict("another summary of this session was saved meanwhile")
        covered = yield ("SELECT 1 FROM messages WHERE session_pk = ? AND active = 1 AND seq = ? AND chain_hash = ?",
                         (session.pk, summary.covers - 1, summary.covers_hash))
        if not covered:
            raise StoreConflict("the history this summary covers has changed since it was read")
        yield ("INSERT INTO summaries (session_pk, version, text, covers, covers_hash, tokens, replaced_tokens,"
               " model, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
               (session.pk, expected_version + 1, _text_in(summary.text), summary.covers, summary.covers_hash,
                summary.tokens, summary.replaced_tokens, _text_in(summary.model), now))
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

    # --- managing sessions ---------------------------------------------------------------------

    async def list_sessions(
        self, tenant: str | None, limit: int, before: tuple[float, str, str] | None = None
    ) -> tuple[list[SessionInfo], tuple[float, str, str] | None]:
        """Ordered by `(updated_at, pk)`, which the activity indexes serve; the cursor names the last
        session listed instead of its pk (a store-wide counter would tell any tenant how many
        sessions every tenant creates), and the pk is looked up again here. A cursor whose session
        was deleted meanwhile resumes after its time: sessions sharing that exact time may be
        listed twice, none is skipped."""
        where = ["(CAST(? AS TEXT) IS NULL OR tenant = ?)"]
        params: list[Any] = [tenant, tenant]
        if before is not None:
            updated_at, cursor_tenant, cursor_id = before
            where.append("(updated_at, pk) < (?, coalesce((SELECT c.pk FROM sessions c"
                         " WHERE c.tenant = ? AND c.session_id = ?), 9223372036854775807))")
            params.extend((updated_at, cursor_tenant, cursor_id))
        rows = await self._infos(" AND ".join(where), params, limit + 1)
        page = [info for info, _ in rows[:limit]]
        last = page[-1] if len(rows) > limit else None
        return page, None if last is None else (last.updated_at, last.tenant, last.session_id)

    async def session_info(self, session: SessionState) -> SessionInfo:
        [(info, _)] = await self._infos("pk = ?", [session.pk], 1)
        return info

    async def _infos(self, where: str, params: list[Any], limit: int) -> list[tuple[SessionInfo, int]]:
        columns = "pk, tenant, session_id, title, created_at, updated_at, length, head_cum"
        rows = await self._fetch(
            f"WITH page AS (SELECT {columns} FROM sessions WHERE {where}"
            " ORDER BY updated_at DESC, pk DESC LIMIT ?)"
            f" SELECT page.*, {_CHAT_TURNS}, coalesce(sum(t.prompt_tokens), 0),"
            " coalesce(sum(t.completion_tokens), 0), sum(t.cost),"
            " coalesce(sum(coalesce(t.full_tokens, t.context_tokens) - t.context_tokens), 0),"
            " (SELECT coalesce(max(version), 0) FROM summaries WHERE session_pk = page.pk)"
            " FROM page LEFT JOIN turns t ON t.session_pk = page.pk"
            f" GROUP BY {', '.join('page.' + c for c in columns.split(', '))}"
            " ORDER BY page.updated_at DESC, page.pk DESC",
            (*params, limit))
        return [
            (SessionInfo(tenant=r[1], session_id=r[2], title=_text_out(r[3]), created_at=r[4], updated_at=r[5],
                         messages=r[6], tokens_stored=r[7], turns=int(r[8]), prompt_tokens=int(r[9]),
                         completion_tokens=int(r[10]), cost=None if r[11] is None else float(r[11]),
                         tokens_saved=int(r[12]), summary_version=int(r[13])),
             int(r[0]))
            for r in rows
        ]

    async def all_messages(self, session: SessionState) -> list[MessageRecord]:
        rows = await self._fetch(
            "SELECT id, seq, active, parent_id, role, body, tokens, created_at FROM messages"
            " WHERE session_pk = ? ORDER BY id", (session.pk,))
        return [MessageRecord(id=r[0], seq=r[1], active=bool(r[2]), parent_id=r[3], role=r[4],
                              body=json.loads(r[5]), tokens=r[6], created_at=r[7]) for r in rows]

    async def turns(self, session: SessionState) -> list[TurnInfo]:
        rows = await self._fetch(
            "SELECT t.kind, t.model, t.created_at, t.context_tokens, t.prompt_tokens, t.completion_tokens,"
            f" t.cost, min(m.seq), count(m.id), {', '.join('t.' + c for c in _SENT_COLUMNS.split(', '))}"
            " FROM turns t LEFT JOIN messages m ON m.turn_id = t.id WHERE t.session_pk = ?"
            " GROUP BY t.id ORDER BY t.id",
            (session.pk,))
        return [TurnInfo(kind=r[0], model=_text_out(r[1]), created_at=r[2], context_tokens=r[3], prompt_tokens=r[4],
                         completion_tokens=r[5], cost=r[6], stored_from=r[7], stored_messages=int(r[8]),
                         sent=_sent(r[9:]))
                for r in rows]

    async def delete_session(self, session: SessionState) -> None:
        await self._db.write(self._forget("pk = ?", (session.pk,)))

    async def delete_tenant(self, tenant: str) -> int:
        return await self._db.write(self._forget("tenant = ?", (tenant,)))

    async def prune(self, older_than: float, tenant: str | None = None) -> int:
        return await self._db.write(self._forget(
            "updated_at < ? AND (CAST(? AS TEXT) IS NULL OR tenant = ?)", (older_than, tenant, tenant)))

    async def clear_session(self, session: SessionState, expired_before: float | None = None) -> bool:
        return await self._db.write(self._clear(session.tenant, session.session_id, expired_before))

    def _clear(self, tenant: str, session_id: str, expired_before: float | None) -> Script[bool]:
        row = yield from self._locked(tenant, session_id, expired_before)
        if row is None:
            return False
        yield "UPDATE messages SET active = 0 WHERE session_pk = ? AND active = 1", (row[0],)
        yield ("UPDATE sessions SET length = 0, head_hash = '', head_cum = 0, head_compact_cum = 0,"
               " system_prompt = NULL, updated_at = ? WHERE pk = ?", (time.time(), row[0]))
        return True

    async def get_metadata(self, session: SessionState) -> Any:
        row = await self._one("SELECT metadata FROM sessions WHERE pk = ?", (session.pk,))
        return json.loads(row[0]) if row and row[0] else {}

    async def set_metadata(
        self, tenant: str, session_id: str, metadata: dict[str, Any], expired_before: float | None = None
    ) -> None:
        await self._db.write(self._write_metadata(tenant, session_id, metadata, False, expired_before))

    async def merge_metadata(
        self, tenant: str, session_id: str, changes: dict[str, Any], expired_before: float | None = None
    ) -> dict[str, Any] | None:
        return await self._db.write(self._write_metadata(tenant, session_id, changes, True, expired_before))

    def _write_metadata(
        self, tenant: str, session_id: str, given: dict[str, Any], merge: bool, expired_before: float | None
    ) -> Script[dict[str, Any] | None]:
        """Replace (creating the session if needed) or merge, under the row lock: a merge reads the
        metadata it merges into in the same transaction that writes the result."""
        row = yield from self._locked(tenant, session_id, expired_before)
        if row is None:
            if merge:
                return None
            row = yield from self._new_session(tenant, session_id)
        metadata = dict(given)
        if merge:
            [(stored,)] = yield "SELECT metadata FROM sessions WHERE pk = ?", (row[0],)
            metadata = json.loads(stored) if stored else {}
            for key, value in given.items():
                if value is None:
                    metadata.pop(key, None)
                else:
                    metadata[key] = value
        yield "UPDATE sessions SET metadata = ?, updated_at = ? WHERE pk = ?", (_dumps(metadata), time.time(), row[0])
        return metadata

    async def usage(self, tenant: str | None) -> UsageTotals:
        return await self._usage(
            f"SELECT {_USAGE_SUMS} FROM sessions s LEFT JOIN turns t ON t.session_pk = s.pk"
            " WHERE (CAST(? AS TEXT) IS NULL OR s.tenant = ?)", tenant)

    async def deleted_usage(self, tenant: str | None) -> UsageTotals:
        return await self._usage(
            f"SELECT {_ROLLUP_SUMS} FROM tenant_usage WHERE (CAST(? AS TEXT) IS NULL OR tenant = ?)", tenant)

    async def _usage(self, sql: str, tenant: str | None) -> UsageTotals:
        row = await self._one(sql, (tenant, tenant))
        assert row is not None
        return _usage_totals(row)

    async def tenant_rollups(self) -> dict[str, UsageTotals]:
        rows = await self._fetch(f"SELECT tenant, {_USAGE_COLUMNS} FROM tenant_usage ORDER BY tenant")
        return {row[0]: _usage_totals(row[1:]) for row in rows}

    async def add_to_rollup(self, tenant: str, usage: UsageTotals) -> None:
        await self._write_one(
            f"INSERT INTO tenant_usage (tenant, {_USAGE_COLUMNS}) VALUES (?, {_marks(_USAGE_COLUMNS)}) {_ADD_TO_ROLLUP}",
            (tenant, usage.sessions, usage.turns, usage.summary_calls, usage.prompt_tokens,
             usage.completion_tokens, usage.cost, usage.context_tokens, usage.full_tokens))

    async def export_session(self, session: SessionState) -> list[dict[str, Any]]:
        head = await self._one(f"SELECT {_SESSION_COLUMNS} FROM sessions WHERE pk = ?", (session.pk,))
        assert head is not None
        records: list[dict[str, Any]] = [{"type": "session", "format": 1, "session_id": session.session_id,
                                          **_record(_SESSION_COLUMNS, head)}]
        turn_ids: dict[int, int] = {}
        for row in await self._fetch(
                f"SELECT id, {_TURN_COLUMNS} FROM turns WHERE session_pk = ? ORDER BY id", (session.pk,)):
            turn_ids[row[0]] = len(turn_ids) + 1
            records.append({"type": "turn", "id": turn_ids[row[0]], **_record(_TURN_COLUMNS, row[1:])})
        message_ids: dict[int, int] = {}
        for row in await self._fetch(
                f"SELECT id, turn_id, parent_id, {_MESSAGE_COLUMNS} FROM messages WHERE session_pk = ?"
                " ORDER BY id", (session.pk,)):
            message_ids[row[0]] = len(message_ids) + 1
            records.append({"type": "message", "id": message_ids[row[0]], "turn": turn_ids[row[1]],
                            "parent": message_ids.get(row[2]) if row[2] is not None else None,
                            **_record(_MESSAGE_COLUMNS, row[3:])})
        for row in await self._fetch(
                f"SELECT {_SUMMARY_COLUMNS} FROM summaries WHERE session_pk = ? ORDER BY version", (session.pk,)):
            records.append({"type": "summary", **_record(_SUMMARY_COLUMNS, row)})
        return records

    async def import_session(self, tenant: str, session_id: str, records: Sequence[dict[str, Any]]) -> None:
        await self._db.write(self._import_session(tenant, session_id, records))

    def _import_session(self, tenant: str, session_id: str, records: Sequence[dict[str, Any]]) -> Script[None]:
        [head] = [r for r in records if r["type"] == "session"]
        created = yield (f"INSERT INTO sessions (tenant, session_id, {_SESSION_COLUMNS})"
                         f" VALUES (?, ?, {_marks(_SESSION_COLUMNS)}) ON CONFLICT (tenant, session_id) DO NOTHING"
                         " RETURNING pk", (tenant, session_id, *_values(_SESSION_COLUMNS, head)))
        if not created:
            raise StoreConflict(f"a session '{session_id}' already exists")
        pk = created[0][0]
        turn_ids: dict[int, int] = {}
        for record in (r for r in records if r["type"] == "turn"):
            [(turn_ids[record["id"]],)] = yield (
                f"INSERT INTO turns (session_pk, {_TURN_COLUMNS}) VALUES (?, {_marks(_TURN_COLUMNS)}) RETURNING id",
                (pk, *_values(_TURN_COLUMNS, record)))
        message_ids: dict[int, int] = {}
        for record in (r for r in records if r["type"] == "message"):
            parent = message_ids[record["parent"]] if record.get("parent") is not None else None
            [(message_ids[record["id"]],)] = yield (
                f"INSERT INTO messages (session_pk, turn_id, parent_id, {_MESSAGE_COLUMNS})"
                f" VALUES (?, ?, ?, {_marks(_MESSAGE_COLUMNS)}) RETURNING id",
                (pk, turn_ids[record["turn"]], parent, *_values(_MESSAGE_COLUMNS, record)))
        for record in (r for r in records if r["type"] == "summary"):
            yield (f"INSERT INTO summaries (session_pk, {_SUMMARY_COLUMNS}) VALUES (?, {_marks(_SUMMARY_COLUMNS)})",
                   (pk, *_values(_SUMMARY_COLUMNS, record)))
        yield ("UPDATE sessions SET summary_version = (SELECT coalesce(max(version), 0) FROM summaries"
               " WHERE session_pk = ?) WHERE pk = ?", (pk, pk))

    async def cap_messages(self, session: SessionState, keep: int) -> int:
        return await self._db.write(self._cap_messages(session, keep))

    def _cap_messages(self, session: SessionState, keep: int) -> Script[int]:
        locked = yield from self._locked(session.tenant, session.session_id)
        if locked is None or locked[0] != session.pk:
            return 0
        # The summary in use is read under the lock: read before it, an edit recorded meanwhile
        # could make it stale and its `covers` would reach into the new branch, still to be sent.
        summary = yield QUERIES["current_summary"], (session.pk, locked[1])
        covers = _summary(summary[0]).covers if summary else 0
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

    async def last_model(self, session: SessionState) -> str | None:
        row = await self._one("SELECT model FROM turns WHERE session_pk = ? AND kind NOT IN ('summary', 'fork')"
                              " ORDER BY id DESC LIMIT 1", (session.pk,))
        return None if row is None else _text_out(str(row[0]))

    async def tenants_sessions(self) -> list[tuple[str, str]]:
        """Every (tenant, session id), for copying a whole store."""
        rows = await self._fetch("SELECT tenant, session_id FROM sessions ORDER BY pk")
        return [(r[0], r[1]) for r in rows]


Head = tuple[int, str, int, int]  # a session's length, head hash and running totals (full, compact)


def _placement(turn: TurnRecord) -> tuple[list[tuple[int, int, int, int]], Head]:
    """Where each of the turn's messages goes (seq, running total before it, its compact tokens and
    compact running total), and the session's head after them (length, hash, running totals)."""
    seq, head_hash = turn.base, turn.base_hash
    cum, compact_cum = turn.base_totals.full, turn.base_totals.compact
    placed = []
    for message in turn.messages:
        compact_tokens = message.tokens if message.compact_tokens is None else message.compact_tokens
        placed.append((seq, cum, compact_tokens, compact_cum))
        seq, head_hash = seq + 1, message.chain_hash
        cum, compact_cum = cum + message.tokens, compact_cum + compact_tokens
    return placed, (seq, head_hash, cum, compact_cum)


def _statement(sql: str, params: Sequence[Any]) -> Script[list[Row]]:
    rows = yield sql, params
    return rows


def _marks(columns: str) -> str:
    return ", ".join("?" * len(columns.split(", ")))


def _record(columns: str, row: Row) -> dict[str, Any]:
    """A table row as an export record: JSON columns decoded, so the export is plain JSON."""
    out = {}
    for name, value in zip(columns.split(", "), row):
        if name in _JSON_COLUMNS and value is not None:
            value = json.loads(value)
        elif name in _TEXT_COLUMNS:
            value = _text_out(value)
        out[name] = value
    return out


def _values(columns: str, record: dict[str, Any]) -> list[Any]:
    values = []
    for name in columns.split(", "):
        value = record.get(name)
        if name in _JSON_COLUMNS and value is not None:
            value = _dumps(value)
        elif name in _TEXT_COLUMNS and isinstance(value, str):
            value = _text_in(value)
        values.append(value)
    return values


def _summary(row: Row) -> Summary:
    return Summary(version=row[0], text=_text_out(row[1]), covers=row[2], covers_hash=row[3], tokens=row[4],
                   replaced_tokens=row[5], model=_text_out(row[6]), created_at=row[7])


def _usage_totals(row: Row) -> UsageTotals:
    """`_USAGE_COLUMNS` (summed: PostgreSQL's sums may be decimals) as totals."""
    return UsageTotals(sessions=int(row[0]), turns=int(row[1]), summary_calls=int(row[2]),
                       prompt_tokens=int(row[3]), completion_tokens=int(row[4]),
                       cost=None if row[5] is None else float(row[5]), context_tokens=int(row[6]),
                       full_tokens=int(row[7]))


def _sent_values(sent: SentContext | None) -> list[int | None]:
    """A `SentContext` as `_SENT_COLUMNS` store it (nulls for a turn that is not a chat turn)."""
    if sent is None:
        return [None] * len(_SENT_COLUMNS.split(", "))
    return [sent.summary_version, sent.first_sent, sent.included, sent.omitted, sent.unsummarised_omitted,
            int(sent.marker), sent.trimmed, sent.deduplicated]  # not `astuple`: it deep-copies, 0.1 ms a turn


def _sent(row: Row) -> SentContext | None:
    """`_SENT_COLUMNS` as stored: null for turns that are not chat turns, or were recorded before
    turns kept this."""
    if row[0] is None:
        return None
    return SentContext(summary_version=row[0], first_sent=row[1], included=row[2], omitted=row[3],
                       unsummarised_omitted=row[4], marker=bool(row[5]), trimmed=row[6], deduplicated=row[7])


def _dumps(value: Any) -> str:
    """JSON text that every database can store: control characters are escaped by `json.dumps`
    itself; a value with a lone surrogate (which no UTF-8 encoder takes) has all non-ASCII escaped.
    ASCII text, the common case, is checked in one pass; other text is encoded once to find out."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    if not text.isascii() and not _encodable(text):
        return json.dumps(value, ensure_ascii=True, separators=(",", ":"))
    return text


# Starts a free text stored as its JSON string: an ESC and a tag no text written before could
# plausibly start with.
_ESCAPED = "\x1bmemproxy-json:"


@overload
def _text_in(text: str) -> str: ...
@overload
def _text_in(text: None) -> None: ...
def _text_in(text: str | None) -> str | None:
    """Free text as a text column stores it: as it is, or escaped where a database could not hold
    it (a NUL, a lone surrogate) or it would read back as escaped."""
    if text is None or ("\x00" not in text and not text.startswith(_ESCAPED) and _encodable(text)):
        return text
    return _ESCAPED + json.dumps(text, ensure_ascii=True)


@overload
def _text_out(stored: str) -> str: ...
@overload
def _text_out(stored: None) -> None: ...
def _text_out(stored: str | None) -> str | None:
    if stored is None or not stored.startswith(_ESCAPED):
        return stored
    try:
        text = json.loads(stored[len(_ESCAPED):])
    except ValueError:  # never written by `_text_in`: a text that happens to start so
        return stored
    return text if isinstance(text, str) else stored


def _encodable(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True
