"""How values are stored: JSON and free text that round-trip through both databases, the column
lists the statements share, and rows read back as the store's dataclasses.

Every JSON string round-trips through both databases. JSON columns hold `json.dumps` text, where a NUL
is already the escape `\u0000` (PostgreSQL's text cannot hold the character itself); a lone surrogate
(a provider may send one) cannot be encoded as UTF-8, so such a value is written with every non-ASCII
character escaped (`dumps`). The plain text columns that take free text (a session's `title`, a
summary's `text`, model names) hold it as it is unless it has one of those characters, or starts like an escaped
one: then it is `_ESCAPED` followed by its JSON string (`text_in`, `text_out`). Rows written before
read back unchanged, so no migration was needed.
"""

from __future__ import annotations

import json
from typing import Any, overload

from ...searchtext import keyed, line_text, message_words, session_key
from ..base import SentContext, Summary, UsageTotals
from .script import Row, Step

# The columns an export carries, as they are named in the tables and in the export records.
SESSION_COLUMNS = ("created_at, updated_at, length, head_hash, head_cum, head_compact_cum, system_prompt,"
                   " title, metadata, end_user, tokenizer")
# Turns of chat, not summariser calls, forks nor writes of conversation items (`turns` rows of kind
# `summary`, `fork`, `items`), in a LEFT JOIN on turns `t`.
CHAT_TURNS = "coalesce(sum(CASE WHEN t.kind NOT IN ('summary', 'fork', 'items') THEN 1 ELSE 0 END), 0)"
# What a chat turn's request was made of (`SentContext`), in the order of its fields.
SENT_COLUMNS = ("summary_version, first_sent, included, omitted, unsummarised_omitted, marker, trimmed, deduplicated,"
                " recalled")
TURN_COLUMNS = ("created_at, model, kind, context_tokens, prompt_tokens, completion_tokens, latency_ms,"
                f" cost, full_tokens, {SENT_COLUMNS}")
# A tenant's usage summed over turns `t` of sessions `s` (LEFT JOIN), in the order of `tenant_usage`.
USAGE_SUMS = (f"count(DISTINCT s.pk), {CHAT_TURNS},"
              " coalesce(sum(CASE WHEN t.kind = 'summary' THEN 1 ELSE 0 END), 0),"
              " coalesce(sum(t.prompt_tokens), 0), coalesce(sum(t.completion_tokens), 0), sum(t.cost),"
              " coalesce(sum(t.context_tokens), 0), coalesce(sum(coalesce(t.full_tokens, t.context_tokens)), 0)")
USAGE_COLUMNS = "sessions, turns, summary_calls, prompt_tokens, completion_tokens, cost, context_tokens, full_tokens"
ROLLUP_SUMS = ", ".join("sum(cost)" if c == "cost" else f"coalesce(sum({c}), 0)" for c in USAGE_COLUMNS.split(", "))
# Adds an inserted `tenant_usage` row to the tenant's existing one; a cost stays unknown (null)
# only while neither part knows one.
ADD_TO_ROLLUP = ("ON CONFLICT (tenant) DO UPDATE SET "
                 + ", ".join(f"{c} = tenant_usage.{c} + excluded.{c}" for c in USAGE_COLUMNS.split(", ")
                             if c != "cost")
                 + ", cost = CASE WHEN tenant_usage.cost IS NULL AND excluded.cost IS NULL THEN NULL"
                 " ELSE coalesce(tenant_usage.cost, 0) + coalesce(excluded.cost, 0) END")


def rollup_step(tenant: str, usage: UsageTotals) -> Step:
    """The statement adding `usage` to the tenant's rollup of deleted sessions (`tenant_usage`)."""
    return (f"INSERT INTO tenant_usage (tenant, {USAGE_COLUMNS}) VALUES (?, {column_marks(USAGE_COLUMNS)})"
            f" {ADD_TO_ROLLUP}", (tenant, usage.sessions, usage.turns, usage.summary_calls, usage.prompt_tokens,
             usage.completion_tokens, usage.cost, usage.context_tokens, usage.full_tokens))


MESSAGE_COLUMNS = ("seq, active, role, body, tokens, cum_before, unit_start, chain_hash, created_at,"
                   " compact_body, compact_tokens, compact_cum_before")
SUMMARY_COLUMNS = "version, text, covers, covers_hash, tokens, replaced_tokens, model, created_at"
_JSON_COLUMNS = frozenset({"system_prompt", "metadata", "body", "compact_body", "recalled"})
# Free text, kept as it is where it can be (`text_in`); a model name only an import can make odd.
_TEXT_COLUMNS = frozenset({"title", "text", "model", "end_user", "tokenizer"})


def column_marks(columns: str) -> str:
    return ", ".join("?" * len(columns.split(", ")))


def as_record(columns: str, row: Row) -> dict[str, Any]:
    """A table row as an export record: JSON columns decoded, so the export is plain JSON."""
    out = {}
    for name, value in zip(columns.split(", "), row):
        if name in _JSON_COLUMNS and value is not None:
            value = json.loads(value)
        elif name in _TEXT_COLUMNS:
            value = text_out(value)
        out[name] = value
    return out


def record_values(columns: str, record: dict[str, Any]) -> list[Any]:
    values = []
    for name in columns.split(", "):
        value = record.get(name)
        if name in _JSON_COLUMNS and value is not None:
            value = dumps(value)
        elif name in _TEXT_COLUMNS and isinstance(value, str):
            value = text_in(value)
        values.append(value)
    return values


def to_summary(row: Row) -> Summary:
    return Summary(version=row[0], text=text_out(row[1]), covers=row[2], covers_hash=row[3], tokens=row[4],
                   replaced_tokens=row[5], model=text_out(row[6]), created_at=row[7])


def to_usage_totals(row: Row) -> UsageTotals:
    """`USAGE_COLUMNS` (summed: PostgreSQL's sums may be decimals) as totals."""
    return UsageTotals(sessions=int(row[0]), turns=int(row[1]), summary_calls=int(row[2]),
                       prompt_tokens=int(row[3]), completion_tokens=int(row[4]),
                       cost=None if row[5] is None else float(row[5]), context_tokens=int(row[6]),
                       full_tokens=int(row[7]))


def sent_values(sent: SentContext | None) -> list[int | str | None]:
    """A `SentContext` as `SENT_COLUMNS` store it (nulls for a turn that is not a chat turn; what
    was recalled as a JSON list of [session id, position], null for nothing)."""
    if sent is None:
        return [None] * len(SENT_COLUMNS.split(", "))
    recalled = dumps([list(r) for r in sent.recalled]) if sent.recalled else None
    return [sent.summary_version, sent.first_sent, sent.included, sent.omitted, sent.unsummarised_omitted,
            int(sent.marker), sent.trimmed, sent.deduplicated, recalled]  # not `astuple`: it deep-copies


def to_sent(row: Row) -> SentContext | None:
    """`SENT_COLUMNS` as stored: null for turns that are not chat turns, or were recorded before
    turns kept this."""
    if row[0] is None:
        return None
    recalled = tuple((str(sid), int(seq)) for sid, seq in json.loads(row[8])) if row[8] else ()
    return SentContext(summary_version=row[0], first_sent=row[1], included=row[2], omitted=row[3],
                       unsummarised_omitted=row[4], marker=bool(row[5]), trimmed=row[6], deduplicated=row[7],
                       recalled=recalled)


def recall_text(body: dict[str, Any], compact_body: dict[str, Any] | None) -> str:
    """What a message's `recall_text` column holds: its compact form as recall shows it (0009_recall)."""
    return text_in(line_text(compact_body if compact_body is not None else body))


def search_text(tenant: str, session_id: str, body: dict[str, Any], created_at: float) -> str:
    """What a message's `search_text` column holds: its words, keyed by its session (0009_recall)."""
    return keyed(session_key(tenant, session_id), message_words(body, created_at))


def dumps(value: Any) -> str:
    """JSON text that every database can store: control characters are escaped by `json.dumps`
    itself; a value with a lone surrogate (which no UTF-8 encoder takes) has all non-ASCII escaped.
    ASCII text, the common case, is checked in one pass; other text is encoded once to find out."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    if not text.isascii() and not _encodable(text):
        return json.dumps(value, ensure_ascii=True, separators=(",", ":"))
    return text


# Starts a free text stored as its JSON string: an ESC and a tag no text written before could
# plausibly start with.
_ESCAPED = "\x1bmemproxy-json:"


@overload
def text_in(text: str) -> str: ...
@overload
def text_in(text: None) -> None: ...
def text_in(text: str | None) -> str | None:
    """Free text as a text column stores it: as it is, or escaped where a database could not hold
    it (a NUL, a lone surrogate) or it would read back as escaped."""
    if text is None or ("\x00" not in text and not text.startswith(_ESCAPED) and _encodable(text)):
        return text
    return _ESCAPED + json.dumps(text, ensure_ascii=True)


@overload
def text_out(stored: str) -> str: ...
@overload
def text_out(stored: None) -> None: ...
def text_out(stored: str | None) -> str | None:
    if stored is None or not stored.startswith(_ESCAPED):
        return stored
    try:
        text = json.loads(stored[len(_ESCAPED):])
    except ValueError:  # never written by `text_in`: a text that happens to start so
        return stored
    return text if isinstance(text, str) else stored


def _encodable(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True
