"""The Store protocol: what memory needs from a database, and nothing more.

Each session owns an active chain of messages numbered by `seq` (0, 1, ...). An edit or regenerate
marks the tail of the chain superseded (kept, never sent again) and continues from the fork point;
stored messages themselves are never rewritten. Every message carries its token count, the tokens of
the active chain before it (`cum_before`) and its chained hash, so serving a turn is a few indexed
lookups whatever the length of the history. `record_turn` writes a whole turn in one transaction; if
the session moved since the turn was planned, a turn that only continued the history goes after the
new head, and any other is refused (`StoreConflict`, `memproxy.store.errors`).

The protocol is split by who calls it: `TurnStore` is what a chat turn and the summariser need,
`AdminStore` what managing sessions needs (the admin API, the CLI, the retention sweep). Each caller
is typed against the narrower one it uses; `Store`, both, is what `open_store` returns. Every backend
passes the one contract suite in `tests/test_store_contract.py`.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol

from ..messages import Message, wire_form, without_reasoning

# How a chat turn's messages matched the stored ones (`memory.reconcile`), kept with the turn.
ChatKind = Literal["new", "continue", "window", "append", "edit", "regenerate"]
# A write of the Conversations API's items (`memproxy.conversations`): items appended, or one
# deleted (the tail cut back and written again without it), with no model call.
ItemsKind = Literal["items"]
# What a stored turn was: a chat turn, a summariser call (`record_summary_call`), the turn a fork's
# copy starts with (`memproxy.admin.fork`), or a write of conversation items.
TurnKind = Literal[ChatKind, "summary", "fork", ItemsKind]


@dataclass(frozen=True)
class SessionState:
    pk: int
    tenant: str
    session_id: str
    length: int  # messages on the active chain
    head_hash: str  # chained hash of the last active message ("" when empty)
    head_cum: int  # tokens of the whole active chain
    head_compact_cum: int  # the same, with older messages in their compact form
    system: list[Message] | None  # the last system prompt the client sent
    created_at: float
    updated_at: float
    summary_version: int  # the newest summary saved (0: none, so there is none to look for)
    # The newest active message, read with the row: whether a request echoes the stored tail is
    # decided against it, with no read of its own on most turns (None: the session is empty).
    head_message: Message | None = None
    # The counter that made its stored token counts (`TokenCounter.name`), `MIXED_COUNTS` once several
    # did, None where unknown (stored before memproxy kept it): a turn counted another way checks
    # what it sends by a count of its own (`memproxy.memory.plan`).
    tokenizer: str | None = None
    # Which row it is (`memproxy.store.sql.common.new_incarnation`): a session deleted and imported
    # again under its id is another, whatever it copied.
    incarnation: int = 0


MIXED_COUNTS = "*"  # `SessionState.tokenizer` of a session whose counts several counters made


@dataclass(frozen=True)
class StoredMessage:
    seq: int
    body: Message
    tokens: int
    cum_before: int
    unit_start: bool
    chain_hash: str
    compact_body: Message | None = None  # how it is sent once older than the newest exchange
    compact_tokens: int = 0
    compact_cum_before: int = 0

    @property
    def compact(self) -> Message:
        return self.compact_body if self.compact_body is not None else self.body

    # How it is sent once its exchange is over (`without_reasoning`), as stored and in compact
    # form: worked out once per decoded message, which the history cache keeps from turn to turn,
    # not once per message per turn (a long session sent whole: thousands).
    @functools.cached_property
    def settled(self) -> Message:
        return without_reasoning(self.body)

    @functools.cached_property
    def settled_compact(self) -> Message:
        return without_reasoning(self.compact)

    # The same as they go upstream (`wire_form`), worked out once too; not for an answer with audio,
    # whose form is the clock's (`memproxy.memory.sent`).
    @functools.cached_property
    def wire_settled(self) -> Message:
        return wire_form(self.settled)

    @functools.cached_property
    def wire_settled_compact(self) -> Message:
        return wire_form(self.settled_compact)

    @property
    def settled_tokens(self) -> int:
        """The tokens of `settled`. An answer's compact form is the answer without its reasoning
        (`memproxy.memory.shrink.new_message`: only a tool result's is trimmed), counted when it
        was stored; an answer stored with no compact form counts whole, never under."""
        if self.compact_body is not None and self.body.get("role") == "assistant":
            return self.compact_tokens
        return self.tokens


@dataclass(frozen=True)
class NewMessage:
    body: Message
    tokens: int
    unit_start: bool
    chain_hash: str
    compact_body: Message | None = None
    compact_tokens: int | None = None  # None: the same as `tokens`
    # The tokens of its line in a recall block (`memproxy.searchtext.recall_line`); None: counted when recalled.
    recall_tokens: int | None = None

    @property
    def compacted_tokens(self) -> int:
        """Its tokens in compact form: what it adds to the compact running total."""
        return self.tokens if self.compact_tokens is None else self.compact_tokens


@dataclass(frozen=True)
class Totals:
    """Tokens of the active chain before a position: as stored, and with compact forms."""

    full: int
    compact: int


@dataclass(frozen=True)
class Summary:
    version: int
    text: str
    covers: int  # active messages with seq < covers are folded into it
    covers_hash: str  # chained hash of message covers - 1 when it was written
    tokens: int  # of the summary message as sent
    replaced_tokens: int  # of what it replaced: the previous summary and the messages folded in
    model: str
    created_at: float = 0.0


def mandatory_start(base: int, whole_last_unit: bool, last_unit: int | None) -> int:
    """Where the stored messages that must be sent start: the last unit's start when the turn must
    send it whole (`memory.fit.must_send_last_unit`), else nothing before `base` must go."""
    return base if not whole_last_unit or last_unit is None else last_unit


@dataclass(frozen=True)
class Snapshot:
    """What fitting a turn into the budget can need from a session, read by one `Store.snapshot`
    call: the totals at the positions the fit asks about, the summary in use, and the stored
    messages that can possibly be sent. That is a bounded tail, never the whole history: the
    messages from `start` on, where `start` is the earliest of the last unit (which must be sent)
    and the first unit start whose tail up to `base` fits in `room` tokens, counted as stored or
    compact (or the whole history, when it all fits as stored). Every unit start before `start`
    costs more than `room` either way."""

    base: int  # stored messages kept before the new ones
    base_totals: Totals
    must_start: int  # stored messages from here on must be sent (the last unit, or none: `base`)
    last_user: int | None  # the newest active user message before `base`
    summary: Summary | None  # the newest summary in use covering at most `must_start` messages
    summary_totals: Totals | None  # the totals at `summary.covers`
    start: int  # position of `messages[0]`
    messages: list[StoredMessage]  # the active messages from `start` to `base`

    def totals_at(self, seq: int) -> Totals | None:
        """Totals before `seq`, where the snapshot knows them (None: before `start`, out of reach)."""
        if seq >= self.base:
            return self.base_totals
        if self.summary is not None and self.summary_totals is not None and seq == self.summary.covers:
            return self.summary_totals
        i = self.index(seq)
        if seq < self.start or i == len(self.messages) or self.messages[i].seq != seq:
            return None
        return Totals(self.messages[i].cum_before, self.messages[i].compact_cum_before)

    def index(self, seq: int) -> int:
        """Where the messages from position `seq` on begin in `messages`. Positions may have gaps:
        `max_messages_per_session` deletes messages a summary in use stands for."""
        return bisect.bisect_left(self.messages, seq, key=lambda m: m.seq)


@dataclass(frozen=True)
class Loaded:
    """A session read together with what fitting a turn at its head can need (`TurnStore.load`):
    the snapshot for `base` = the session's length and any room up to `room`. A turn that continues
    the session (most turns) needs nothing more from the store to plan."""

    session: SessionState
    room: int
    last_unit: int | None  # the newest unit start
    last_user: int | None  # the newest user message
    start: int  # position of `messages[0]`
    messages: list[StoredMessage]  # every message that any room up to `room` could send
    summary: Summary | None  # the session's newest summary, if it is in use
    summary_totals: Totals | None
    summary_known: bool = True  # False: the newest summary is not in use, and an older one may be
    # The store's own note for recall (its in-memory index of the session, checked by this very
    # read, with the messages it lacks), for `TurnStore.recall_postings` of the same turn to use
    # without a statement of its own (None: nothing to note).
    recall: object = field(default=None, compare=False, repr=False)

    def snapshot(self, base: int, whole_last_unit: bool, room: int) -> Snapshot | None:
        """What `TurnStore.snapshot` would give (it may hold more messages, never fewer), or None
        where this read cannot tell: a base before the head, a larger room, a newest summary not in
        use (an older one may be), or a summary that reaches into the unit that must be sent."""
        session = self.session
        if base != session.length or room > self.room or not self.summary_known:
            return None
        must_start = mandatory_start(base, whole_last_unit, self.last_unit)
        if self.summary is not None and self.summary.covers > must_start:
            return None
        return Snapshot(base=base, base_totals=Totals(session.head_cum, session.head_compact_cum),
                        must_start=must_start, last_user=self.last_user, summary=self.summary,
                        summary_totals=self.summary_totals, start=self.start, messages=self.messages)


# A recall query word found at more positions than this is left out of the ranking: its weight is
# small by then, and reading its positions would make a turn's cost grow with the session (a long
# question of common words on a 10,000-message session took 54 ms unbounded).
COMMON_WORD_POSITIONS = 1000


@dataclass(frozen=True)
class Postings:
    """Where each word of a recall query occurs among the messages recall may send
    (`TurnStore.recall_postings`): all that ranking them needs (`memproxy.memory.recall.rank`)."""

    sizes: dict[str, int]  # session id -> how many positions recall may take from it
    words: list[dict[str, list[int]]]  # per query word, in order: session id -> its positions holding it
    # The store's own note of where it found them (its in-memory index, checked against the store by
    # this very call), for `recall_messages` of the same turn to read from without checking again.
    source: object = field(default=None, compare=False, repr=False)


class RecalledMessage(NamedTuple):
    """A stored message recall may send, as `TurnStore.recall_messages` reads it: no body to decode,
    only what its line in the block needs (`memproxy.memory.recall`). A tuple: a turn reads hundreds."""

    session_id: str
    seq: int
    role: str
    unit_start: bool
    text: str  # its compact form as one line (`memproxy.searchtext.line_text`)
    tokens: int | None  # that line's tokens, as stored with it (None: not counted yet)
    compact_tokens: int  # what it cost as a message of its own, in compact form
    created_at: float


@dataclass(frozen=True)
class SearchHit:
    """A stored message found by `AdminStore.search`."""

    tenant: str
    session_id: str
    seq: int
    score: float  # higher ranks first
    body: Message
    created_at: float


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int | None = None
    completion_tokens: int | None = None

    @classmethod
    def reported(cls, usage: Any) -> Usage:
        """From a provider's `usage` object, keeping only counts that are integers."""
        counts = usage if isinstance(usage, dict) else {}
        prompt, completion = counts.get("prompt_tokens"), counts.get("completion_tokens")
        return cls(prompt if isinstance(prompt, int) else None,
                   completion if isinstance(completion, int) else None)


@dataclass(frozen=True)
class SummaryCall:
    """One answered call to the summariser model, whatever came of its summary: what it cost."""

    model: str
    context_tokens: int  # of the request, as memproxy counts it
    usage: Usage
    latency_ms: float
    cost: float | None = None


@dataclass(frozen=True)
class SentContext:
    """What a chat turn's request was made of, kept with the turn so that what the model saw, and
    why, can be told after the fact (the admin `show`), not only for the next request."""

    summary_version: int  # the summary sent, 0 for none
    first_sent: int  # position of the first stored message sent
    included: int  # stored messages sent
    omitted: int  # stored messages not sent (summarised or left out)
    unsummarised_omitted: int  # of those, the ones no summary sent stands for
    marker: bool  # a note saying that earlier messages are not shown was sent
    trimmed: int  # stored tool outputs sent as head + tail
    deduplicated: int  # stored contents sent as a reference to an earlier copy
    # The stored messages recalled into the request (`memory.recall`), as (session id, position).
    recalled: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class NewResponse:
    """A response of `POST /v1/responses` kept with its turn (`TurnRecord.response`), so that a
    later request may name it (`previous_response_id`) and `GET /v1/responses/{id}` return it. It
    points at the turn's answer: the last of the turn's messages."""

    id: str  # `resp_...`, unique within its tenant
    body: dict[str, Any]  # the response object as returned
    input_items: list[dict[str, Any]]  # the input items it was asked with, as the client sent them


@dataclass(frozen=True)
class StoredResponse:
    """A kept response (`TurnStore.get_response`), with where its answer stands in its session."""

    id: str
    tenant: str
    session_id: str
    seq: int  # position of its answer on the session's chain
    chain_hash: str  # that answer's chained hash
    body: dict[str, Any]
    input_items: list[dict[str, Any]]
    created_at: float
    active: bool  # its answer is still on the active chain (not superseded by an edit)
    head: bool  # its answer is the session's newest message


@dataclass(frozen=True)
class KeptAnswer:
    """A kept response whose answer is an active message of its session (`TurnStore.kept_answers`)."""

    response_id: str
    seq: int  # position of its answer
    output: list[Any]  # the response's output items, as returned


@dataclass(frozen=True)
class TurnRecord:
    """One successful exchange, written atomically.

    The active chain is cut back to `base` messages (superseding the rest, if any) and `messages`
    (the client's new messages, then the assistant reply) continue it. `expected_length` and
    `expected_head_hash` are the session as it was when the turn was planned.
    """

    tenant: str
    session_id: str
    expected_length: int
    expected_head_hash: str
    base: int
    base_totals: Totals
    base_hash: str
    messages: Sequence[NewMessage]
    system: list[Message] | None
    model: str
    kind: ChatKind | ItemsKind
    context_tokens: int
    latency_ms: float
    usage: Usage = field(default_factory=Usage)
    full_tokens: int = 0  # what the request would have cost resending the whole history
    cost: float | None = None  # upstream cost, where litellm knows the price
    title: str | None = None  # the session's title, if it has none yet
    # The turn was planned on a session idle since before this time (`idle_ttl_seconds`): the store
    # starts it afresh, unless a write meanwhile (a metadata write, a clear) already did.
    expired_before: float | None = None
    sent: SentContext | None = None
    # The end user the turn was made for (`session_ids.end_user`: `X-Memproxy-User`, else the request's
    # `user` or `safety_identifier`): the session's, for recall across that user's sessions
    # (`memory.recall_scope: user`).
    end_user: str | None = None
    response: NewResponse | None = None  # a Responses API answer, kept with the turn
    tokenizer: str | None = None  # the counter that counted its messages (`TokenCounter.name`)
    # What the turn continues is fixed (a Responses `previous_response_id`: the provider must see only
    # what led to that response): after another writer's turn it is refused, never rebased after it.
    pinned: bool = False
    # The session's metadata, replaced whole with the turn (a conversation created with items and
    # metadata: one write, so a failure leaves neither); None leaves it as it is.
    metadata: dict[str, Any] | None = None


@dataclass(frozen=True)
class SessionInfo:
    """A session as listed: activity, size, usage."""

    tenant: str
    session_id: str
    title: str | None
    created_at: float
    updated_at: float
    messages: int  # on the active chain
    tokens_stored: int
    turns: int
    prompt_tokens: int
    completion_tokens: int
    cost: float | None
    tokens_saved: int  # resending everything would have cost this much more
    summary_version: int


@dataclass(frozen=True)
class MessageRecord:
    """Any stored message, superseded ones included."""

    id: int
    seq: int
    active: bool
    parent_id: int | None
    role: str
    body: Message
    tokens: int
    created_at: float


@dataclass(frozen=True)
class TurnInfo:
    """A stored turn (a chat turn, a summariser call or a fork) as `show` lists it."""

    kind: TurnKind
    model: str
    created_at: float
    context_tokens: int
    prompt_tokens: int | None
    completion_tokens: int | None
    cost: float | None
    stored_from: int | None  # position of the first message it stored (None: it stored none)
    stored_messages: int  # messages it stored that are still kept, superseded ones included
    sent: SentContext | None  # None: not a chat turn, or recorded before this was kept


@dataclass(frozen=True)
class StoredCounts:
    """What the store holds, for the metrics gauges (`AdminStore.stored_counts`)."""

    sessions: int
    messages: int  # every stored message, superseded ones included


@dataclass(frozen=True)
class UsageTotals:
    sessions: int
    turns: int  # chat turns; summariser calls are counted apart, their tokens and cost included
    prompt_tokens: int
    completion_tokens: int
    cost: float | None
    context_tokens: int  # what memproxy sent, summariser calls included
    full_tokens: int  # what resending everything would have sent
    summary_calls: int = 0

    @property
    def tokens_saved(self) -> int:
        return self.full_tokens - self.context_tokens

    def plus(self, other: UsageTotals) -> UsageTotals:
        """Both together; a cost is known if either part knows one."""
        cost = None if self.cost is None and other.cost is None else (self.cost or 0.0) + (other.cost or 0.0)
        return UsageTotals(
            sessions=self.sessions + other.sessions, turns=self.turns + other.turns,
            prompt_tokens=self.prompt_tokens + other.prompt_tokens,
            completion_tokens=self.completion_tokens + other.completion_tokens, cost=cost,
            context_tokens=self.context_tokens + other.context_tokens,
            full_tokens=self.full_tokens + other.full_tokens, summary_calls=self.summary_calls + other.summary_calls)


@dataclass(frozen=True)
class EndpointUsage:
    """What a tenant's calls to one pass-through endpoint (`embeddings`, `images`, ...) spent:
    calls that belong to no session, accounted to the tenant alone. A count the provider did not
    report adds nothing; a cost stays unknown (None) while no call's cost is known."""

    tenant: str
    endpoint: str
    calls: int
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost: float | None = None


class TurnStore(Protocol):
    """What a chat turn and the summariser need: a session read, its snapshot and summary, the turn
    written in one transaction, summaries saved under a lease, and the message cap."""

    async def ping(self) -> None: ...

    async def get_session(self, tenant: str, session_id: str) -> SessionState | None: ...

    async def load(self, tenant: str, session_id: str, room: int) -> Loaded | None:
        """The session and, read with it, its snapshot at the head for any room up to `room`
        (`Loaded.snapshot`); None if there is no such session. One trip on SQLite, two reads."""
        ...

    async def matched_prefix(self, session: SessionState, hashes: Sequence[str]) -> int:
        """How many leading `hashes` are on the session's active chain (they match position by position)."""
        ...

    async def totals_at(self, session: SessionState, seq: int) -> Totals:
        """Tokens of the active chain before position `seq` (`seq <= length`)."""
        ...

    async def user_positions(self, session: SessionState, before: int, limit: int) -> list[int]:
        """Positions of the newest `limit` active user messages below `before`, newest first."""
        ...

    async def snapshot(self, session: SessionState, base: int, whole_last_unit: bool, room: int) -> Snapshot:
        """What fitting a turn that keeps `base` stored messages can need (`Snapshot`), in as few
        trips as the backend allows. `whole_last_unit`: the last stored unit must be sent (a new
        tool result answers it, or nothing new was sent); `room`: the most tokens stored history can
        take, which bounds the messages read."""
        ...

    async def active_range(self, session: SessionState, start: int, stop: int) -> list[StoredMessage]: ...

    async def branch(self, session: SessionState, seq: int, chain_hash: str) -> list[StoredMessage] | None:
        """The chain that ends in the message at `seq` whose chained hash is `chain_hash`, active or
        superseded, from position 0 (where an edit forked it off, the active messages before the
        fork); None where that message, or one before it, is no longer stored (the message cap)."""
        ...

    async def recall_postings(self, session: SessionState, words: Sequence[str], before: int,
                              end_user: str | None = None, checked: object = None,
                              active_since: float | None = None) -> Postings:
        """Where each of `words` (`memproxy.searchtext.query_words`) occurs, as the full-text index
        stems it: among the session's active messages before position `before`, and, with
        `end_user`, every active message of the tenant's other sessions made for that end user
        (the newest 50). Superseded and deleted messages are never found. One statement, bounded:
        a word found at more than `COMMON_WORD_POSITIONS` positions in all is too common to tell
        messages apart, and is returned as found nowhere (SQLite reads no further than one past it;
        a PostgreSQL GIN bitmap is built whole). `checked`: `Loaded.recall` of this turn's
        `load`, which spares the statement where it holds the index it checked. `active_since`:
        the other sessions active since then only (the others have expired)."""
        ...

    async def recall_messages(self, session: SessionState, spans: Sequence[tuple[str, int, int]], before: int,
                              end_user: str | None = None, found: Postings | None = None) -> list[RecalledMessage]:
        """The active messages of `spans` (session id, first position, last position), each span
        extended to whole units (a message and the tool results answering it), by session and
        position; never at or after `before` in this session, nor in a session `recall_postings`
        would not look in. One statement for chat without tools; one more where a span must grow
        to whole units, and one to name an end user's other sessions. `found`: what
        `recall_postings` answered for the same `before` this turn; where it came from an index
        that call checked, the messages are read from that index and nothing is asked of the store
        (a turn is planned from what was stored when it began either way)."""
        ...

    async def current_summary(self, session: SessionState, upto: int) -> Summary | None:
        """The newest summary covering at most `upto` messages that are still the active history."""
        ...

    async def newest_summary_version(self, session: SessionState) -> int:
        """The newest summary version saved, in use or not (0: none): the `expected_version` a fold
        passes to `save_summary`. One row, where `summary_history` reads every version."""
        ...

    async def record_turn(self, turn: TurnRecord) -> None:
        """Write the turn in one transaction. If the session moved since the turn was planned, a
        continuation (`base == expected_length`, its base still on the active chain) is appended
        after the new head; anything else raises `StoreConflict` and writes nothing."""
        ...

    async def get_response(self, tenant: str, response_id: str, with_input: bool = True) -> StoredResponse | None:
        """The tenant's kept response of that id (None: no such response, or another tenant's);
        without `with_input`, its `input_items` are not read (left empty): they hold the whole
        history a full-history client sent, where its output is one answer."""
        ...

    async def kept_answers(self, session: SessionState) -> list[KeptAnswer]:
        """The session's kept responses whose answers are still active (on the chain, unedited),
        by position: what names a conversation's items where they are a kept response's output."""
        ...

    async def delete_response(self, tenant: str, response_id: str) -> bool:
        """Forget a kept response (its turn's messages stay in the session); False if there was none."""
        ...

    async def add_endpoint_usage(self, usage: EndpointUsage) -> None:
        """Add to what the tenant's calls to `usage.endpoint` spent: one answered call, or a copy
        of another store's row (`endpoint_usage`)."""
        ...

    async def record_summary_call(self, session: SessionState, call: SummaryCall) -> None:
        """Account a summariser call to its session (a `turns` row of kind `summary`, which sends
        nothing a full history would have: it counts against the tokens memory saved); nothing if
        the session is gone."""
        ...

    async def save_summary(self, session: SessionState, expected_version: int, summary: Summary) -> None:
        """Store `summary` as version `expected_version + 1`; `StoreConflict` if another version
        was saved meanwhile or the messages it covers are no longer the active history."""
        ...

    async def take_summary_lease(self, session: SessionState, holder: str, seconds: float) -> bool:
        """Claim the right to summarise the session for `seconds`, across every process sharing
        the store; False while someone else holds an unexpired lease."""
        ...

    async def release_summary_lease(self, session: SessionState, holder: str) -> None: ...

    async def cap_messages(self, session: SessionState, keep: int) -> int:
        """Delete the oldest stored messages beyond `keep` that can never be sent again (superseded,
        or covered by the summary in use); returns how many."""
        ...

    async def touch(self, session: SessionState, now: float) -> None:
        """Mark the session active at `now` (its last activity only moves forward): a turn on it
        has begun (`memproxy.memory.retention.keep_alive`)."""
        ...

    async def close(self) -> None: ...


class AdminStore(Protocol):
    """What managing sessions needs (the admin API, the CLI, the retention sweep): listing,
    showing, exporting and importing, deleting and clearing, metadata and usage. `tenant=None`
    means every tenant. A session to manage is found with `TurnStore.get_session`."""

    async def list_sessions(
        self, tenant: str | None, limit: int, before: tuple[float, str, str] | None = None
    ) -> tuple[list[SessionInfo], tuple[float, str, str] | None]:
        """Newest activity first, `limit` at a time; returns the page and the cursor of the next.
        A cursor is the last session listed, as `(updated_at, tenant, session_id)`: what its
        tenant may see, never a store-wide key."""
        ...

    async def session_info(self, session: SessionState) -> SessionInfo: ...

    async def last_model(self, session: SessionState) -> str | None:
        """The model of the session's newest chat turn (summariser calls and forks aside)."""
        ...

    async def all_messages(self, session: SessionState) -> list[MessageRecord]: ...

    async def turns(self, session: SessionState) -> list[TurnInfo]:
        """Every stored turn of the session, oldest first."""
        ...

    async def summary_history(self, session: SessionState) -> list[Summary]:
        """Every summary version saved, oldest first, in use or not (what `show` lists)."""
        ...

    # Deleting sessions, by any of these or by a turn replacing an expired session, first adds
    # their usage to their tenant's rollup (`deleted_usage`), in the same transaction.

    async def delete_session(self, session: SessionState) -> None: ...

    async def delete_tenant(self, tenant: str) -> int:
        """Delete every session of the tenant, whatever its clock says; returns how many."""
        ...

    # `expired_before`: a session last active before this time has expired (`idle_ttl_seconds`);
    # a write to it first starts it afresh, exactly as a turn would (the old one deleted, usage
    # rolled up), so nothing of its past comes back. Checked under the session's row lock.

    async def clear_session(self, session: SessionState, expired_before: float | None = None) -> bool:
        """Start afresh: every message superseded, no system prompt; the record (title, metadata)
        stays. False if the session is gone."""
        ...

    async def get_metadata(self, session: SessionState) -> Any: ...

    async def set_metadata(
        self, tenant: str, session_id: str, metadata: dict[str, Any], expired_before: float | None = None
    ) -> None:
        """Replace the metadata; creates the session if it does not exist yet (an agent may set
        state before a turn)."""
        ...

    async def merge_metadata(
        self, tenant: str, session_id: str, changes: dict[str, Any], expired_before: float | None = None
    ) -> dict[str, Any] | None:
        """Merge top-level keys into the metadata (a key set to None is removed) and return the
        result, read and written in one transaction under the session's row lock, so concurrent
        merges of different keys all land; None if there is no such session."""
        ...

    async def usage(self, tenant: str | None) -> UsageTotals:
        """What the tenant's current sessions spent."""
        ...

    async def deleted_usage(self, tenant: str | None) -> UsageTotals:
        """What the tenant's deleted sessions had spent (`sessions`: how many were deleted)."""
        ...

    async def export_session(self, session: SessionState) -> list[dict[str, Any]]:
        """Every record of the session as plain JSON-able dicts, ids numbered within the export, as of
        one moment: turns written meanwhile are wholly in it or wholly not."""
        ...

    async def import_session(self, tenant: str, session_id: str, records: Sequence[dict[str, Any]]) -> None:
        """Recreate an exported session under `session_id`; `StoreConflict` if that id exists."""
        ...

    async def prune(self, older_than: float, tenant: str | None = None) -> int:
        """Delete sessions idle since before `older_than` (of every tenant with None); returns how many."""
        ...

    async def tenant_rollups(self) -> dict[str, UsageTotals]:
        """Every tenant's `deleted_usage`, for copying a whole store."""
        ...

    async def add_to_rollup(self, tenant: str, usage: UsageTotals) -> None:
        """Add to what the tenant's deleted sessions had spent (a copy of another store's rollup)."""
        ...

    async def endpoint_usage(self, tenant: str | None) -> list[EndpointUsage]:
        """What the tenant's (every tenant's, with None) calls to the pass-through endpoints spent,
        a row per tenant and endpoint, ordered by both. Deleting sessions or tenants keeps it."""
        ...

    async def search(self, tenant: str | None, words: Sequence[str], limit: int,
                     session: SessionState | None = None, active_since: float | None = None) -> list[SearchHit]:
        """The active messages of the tenant's sessions (of `session` alone, if given) that match
        any of `words`, best `limit` first; with `active_since`, of sessions active since then only
        (the others have expired: `retention.idle_ttl_seconds`)."""
        ...

    async def stored_counts(self) -> StoredCounts:
        """How many sessions and messages the store holds, read at each metrics scrape: one
        statement, bounded (`Backend.row_count`)."""
        ...

    async def tenants_sessions(self) -> list[tuple[str, str]]:
        """Every (tenant, session id), for copying a whole store."""
        ...

    async def refresh_statistics(self) -> None:
        """After a bulk copy into the store: the database's query planner given fresh statistics of
        what it now holds, so that the first turns on long copied sessions are planned as later ones
        will be (PostgreSQL: ANALYZE; SQLite plans without statistics: nothing). Changes nothing stored."""
        ...


class Store(TurnStore, AdminStore, Protocol):
    """A whole store, as `open_store` returns it: what serves turns and what manages sessions."""
