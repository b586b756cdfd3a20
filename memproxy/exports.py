"""Session exports as JSON lines, and the checks an import passes before anything is written.

An export is one `session` record, then `turn`, `message` and `summary` records (`Store.export_session`).
Importing one gives back the same records, so a damaged or hand-edited export must be refused
whole, with a 400 naming the line and the field, never half-imported or stored in a shape that
fails later (a system prompt that is not a list of messages makes every later turn fail; a number
too large for its column is a database error). Every field is checked against what the store
writes: its JSON type, null where the store may write null, the range its column holds, and the
relations between records (ids, parents, positions, the head of the active chain, summaries).
Timestamps in the future are brought back to now: a session active "tomorrow" would outlive every
prune and idle TTL.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from typing import Any

from .bodies import parse_json
from .errors import BadRequest
from .messages import ROLES, SYSTEM_ROLES, validate_message

Record = dict[str, Any]
# A field's check: what is wrong with a value, or None.
Check = Callable[[Any], str | None]

_INT32, _INT64 = 2**31, 2**63  # what INTEGER and BIGINT columns hold on PostgreSQL


def _integer(high: int = _INT32, low: int = 0, nullable: bool = False) -> Check:
    def check(value: Any) -> str | None:
        if value is None and nullable:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            return "must be an integer" + (" or null" if nullable else "")
        return None if low <= value < high else f"must be from {low} to {high - 1}"
    return check


def _number(nullable: bool = False) -> Check:
    def check(value: Any) -> str | None:
        if value is None and nullable:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return "must be a number" + (" or null" if nullable else "")
        return None if math.isfinite(value) and value >= 0 else "must be a finite number, not negative"
    return check


def _text(nullable: bool = False, choices: frozenset[str] | None = None) -> Check:
    def check(value: Any) -> str | None:
        if value is None and nullable:
            return None
        if not isinstance(value, str):
            return "must be a string" + (" or null" if nullable else "")
        return None if choices is None or value in choices else f"must be one of {', '.join(sorted(choices))}"
    return check


def _flag(nullable: bool = False) -> Check:
    def check(value: Any) -> str | None:
        if value is None and nullable:
            return None
        ok = not isinstance(value, bool) and value in (0, 1)
        return None if ok else "must be 0 or 1" + (" or null" if nullable else "")
    return check


def _object(value: Any) -> str | None:
    return None if value is None or isinstance(value, dict) else "must be an object or null"


def _message(where: str, nullable: bool = False) -> Check:
    def check(value: Any) -> str | None:
        if value is None and nullable:
            return None
        try:
            validate_message(value, where)
        except BadRequest as exc:
            return f"is not a chat message: {exc.message}"
        return None
    return check


def _system_prompt(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        return "must be a non-empty list of system or developer messages, or null"
    for i, message in enumerate(value):
        problem = _message(f"system_prompt[{i}]")(message)
        if problem is None and message["role"] not in SYSTEM_ROLES:
            problem = f"is not a list of system or developer messages: [{i}] is a {message['role']} message"
        if problem:
            return problem
    return None


_SENT = {name: _integer(nullable=True) for name in (
    "summary_version", "first_sent", "included", "omitted", "unsummarised_omitted", "trimmed", "deduplicated")}
_SENT["marker"] = _flag(nullable=True)

# Every field of every record type, as the store writes it.
FIELDS: dict[str, dict[str, Check]] = {
    "session": {
        "format": _integer(high=2, low=1), "session_id": _text(nullable=True),
        "created_at": _number(), "updated_at": _number(), "length": _integer(), "head_hash": _text(),
        "head_cum": _integer(_INT64), "head_compact_cum": _integer(_INT64), "system_prompt": _system_prompt,
        "history_mode": _text(nullable=True, choices=frozenset({"full", "new"})), "title": _text(nullable=True),
        "metadata": _object,
    },
    "turn": {
        "id": _integer(_INT64), "created_at": _number(), "model": _text(), "kind": _text(),
        "context_tokens": _integer(), "prompt_tokens": _integer(nullable=True),
        "completion_tokens": _integer(nullable=True), "latency_ms": _number(), "cost": _number(nullable=True),
        "full_tokens": _integer(_INT64, nullable=True), **_SENT,
    },
    "message": {
        "id": _integer(_INT64), "turn": _integer(_INT64), "parent": _integer(_INT64, nullable=True),
        "seq": _integer(), "active": _flag(), "role": _text(choices=ROLES), "body": _message("body"),
        "tokens": _integer(), "cum_before": _integer(_INT64), "unit_start": _flag(), "chain_hash": _text(),
        "created_at": _number(), "compact_body": _message("compact_body", nullable=True), "compact_tokens": _integer(),
        "compact_cum_before": _integer(_INT64),
    },
    "summary": {
        "version": _integer(low=1), "text": _text(), "covers": _integer(low=1), "covers_hash": _text(),
        "tokens": _integer(), "replaced_tokens": _integer(), "model": _text(), "created_at": _number(),
    },
}
# Fields an export from before they existed lacks: absent reads as null. `history_mode` is the other
# way round: exports written before memproxy stopped learning a client's kind carry it; it is checked
# and then ignored (the store has no place for it any more).
_OPTIONAL = {"session_id", "format", "system_prompt", "history_mode", "title", "metadata", "prompt_tokens",
             "completion_tokens", "cost", "full_tokens", "parent", "compact_body", *_SENT}
_TIMES = ("created_at", "updated_at")


def to_jsonl(records: list[Record]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n" for r in records)


def from_jsonl(data: bytes | str) -> list[Record]:
    """The records of an export, checked; a 400 naming the line and field of the first problem.
    Lines end at `\n` only: an export holds U+2028 and other line separators as they are, inside
    its strings (`str.splitlines` would cut a record there). Each line is parsed as a request body
    is (`parse_json`): no lone surrogates, no deep nesting, no NaN."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    numbered: list[tuple[int, Record]] = []
    for line, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            record = parse_json(raw, "the record")
        except BadRequest as exc:
            raise BadRequest(f"not JSON lines: line {line}: {exc.message}", param=exc.param) from exc
        if not isinstance(record, dict) or not isinstance(record.get("type"), str) or record["type"] not in FIELDS:
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
    kind = record["type"]
    for name, check in FIELDS[kind].items():
        if name not in record and name in _OPTIONAL:
            continue
        problem = check(record.get(name)) if name in record else "is missing"
        if problem:
            raise BadRequest(f"line {line}: {kind} field '{name}' {problem}")
    if kind == "message" and record["body"]["role"] != record["role"]:
        raise BadRequest(f"line {line}: message field 'role' is not the role of its 'body'")
    if kind == "turn" and len({record.get(name) is None for name in _SENT}) > 1:
        raise BadRequest(f"line {line}: turn fields {', '.join(_SENT)} are all null or all set")


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
        if kind == "message" and (record["turn"] not in seen["turn"]
                                  or record.get("parent") not in (None, *seen["message"])):
            raise BadRequest(f"line {line}: a message refers to a turn or message not before it")
        seen[kind].add(key)
    head = next(r for _, r in numbered if r["type"] == "session")
    length = head["length"]
    active = {r["seq"]: r for _, r in numbered if r["type"] == "message" and r["active"]}
    count = sum(1 for _, r in numbered if r["type"] == "message" and r["active"])
    if len(active) != count or not all(0 <= seq < length for seq in active) or \
            len({r["chain_hash"] for r in active.values()}) != count:
        raise BadRequest("the active messages of an export must be numbered below its length, once each")
    summaries = [r for _, r in numbered if r["type"] == "summary"]
    for summary in summaries:
        if summary["covers"] > length:
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
