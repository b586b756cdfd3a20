"""Planning a turn: what to send, from the client's messages and what is stored.

`prepare_turn` is the one place a request becomes what to send, for the chat endpoint and for the
admin preview of the next request alike: both hand it the request's parameters, and the budget (the
output reserve included, `output_reserve`) is decided here by one rule. It reconciles the client's
messages with the session, counts the new ones (the only tokenizing a turn does), and fits the
request under the budget. When unsummarised turns must be left out and the overflow policy is
`summarize`, it folds them into the summary first (bounded by a timeout; a marker stands in if that
fails). Nothing is written until the upstream call has succeeded (`memproxy.memory.record` then
describes the whole turn for the store to write), but for one case: a conversation resent to a
session that does not hold it, too long to send whole, has its history stored first
(`resent_history`), so that memory can leave out what does not fit instead of refusing it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ..concurrency import BackgroundTasks
from ..config import MemoryConfig, ModelConfig
from ..errors import BadRequest, ContextLengthExceeded
from ..messages import Message, chain_hashes, history_end, split_system
from ..store import NewMessage, SessionState, Snapshot, StoredMessage, Totals, TurnRecord, TurnStore
from ..store.errors import StoreConflict
from ..timing import lap
from ..tokens import REPLY_PRIMING, TokenCounter, request_tokens
from . import recall
from .fit import (Budget, Context, Fixed, fit, must_send_last_unit, room_beside, room_for_history, wants_question,
                  with_last_unit_counted)
from .reconcile import Reconciled, reconcile
from .sent import SentHistories
from .retention import expired_before, has_expired, keep_alive
from .shrink import new_message, title_of
from .summaries import FoldResult, Summarizer

_SYNC_FOLDS = 3  # at most this many folds before one request
_HEAD_READ = 32  # messages read per opening turn kept (`memory.head_turns`): longer turns are not kept
# A session counted by another counter: at most this many plans, each for the ratio the last one was
# over by, and a little more.
_PLANS = 5
_REPLAN_STEP = 1.02


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
    budget: Budget
    full_tokens: int  # what resending the whole history would cost
    expired_before: float | None = None  # set when the stored session idled past its TTL
    end_user: str | None = None  # the end user the turn is for (`X-Memproxy-User`, else `user`)
    # How the client's request was read, where its history was stored first (`resent_history`) and
    # the turn then planned as that history's continuation (`reconciled`): what headers report.
    read_as: Reconciled | None = None
    # The stored messages the plan left out that no summary stands for, as the request's own fold
    # (`overflow: summarize`) decides on them: before recall held back room from older kept turns
    # (those give way to recall, and are neither folded nor, unless recalled, sent).
    unsummarised: int = 0

    @property
    def reading(self) -> Reconciled:
        """How the client's request was read: its kind and what it superseded."""
        return self.read_as or self.reconciled

    @property
    def expired(self) -> bool:
        """The stored session idled past its TTL: this turn starts it afresh."""
        return self.expired_before is not None


def output_reserve(params: dict[str, Any], model: ModelConfig, window: int) -> int:
    """The tokens kept free for the answer: the request's `max_completion_tokens` or `max_tokens`
    (a positive integer below the window; the larger where both are set: providers differ in which
    one they honour, and litellm's translation keeps either), else the model's
    `max_output_tokens`, at most the window less one token."""
    asked = []
    for key in ("max_completion_tokens", "max_tokens"):
        value = params.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BadRequest(f"'{key}' must be a positive integer", param=key)
        if value >= window:
            raise ContextLengthExceeded(
                f"'{key}' is {value}, but model '{model.name}' has a context window of "
                f"{window} tokens in all", param=key)
        asked.append(value)
    return max(asked) if asked else min(model.max_output_tokens, window - 1)


def request_budget(params: dict[str, Any], model: ModelConfig, window: int, memory: MemoryConfig,
                   calibration: float = 1.0) -> Budget:
    return Budget(window, output_reserve(params, model, window), memory.safety_margin(window), calibration)


def prompt_schemas(params: dict[str, Any]) -> list[Any]:
    """What the provider renders into the prompt besides the messages: tool and (legacy) function
    schemas, and a JSON schema the output must follow. They count against the budget, the same way
    for a chat request and for the admin preview of one."""
    schemas = [*(params.get("tools") or []), *(params.get("functions") or [])]
    response_format = params.get("response_format")
    if isinstance(response_format, dict) and response_format.get("json_schema"):
        schemas.append(response_format["json_schema"])
    return schemas


async def prepare_turn(
    store: TurnStore,
    summarizer: Summarizer,
    model: ModelConfig,
    counter: TokenCounter,
    window: int,
    memory: MemoryConfig,
    tenant: str,
    session_id: str,
    messages: list[Message],
    params: dict[str, Any],  # the request's other parameters (max_tokens, tools, response_format...)
    requested_history: str,  # the X-Memproxy-History header: auto, full or new
    idle_ttl: float | None = None,
    preview: bool = False,
    end_user: str | None = None,
    calibration: float = 1.0,
    tasks: BackgroundTasks | None = None,
    histories: SentHistories | None = None,
) -> PreparedTurn:
    """`preview`: plan only, as the admin context endpoint does; no summary is folded. `end_user`:
    whose other sessions recall may look in (`memory.recall_scope: user`). `calibration`: the
    model's provider's tokens per counted token (`memproxy.calibration`). `tasks`: what owns a
    resent history's write (`resent_history`), so that it outlives a client that hangs up and the
    session's lock is held until it is done, as a turn's is (`BackgroundTasks.run`). `histories`:
    the older parts of histories as earlier turns sent them (`memory.sent`).

    A session's stored counts were made by the counter of the model it was talking to then. Where
    that was another counter (a session moved from a cl100k model to an o200k one, or to a Claude),
    they can be off by any ratio (a run of rare characters: four times), so what the plan would send
    is counted again with this model's counter, and planned again for less while it does not fit."""
    args = (store, summarizer, model, counter, window, memory, tenant, session_id, messages, params,
            requested_history, idle_ttl, preview, end_user)
    turn, plans = await _prepare(*args, calibration, tasks, histories), 1
    while turn.session is not None and turn.session.tokenizer not in (None, counter.name):
        exact = request_tokens(counter, turn.context.messages, prompt_schemas(params))
        if exact <= turn.budget.input_tokens or plans == _PLANS:  # over still: the provider has the last word
            return dataclasses.replace(turn, context=dataclasses.replace(turn.context, tokens=exact))
        # By how far the count planned with was off, not only how far the request is over: a history
        # that fit the budget whole by its stored counts would be planned whole again, and again.
        calibration *= max(exact / turn.budget.input_tokens, exact / max(turn.context.tokens, 1)) * _REPLAN_STEP
        # A history the first plan stored (`resent_history`) is read as stored by the next: the
        # client's reading stays the first one's.
        replanned = await _prepare(*args, calibration, tasks, histories)
        turn, plans = dataclasses.replace(replanned, read_as=turn.read_as or replanned.read_as), plans + 1
    return turn


async def _prepare(
    store: TurnStore, summarizer: Summarizer, model: ModelConfig, counter: TokenCounter, window: int,
    memory: MemoryConfig, tenant: str, session_id: str, messages: list[Message], params: dict[str, Any],
    requested_history: str, idle_ttl: float | None, preview: bool, end_user: str | None, calibration: float,
    tasks: BackgroundTasks | None, histories: SentHistories | None,
) -> PreparedTurn:
    budget = request_budget(params, model, window, memory, calibration)
    schemas = prompt_schemas(params)
    tools = counter.tools(schemas)
    # The session and its snapshot at the head, in one read: sized for the most room history can
    # have (no system prompt or new message), so whatever the reconcile finds new, a turn at the
    # head needs nothing more from the store to plan.
    loaded = await store.load(tenant, session_id, budget.input_tokens - tools - REPLY_PRIMING)
    session = loaded.session if loaded else None
    cutoff = expired_before(idle_ttl) if has_expired(session, idle_ttl) else None
    if cutoff is not None:
        session = None  # planned as new; the store restarts the old one when the turn is written
    # Marked active once the plan stands (`keep_alive`): a request refused as too long changes nothing.
    planned_on = None if preview else session
    system, conversation = split_system(messages)
    system_changed = bool(system) and (session is None or session.system != system)
    if not system and session is not None and session.system:
        system = session.system
    held = loaded.messages if loaded is not None and session is loaded.session else ()
    reconciled = await reconcile(store, session, conversation, requested_history, held)
    lap("reconcile")
    hashes = chain_hashes(reconciled.base_hash, reconciled.new)
    new = [new_message(m, h, counter, memory) for m, h in zip(reconciled.new, hashes)]
    fixed = Fixed(
        system=system,
        new=reconciled.new,
        tokens=sum(counter.message(m) for m in system) + sum(m.tokens for m in new)
        + tools + REPLY_PRIMING,
    )
    split = resent_history(reconciled) if fixed.tokens > budget.input_tokens and not preview else 0
    if split and fixed.tokens - sum(m.tokens for m in new[:split]) > budget.input_tokens:
        split = 0  # its newest exchange alone cannot fit either: refused (`fit`) before anything is stored
    if split:
        # A conversation this session does not hold, too long to send whole (an existing chat
        # pointed at memproxy, or resent after its session expired or was cleared, or an edit of
        # an early message of a long one, such as an old tool output cleared): its history is
        # stored first, so that what follows is planned as a continuation of it, with a summary or
        # a marker for what does not fit, and the client gets an answer instead of a 400.
        base_totals = None
        if session is not None and reconciled.kind == "edit":
            base_totals = (await store.snapshot(session, reconciled.base, False, 0)).base_totals
        write = store.record_turn(_history_turn(tenant, session_id, session, reconciled, new[:split], system,
                                                system_changed, model.name, cutoff, end_user, counter.name,
                                                base_totals))
        try:
            await (write if tasks is None else tasks.run(write))
        except StoreConflict:
            pass  # another writer (a process given the same conversation) moved the session: planned on it again
        planned = await _prepare(store, summarizer, model, counter, window, memory, tenant, session_id, messages,
                                 params, requested_history, idle_ttl, preview, end_user, calibration, tasks,
                                 histories)
        return dataclasses.replace(planned, read_as=reconciled)

    memo: list[tuple[SessionState, Snapshot]] = []  # the last snapshot read, and of which state
    heads: list[list[StoredMessage]] = []  # the opening turns (`memory.head_turns`), once read
    questions: dict[int, StoredMessage | None] = {}  # an agent loop's question, by position, once read

    async def build(session: SessionState | None, reserve: int = 0) -> Context:
        # The snapshot read with the session, or one store call where that read cannot tell (a
        # base before the head, a summary saved since); the fit itself reads nothing else. Fits of
        # one session state (recall's) share its snapshot.
        snapshot = None
        if session is not None and reconciled.base > 0:
            if memo and memo[0][0] is session:
                snapshot = memo[0][1]
            else:
                whole_last_unit, room = must_send_last_unit(fixed.new), room_for_history(fixed, budget)
                if loaded is not None and session is loaded.session:
                    snapshot = loaded.snapshot(reconciled.base, whole_last_unit, room)
                if snapshot is None:
                    snapshot = await store.snapshot(session, reconciled.base, whole_last_unit, room)
                if session.tokenizer not in (None, counter.name):  # counted by another model's counter
                    snapshot = with_last_unit_counted(snapshot, counter)
                memo[:] = [(session, snapshot)]
        head: list[StoredMessage] = []
        if session is not None and snapshot is not None and memory.head_turns \
                and snapshot.base_totals.full > room_for_history(fixed, budget):
            if not heads:
                heads.append(await opening_turns(store, session, reconciled.base, memory.head_turns))
            head = heads[0]
        use_marker = memory.overflow != "drop"
        context = fit(snapshot, fixed, budget, model.name, counter, memory, use_marker, reserve, head,
                      histories=histories)
        at = wants_question(snapshot, fixed.new, context)
        if session is None or snapshot is None or at is None:
            return context
        # An agent loop whose newest exchange does not fit whole: its question, read where the
        # snapshot does not hold it (rare: the exchange outgrew the window), goes in verbatim.
        if at not in questions:
            i = snapshot.index(at)
            found = snapshot.messages[i:i + 1] if at >= snapshot.start else []
            if not found or found[0].seq != at:
                found = await store.active_range(session, at, at + 1)
            questions[at] = found[0] if found and found[0].body.get("role") == "user" else None
        question = questions[at]
        if question is None:
            return context
        return fit(snapshot, fixed, budget, model.name, counter, memory, use_marker, reserve, head, question,
                   histories)

    context = await build(session)
    if context.unsummarised_omitted and memory.overflow == "summarize" and session and not preview:
        # Recall plans again from the session as the fold left it: its summary, just saved, stays.
        context, session = await _fold_left_out(summarizer, session, model, budget, memory, context, build)
    unsummarised = context.unsummarised_omitted
    if session is not None and context.omitted and memory.recall_room(window) > 0:
        lap("budget")
        scope = end_user if memory.recall_scope == "user" else None
        checked = loaded.recall if loaded is not None and session is loaded.session else None
        floor = memory.recall_floor(window)
        beside = room_beside(context, budget, memory.recall_room(window), floor)
        context = await _recall(store, session, fixed, beside, floor, memory.recall_context, scope, counter, context,
                                build, checked, expired_before(idle_ttl))
        lap("recall")
    await keep_alive(store, planned_on, idle_ttl)
    return PreparedTurn(tenant, session_id, session, reconciled, new, system, system_changed, context, budget,
                        full_tokens=fixed.tokens + context.base_totals.full, expired_before=cutoff,
                        end_user=end_user, unsummarised=unsummarised)


def resent_history(reconciled: Reconciled) -> int:
    """Where the newest exchange starts among new messages that hold a conversation's history (an
    assistant answer before the latest user message), 0 where they hold none: a long prompt of the
    client's own is never taken for history and left out. Whatever the kind: a new session's
    conversation, an edit's branch from the fork on, or exchanges the store lacks after the ones
    it holds (a turn not recorded, a client that talked elsewhere meanwhile)."""
    return history_end(reconciled.new)


def _history_turn(tenant: str, session_id: str, session: SessionState | None, reconciled: Reconciled,
                  history: list[NewMessage], system: list[Message], system_changed: bool, model: str,
                  expired: float | None, end_user: str | None, tokenizer: str,
                  base_totals: Totals | None = None) -> TurnRecord:
    """The write of a resent conversation's history (`resent_history`), before its newest exchange
    is planned: its messages as a turn of their own, which sent nothing and cost nothing.
    `base_totals`: the stored history's totals at an edit's fork."""
    at_head = session is not None and reconciled.base == session.length
    if base_totals is None:
        base_totals = Totals(session.head_cum, session.head_compact_cum) if at_head and session else Totals(0, 0)
    return TurnRecord(
        tenant=tenant, session_id=session_id,
        expected_length=session.length if session else 0,
        expected_head_hash=session.head_hash if session else "",
        base=reconciled.base,
        base_totals=base_totals,
        base_hash=reconciled.base_hash, messages=history, system=system if system_changed else None,
        model=model, kind=reconciled.kind, context_tokens=0, latency_ms=0.0,
        title=title_of(m.body for m in history), expired_before=expired, end_user=end_user, tokenizer=tokenizer,
        pinned=True,  # a history goes where the client's conversation has it, never after another writer's turn
    )


async def opening_turns(store: TurnStore, session: SessionState, base: int, turns: int) -> list[StoredMessage]:
    """The session's first `turns` turns (each from a user message to the next), or nothing where
    they are not all stored from position 0 on (the message cap deleted some) or would reach `base`."""
    messages = await store.active_range(session, 0, min(base, _HEAD_READ * turns))
    users = [m.seq for m in messages if m.body.get("role") == "user"]
    if not messages or messages[0].seq != 0 or len(users) <= turns:
        return []
    end = users[turns]
    head = [m for m in messages if m.seq < end]
    return head if [m.seq for m in head] == list(range(end)) else []


async def _recall(
    store: TurnStore, session: SessionState, fixed: Fixed, beside: int | None, floor: int, around: int,
    end_user: str | None, counter: TokenCounter, context: Context,
    build: Callable[[SessionState, int], Awaitable[Context]], checked: object = None,
    active_since: float | None = None,
) -> Context:
    """The fit with recall (`memory.recall`): the store's best matches for the question, in the
    room the request leaves beside its kept turns (`beside`, from `room_beside`), or, where that
    is less than recall is sure of, in `floor` tokens held back from older kept turns, whatever
    the block then leaves unused given back to them. `checked`: what the turn's load noted for
    recall (`Loaded.recall`); `active_since`: the end user's other sessions idle since before then
    have expired, and are not searched.

    Where the spare room suffices, the kept turns stay as they would be without recall, so the
    prefix before the block (system prompt, opening turns, summary, kept turns) is the one the
    previous request sent, grown by its exchange: the provider's prompt cache keeps hitting."""
    held = dataclasses.replace(context, recall_room=beside) if beside is not None else await build(session, floor)
    query = recall.question(fixed.new, context.messages)
    words = query.words
    if held.recall_room <= 0 or not words:
        return context
    postings = await store.recall_postings(session, words, held.first_sent, end_user, checked, active_since)
    limit = recall.shortlist(held.recall_room, session.head_compact_cum / max(session.length, 1))
    ranked = recall.rank(postings, around, session.session_id, limit, start=held.head_end,
                         weights=query.weights)
    if held.question >= 0:  # sent already, before the kept turns: never twice
        ranked = [r for r in ranked if r.seq != held.question or r.session_id != session.session_id]
    messages = await store.recall_messages(session, recall.spans(ranked), held.first_sent, end_user, postings)
    block = recall.choose(ranked, messages, words, held.recall_room, session.session_id, counter)
    if block is None:
        return context
    if block.tokens < held.recall_room and beside is None:  # room held back: what is left goes back
        refit = await build(session, block.tokens)
        smaller = recall.without(block, ranked, words, session.session_id, refit.first_sent, counter)
        if smaller is None:  # all it found is sent as kept turns
            return context
        if smaller.tokens <= refit.recall_room:
            held, block = refit, smaller
    at = recall.insert_at(held.messages, len(fixed.new))
    return dataclasses.replace(held, messages=[*held.messages[:at], block.message, *held.messages[at:]],
                               tokens=held.tokens + block.tokens, recall_tokens=block.tokens,
                               recalled=block.recalled, recall_query=tuple(words), recall_index=at)


async def _fold_left_out(
    summarizer: Summarizer, session: SessionState, model: ModelConfig, budget: Budget,
    memory: MemoryConfig, context: Context, build: Callable[[SessionState, int], Awaitable[Context]],
) -> tuple[Context, SessionState]:
    """The overflow policy `summarize`: fold what was left out, and everything older than the
    verbatim tail, then plan again. The room the new summary takes can push more turns out, so
    this repeats while folds apply, all within `sync_summary_timeout_seconds`; past that the fold
    goes on in the background and this request gets a marker meanwhile. The plan, and the session
    as it was planned on (its newest summary's version)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + memory.sync_summary_timeout_seconds
    tail = await summarizer.tail_start(session, budget.window)
    for _ in range(_SYNC_FOLDS):
        if not context.unsummarised_omitted or not summarizer.may_fold(session.tenant, session.session_id):
            break
        upto = min(max(context.first_sent, tail), context.mandatory_start)
        fold = summarizer.fold(session.tenant, session.session_id, model, upto=upto, automatic=True)
        try:
            result: FoldResult | None = await asyncio.wait_for(fold, max(deadline - loop.time(), 0))
        except asyncio.TimeoutError:
            result = None
        if result is not None and result.summary is not None:
            # The session was read before this summary was saved; planning again must look for it.
            session = dataclasses.replace(session, summary_version=result.summary.version)
        context = await build(session, 0)
        if result is None or result.outcome != "applied":
            break
    return context, session
