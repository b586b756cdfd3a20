"""A turn of memory: plan what to send from what is stored, then record what happened.

`prepare_turn` reconciles the client's messages with the session, counts the new ones (the only
tokenizing a turn does), and builds the request under the budget. Nothing is written until the
upstream call has succeeded; `turn_record` then describes the whole turn (superseded tail, new
messages, reply, usage) for the store to write in one transaction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .context import Budget, Context, build_context
from .messages import Message, assistant_message, chain_hash, chain_hashes, split_system, starts_unit
from .reconcile import Reconciled, reconcile
from .store import NewMessage, SessionState, Store, TurnRecord, Usage
from .tokens import TokenCounter


@dataclass(frozen=True)
class PreparedTurn:
    tenant: str
    session_id: str
    session: SessionState | None
    reconciled: Reconciled
    new: list[NewMessage]
    system: list[Message]
    system_changed: bool
    context: Context


async def prepare_turn(
    store: Store,
    counter: TokenCounter,
    budget: Budget,
    tenant: str,
    session_id: str,
    messages: list[Message],
    schemas: list[Any],
    history_mode: str,
    model_name: str,
) -> PreparedTurn:
    session = await store.get_session(tenant, session_id)
    system, conversation = split_system(messages)
    system_changed = bool(system) and (session is None or session.system != system)
    if not system and session is not None and session.system:
        system = session.system
    reconciled = await reconcile(store, session, conversation, history_mode)
    hashes = chain_hashes(reconciled.base_hash, reconciled.new)
    new = [
        NewMessage(body=m, tokens=counter.message(m), unit_start=starts_unit(m), chain_hash=h)
        for m, h in zip(reconciled.new, hashes)
    ]
    context = await build_context(
        store,
        session,
        reconciled.base,
        system,
        sum(counter.message(m) for m in system),
        reconciled.new,
        sum(m.tokens for m in new),
        counter.tools(schemas),
        budget,
        model_name,
        counter,
    )
    return PreparedTurn(tenant, session_id, session, reconciled, new, system, system_changed, context)


def turn_record(
    turn: PreparedTurn,
    counter: TokenCounter,
    reply: Message,
    model: str,
    usage: dict[str, Any] | None,
    latency_ms: float,
) -> TurnRecord:
    body = assistant_message(reply)
    parent = turn.new[-1].chain_hash if turn.new else turn.reconciled.base_hash
    answer = NewMessage(body=body, tokens=counter.message(body), unit_start=True,
                        chain_hash=chain_hash(parent, body))
    session = turn.session
    base = turn.reconciled.base
    return TurnRecord(
        tenant=turn.tenant,
        session_id=turn.session_id,
        expected_length=session.length if session else 0,
        expected_head_hash=session.head_hash if session else "",
        base=base,
        base_cum=turn.context.base_cum,
        base_hash=turn.reconciled.base_hash,
        messages=[*turn.new, answer],
        system=turn.system if turn.system_changed else None,
        history_mode=turn.reconciled.history_mode,
        model=model,
        kind=turn.reconciled.kind,
        context_tokens=turn.context.tokens,
        latency_ms=latency_ms,
        usage=Usage(
            prompt_tokens=_int(usage, "prompt_tokens"),
            completion_tokens=_int(usage, "completion_tokens"),
        ),
    )


def _int(usage: dict[str, Any] | None, key: str) -> int | None:
    value = (usage or {}).get(key)
    return value if isinstance(value, int) else None
