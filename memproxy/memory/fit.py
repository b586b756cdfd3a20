"""Fitting a request into the model's window: the budget and the pre-flight overflow check.

budget = max input tokens - output reserve - safety margin. The request sent is, in order:

    system prompt | summary of older turns | marker | stored turns that fit | new messages

What must be sent (system prompt, tool schemas, the new messages, and the stored unit a new tool
result answers) is checked first: if that alone cannot fit, `ContextLengthExceeded` is raised before
anything is sent or stored. Stored history fills what is left, newest first, in whole units (a
message and the tool results answering it), so no tool result is sent without its call; a call the
client never answered goes as a line of its message's text (`settle_unanswered_calls`). The newest
exchange (from the latest user message on) goes verbatim; older messages go in their compact form
(`memproxy.memory.shrink`).

The summary, when there is one, stands for every message before `covers`; only later messages are
candidates. Unsummarised messages that do not fit are announced by a marker (policy permitting), so
they are never lost without a trace.

`fit` is a pure function (what it keeps of a history as sent for the next turn, `memory.sent`, is
the same whether it is kept or worked out again): everything it decides from is in a `Snapshot`
that one store call loads (`Store.snapshot`): the totals it asks about, the summary in use, and the
tail of stored messages that can possibly be sent. Stored messages carry their token counts and running totals, so the tail
is bounded by the room in the budget, not by the length of the history, and nothing stored is
re-tokenized to build a request.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NamedTuple

from ..config import MemoryConfig
from ..errors import BadRequest, ContextLengthExceeded
from ..messages import Message, called, starts_unit, unanswered_result, wire_form
from ..store import Snapshot, StoredMessage, Summary, Totals
from ..tokens import TokenCounter, holds_media
from .sent import SentHistories, older

SUMMARY_PREFIX = (
    "Summary of the earlier conversation, for background only: it records what was said before "
    "the messages that follow and is not a new instruction.\n\n"
)


@dataclass(frozen=True)
class Budget:
    window: int
    output_reserve: int
    margin: int
    calibration: float = 1.0  # the provider's tokens per counted token (`memproxy.calibration`)

    @property
    def input_tokens(self) -> int:
        """What the request may hold, by memproxy's count: beyond it, a request is refused."""
        return self.window - self.output_reserve - self.margin

    @property
    def planned_tokens(self) -> int:
        """What history is planned to fill up to: the input tokens as the provider counts them."""
        return int(self.input_tokens / self.calibration)


@dataclass(frozen=True)
class Fixed:
    """What every request sends whatever the history: it must fit."""

    system: list[Message]
    new: list[Message]
    tokens: int  # system prompt, new messages, tool schemas and the reply priming


class Recalled(NamedTuple):
    """A stored message sent again in the recall block (`memproxy.memory.recall`)."""

    session_id: str
    seq: int
    role: str
    created_at: float
    score: float | None  # its own match score as a hit; None: sent as context around hits
    matched: tuple[str, ...] = ()  # the query words it holds


@dataclass(frozen=True)
class Context:
    messages: list[Message]
    tokens: int  # counted tokens of the whole request
    included: int  # stored messages sent
    omitted: int  # stored messages not sent (summarised or left out)
    unsummarised_omitted: int  # of those, the ones no summary sent stands for
    first_sent: int  # position of the first stored message sent
    mandatory_start: int  # stored messages from here on must be sent
    base_totals: Totals  # tokens of the stored history kept before the new messages
    summary: Summary | None = None
    marker: bool = False
    trimmed: int = 0  # stored tool outputs sent in their compact form
    deduplicated: int = 0  # stored contents sent as a reference to an earlier copy
    # What a background fold would weigh against its threshold, as this turn saw the session: the
    # summary in use and the stored history after it, in compact tokens (`Summarizer.after_turn`).
    unfolded: int = 0
    # Recall (`memproxy.memory.recall`): the room the fit held back for it, and what it sent there.
    recall_room: int = 0
    recall_tokens: int = 0
    recalled: tuple[Recalled, ...] = ()
    recall_query: tuple[str, ...] = ()
    recall_index: int = -1  # where the recall block is in `messages` (-1: none)
    # The session's opening turns sent verbatim after the system prompt (`memory.head_turns`): how
    # many messages, and the position where they end (0: none sent).
    head: int = 0
    head_end: int = 0
    # The stored user message an agent loop continues, sent verbatim before the kept turns where
    # the cut fell after it (`fit`'s `question`): its position (-1: none sent so).
    question: int = -1
    media: bool = False  # a message holds media or a spoken answer (`tokens.holds_media`): counted by estimate


def summary_message(text: str) -> Message:
    return {"role": "system", "content": SUMMARY_PREFIX + text}


def marker_message(left_out: int, summarised: bool = False, short: bool = False) -> Message:
    """`summarised`: some of them are in a summary that did not fit either. `short`: the fewest
    words that still say it, where the whole sentence does not fit."""
    if short:
        return {"role": "system", "content": f"[{left_out} earlier messages are not shown here.]"}
    why = "" if summarised else " and have not been summarised yet"
    return {
        "role": "system",
        "content": f"[{left_out} earlier messages of this conversation are not shown here: they did "
                   f"not fit in the context window{why}.]",
    }


@lru_cache(maxsize=4096)
def summary_tokens(counter: TokenCounter, text: str) -> int:
    """Summaries are small and change rarely; each is counted once per model tokenizer."""
    return counter.message(summary_message(text))


def must_send_last_unit(new: Sequence[Message]) -> bool:
    """Whether the newest stored unit must go: it holds the call a new tool result answers, or, when
    the client sent nothing new (regenerate), the message being answered."""
    return not new or not starts_unit(new[0])


def room_for_history(fixed: Fixed, budget: Budget) -> int:
    """The most tokens stored history can take in this request: what bounds the snapshot."""
    return budget.input_tokens - fixed.tokens


def room_beside(context: Context, budget: Budget, most: int, floor: int) -> int | None:
    """The room recall takes in a request planned as `context`, beside its kept turns: what the
    request leaves unused, up to `most`, where that is at least `floor` (the room recall is sure
    of); else None: older kept turns must give way (`fit`'s `reserve`)."""
    spare = max(0, min(budget.input_tokens, budget.planned_tokens) - context.tokens)
    return min(most, spare) if spare >= floor else None


def with_last_unit_counted(snapshot: Snapshot, counter: TokenCounter) -> Snapshot:
    """`snapshot` with what must be sent (the last unit, from `must_start` on) counted again by
    `counter`, for a session whose stored counts another counter made (a session moved to another
    model): the pre-flight check refuses a request by that count, and a unit another tokenizer
    counted at four times as much (a run of rare characters) would be refused though it fits.
    The older history's counts stay as stored: the plan counts what it sends again."""
    if snapshot.must_start >= snapshot.base:
        return snapshot
    before = _known(snapshot, snapshot.must_start)
    full, compact = before.full, before.compact
    at = snapshot.index(snapshot.must_start)
    messages = snapshot.messages[:at]
    for m in snapshot.messages[at:]:
        tokens = counter.message(m.body)
        compact_tokens = tokens if m.compact_body is None else counter.message(m.compact_body)
        messages.append(dataclasses.replace(m, tokens=tokens, cum_before=full, compact_tokens=compact_tokens,
                                            compact_cum_before=compact))
        full, compact = full + tokens, compact + compact_tokens
    return dataclasses.replace(snapshot, base_totals=Totals(full, compact), messages=messages)


def fit(
    snapshot: Snapshot | None,
    fixed: Fixed,
    budget: Budget,
    model_name: str,
    counter: TokenCounter,
    memory: MemoryConfig,
    use_marker: bool,
    reserve: int = 0,
    head: Sequence[StoredMessage] = (),
    question: StoredMessage | None = None,
    histories: SentHistories | None = None,
) -> Context:
    """The request to send: `fixed` plus the stored history that fits, from `snapshot` alone (None:
    nothing is stored before the new messages). Pure: it reads nothing but its arguments.

    `reserve`: tokens to hold back for recall from the room older kept turns would take, once the
    summary, the marker and the newest exchanges (from the latest stored user message on, verbatim)
    have theirs (`Context.recall_room` says how many were held). `head`: the session's opening turns
    (`memory.head_turns`), sent verbatim after the system prompt whenever older history must be left
    out, if they fit beside what must be sent. `question`: the stored user message an agent loop
    continues (`snapshot.last_user`; `wants_question` says when the plan reads it), sent verbatim
    before the kept turns where the cut falls after it, if it fits beside what must be sent: an
    agent's task is not left out for its own tool calls, nor its conversation opened with the
    model (which Gemini's and Anthropic's APIs refuse). `histories`: what earlier turns worked out
    of the same history (`memory.sent`). The messages are in the form they go upstream
    (`messages.wire_form`)."""
    available = room_for_history(fixed, budget)
    empty = Totals(0, 0)
    if snapshot is None or snapshot.base == 0:
        _check_fits(available, 0, fixed, budget, model_name)
        return Context(list(map(wire_form, fixed.system + fixed.new)), fixed.tokens, 0, 0, 0, 0, 0, empty,
                       media=holds_media(fixed.system + fixed.new))
    unfolded = snapshot.base_totals.compact
    if snapshot.summary is not None and snapshot.summary_totals is not None:
        unfolded += summary_tokens(counter, snapshot.summary.text) - snapshot.summary_totals.compact
    base, base_totals, must_start = snapshot.base, snapshot.base_totals, snapshot.must_start
    must_tokens = base_totals.full - _known(snapshot, must_start).full
    _check_fits(available, must_tokens, fixed, budget, model_name)
    # Planned for the provider's count; what must be sent goes whatever the calibration says.
    available = max(min(available, budget.planned_tokens - fixed.tokens), must_tokens)

    summary = snapshot.summary
    covered = summary.covers if summary else 0  # whether or not the summary fits
    extra: list[Message] = []
    if summary is not None:
        tokens = summary_tokens(counter, summary.text)
        if must_tokens + tokens <= available:
            available -= tokens
            extra.append(summary_message(summary.text))
        else:
            summary = None
    floor = summary.covers if summary else 0
    stored = snapshot.messages
    # The whole history fits as stored (most sessions): no cut to look for, unless the session opens
    # on a tool result, which no cut may keep without its call.
    whole = floor == 0 and base_totals.full <= available and snapshot.start == 0 and bool(stored) \
        and stored[0].seq == 0 and stored[0].unit_start
    opening: list[Message] = []
    opening_tokens = 0
    if head and not whole and len(head) <= must_start:
        opening, saved = settle_unanswered_calls([m.settled for m in head], [m.settled_tokens for m in head],
                                              [], counter)
        opening_tokens = sum(m.settled_tokens for m in head) - saved
        # Where history is left out, what is sent must say so: the opening turns never take the
        # room of the shortest marker.
        least_marker = counter.message(marker_message(base, short=True)) if use_marker else 0
        if must_tokens + opening_tokens + least_marker <= available:
            available -= opening_tokens
            floor = max(floor, len(head))
        else:
            opening, opening_tokens = [], 0
    newest = _newest_exchange(snapshot, fixed.new, floor)
    trim = memory.tool_output_max_tokens > 0
    if question is not None and (question.seq < len(opening) or any(m.get("role") == "user" for m in fixed.new)):
        question = None  # sent already among the opening turns, or the client asks anew
    # this counter's count: the stored one may be another's
    asked_tokens = counter.message(question.body) if question is not None else 0
    held = 0
    if reserve > 0:
        marker_cost = counter.message(marker_message(base)) if use_marker else 0
        room = available - marker_cost
        protected_from = snapshot.last_user
        protected = _verbatim_from(snapshot, protected_from, must_tokens)
        if protected >= room:  # the exchange before does not fit whole anyway: only the newest is kept
            protected_from = newest
            protected = _verbatim_from(snapshot, newest, must_tokens)
        if question is not None and (protected_from is None or protected_from > question.seq
                                     or snapshot.totals_at(protected_from) is None):
            protected += asked_tokens  # recall's room is not the agent loop's question's
        held = max(0, min(reserve, room - protected))
        available -= held
    if whole and base_totals.full <= available:  # still, with recall's room held back
        start = 0
    else:
        start = _cut(snapshot, newest, floor, available, trim)
    asked: list[Message] = []
    if question is not None and question.seq < start:
        least_marker = counter.message(marker_message(base, short=True)) if use_marker else 0
        if must_tokens + asked_tokens + least_marker <= available:
            available -= asked_tokens
            asked = [question.body]
            start = _cut(snapshot, newest, floor, available, trim)
    if not asked:
        asked_tokens = 0
    asked_left_out = int(bool(asked) and question is not None and question.seq >= floor)  # sent, not left out
    marker = False
    if start > floor and use_marker:
        # The sentence, else its short form; kept turns make room for it, never the other way round.
        for short in (False, True):
            marker_tokens = counter.message(marker_message(base, short=short))  # at least the real one's count
            if must_tokens + marker_tokens <= available:
                available -= marker_tokens
                start = _cut(snapshot, newest, floor, available, trim)
                # "not summarised yet" unless a summary covering some of them was left out too
                extra.append(marker_message(start - floor - asked_left_out,
                                            summarised=summary is None and covered > 0, short=short))
                marker = True
                break
    if start < snapshot.start:
        raise LookupError(f"position {start} is outside the session snapshot")
    sent = stored[snapshot.index(start) :]
    history, tokens_sent, trimmed, deduplicated, media = _history(sent, newest, fixed.new, counter, memory, histories)
    _check_answered(history, fixed.new)
    return Context(
        messages=[*map(wire_form, [*fixed.system, *opening, *extra, *asked]), *history, *map(wire_form, fixed.new)],
        tokens=fixed.tokens + sum(counter.message(m) for m in extra) + tokens_sent + opening_tokens + asked_tokens,
        included=len(opening) + len(asked) + len(history),
        omitted=base - len(opening) - len(asked) - len(history),
        unsummarised_omitted=start - floor - asked_left_out,
        first_sent=start,
        mandatory_start=must_start,
        base_totals=base_totals,
        summary=summary,
        marker=marker,
        trimmed=trimmed,
        deduplicated=deduplicated,
        unfolded=unfolded,
        recall_room=held,
        head=len(opening),
        head_end=len(head) if opening else 0,
        question=question.seq if asked and question is not None else -1,
        media=media or holds_media([*fixed.system, *opening, *asked, *fixed.new]),
    )


def wants_question(snapshot: Snapshot | None, new: Sequence[Message], context: Context) -> int | None:
    """Where the stored user message an agent loop continues is, if the plan `context` left it
    out (`fit`'s `question`: the plan reads it and fits again); None where there is none to send
    so: the client sent a user message, the question is sent already, or it opens the session's
    opening turns (`memory.head_turns`), which go whole or not at all."""
    if snapshot is None or snapshot.last_user is None or context.question >= 0:
        return None
    at = snapshot.last_user
    if at >= context.first_sent or at < context.head_end or any(m.get("role") == "user" for m in new):
        return None
    return at


def _unit_start_from(snapshot: Snapshot, seq: int) -> int:
    """The first unit start from position `seq` on (`base` if none), where the snapshot holds it."""
    if seq < snapshot.start or seq >= snapshot.base:
        return seq
    for m in itertools.islice(snapshot.messages, snapshot.index(seq), None):
        if m.unit_start:
            return m.seq
    return snapshot.base


def _check_answered(history: list[Message], new: list[Message]) -> None:
    """Refuse new tool results that follow no call of theirs: a client that sends only its new
    messages returning a call's results after another request continued the session. Sent so,
    the provider refuses them, after memory would have left their call out."""
    if not any(m.get("role") == "tool" for m in new):
        return
    index = unanswered_result(history, new)
    if index is not None:
        raise BadRequest(
            f"A tool result answers call '{new[index].get('tool_call_id')}', but it does not follow the "
            "assistant message that made that call: the session's latest message is another one (did "
            "another request continue the session meanwhile?). Send a call's results right after it, "
            "or resend the conversation whole.", param="messages")


def _verbatim_from(snapshot: Snapshot, seq: int | None, must_tokens: int) -> int:
    """The stored tokens from position `seq` on, as stored (what recall's room may not take: the
    newest exchange, and the one before it when it fits), where the snapshot knows them; at least
    what must be sent."""
    totals = None if seq is None else snapshot.totals_at(seq)
    return max(0 if totals is None else snapshot.base_totals.full - totals.full, must_tokens)


def _known(snapshot: Snapshot, seq: int) -> Totals:
    totals = snapshot.totals_at(seq)
    if totals is None:
        raise LookupError(f"position {seq} is outside the session snapshot")
    return totals


def _newest_exchange(snapshot: Snapshot, new: Sequence[Message], floor: int) -> int:
    """Where the newest exchange starts: nothing stored if the client sent a user message, else the
    latest stored user message (an agent loop continuing it)."""
    if any(m.get("role") == "user" for m in new):
        return snapshot.base
    newest = floor if snapshot.last_user is None else snapshot.last_user
    # It opens on a unit: a summary made before an edit may end inside one of the edited branch (it
    # folded a call the branch then answered right after it); the results after its end are left
    # out (and counted so), never sent without their call.
    return _unit_start_from(snapshot, min(max(newest, floor), snapshot.must_start))


def _cut(snapshot: Snapshot, newest: int, floor: int, available: int, trim: bool) -> int:
    """The first stored position sent: the longest run of whole units ending at `base` that fits,
    counting the newest exchange verbatim and older messages in their compact form (`trim`).

    A position before the snapshot's `start` costs more than the room it was read for, so a
    newest exchange that begins there cannot go verbatim, and no cut is looked for there."""
    base_totals = snapshot.base_totals
    newest_totals = snapshot.totals_at(newest)
    if newest_totals is not None and base_totals.full - newest_totals.full <= available:
        verbatim = base_totals.full - newest_totals.full
        older = newest_totals.compact if trim else newest_totals.full
        found = _first_fitting_unit_start(snapshot, floor, older - (available - verbatim), trim)
        if found is None or found >= newest:
            return newest
        # History is left out: what is kept opens with a user message, the newest exchange's where
        # none comes before it (the last exchange's answer alone, its question and calls left out).
        # An answer without its question tells little, and Gemini's API refuses a conversation that
        # opens with the model (as Anthropic's did, and as tests/fake_anthropic.py does).
        return _next_user_message(snapshot, found, newest) if found > floor else found
    found = _first_fitting_unit_start(snapshot, max(floor, newest), base_totals.full - available, False)
    return snapshot.must_start if found is None or found > snapshot.must_start else found


def _next_user_message(snapshot: Snapshot, start: int, newest: int) -> int:
    """The first user message from position `start` to before `newest`, else `newest`."""
    for m in itertools.islice(snapshot.messages, snapshot.index(start), snapshot.index(newest)):
        if m.body.get("role") == "user":
            return m.seq
    return newest


def _first_fitting_unit_start(snapshot: Snapshot, floor: int, min_cum_before: int, compact: bool) -> int | None:
    """The least unit start from `floor` on whose running total before it (compact or as stored)
    is at least `min_cum_before`. Running totals only grow, so the messages before the first one
    that reaches it are passed over by bisection, not one by one (a long snapshot: hundreds)."""
    messages = snapshot.messages
    key = (lambda m: m.compact_cum_before) if compact else (lambda m: m.cum_before)
    start = bisect.bisect_left(messages, min_cum_before, lo=snapshot.index(floor), key=key)
    return next((m.seq for m in itertools.islice(messages, start, None) if m.unit_start), None)


def _history(
    stored: list[StoredMessage], newest: int, new: list[Message], counter: TokenCounter, memory: MemoryConfig,
    histories: SentHistories | None = None,
) -> tuple[list[Message], int, int, int, bool]:
    """The stored messages as sent, in wire form (compact when older than the newest exchange, repeats
    sent once, unanswered calls told as text), their tokens, how many were trimmed and deduplicated,
    and whether one holds media (`tokens.holds_media`). `histories`: the older part as earlier
    turns worked it out (`memory.sent`)."""
    split = bisect.bisect_left(stored, newest, key=lambda m: m.seq)
    old, recent = stored[:split], stored[split:]
    # With trimming off (tool_output_max_tokens: 0), forms stored compact earlier go in full too;
    # reasoning never does (`without_reasoning`), nor is it counted where the answer's form
    # without it was counted when stored (`settled_tokens`); where it still holds it (a message
    # stored before reasoning was left out), it goes now, still counted: never under.
    trim, least = memory.tool_output_max_tokens > 0, memory.dedupe_min_tokens
    part = histories.older(old, trim, least, counter) if histories is not None else older(old, trim, least, counter)
    bodies = part.bodies + [wire_form(m.body) for m in recent]
    tokens = part.tokens + [m.tokens for m in recent]
    callers = part.callers + [i for i, m in enumerate(recent, len(old)) if m.body.get("tool_calls")]
    history, unanswered_saved = settle_unanswered_calls(bodies, tokens, new, counter, callers)
    media = part.media > 0 or holds_media([m.body for m in recent])
    return history, sum(tokens) - part.saved - unanswered_saved, part.trimmed, part.deduplicated, media


def settle_unanswered_calls(
    bodies: list[Message], tokens: list[int], new: list[Message], counter: TokenCounter,
    callers: list[int] | None = None,
) -> tuple[list[Message], int]:
    """The stored messages to send, without tool calls that no tool result answers.

    A client may get tool calls back and move on without running them (a structured answer given
    as a call, as pydantic-ai's output tool and instructor's tools mode give it, is never answered
    either); providers refuse a request holding an unanswered call. Such a call goes as a line of
    its message's text instead, `[called name {arguments}, no result]`, so the model still sees
    what it answered (the store keeps the call): never more than the call cost, which the fit was
    counted with; where it would cost more (a call of a very short id), the call is left out, and a
    message left with neither calls nor content is not sent. Returns the tokens this saved.
    `callers`: where the messages that call tools are, where known (a step per call, not per message).
    """
    if callers is None:
        callers = [i for i, message in enumerate(bodies) if message.get("tool_calls")]
    history = list(bodies)
    if not callers:  # most conversations: nothing to look at
        return history, 0
    saved = 0
    dropped: set[int] = set()
    for i in callers:
        message, count = bodies[i], tokens[i]
        calls = message["tool_calls"]
        answered = set()
        j = i + 1  # the tool results that follow it, among the stored messages and then the new ones
        while j < len(bodies) + len(new):
            following = bodies[j] if j < len(bodies) else new[j - len(bodies)]
            if following.get("role") != "tool":
                break
            answered.add(following.get("tool_call_id"))
            j += 1
        kept = [call for call in calls if call.get("id") in answered]
        if len(kept) == len(calls):
            continue
        body = {k: v for k, v in message.items() if k != "tool_calls"}
        if kept:
            body["tool_calls"] = kept
        told = _told(body, [call for call in calls if call.get("id") not in answered])
        if told is not None and (cost := counter.message(told)) <= count:
            body = told
        elif not kept and not body.get("content"):
            saved += count
            dropped.add(i)
            continue
        else:
            cost = counter.message(body)
        saved += count - cost
        history[i] = wire_form(body)
    return ([m for i, m in enumerate(history) if i not in dropped] if dropped else history), saved


def _told(body: Message, calls: list[Any]) -> Message | None:
    """`body` with a line of its text saying each of `calls` (None: content it cannot add to)."""
    text = "\n".join(f"[called {name if isinstance(name, str) and name else 'a tool'} "
                     f"{given if isinstance(given, str) and given else '{}'}, no result]"
                     for name, given in map(called, calls))
    content = body.get("content")
    if content is None or content == "":
        return {**body, "content": text}
    if isinstance(content, str):
        return {**body, "content": f"{content}\n{text}"}
    if isinstance(content, list):
        return {**body, "content": [*content, {"type": "text", "text": text}]}
    return None


def _check_fits(available: int, must_tokens: int, fixed: Fixed, budget: Budget, model: str) -> None:
    if must_tokens <= available:
        return
    if budget.input_tokens <= 0:  # the output's reserve and the margin take the whole window
        raise ContextLengthExceeded(
            f"The output's reserve leaves no room for input: model '{model}' has a context window of "
            f"{budget.window}, of which {budget.output_reserve} are reserved for the output (max_tokens or "
            f"max_completion_tokens, else the model's max_output_tokens) and {budget.margin} are a safety "
            "margin for counting. Lower max_tokens.",
            param="messages",
        )
    raise ContextLengthExceeded(
        f"This request needs at least {fixed.tokens + must_tokens} input tokens (system prompt, tools "
        f"and the new messages), but model '{model}' allows {budget.input_tokens}: a context window of "
        f"{budget.window} minus {budget.output_reserve} reserved for the output and a safety margin of "
        f"{budget.margin}. Shorten the new messages or lower max_tokens.",
        param="messages",
    )
