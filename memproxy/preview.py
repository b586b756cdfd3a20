"""The context preview: the request a session's next turn would send, planned exactly as the chat
endpoint plans it (same code, no summary folded), labelled part by part, nothing stored or sent.
Shared by the admin API (`POST /v1/sessions/{id}/context`) and `memproxy sessions context`.
"""

from __future__ import annotations

from typing import Any

from .config import Config, ModelConfig
from .errors import BadRequest
from .memory.plan import PreparedTurn, prepare_turn, prompt_schemas
from .memory.sent import SentHistories
from .memory.summaries import Summarizer
from .messages import validate_message, within_cache_breakpoints
from .params import check_params
from .provider import Provider
from .store import SessionState, TurnStore
from .tokens import REPLY_PRIMING


async def context(
    store: TurnStore, summarizer: Summarizer, provider: Provider, config: Config, model: ModelConfig,
    tenant: str, session: SessionState, new: list[Any], params: dict[str, Any], end_user: str | None = None,
    histories: SentHistories | None = None,
) -> dict[str, Any]:
    """The request the session's next turn would send, labelled part by part; `new` and `params`
    are checked as the chat endpoint checks them (a 400 naming the field). `end_user`: whose other
    sessions recall may look in (`memory.recall_scope: user`); `histories`: the chat endpoint's
    (`memory.sent`)."""
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
                              calibration=provider.calibration.factor(model.name, (tenant, session.session_id)),
                              histories=histories)
    ctx, budget = turn.context, turn.budget
    schemas = prompt_schemas(params)
    sent = ctx.messages
    n_system, n_new = len(turn.system), len(turn.reconciled.new)
    n_head, n_extra = ctx.head, int(ctx.summary is not None) + int(ctx.marker)
    n_question = int(ctx.question >= 0)
    block = [sent[ctx.recall_index]] if ctx.recall_index >= 0 else []
    kept = [m for m in sent[n_system + n_head + n_extra + n_question : len(sent) - n_new]
            if not (block and m is block[0])]
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
    if n_question:  # an agent loop's question, its exchange too long to send whole
        parts.append({"part": "question", "messages": 1, "position": ctx.question,
                      "tokens": tokens(sent[after_head + n_extra : after_head + n_extra + 1])})
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
        "messages": within_cache_breakpoints(sent, n_new, params.get("tools")),
    }


async def _tokens_before(store: TurnStore, turn: PreparedTurn) -> int:
    """What the stored messages left out of a request hold, as stored (before trimming): the
    tokens the summary, the marker or nothing stand in for; the opening turns kept
    (`memory.head_turns`) and an agent loop's question are sent, not left out."""
    if turn.session is None or not turn.context.omitted:
        return 0
    left = (await store.totals_at(turn.session, turn.context.first_sent)).full
    head = turn.context.head_end
    if head:
        left -= (await store.totals_at(turn.session, head)).full
    question = turn.context.question  # an agent loop's question, sent ahead of the kept turns
    if question >= 0:
        left -= (await store.totals_at(turn.session, question + 1)).full \
            - (await store.totals_at(turn.session, question)).full
    return left
