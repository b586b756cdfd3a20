"""Session exports as JSON lines, and the checks an import passes before anything is written.

An export is one `session` record, then `turn`, `message` and `summary` records (`Store.export_session`).
Importing one gives back the same records, so a damaged or hand-edited export must be refused
whole, with a 400 naming the line and the field, never half-imported or stored in a shape that
fails later (a system prompt that is not a list of messages makes every later turn fail; a number
too large for its column is a database error). Every field is checked against what the store
writes: its JSON type, null where the store may write null, the range its column holds, and the
relations between records (ids, parents, positions, the head of the active chain, summaries), and
each active message's chain hash against its body.
Timestamps in the future are brought back to now: a session active "tomorrow" would outlive every
prune and idle TTL.

Each record type is a strict pydantic model (`extra="forbid"`: a field the store never writes is
refused too); its first error becomes `line N: <type> field '<name>' <why>`, in memproxy's words.
The relations between records are checked after, by hand: they span lines.
"""

from __future__ import annotations

import json
import math
import re
import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from .jsonparse import parse_json, refuse_lone_surrogates
from .errors import BadRequest
from .messages import SYSTEM_ROLES, chain_hash, validate_message
from .store.base import TurnKind

Record = dict[str, Any]

_INT32, _INT64 = 2**31, 2**63  # what INTEGER and BIGINT columns hold on PostgreSQL


# --- field types: what the store writes, each with the range its column holds ---------------------

def _range(low: int, high: int) -> AfterValidator:
    def check(value: int) -> int:
        if not low <= value < high:
            raise ValueError(f"must be from {low} to {high - 1}")
        return value
    return AfterValidator(check)


def _finite(value: float) -> float:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError("must be a finite number, not negative")
    return value


_HASH = re.compile("[0-9a-f]{32}")  # what `messages.chain_hash` makes


def _hash(empty: bool = False) -> AfterValidator:
    """A chain hash (or, `empty`, none: the head of an empty session). Only a hash can match one,
    and only such text is sure to fit a text column: PostgreSQL refuses a NUL in one with an error,
    answered as a store failure (503) rather than the client's mistake."""
    def check(value: str) -> str:
        if not (_HASH.fullmatch(value) or (empty and not value)):
            raise ValueError("must be a chain hash, 32 hex digits" + (", or empty" if empty else ""))
        return value
    return AfterValidator(check)


def _flag(value: int) -> int:
    if value not in (0, 1):
        raise ValueError("must be 0 or 1")
    return value


def _chat_message(value: Any, where: str) -> Any:
    try:
        validate_message(value, where)
    except BadRequest as exc:
        raise ValueError(f"is not a chat message: {exc.message}") from None
    return value


def _message(where: str, nullable: bool = False) -> AfterValidator:
    return AfterValidator(lambda value: value if value is None and nullable else _chat_message(value, where))


def _system_prompt(value: Any) -> Any:
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise ValueError("must be a non-empty list of system or developer messages, or null")
    for i, message in enumerate(value):
        _chat_message(message, f"system_prompt[{i}]")
        if message["role"] not in SYSTEM_ROLES:
            raise ValueError(f"is not a list of system or developer messages: [{i}] is a {message['role']} message")
    return value


Int = Annotated[int, _range(0, _INT32)]  # an INTEGER column
Big = Annotated[int, _range(0, _INT64)]  # a BIGINT column
Number = Annotated[float, AfterValidator(_finite)]
Flag = Annotated[int, AfterValidator(_flag)]
Hash = Annotated[str, _hash()]
Role = Literal["assistant", "developer", "function", "system", "tool", "user"]  # messages.ROLES


class _Record(BaseModel):
    """One line of an export. Strict: JSON types as the store writes them (no "3" for 3, no true for
    1); a field the store never writes is refused. Fields an export from before they existed lacks
    default to null (their records are imported as read, not as these models)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class SessionRecord(_Record):
    type: Literal["session"]
    format: Annotated[int, _range(1, 2)] = 1
    session_id: str | None = None
    created_at: Number
    updated_at: Number
    length: Int
    head_hash: Annotated[str, _hash(empty=True)]
    head_cum: Big
    head_compact_cum: Big
    system_prompt: Annotated[Any, AfterValidator(_system_prompt)] = None
    # Exports written before memproxy stopped learning a client's kind carry it: checked, then ignored
    # (the store has no place for it any more).
    history_mode: Literal["full", "new"] | None = None
    title: str | None = None
    metadata: dict[str, Any] | None = None
    end_user: str | None = None  # whose sessions recall may search together (`memory.recall_scope: user`)
    tokenizer: str | None = None  # which counter made the token counts (`SessionState.tokenizer`)


_SENT = ("summary_version", "first_sent", "included", "omitted", "unsummarised_omitted", "trimmed",
         "deduplicated", "marker")


def _pair(value: Any) -> Any:
    """A JSON array as the tuple a strict model reads (strict mode takes a list for a tuple only
    from JSON text, and an export's lines are parsed first)."""
    return tuple(value) if isinstance(value, list) else value


class TurnRecord(_Record):
    type: Literal["turn"]
    id: Big
    created_at: Number
    model: str
    kind: TurnKind  # every kind memproxy has written
    context_tokens: Int
    prompt_tokens: Int | None = None
    completion_tokens: Int | None = None
    latency_ms: Number
    cost: Number | None = None
    full_tokens: Big | None = None
    # What the turn sent (`SentContext`): all null (a turn from before it was kept) or all set.
    summary_version: Int | None = None
    first_sent: Int | None = None
    included: Int | None = None
    omitted: Int | None = None
    unsummarised_omitted: Int | None = None
    trimmed: Int | None = None
    deduplicated: Int | None = None
    marker: Flag | None = None
    # The messages recall sent again, as [session id, position] pairs (null: none, or older exports).
    recalled: list[Annotated[tuple[Annotated[str, Field(max_length=128)], Int], BeforeValidator(_pair)]] | None = None

    @model_validator(mode="after")
    def _sent_whole(self) -> TurnRecord:
        if len({getattr(self, name) is None for name in _SENT}) > 1:
            raise ValueError(f"turn fields {', '.join(_SENT)} are all null or all set")
        return self


class MessageRecord(_Record):
    type: Literal["message"]
    id: Big
    turn: Big
    parent: Big | None = None
    seq: Int
    active: Flag
    role: Role
    body: Annotated[Any, _message("body")]
    tokens: Int
    cum_before: Big
    unit_start: Flag
    chain_hash: Hash
    created_at: Number
    compact_body: Annotated[Any, _message("compact_body", nullable=True)] = None
    compact_tokens: Int
    compact_cum_before: Big

    @model_validator(mode="after")
    def _role_of_body(self) -> MessageRecord:
        if self.body["role"] != self.role:
            raise ValueError("message field 'role' is not the role of its 'body'")
        return self


class SummaryRecord(_Record):
    type: Literal["summary"]
    version: Annotated[int, _range(1, _INT32)]
    text: str
    covers: Annotated[int, _range(1, _INT32)]
    covers_hash: Hash
    tokens: Int
    replaced_tokens: Int
    model: str
    created_at: Number


RecordType = Literal["session", "turn", "message", "summary"]
RECORDS: dict[RecordType, type[_Record]] = {"session": SessionRecord, "turn": TurnRecord, "message": MessageRecord,
                                     "summary": SummaryRecord}
_TIMES = ("created_at", "updated_at")
_TYPE_WORDS = {"int_type": "an integer", "float_type": "a number", "string_type": "a string",
               "dict_type": "an object", "list_type": "a list"}


_PROVIDER_TEXT = frozenset({"body", "compact_body", "text"})  # a message's forms, a summary's text


def to_jsonl(records: list[Record]) -> str:
    """One line a record, as UTF-8 text; a record holding a lone surrogate (a provider's answer is
    stored as it came), which UTF-8 cannot encode, is written with JSON's escapes instead."""
    return "".join(_line(r) + "\n" for r in records)


def _line(record: Record) -> str:
    line = json.dumps(record, ensure_ascii=False, separators=(",", ":"))
    if line.isascii():
        return line
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(record, separators=(",", ":"))
    return line


def from_jsonl(data: bytes | str) -> list[Record]:
    """The records of an export, checked; a 400 naming the line and field of the first problem.
    Lines end at `\n` only: an export holds U+2028 and other line separators as they are, inside
    its strings (`str.splitlines` would cut a record there). Each line is parsed as a request body
    is (`parse_json`: no deep nesting, no NaN, no lone surrogates), but for message bodies and
    summary texts, which may hold a lone surrogate a provider answered (stored as it came)."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    numbered: list[tuple[int, Record]] = []
    for line, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            record = parse_json(raw, "the record", surrogates=True)
            if isinstance(record, dict):
                refuse_lone_surrogates({k: v for k, v in record.items() if k not in _PROVIDER_TEXT}, "the record")
        except BadRequest as exc:
            raise BadRequest(f"not JSON lines: line {line}: {exc.message}", param=exc.param) from exc
        if not isinstance(record, dict) or not isinstance(record.get("type"), str) or record["type"] not in RECORDS:
            raise BadRequest(f"line {line}: an export holds one session record and turn, message and "
                             "summary records")
        numbered.append((line, record))
    if [r["type"] for _, r in numbered].count("session") != 1:
        raise BadRequest("an export holds one session record and turn, message and summary records")
    for line, record in numbered:
        _check_fields(line, record)
    _check_relations(numbered)
    now = time.time()
    return [{**r, **{t: min(r[t], now) for t in _TIMES if t in r}} for _, r in numbered]


def _check_fields(line: int, record: Record) -> None:
    """The record against its model; the first problem as a 400 naming the line and the field."""
    kind = record["type"]
    model = RECORDS[kind]
    try:
        model.model_validate(record)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        if not error["loc"]:  # a check across the record's fields: its message says it all
            raise BadRequest(f"line {line}: {error['ctx']['error']}") from None
        name = str(error["loc"][0])
        raise BadRequest(f"line {line}: {kind} field '{name}' {_problem(model, name, error)}") from None


def _problem(model: type[_Record], name: str, error: Any) -> str:
    kind, ctx = error["type"], error.get("ctx") or {}
    field = model.model_fields.get(name)
    nullable = field is not None and not field.is_required() and field.default is None
    if kind == "missing":
        return "is missing"
    if kind == "extra_forbidden":
        return "is not a field of this record"
    if kind == "value_error":
        return str(ctx["error"])
    if kind == "literal_error":
        return f"must be one of {str(ctx['expected']).replace(chr(39), '').replace(' or ', ', ')}"
    return f"must be {_TYPE_WORDS.get(kind, 'valid')}" + (" or null" if nullable else "")


def _check_relations(numbered: list[tuple[int, Record]]) -> None:
    """Ids once each and referring back; the active chain numbered below the length, ending at the
    head; and gaps in it only where `max_messages_per_session` deletes: under a summary in use."""
    seen: dict[str, set[int]] = {"turn": set(), "message": set(), "summary": set()}
    for line, record in numbered:
        kind = record["type"]
        if kind == "session":
            continue
        key: int = record["version"] if kind == "summary" else record["id"]
        if key in seen[kind]:
            raise BadRequest(f"line {line}: a second {kind} {'version' if kind == 'summary' else 'id'} {key}")
        parent = record.get("parent")
        if kind == "message" and (record["turn"] not in seen["turn"]
                                  or (parent is not None and parent not in seen["message"])):
            raise BadRequest(f"line {line}: a message refers to a turn or message not before it")
        seen[kind].add(key)
    head = next(r for _, r in numbered if r["type"] == "session")
    length = head["length"]
    active = {r["seq"]: r for _, r in numbered if r["type"] == "message" and r["active"]}
    count = sum(1 for _, r in numbered if r["type"] == "message" and r["active"])
    if len(active) != count or not all(0 <= seq < length for seq in active) or \
            len({r["chain_hash"] for r in active.values()}) != count:
        raise BadRequest("the active messages of an export must be numbered below its length, once each")
    _check_chain(numbered, active)
    summaries = [r for _, r in numbered if r["type"] == "summary"]
    # A clear or an edit back to fewer messages keeps the summaries written before it (stale, never
    # used again): one may cover more than the length, never more than the messages stored reach.
    reach = max([length] + [r["seq"] + 1 for _, r in numbered if r["type"] == "message"])
    for summary in summaries:
        if summary["covers"] > reach:
            raise BadRequest(f"summary {summary['version']} covers {summary['covers']} messages, more than "
                             f"the session's length {length}")
    if has_gap(active, summaries_in_use(summaries, active, length), length):
        raise BadRequest("the active chain has a gap that no summary in use stands for")
    last = active[length - 1] if length else None
    expected = {"head_hash": last["chain_hash"], "head_cum": last["cum_before"] + last["tokens"],
                "head_compact_cum": last["compact_cum_before"] + last["compact_tokens"]} if last else \
        {"head_hash": "", "head_cum": 0, "head_compact_cum": 0}
    for name, value in expected.items():
        if head[name] != value:
            raise BadRequest(f"session field '{name}' does not match the last active message")


def _check_chain(numbered: list[tuple[int, Record]], active: dict[int, Record]) -> None:
    """Each active message's `chain_hash` names its body and the chain before it, where that chain
    is in the export (the first message, or one after an active one; the messages a cap deleted
    cannot be checked). Reconciling a client's messages matches them by these hashes: a body edited
    by hand under its old hash would be taken for what the client sent, and sent in its place."""
    lines = {id(r): line for line, r in numbered}
    for seq in sorted(active):
        before = "" if seq == 0 else active.get(seq - 1, {}).get("chain_hash")
        record = active[seq]
        if before is not None and chain_hash(before, record["body"]) != record["chain_hash"]:
            raise BadRequest(f"line {lines[id(record)]}: message field 'chain_hash' does not match its body and the"
                             " messages before it (an export is imported as exported; change a conversation"
                             " through the API)")


def summaries_in_use(records: list[Record], active: dict[int, Record], upto: int) -> list[Record]:
    """The summaries covering at most `upto` messages whose last one is still on the active chain
    (`active`: the active messages by position)."""
    return [s for s in records if s["type"] == "summary" and s["covers"] <= upto
            and active.get(s["covers"] - 1, {}).get("chain_hash") == s["covers_hash"]]


def has_gap(active: dict[int, Record], summaries: list[Record], end: int) -> bool:
    """Whether a position below `end` is missing from the active chain that none of `summaries`
    stands for (`max_messages_per_session` deletes only what the summary in use covers)."""
    floor = max((s["covers"] for s in summaries), default=1) - 1
    # Counted, not walked: `end` comes from the export and may be huge.
    return sum(1 for seq in active if floor <= seq < end) != max(end - floor, 0)


def exported_id(records: list[Record]) -> str:
    return str(next(r for r in records if r["type"] == "session").get("session_id") or "")
