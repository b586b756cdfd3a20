"""Managing sessions: what the admin HTTP API and the CLI share, as plain data in and out.

Listing pages newest activity first with an opaque cursor; `show` gives the active conversation in
order with superseded branches apart, the summary and its history, metadata and usage; a fork is
an export of the kept prefix imported under a new id (`memproxy.exports` reads and checks exports);
usage adds what deleted sessions had spent to what current ones have. The context preview, which
plans a turn, is `memproxy.preview`: this module stays light (no planner, provider or HTTP server),
as the `memproxy sessions` commands that use it must start fast.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .config import Config, ModelConfig
from .errors import BadRequest, Conflict, NotFound
from .exports import has_gap, summaries_in_use
from .jsonparse import parse_json
from .messages import wire_form
from .searchtext import matched_words, query_words
from .session_ids import SESSION_ID_RULE, is_session_id
from .store import (
    AdminStore,
    EndpointUsage,
    MessageRecord,
    SessionInfo,
    SessionState,
    Store,
    Summary,
    TurnInfo,
    UsageTotals,
)

if TYPE_CHECKING:
    from .memory.summaries import FoldResult


def _cursor(value: tuple[float, str, str] | None) -> str | None:
    """Opaque to clients: base64url of `[updated_at, tenant, session_id]` of the last session
    listed, all of it the caller's own (never the store-wide pk, which counts every tenant's
    sessions)."""
    if value is None:
        return None
    text = json.dumps(list(value), ensure_ascii=False, separators=(",", ":"))
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def _parse_cursor(value: str | None, tenant: str | None) -> tuple[float, str, str] | None:
    """A cursor `_cursor` wrote for this listing: a finite time, and a session of the tenant
    listed (a cursor from another tenant's listing is refused, not silently resumed)."""
    if value is None:
        return None
    cursor: Any = None
    try:
        cursor = parse_json(base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)))
        if not (isinstance(cursor, list) and cursor and isinstance(cursor[0], (int, float))
                and not isinstance(cursor[0], bool)):
            raise ValueError
        updated_at = float(cursor[0])
    except (BadRequest, ValueError, TypeError, IndexError, OverflowError) as exc:
        raise _bad_cursor() from exc
    if not (len(cursor) == 3 and math.isfinite(updated_at) and isinstance(cursor[1], str)
            and cursor[1].isprintable() and isinstance(cursor[2], str) and is_session_id(cursor[2])
            and tenant in (None, cursor[1])):
        raise _bad_cursor()
    return updated_at, cursor[1], cursor[2]


def _bad_cursor() -> BadRequest:
    return BadRequest("'after' is not a cursor this API returned", param="after")


def info_json(info: SessionInfo) -> dict[str, Any]:
    return {
        "id": info.session_id,
        "object": "session",
        "tenant": info.tenant,
        "title": info.title,
        "created_at": info.created_at,
        "updated_at": info.updated_at,
        "message_count": info.messages,
        "tokens_stored": info.tokens_stored,
        "summary_version": info.summary_version,
        "usage": {
            "turns": info.turns,
            "prompt_tokens": info.prompt_tokens,
            "completion_tokens": info.completion_tokens,
            "cost": info.cost,
            "tokens_saved": info.tokens_saved,
        },
    }


async def list_sessions(store: AdminStore, tenant: str | None, limit: int, after: str | None) -> dict[str, Any]:
    if not 1 <= limit <= 1000:
        raise BadRequest("'limit' must be an integer from 1 to 1000", param="limit")
    page, cursor = await store.list_sessions(tenant, limit, _parse_cursor(after, tenant))
    return {"object": "list", "data": [info_json(i) for i in page], "next": _cursor(cursor)}


def _message_json(message: MessageRecord) -> dict[str, Any]:
    return {"position": message.seq, "message": message.body, "tokens": message.tokens,
            "created_at": message.created_at}


def summary_json(summary: Summary) -> dict[str, Any]:
    return {"version": summary.version, "text": summary.text, "covers_messages": summary.covers,
            "tokens": summary.tokens, "replaced_tokens": summary.replaced_tokens, "model": summary.model,
            "created_at": summary.created_at}


def branches(messages: list[MessageRecord]) -> list[dict[str, Any]]:
    """Superseded messages grouped into the branches they formed, in the order they were stored."""
    result: list[dict[str, Any]] = []
    last_id: int | None = None
    for message in messages:
        if message.active:
            continue
        if not result or message.parent_id != last_id:
            result.append({"forked_at": message.seq, "messages": []})
        result[-1]["messages"].append(_message_json(message))
        last_id = message.id
    return result


async def show(store: Store, session: SessionState) -> dict[str, Any]:
    messages = await store.all_messages(session)
    summary = await store.current_summary(session, session.length)
    return {
        **info_json(await store.session_info(session)),
        "system": session.system,
        "messages": [_message_json(m) for m in sorted((m for m in messages if m.active), key=lambda m: m.seq)],
        "superseded": branches(messages),
        "summary": summary_json(summary) if summary else None,
        "summary_history": [summary_json(s) for s in await store.summary_history(session)],
        "metadata": await store.get_metadata(session),
        "turns": [turn_json(i + 1, t) for i, t in enumerate(await store.turns(session))],
    }


def turn_json(number: int, turn: TurnInfo) -> dict[str, Any]:
    """A stored turn: what it cost, which messages it stored, and for a chat turn what its request
    was made of (`sent`), so "what did the model see in turn N, and why" has an answer later."""
    sent = turn.sent
    return {
        "turn": number, "kind": turn.kind, "model": turn.model, "created_at": turn.created_at,
        "context_tokens": turn.context_tokens, "prompt_tokens": turn.prompt_tokens,
        "completion_tokens": turn.completion_tokens, "cost": turn.cost,
        "stored_from_position": turn.stored_from, "stored_messages": turn.stored_messages,
        "sent": None if sent is None else {
            "summary_version": sent.summary_version, "from_position": sent.first_sent,
            "stored_included": sent.included, "stored_omitted": sent.omitted,
            "unsummarised_omitted": sent.unsummarised_omitted, "marker": sent.marker,
            "tool_outputs_trimmed": sent.trimmed, "deduplicated": sent.deduplicated,
            "recalled": [{"session_id": sid, "position": seq} for sid, seq in sent.recalled],
        },
    }


def usage_json(tenant: str | None, current: UsageTotals, deleted: UsageTotals,
               endpoints: Sequence[EndpointUsage] = ()) -> dict[str, Any]:
    """Totals over every session the tenant ever had and every call it made to the pass-through
    endpoints: `sessions` counts the current ones, `deleted_sessions` is the part of the totals
    that sessions since deleted had spent, and `endpoints` the part (tokens and cost) that the
    endpoint calls spent, by endpoint."""
    totals = _totals_json(current.plus(deleted))
    by_endpoint: dict[str, dict[str, Any]] = {}
    for row in endpoints:  # every tenant's rows, with tenant None: summed by endpoint
        spent = by_endpoint.setdefault(row.endpoint, {"calls": 0, "prompt_tokens": 0, "completion_tokens": 0,
                                                      "cost": None})
        spent["calls"] += row.calls
        spent["prompt_tokens"] += row.prompt_tokens
        spent["completion_tokens"] += row.completion_tokens
        spent["cost"] = _add_cost(spent["cost"], row.cost)
        totals["prompt_tokens"] += row.prompt_tokens
        totals["completion_tokens"] += row.completion_tokens
        totals["cost"] = _add_cost(totals["cost"], row.cost)
    return {"object": "usage", "tenant": tenant, **totals, "sessions": current.sessions,
            "deleted_sessions": _totals_json(deleted), "endpoints": by_endpoint}


def _add_cost(total: float | None, cost: float | None) -> float | None:
    """A cost is known if either part knows one."""
    return None if total is None and cost is None else (total or 0.0) + (cost or 0.0)


def _totals_json(usage: UsageTotals) -> dict[str, Any]:
    return {
        "sessions": usage.sessions,
        "turns": usage.turns,
        "summary_calls": usage.summary_calls,
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "cost": usage.cost,
        "context_tokens": usage.context_tokens,
        "full_history_tokens": usage.full_tokens,
        "tokens_saved": usage.tokens_saved,
    }


async def usage(store: AdminStore, tenant: str | None) -> dict[str, Any]:
    return usage_json(tenant, await store.usage(tenant), await store.deleted_usage(tenant),
                      await store.endpoint_usage(tenant))


def compaction(session_id: str, result: FoldResult) -> dict[str, Any]:
    return {
        "object": "session.compaction",
        "session_id": session_id,
        "outcome": result.outcome,
        "detail": result.detail or None,
        "messages_folded": result.messages_folded,
        "tokens_before": result.tokens_before,
        "tokens_after": result.tokens_after,
        "summary": summary_json(result.summary) if result.summary else None,
    }


async def fork(store: AdminStore, session: SessionState, tenant: str, new_id: Any, at: Any = None) -> int:
    """A new session holding the first `at` active messages (default all) and the summaries
    covering no more; returns `at`. A fork never cuts a unit: the session it makes must be one a
    turn could have left, or it would send a tool call without its results."""
    if not isinstance(new_id, str) or not is_session_id(new_id):
        raise BadRequest(f"'new_id' must be a session id ({SESSION_ID_RULE})",
                         param="new_id")
    at = session.length if at is None else at
    if isinstance(at, bool) or not isinstance(at, int) or not 0 <= at <= session.length:
        raise BadRequest(f"'at' must be an integer from 0 to {session.length}", param="at")
    records = await store.export_session(session)
    exported = next((r for r in records if r["type"] == "session"), None)
    if exported is None or (exported["length"], exported["head_hash"]) != (session.length, session.head_hash):
        # A turn, an edit or a clear on another request or replica, between the session's read and
        # its export: `at` was read from a session that is no longer there.
        raise Conflict("the session changed while it was being forked (a turn, an edit or a clear "
                       "landed meanwhile); retry the fork")
    active = {r["seq"]: r for r in records if r["type"] == "message" and r["active"]}
    if at < session.length and not (at in active and active[at]["unit_start"]):
        raise BadRequest(f"'at' must be the position of a message that starts a unit, or {session.length}: "
                         f"position {at} lies between a tool call and its results, or is no longer stored",
                         param="at")
    kept = [active[seq] for seq in sorted(active) if seq < at]
    head = dict(exported)
    last = kept[-1] if kept else None
    head.update(
        length=at,
        head_hash=last["chain_hash"] if last else "",
        head_cum=last["cum_before"] + last["tokens"] if last else 0,
        head_compact_cum=last["compact_cum_before"] + last["compact_tokens"] if last else 0,
    )
    turn = {"type": "turn", "id": 1, "created_at": head["updated_at"], "model": "-", "kind": "fork",
            "context_tokens": 0, "prompt_tokens": None, "completion_tokens": None, "latency_ms": 0.0,
            "cost": None, "full_tokens": 0}
    messages = [{**m, "id": i + 1, "turn": 1, "parent": i or None} for i, m in enumerate(kept)]
    summaries = summaries_in_use(records, active, at)
    if has_gap(active, summaries, at):
        raise BadRequest(f"messages before position {at} were deleted (retention.max_messages_per_session) and "
                         "no summary the fork can keep stands for them", param="at")
    await store.import_session(tenant, new_id, [head, turn, *messages, *summaries])
    return at


async def session_model(store: AdminStore, config: Config, session: SessionState, name: Any) -> ModelConfig:
    """The model a preview or a compaction is sized for: the one named, else the one the session
    last chatted with, else the summariser's, else the first configured."""
    if not name:
        last = await store.last_model(session)
        name = last if last and config.model(last) else config.memory.summarizer_model
        name = name or (config.models[0].name if config.models else None)
    model = config.model(name) if isinstance(name, str) else None
    if model is None:
        raise NotFound(f"The model '{name}' does not exist on this proxy.", code="model_not_found",
                       param="model")
    return model


SEARCH_LIMIT = 100  # the most hits one search returns


async def search(store: AdminStore, tenant: str | None, body: dict[str, Any],
                 session: SessionState | None = None, active_since: float | None = None) -> dict[str, Any]:
    """Stored messages matching a query, best first: of one session, or of every session the
    caller may see (`tenant` None: every tenant, for an admin key), of sessions active since
    `active_since` (the others have expired). The query is words, as recall looks them up
    (`memproxy.searchtext.query_words`); `limit` 1-100 (default 20)."""
    query, limit = body.get("query"), body.get("limit", 20)
    if not isinstance(query, str) or not query.strip():
        raise BadRequest("'query' must be a non-empty string", param="query")
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= SEARCH_LIMIT:
        raise BadRequest(f"'limit' must be an integer from 1 to {SEARCH_LIMIT}", param="limit")
    words = query_words(query)
    hits = await store.search(tenant, words, limit, session, active_since) if words else []
    return {"object": "list", "query": words, "data": [
        {"object": "session.search_hit", "tenant": hit.tenant, "session_id": hit.session_id, "position": hit.seq,
         "role": hit.body.get("role"), "created_at": hit.created_at, "score": round(hit.score, 4),
         "matched": matched_words(words, hit.body, hit.created_at), "message": wire_form(hit.body)} for hit in hits]}
