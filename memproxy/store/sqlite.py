"""The embedded default store: one SQLite file in WAL mode.

Two connections: reads go to one and see only committed data; every write is one `BEGIN IMMEDIATE`
transaction on the other, behind a lock, so a reader never sees half a turn and another process
(the CLI, a second server) waits on the busy timeout instead of failing.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from importlib import resources
from pathlib import Path
from typing import Any

import aiosqlite

from ..errors import Conflict
from .base import (
    MessageRecord,
    SessionInfo,
    SessionState,
    StoredMessage,
    Summary,
    Totals,
    TurnRecord,
    UsageTotals,
)

_HASH_CHUNK = 500

# The queries that serve a turn; each is answered from an index (tests/test_store_contract.py checks
# the plans), so their cost does not grow with the length of a session's history.
QUERIES = {
    "get_session": "SELECT pk, tenant, session_id, length, head_hash, head_cum, head_compact_cum,"
    " system_prompt, history_mode, created_at, updated_at FROM sessions"
    " WHERE tenant = ? AND session_id = ?",
    "matched_prefix": "SELECT max(seq) FROM messages WHERE session_pk = ? AND active = 1"
    " AND chain_hash IN ({marks})",
    "totals_at": "SELECT cum_before, compact_cum_before FROM messages"
    " WHERE session_pk = ? AND active = 1 AND seq = ?",
    # Walks back from `seq` through one unit's tool results at most.
    "last_unit_start": "SELECT seq FROM messages WHERE session_pk = ? AND active = 1"
    " AND unit_start = 1 AND seq < ? ORDER BY seq DESC LIMIT 1",
    "user_positions": "SELECT seq FROM messages WHERE session_pk = ? AND active = 1 AND role = 'user'"
    " AND seq < ? ORDER BY seq DESC LIMIT ?",
    "first_fitting_unit_start": "SELECT seq FROM messages WHERE session_pk = ? AND active = 1"
    " AND unit_start = 1 AND cum_before >= ? AND seq >= ? ORDER BY cum_before LIMIT 1",
    "first_fitting_compact_unit_start": "SELECT seq FROM messages WHERE session_pk = ? AND active = 1"
    " AND unit_start = 1 AND compact_cum_before >= ? AND seq >= ? ORDER BY compact_cum_before LIMIT 1",
    "active_range": "SELECT seq, body, tokens, cum_before, unit_start, chain_hash, compact_body,"
    " compact_tokens, compact_cum_before FROM messages"
    " WHERE session_pk = ? AND active = 1 AND seq >= ? AND seq < ? ORDER BY seq",
    "current_summary": "SELECT s.version, s.text, s.covers, s.covers_hash, s.tokens, s.replaced_tokens,"
    " s.model, s.created_at FROM summaries s JOIN messages m ON m.session_pk = s.session_pk"
    " AND m.active = 1 AND m.seq = s.covers - 1 AND m.chain_hash = s.covers_hash"
    " WHERE s.session_pk = ? AND s.covers <= ? ORDER BY s.version DESC LIMIT 1",
    "message_id": "SELECT id FROM messages WHERE session_pk = ? AND active = 1 AND seq = ?",
    "supersede": "UPDATE messages SET active = 0 WHERE session_pk = ? AND active = 1 AND seq >= ?",
}


def sqlite_path(url: str) -> str:
    """`sqlite:///relative.db`, `sqlite:////abs/path.db` or `sqlite:///:memory:` to a path."""
    if not url.startswith("sqlite:///"):
        raise ValueError(f"not a sqlite URL: {url!r}")
    return url[len("sqlite:///"):]


def migrations() -> list[tuple[str, str]]:
    folder = resources.files("memproxy.store") / "migrations" / "sqlite"
    files = sorted((f for f in folder.iterdir() if f.name.endswith(".sql")), key=lambda f: f.name)
    return [(f.name.removesuffix(".sql"), f.read_text(encoding="utf-8")) for f in files]


async def _connect(path: str, busy_timeout_ms: int) -> aiosqlite.Connection:
    conn = await aiosqlite.connect(path, isolation_level=None)
    await conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
    await conn.execute("PRAGMA foreign_keys = ON")
    await conn.execute("PRAGMA synchronous = NORMAL")
    return conn


class SQLiteStore:
    def __init__(self, reader: aiosqlite.Connection, writer: aiosqlite.Connection) -> None:
        self._reader = reader
        self._writer = writer
        self._write_lock = asyncio.Lock()

    @classmethod
    async def open(cls, url: str, busy_timeout_ms: int = 5000) -> SQLiteStore:
        path = sqlite_path(url)
        if path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        writer = await _connect(path, busy_timeout_ms)
        await writer.execute("PRAGMA journal_mode = WAL")
        await _migrate(writer)
        reader = await _connect(path, busy_timeout_ms) if path != ":memory:" else writer
        return cls(reader, writer)

    async def close(self) -> None:
        if self._reader is not self._writer:
            await self._reader.close()
        await self._writer.close()

    async def ping(self) -> None:
        async with self._reader.execute("SELECT 1") as cur:
            await cur.fetchone()

    async def get_session(self, tenant: str, session_id: str) -> SessionState | None:
        async with self._reader.execute(QUERIES["get_session"], (tenant, session_id)) as cur:
            row = await cur.fetchone()
        if row is None:
            return None
        return SessionState(
            pk=row[0], tenant=row[1], session_id=row[2], length=row[3], head_hash=row[4],
            head_cum=row[5], head_compact_cum=row[6], system=json.loads(row[7]) if row[7] else None,
            history_mode=row[8], created_at=row[9], updated_at=row[10],
        )

    async def matched_prefix(self, session: SessionState, hashes: Sequence[str]) -> int:
        best = -1
        for i in range(0, len(hashes), _HASH_CHUNK):
            chunk = list(hashes[i : i + _HASH_CHUNK])
            marks = ",".join("?" * len(chunk))
            async with self._reader.execute(
                QUERIES["matched_prefix"].format(marks=marks), (session.pk, *chunk),
            ) as cur:
                row = await cur.fetchone()
            if row is not None and row[0] is not None:
                best = max(best, int(row[0]))
        return best + 1

    async def totals_at(self, session: SessionState, seq: int) -> Totals:
        if seq >= session.length:
            return Totals(session.head_cum, session.head_compact_cum)
        async with self._reader.execute(QUERIES["totals_at"], (session.pk, seq)) as cur:
            row = await cur.fetchone()
        if row is None:
            raise LookupError(f"no active message at position {seq}")
        return Totals(int(row[0]), int(row[1]))

    async def last_unit_start(self, session: SessionState, before: int) -> int:
        async with self._reader.execute(
            QUERIES["last_unit_start"], (session.pk, before),
        ) as cur:
            row = await cur.fetchone()
        return before if row is None or row[0] is None else int(row[0])

    async def user_positions(self, session: SessionState, before: int, limit: int) -> list[int]:
        async with self._reader.execute(QUERIES["user_positions"], (session.pk, before, limit)) as cur:
            return [int(row[0]) for row in await cur.fetchall()]

    async def first_fitting_unit_start(
        self, session: SessionState, floor: int, min_cum_before: int, compact: bool = False
    ) -> int | None:
        query = QUERIES["first_fitting_compact_unit_start" if compact else "first_fitting_unit_start"]
        async with self._reader.execute(query, (session.pk, min_cum_before, floor)) as cur:
            row = await cur.fetchone()
        return None if row is None else int(row[0])

    async def active_range(self, session: SessionState, start: int, stop: int) -> list[StoredMessage]:
        if start >= stop:
            return []
        async with self._reader.execute(
            QUERIES["active_range"], (session.pk, start, stop),
        ) as cur:
            rows = await cur.fetchall()
        return [
            StoredMessage(seq=r[0], body=json.loads(r[1]), tokens=r[2], cum_before=r[3],
                          unit_start=bool(r[4]), chain_hash=r[5],
                          compact_body=json.loads(r[6]) if r[6] else None, compact_tokens=r[7],
                          compact_cum_before=r[8])
            for r in rows
        ]

    async def current_summary(self, session: SessionState, upto: int) -> Summary | None:
        async with self._reader.execute(QUERIES["current_summary"], (session.pk, upto)) as cur:
            row = await cur.fetchone()
        return None if row is None else _summary(row)

    async def summary_history(self, session: SessionState) -> list[Summary]:
        async with self._reader.execute(
            "SELECT version, text, covers, covers_hash, tokens, replaced_tokens, model, created_at"
            " FROM summaries WHERE session_pk = ? ORDER BY version", (session.pk,)
        ) as cur:
            return [_summary(row) for row in await cur.fetchall()]

    async def save_summary(self, session: SessionState, expected_version: int, summary: Summary) -> None:
        async with self._transaction():
            await self._save_summary(session, expected_version, summary)

    async def _save_summary(self, session: SessionState, expected_version: int, summary: Summary) -> None:
        db = self._writer
        async with db.execute(
            "SELECT coalesce(max(version), 0) FROM summaries WHERE session_pk = ?", (session.pk,)
        ) as cur:
            row = await cur.fetchone()
        if row is None or row[0] != expected_version:
            raise Conflict("another summary of this session was saved meanwhile")
        async with db.execute(
            "SELECT 1 FROM messages WHERE session_pk = ? AND active = 1 AND seq = ? AND chain_hash = ?",
            (session.pk, summary.covers - 1, summary.covers_hash),
        ) as cur:
            if await cur.fetchone() is None:
                raise Conflict("the history this summary covers has changed since it was read")
        await db.execute(
            "INSERT INTO summaries (session_pk, version, text, covers, covers_hash, tokens,"
            " replaced_tokens, model, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (session.pk, expected_version + 1, summary.text, summary.covers, summary.covers_hash,
             summary.tokens, summary.replaced_tokens, summary.model, time.time()),
        )

    @asynccontextmanager
    async def _transaction(self) -> AsyncIterator[aiosqlite.Connection]:
        """One write transaction on the writer connection; rolled back on any error."""
        async with self._write_lock:
            await self._writer.execute("BEGIN IMMEDIATE")
            try:
                yield self._writer
            except BaseException:
                await self._writer.execute("ROLLBACK")
                raise
            await self._writer.execute("COMMIT")

    async def record_turn(self, turn: TurnRecord) -> None:
        async with self._transaction():
            await self._record(turn)

    async def _record(self, turn: TurnRecord) -> None:
        db = self._writer
        now = time.time()
        async with db.execute(
            "SELECT pk, length, head_hash FROM sessions WHERE tenant = ? AND session_id = ?",
            (turn.tenant, turn.session_id),
        ) as cur:
            row = await cur.fetchone()
        if row is not None and turn.replaces_expired:
            await db.execute("DELETE FROM sessions WHERE pk = ?", (row[0],))
            row = None
        if row is None:
            if turn.expected_length != 0:
                raise Conflict("the session was deleted while this turn was in flight")
            async with db.execute(
                "INSERT INTO sessions (tenant, session_id, created_at, updated_at) VALUES (?, ?, ?, ?)",
                (turn.tenant, turn.session_id, now, now),
            ) as cur:
                pk = cur.lastrowid
        else:
            pk = row[0]
            if (row[1], row[2]) != (turn.expected_length, turn.expected_head_hash):
                raise Conflict("the session changed while this turn was in flight; retry it")
        assert pk is not None
        if turn.base < turn.expected_length:
            await db.execute(QUERIES["supersede"], (pk, turn.base))
        parent_id = await self._message_id(pk, turn.base - 1)
        async with db.execute(
            "INSERT INTO turns (session_pk, created_at, model, kind, context_tokens, prompt_tokens,"
            " completion_tokens, latency_ms, cost, full_tokens) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (pk, now, turn.model, turn.kind, turn.context_tokens, turn.usage.prompt_tokens,
             turn.usage.completion_tokens, turn.latency_ms, turn.cost, turn.full_tokens),
        ) as cur:
            turn_id = cur.lastrowid
        seq, head_hash = turn.base, turn.base_hash
        cum, compact_cum = turn.base_totals.full, turn.base_totals.compact
        for message in turn.messages:
            compact_tokens = message.tokens if message.compact_tokens is None else message.compact_tokens
            async with db.execute(
                "INSERT INTO messages (session_pk, turn_id, parent_id, seq, role, body, tokens,"
                " cum_before, unit_start, chain_hash, created_at, compact_body, compact_tokens,"
                " compact_cum_before) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (pk, turn_id, parent_id, seq, message.body.get("role"), _dumps(message.body),
                 message.tokens, cum, int(message.unit_start), message.chain_hash, now,
                 None if message.compact_body is None else _dumps(message.compact_body),
                 compact_tokens, compact_cum),
            ) as cur:
                parent_id = cur.lastrowid
            seq, head_hash = seq + 1, message.chain_hash
            cum, compact_cum = cum + message.tokens, compact_cum + compact_tokens
        await db.execute(
            "UPDATE sessions SET length = ?, head_hash = ?, head_cum = ?, head_compact_cum = ?,"
            " updated_at = ?, system_prompt = coalesce(?, system_prompt),"
            " history_mode = coalesce(?, history_mode), title = coalesce(title, ?) WHERE pk = ?",
            (seq, head_hash, cum, compact_cum, now, _dumps(turn.system) if turn.system else None,
             turn.history_mode, turn.title, pk),
        )

    # --- managing sessions ---------------------------------------------------------------------

    async def list_sessions(
        self, tenant: str | None, limit: int, before: tuple[float, int] | None = None
    ) -> tuple[list[SessionInfo], tuple[float, int] | None]:
        where = ["(? IS NULL OR tenant = ?)"]
        params: list[Any] = [tenant, tenant]
        if before is not None:
            where.append("(updated_at, pk) < (?, ?)")
            params.extend(before)
        rows = await self._infos(" AND ".join(where), params, limit + 1)
        page = [info for info, _ in rows[:limit]]
        cursor = (rows[limit - 1][0].updated_at, rows[limit - 1][1]) if len(rows) > limit else None
        return page, cursor

    async def session_info(self, session: SessionState) -> SessionInfo:
        [(info, _)] = await self._infos("pk = ?", [session.pk], 1)
        return info

    async def _infos(self, where: str, params: list[Any], limit: int) -> list[tuple[SessionInfo, int]]:
        async with self._reader.execute(
            f"WITH page AS (SELECT pk, tenant, session_id, title, created_at, updated_at, length, head_cum"
            f" FROM sessions WHERE {where} ORDER BY updated_at DESC, pk DESC LIMIT ?)"
            " SELECT page.*, count(t.id), coalesce(sum(t.prompt_tokens), 0),"
            " coalesce(sum(t.completion_tokens), 0), sum(t.cost),"
            " coalesce(sum(coalesce(t.full_tokens, t.context_tokens) - t.context_tokens), 0),"
            " (SELECT coalesce(max(version), 0) FROM summaries WHERE session_pk = page.pk)"
            " FROM page LEFT JOIN turns t ON t.session_pk = page.pk"
            " GROUP BY page.pk ORDER BY page.updated_at DESC, page.pk DESC",
            (*params, limit),
        ) as cur:
            rows = await cur.fetchall()
        return [
            (SessionInfo(tenant=r[1], session_id=r[2], title=r[3], created_at=r[4], updated_at=r[5],
                         messages=r[6], tokens_stored=r[7], turns=r[8], prompt_tokens=r[9],
                         completion_tokens=r[10], cost=r[11], tokens_saved=r[12], summary_version=r[13]),
             r[0])
            for r in rows
        ]

    async def all_messages(self, session: SessionState) -> list[MessageRecord]:
        async with self._reader.execute(
            "SELECT id, seq, active, parent_id, role, body, tokens, created_at FROM messages"
            " WHERE session_pk = ? ORDER BY id", (session.pk,)
        ) as cur:
            rows = await cur.fetchall()
        return [MessageRecord(id=r[0], seq=r[1], active=bool(r[2]), parent_id=r[3], role=r[4],
                              body=json.loads(r[5]), tokens=r[6], created_at=r[7]) for r in rows]

    async def delete_session(self, session: SessionState) -> None:
        async with self._transaction() as db:
            await db.execute("DELETE FROM sessions WHERE pk = ?", (session.pk,))

    async def clear_session(self, session: SessionState) -> None:
        async with self._transaction() as db:
            await db.execute("UPDATE messages SET active = 0 WHERE session_pk = ? AND active = 1", (session.pk,))
            await db.execute(
                "UPDATE sessions SET length = 0, head_hash = '', head_cum = 0, head_compact_cum = 0,"
                " system_prompt = NULL, history_mode = NULL, updated_at = ? WHERE pk = ?",
                (time.time(), session.pk),
            )

    async def get_metadata(self, session: SessionState) -> Any:
        async with self._reader.execute("SELECT metadata FROM sessions WHERE pk = ?", (session.pk,)) as cur:
            row = await cur.fetchone()
        return json.loads(row[0]) if row and row[0] else {}

    async def set_metadata(self, tenant: str, session_id: str, metadata: Any) -> None:
        now = time.time()
        async with self._transaction() as db:
            await db.execute(
                "INSERT INTO sessions (tenant, session_id, created_at, updated_at, metadata)"
                " VALUES (?, ?, ?, ?, ?) ON CONFLICT (tenant, session_id)"
                " DO UPDATE SET metadata = excluded.metadata, updated_at = excluded.updated_at",
                (tenant, session_id, now, now, _dumps(metadata)),
            )

    async def usage(self, tenant: str | None) -> UsageTotals:
        async with self._reader.execute(
            "SELECT count(DISTINCT s.pk), count(t.id), coalesce(sum(t.prompt_tokens), 0),"
            " coalesce(sum(t.completion_tokens), 0), sum(t.cost), coalesce(sum(t.context_tokens), 0),"
            " coalesce(sum(coalesce(t.full_tokens, t.context_tokens)), 0)"
            " FROM sessions s LEFT JOIN turns t ON t.session_pk = s.pk WHERE (? IS NULL OR s.tenant = ?)",
            (tenant, tenant),
        ) as cur:
            r = await cur.fetchone()
        assert r is not None
        return UsageTotals(sessions=r[0], turns=r[1], prompt_tokens=r[2], completion_tokens=r[3],
                           cost=r[4], context_tokens=r[5], full_tokens=r[6])

    async def export_session(self, session: SessionState) -> list[dict[str, Any]]:
        db = self._reader
        async with db.execute(f"SELECT {_SESSION_COLUMNS} FROM sessions WHERE pk = ?", (session.pk,)) as cur:
            row = await cur.fetchone()
        assert row is not None
        records: list[dict[str, Any]] = [{"type": "session", "format": 1, "session_id": session.session_id,
                                          **_record(_SESSION_COLUMNS, row)}]
        turn_ids: dict[int, int] = {}
        async with db.execute(f"SELECT id, {_TURN_COLUMNS} FROM turns WHERE session_pk = ? ORDER BY id",
                              (session.pk,)) as cur:
            for row in await cur.fetchall():
                turn_ids[row[0]] = len(turn_ids) + 1
                records.append({"type": "turn", "id": turn_ids[row[0]], **_record(_TURN_COLUMNS, row[1:])})
        message_ids: dict[int, int] = {}
        async with db.execute(
            f"SELECT id, turn_id, parent_id, {_MESSAGE_COLUMNS} FROM messages WHERE session_pk = ? ORDER BY id",
            (session.pk,),
        ) as cur:
            for row in await cur.fetchall():
                message_ids[row[0]] = len(message_ids) + 1
                records.append({"type": "message", "id": message_ids[row[0]], "turn": turn_ids[row[1]],
                                "parent": message_ids.get(row[2]) if row[2] is not None else None,
                                **_record(_MESSAGE_COLUMNS, row[3:])})
        async with db.execute(f"SELECT {_SUMMARY_COLUMNS} FROM summaries WHERE session_pk = ? ORDER BY version",
                              (session.pk,)) as cur:
            records.extend({"type": "summary", **_record(_SUMMARY_COLUMNS, row)} for row in await cur.fetchall())
        return records

    async def import_session(self, tenant: str, session_id: str, records: Sequence[dict[str, Any]]) -> None:
        async with self._transaction() as db:
            async with db.execute(
                "SELECT 1 FROM sessions WHERE tenant = ? AND session_id = ?", (tenant, session_id)
            ) as cur:
                if await cur.fetchone() is not None:
                    raise Conflict(f"a session '{session_id}' already exists")
            [head] = [r for r in records if r["type"] == "session"]
            columns = _SESSION_COLUMNS.split(", ")
            async with db.execute(
                f"INSERT INTO sessions (tenant, session_id, {_SESSION_COLUMNS})"
                f" VALUES (?, ?, {', '.join('?' * len(columns))})",
                (tenant, session_id, *_values(columns, head)),
            ) as cur:
                pk = cur.lastrowid
            turn_ids: dict[int, int | None] = {}
            for record in (r for r in records if r["type"] == "turn"):
                columns = _TURN_COLUMNS.split(", ")
                async with db.execute(
                    f"INSERT INTO turns (session_pk, {_TURN_COLUMNS}) VALUES (?, {', '.join('?' * len(columns))})",
                    (pk, *_values(columns, record)),
                ) as cur:
                    turn_ids[record["id"]] = cur.lastrowid
            message_ids: dict[int, int | None] = {}
            for record in (r for r in records if r["type"] == "message"):
                columns = _MESSAGE_COLUMNS.split(", ")
                parent = message_ids[record["parent"]] if record.get("parent") is not None else None
                async with db.execute(
                    f"INSERT INTO messages (session_pk, turn_id, parent_id, {_MESSAGE_COLUMNS})"
                    f" VALUES (?, ?, ?, {', '.join('?' * len(columns))})",
                    (pk, turn_ids[record["turn"]], parent, *_values(columns, record)),
                ) as cur:
                    message_ids[record["id"]] = cur.lastrowid
            for record in (r for r in records if r["type"] == "summary"):
                columns = _SUMMARY_COLUMNS.split(", ")
                await db.execute(
                    f"INSERT INTO summaries (session_pk, {_SUMMARY_COLUMNS}) VALUES (?, {', '.join('?' * len(columns))})",
                    (pk, *_values(columns, record)),
                )

    async def prune(self, older_than: float, tenant: str | None = None) -> int:
        async with self._transaction() as db:
            async with db.execute(
                "DELETE FROM sessions WHERE updated_at < ? AND (? IS NULL OR tenant = ?)",
                (older_than, tenant, tenant),
            ) as cur:
                return cur.rowcount

    async def cap_messages(self, session: SessionState, keep: int) -> int:
        summary = await self.current_summary(session, session.length)
        covers = summary.covers if summary else 0
        async with self._transaction() as db:
            async with db.execute("SELECT count(*) FROM messages WHERE session_pk = ?", (session.pk,)) as cur:
                row = await cur.fetchone()
            excess = (row[0] if row else 0) - keep
            if excess <= 0:
                return 0
            # Superseded messages first, then what the summary in use stands for (its last message
            # stays: it proves the summary still matches the history).
            async with db.execute(
                "SELECT id FROM messages WHERE session_pk = ? AND (active = 0 OR seq < ?)"
                " ORDER BY active, id LIMIT ?", (session.pk, covers - 1, excess),
            ) as cur:
                ids = [r[0] for r in await cur.fetchall()]
            marks = ",".join("?" * len(ids))
            await db.execute(f"UPDATE messages SET parent_id = NULL WHERE parent_id IN ({marks})", ids)
            await db.execute(f"DELETE FROM messages WHERE id IN ({marks})", ids)
            return len(ids)

    async def _message_id(self, pk: int, seq: int) -> int | None:
        if seq < 0:
            return None
        async with self._writer.execute(QUERIES["message_id"], (pk, seq)) as cur:
            row = await cur.fetchone()
        return None if row is None else int(row[0])


# The columns an export carries, as they are named in the tables and in the export records.
_SESSION_COLUMNS = ("created_at, updated_at, length, head_hash, head_cum, head_compact_cum, system_prompt,"
                    " history_mode, title, metadata")
_TURN_COLUMNS = ("created_at, model, kind, context_tokens, prompt_tokens, completion_tokens, latency_ms,"
                 " cost, full_tokens")
_MESSAGE_COLUMNS = ("seq, active, role, body, tokens, cum_before, unit_start, chain_hash, created_at,"
                    " compact_body, compact_tokens, compact_cum_before")
_SUMMARY_COLUMNS = "version, text, covers, covers_hash, tokens, replaced_tokens, model, created_at"
_JSON_COLUMNS = frozenset({"system_prompt", "metadata", "body", "compact_body"})


def _record(columns: str, row: Sequence[Any]) -> dict[str, Any]:
    """A table row as an export record: JSON columns decoded, so the export is plain JSON."""
    out = {}
    for name, value in zip(columns.split(", "), row):
        out[name] = json.loads(value) if name in _JSON_COLUMNS and value is not None else value
    return out


def _values(columns: list[str], record: dict[str, Any]) -> list[Any]:
    return [_dumps(record.get(c)) if c in _JSON_COLUMNS and record.get(c) is not None else record.get(c)
            for c in columns]


def _summary(row: Any) -> Summary:
    return Summary(version=row[0], text=row[1], covers=row[2], covers_hash=row[3], tokens=row[4],
                   replaced_tokens=row[5], model=row[6], created_at=row[7])


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


async def _migrate(db: aiosqlite.Connection) -> None:
    """Apply the numbered migrations not yet recorded, each in its own write transaction, so two
    processes starting on one file at once apply each migration exactly once."""
    await db.execute(
        "CREATE TABLE IF NOT EXISTS schema_migrations (id TEXT PRIMARY KEY, applied_at REAL NOT NULL)"
    )
    for migration_id, sql in migrations():
        await db.execute("BEGIN IMMEDIATE")
        try:
            async with db.execute("SELECT 1 FROM schema_migrations WHERE id = ?", (migration_id,)) as cur:
                done = await cur.fetchone() is not None
            if not done:
                for statement in _statements(sql):
                    await db.execute(statement)
                await db.execute(
                    "INSERT INTO schema_migrations (id, applied_at) VALUES (?, ?)",
                    (migration_id, time.time()),
                )
        except BaseException:
            await db.execute("ROLLBACK")
            raise
        await db.execute("COMMIT")


def _statements(sql: str) -> list[str]:
    lines = [line for line in sql.splitlines() if not line.strip().startswith("--")]
    return [s.strip() for s in "\n".join(lines).split(";") if s.strip()]
