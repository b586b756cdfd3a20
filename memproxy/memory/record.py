"""Recording a turn: what the store writes once the upstream call has succeeded.

`turn_record` describes the whole turn (superseded tail, new messages, reply, usage, and what was
sent) for the store to write in one transaction; nothing here touches the store.
"""

from __future__ import annotations

from typing import Any

from ..config import MemoryConfig
from ..messages import Message, assistant_message, chain_hash
from ..store import SentContext, TurnRecord, Usage
from ..tokens import TokenCounter
from .fit import Context
from .plan import PreparedTurn
from .shrink import new_message, title_of


def turn_record(
    turn: PreparedTurn,
    counter: TokenCounter,
    memory: MemoryConfig,
    reply: Message,
    model: str,
    usage: dict[str, Any] | None,
    latency_ms: float,
    cost: float | None = None,
) -> TurnRecord:
    body = assistant_message(reply)
    parent = turn.new[-1].chain_hash if turn.new else turn.reconciled.base_hash
    answer = new_message(body, chain_hash(parent, body), counter, memory)
    session = turn.session
    return TurnRecord(
        tenant=turn.tenant,
        session_id=turn.session_id,
        expected_length=session.length if session else 0,
        expected_head_hash=session.head_hash if session else "",
        base=turn.reconciled.base,
        base_totals=turn.context.base_totals,
        base_hash=turn.reconciled.base_hash,
        messages=[*turn.new, answer],
        system=turn.system if turn.system_changed else None,
        model=model,
        kind=turn.reconciled.kind,
        context_tokens=turn.context.tokens,
        latency_ms=latency_ms,
        usage=Usage.reported(usage),
        full_tokens=turn.full_tokens,
        cost=cost,
        title=title_of(m.body for m in turn.new),
        expired_before=turn.expired_before,
        sent=sent_context(turn.context),
        end_user=turn.end_user,
        tokenizer=counter.name,
    )


def sent_context(context: Context) -> SentContext:
    return SentContext(
        summary_version=context.summary.version if context.summary else 0,
        first_sent=context.first_sent,
        included=context.included,
        omitted=context.omitted,
        unsummarised_omitted=context.unsummarised_omitted,
        marker=context.marker,
        trimmed=context.trimmed,
        deduplicated=context.deduplicated,
        recalled=tuple((r.session_id, r.seq) for r in context.recalled),
    )


