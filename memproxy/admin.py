"""Managing sessions: what the admin HTTP API and the CLI share, as plain data in and out.

Listing pages newest activity first with an opaque cursor; `show` gives the active conversation in
order with superseded branches apart, the summary and its history, metadata and usage; `context`
plans the next request exactly as the chat endpoint would (same code, no summary folded) and labels
its parts; a fork is an export of the kept prefix imported under a new id (`memproxy.exports` reads
and checks exports); usage adds what deleted sessions had spent to what current ones have.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Sequence
from typing import Any

from .bodies import parse_json
from .config import Config, ModelConfig
from .errors import BadRequest, Conflict, NotFound
from .exports import has_gap, summaries_in_use
from .memory.plan import PreparedTurn, prepare_turn, prompt_schemas
from .memory.summaries import FoldResult, Summarizer
from .messages import validate_message, wire_form
from .params import check_params
from .searchtext import matched_words, query_words
from .provider import Provider
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
    TurnStore,
    UsageTotals,
)
from .tokens import REPLY_PRIMING


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


async def _tokens_before(store: TurnStore, turn: PreparedTurn) -> int:
    """What the stored messages left out of a request hold, as stored (before trimming): the
    tokens the summary, the marker or nothing stand in for; the opening turns kept
    (`memory.head_turns`) are sent, not left out."""
    if turn.session is None or not turn.context.omitted:
        return 0
    left = (await store.totals_at(turn.session, turn.context.first_sent)).full
    head = turn.context.head_end
    return left - (await store.totals_at(turn.session, head)).full if head else left


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


async def context(
    store: TurnStore, summarizer: Summarizer, provider: Provider, config: Config, model: ModelConfig,
    tenant: str, session: SessionState, new: list[Any], params: dict[str, Any], end_user: str | None = None,
) -> dict[str, Any]:
    """The request the session's next turn would send, labelled part by part; `new` and `params`
    are checked as the chat endpoint checks them (a 400 naming the field). `end_user`: whose other
    sessions recall may look in (`memory.recall_scope: user`)."""
    new = [] if new is None else new
    if not isinstance(new, list):
        raise BadRequest("'messages' must be an array of the turn's new messages", param="messages")
    for i, message in enumerate(new):
        validate_message(message, f"messages[{i}]")
    check_params(params, provider.through_litellm(model))
    counter = provider.counter(model)
    # The budget, the output reserve included, by the rule the chat endpoint follows (memory.plan).
    turn = await prepare_turn(store, summarizer, model, counter, provider.window(model), config.memory,
                              tenant, session.session_id, list(new), params, "new",
                              idle_ttl=config.retention.idle_ttl_seconds, preview=True, end_user=end_user,
                              calibration=provider.calibration.factor(model.name, (tenant, session.session_id)))
    ctx, budget = turn.context, turn.budget
    schemas = prompt_schemas(params)
    sent = ctx.messages
    n_system, n_new = len(turn.system), len(turn.reconciled.new)
    n_head, n_extra = ctx.head, int(ctx.summary is not None) + int(ctx.marker)
    block = [sent[ctx.recall_index]] if ctx.recall_index >= 0 else []
    kept = [m for m in sent[n_system + n_head + n_extra : len(sent) - n_new] if not (block and m is block[0])]
    after_head = n_system + n_head

    def tokens(messages: list[Any]) -> int:
        return sum(counter.message(m) for m in messages)

    covered = ctx.summary.covers if ctx.summary else 0
    parts: list[dict[str, Any]] = [{"part": "system", "messages": n_system, "tokens": tokens(sent[:n_system])}]
    if n_head:
        parts.append({"part": "head", "messages": n_head, "to_position": ctx.head_end,
                      "tokens": tokens(sent[n_system:after_head])})
    if ctx.summary:
        parts.append({"part": "summary", "version": ctx.summary.version, "covers_messages": covered,
                      "tokens": tokens(sent[after_head : after_head + 1])})
    if ctx.marker:
        parts.append({"part": "marker", "tokens": tokens(sent[after_head + n_extra - 1 : after_head + n_extra])})
    parts += [
        {"part": "kept", "messages": len(kept), "from_position": ctx.first_sent, "tokens": tokens(kept),
         "tool_outputs_trimmed": ctx.trimmed, "deduplicated": ctx.deduplicated},
        {"part": "left_out", "messages": ctx.omitted, "summarised": covered,
         "unsummarised": ctx.unsummarised_omitted, "tokens_stored": await _tokens_before(store, turn)},
        {"part": "recalled", "messages": len(ctx.recalled), "tokens": tokens(block), "room": ctx.recall_room,
         "query": list(ctx.recall_query), "excerpts": [
             {"session_id": r.session_id, "position": r.seq, "role": r.role,
              "created_at": r.created_at, "hit": r.score is not None,
              "score": None if r.score is None else round(r.score, 4),
              "matched": list(r.matched) if r.score is not None else []}
             for r in ctx.recalled]},
        {"part": "new", "messages": n_new, "tokens": tokens(sent[len(sent) - n_new :] if n_new else [])},
        {"part": "tools_and_priming", "tokens": counter.tools(schemas) + REPLY_PRIMING},
    ]
    return {
        "object": "session.context",
        "session_id": session.session_id,
        "model": model.name,
        "budget": {"window": budget.window, "output_reserve": budget.output_reserve,
                   "safety_margin": budget.margin, "input_tokens": budget.input_tokens,
                   "calibration": budget.calibration, "planned_tokens": budget.planned_tokens},
        "tokens": ctx.tokens,
        "expired": turn.expired,
        "would_summarize": bool(turn.unsummarised) and config.memory.overflow == "summarize"
        and summarizer.may_fold(tenant, session.session_id),
        "parts": parts,
        "messages": [wire_form(m) for m in sent],
    }



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
