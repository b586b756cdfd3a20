"""The SQL store's half that manages sessions (`AdminStore`): listing, showing, usage, metadata,
clearing and deleting, export and import, and copying rollups between stores."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from ..base import (EndpointUsage, MessageRecord, SessionInfo, SessionState, StoredCounts, Summary, TurnInfo,
                    UsageTotals)
from ..errors import StoreConflict
from .codec import (
    CHAT_TURNS,
    MESSAGE_COLUMNS,
    ROLLUP_SUMS,
    SENT_COLUMNS,
    SESSION_COLUMNS,
    SUMMARY_COLUMNS,
    TURN_COLUMNS,
    USAGE_COLUMNS,
    USAGE_SUMS,
    as_record,
    column_marks,
    dumps,
    record_values,
    rollup_step,
    recall_text,
    search_text,
    text_out,
    to_sent,
    to_summary,
    to_usage_totals,
)
from .common import SQLBase, new_incarnation
from .script import Script


class SQLAdmin(SQLBase):
    """The `AdminStore` methods."""

    async def stored_counts(self) -> StoredCounts:
        row = await self._one(f"SELECT {self._db.row_count('sessions')}, {self._db.row_count('messages')}")
        assert row is not None
        return StoredCounts(sessions=int(row[0]), messages=int(row[1]))

    async def summary_history(self, session: SessionState) -> list[Summary]:
        rows = await self._fetch(
            f"SELECT {SUMMARY_COLUMNS} FROM summaries WHERE session_pk = ? ORDER BY version", (session.pk,))
        return [to_summary(row) for row in rows]

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
            f" SELECT page.*, {CHAT_TURNS}, coalesce(sum(t.prompt_tokens), 0),"
            " coalesce(sum(t.completion_tokens), 0), sum(t.cost),"
            " coalesce(sum(coalesce(t.full_tokens, t.context_tokens) - t.context_tokens), 0),"
            " (SELECT coalesce(max(version), 0) FROM summaries WHERE session_pk = page.pk)"
            " FROM page LEFT JOIN turns t ON t.session_pk = page.pk"
            f" GROUP BY {', '.join('page.' + c for c in columns.split(', '))}"
            " ORDER BY page.updated_at DESC, page.pk DESC",
            (*params, limit))
        return [
            (SessionInfo(tenant=r[1], session_id=r[2], title=text_out(r[3]), created_at=r[4], updated_at=r[5],
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
            f" t.cost, min(m.seq), count(m.id), {', '.join('t.' + c for c in SENT_COLUMNS.split(', '))}"
            " FROM turns t LEFT JOIN messages m ON m.turn_id = t.id WHERE t.session_pk = ?"
            " GROUP BY t.id ORDER BY t.id",
            (session.pk,))
        return [TurnInfo(kind=r[0], model=text_out(r[1]), created_at=r[2], context_tokens=r[3], prompt_tokens=r[4],
                         completion_tokens=r[5], cost=r[6], stored_from=r[7], stored_messages=int(r[8]),
                         sent=to_sent(r[9:]))
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
        yield "UPDATE sessions SET metadata = ?, updated_at = ? WHERE pk = ?", (dumps(metadata), time.time(), row[0])
        return metadata

    async def usage(self, tenant: str | None) -> UsageTotals:
        return await self._usage(
            f"SELECT {USAGE_SUMS} FROM sessions s LEFT JOIN turns t ON t.session_pk = s.pk"
            " WHERE (CAST(? AS TEXT) IS NULL OR s.tenant = ?)", tenant)

    async def deleted_usage(self, tenant: str | None) -> UsageTotals:
        return await self._usage(
            f"SELECT {ROLLUP_SUMS} FROM tenant_usage WHERE (CAST(? AS TEXT) IS NULL OR tenant = ?)", tenant)

    async def _usage(self, sql: str, tenant: str | None) -> UsageTotals:
        row = await self._one(sql, (tenant, tenant))
        assert row is not None
        return to_usage_totals(row)

    async def tenant_rollups(self) -> dict[str, UsageTotals]:
        rows = await self._fetch(f"SELECT tenant, {USAGE_COLUMNS} FROM tenant_usage ORDER BY tenant")
        return {row[0]: to_usage_totals(row[1:]) for row in rows}

    async def add_to_rollup(self, tenant: str, usage: UsageTotals) -> None:
        await self._write_one(*rollup_step(tenant, usage))

    async def endpoint_usage(self, tenant: str | None) -> list[EndpointUsage]:
        rows = await self._fetch(
            "SELECT tenant, endpoint, calls, prompt_tokens, completion_tokens, cost FROM endpoint_usage"
            " WHERE (CAST(? AS TEXT) IS NULL OR tenant = ?) ORDER BY tenant, endpoint", (tenant, tenant))
        return [EndpointUsage(row[0], row[1], int(row[2]), int(row[3]), int(row[4]),
                              None if row[5] is None else float(row[5])) for row in rows]

    async def export_session(self, session: SessionState) -> list[dict[str, Any]]:
        return await self._db.write(self._export_session(session))

    def _export_session(self, session: SessionState) -> Script[list[dict[str, Any]]]:
        """The session's records as of one moment: its row is locked first, so no turn, summary or
        cap lands between the reads (four reads outside a transaction each saw a later session:
        a message of a turn not read yet)."""
        heads = yield f"SELECT {SESSION_COLUMNS} FROM sessions WHERE pk = ?" + self._db.row_lock, (session.pk,)
        if not heads:
            raise StoreConflict(f"the session '{session.session_id}' was deleted while it was read")
        records: list[dict[str, Any]] = [{"type": "session", "format": 1, "session_id": session.session_id,
                                          **as_record(SESSION_COLUMNS, heads[0])}]
        turn_ids: dict[int, int] = {}
        for row in (yield f"SELECT id, {TURN_COLUMNS} FROM turns WHERE session_pk = ? ORDER BY id", (session.pk,)):
            turn_ids[row[0]] = len(turn_ids) + 1
            records.append({"type": "turn", "id": turn_ids[row[0]], **as_record(TURN_COLUMNS, row[1:])})
        message_ids: dict[int, int] = {}
        for row in (yield (f"SELECT id, turn_id, parent_id, {MESSAGE_COLUMNS} FROM messages WHERE session_pk = ?"
                           " ORDER BY id", (session.pk,))):
            message_ids[row[0]] = len(message_ids) + 1
            records.append({"type": "message", "id": message_ids[row[0]], "turn": turn_ids[row[1]],
                            "parent": message_ids.get(row[2]) if row[2] is not None else None,
                            **as_record(MESSAGE_COLUMNS, row[3:])})
        for row in (yield (f"SELECT {SUMMARY_COLUMNS} FROM summaries WHERE session_pk = ? ORDER BY version",
                           (session.pk,))):
            records.append({"type": "summary", **as_record(SUMMARY_COLUMNS, row)})
        return records

    async def import_session(self, tenant: str, session_id: str, records: Sequence[dict[str, Any]]) -> None:
        await self._db.write(self._import_session(tenant, session_id, records))

    def _import_session(self, tenant: str, session_id: str, records: Sequence[dict[str, Any]]) -> Script[None]:
        [head] = [r for r in records if r["type"] == "session"]
        created = yield (f"INSERT INTO sessions (tenant, session_id, incarnation, {SESSION_COLUMNS})"
                         f" VALUES (?, ?, ?, {column_marks(SESSION_COLUMNS)}) ON CONFLICT (tenant, session_id)"
                         " DO NOTHING RETURNING pk",
                         (tenant, session_id, new_incarnation(), *record_values(SESSION_COLUMNS, head)))
        if not created:
            raise StoreConflict(f"a session '{session_id}' already exists")
        pk = created[0][0]
        turn_ids: dict[int, int] = {}
        for record in (r for r in records if r["type"] == "turn"):
            [(turn_ids[record["id"]],)] = yield (
                f"INSERT INTO turns (session_pk, {TURN_COLUMNS}) VALUES (?, {column_marks(TURN_COLUMNS)}) RETURNING id",
                (pk, *record_values(TURN_COLUMNS, record)))
        message_ids: dict[int, int] = {}
        for record in (r for r in records if r["type"] == "message"):
            parent = message_ids[record["parent"]] if record.get("parent") is not None else None
            [(message_ids[record["id"]],)] = yield (
                f"INSERT INTO messages (session_pk, turn_id, parent_id, {MESSAGE_COLUMNS}, search_text, recall_text)"
                f" VALUES (?, ?, ?, {column_marks(MESSAGE_COLUMNS)}, ?, ?) RETURNING id",
                (pk, turn_ids[record["turn"]], parent, *record_values(MESSAGE_COLUMNS, record),
                 search_text(tenant, session_id, record["body"], float(record["created_at"])),
                 recall_text(record["body"], record.get("compact_body"))))
        for record in (r for r in records if r["type"] == "summary"):
            yield (f"INSERT INTO summaries (session_pk, {SUMMARY_COLUMNS}) VALUES (?, {column_marks(SUMMARY_COLUMNS)})",
                   (pk, *record_values(SUMMARY_COLUMNS, record)))
        yield ("UPDATE sessions SET summary_version = (SELECT coalesce(max(version), 0) FROM summaries"
               " WHERE session_pk = ?) WHERE pk = ?", (pk, pk))

    async def last_model(self, session: SessionState) -> str | None:
        row = await self._one("SELECT model FROM turns WHERE session_pk = ? AND kind NOT IN ('summary', 'fork', 'items')"
                              " ORDER BY id DESC LIMIT 1", (session.pk,))
        return None if row is None else text_out(str(row[0]))

    async def tenants_sessions(self) -> list[tuple[str, str]]:
        """Every (tenant, session id), for copying a whole store."""
        rows = await self._fetch("SELECT tenant, session_id FROM sessions ORDER BY pk")
        return [(r[0], r[1]) for r in rows]

    async def refresh_statistics(self) -> None:
        if self._db.analyze is not None:
            await self._write_one(self._db.analyze)
