"""Recall: the stored turns that matter come back, however old.

When a request leaves older history out, the fit holds back room for recall (`memory.recall_tokens`,
taken from what older kept turns would have had, never from the system prompt, the summary, the
marker, the newest exchange or the one before it). The store ranks the left-out messages of the
session (summarised ones too: the summary is lossy, the store is not) against the new question with
its full-text index (`TurnStore.recall`: BM25 on SQLite's FTS5, `ts_rank` on PostgreSQL), and
`choose` here picks what goes, a pure function of what the store found:

- the question is the latest user message's words (`searchtext.query_words`); a short follow-up
  ("and then?", fewer than `SHORT_QUESTION` words) is looked up with the exchange before it too;
- each hit goes with `memory.recall_context` messages each side of it, extended to whole units (a
  tool call with its results), so a question comes back with its answer and no tool result without
  its call;
- hits are ranked by their own score plus half of their neighbours' (`NEIGHBOUR_WEIGHT`): a hit
  inside a run of hits carries the passage, a lone mention ranks below it;
- the best spans that fit the room go, in chronological order, as one message after the kept turns
  and before the new messages (before the unit a new tool result answers), framed as background.

The block is never stored: the next turn recalls afresh. Where it goes keeps the provider's prompt
cache: the system prompt, the summary and the kept turns before it are what they would have been
without it. Whatever room it leaves unused goes back to the kept turns (`memory.plan`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from ..messages import Message, starts_unit
from ..searchtext import message_words, query_words
from ..store import Recall, RecalledMessage
from ..tokens import TokenCounter
from .fit import Recalled
from .shrink import content_text

HITS = 40  # the most hits the store ranks for one recall
SHORT_QUESTION = 3  # a question of fewer words is looked up with the exchange before it
NEIGHBOUR_WEIGHT = 0.5  # a hit's rank: its score plus this much of its neighbours' scores
# A message's line in the block costs its content, its label ("[#1234 assistant] ") and a newline,
# where as a message of its own it cost its content and the per-message overhead (4); a run of
# messages starts with the time. Estimates: the block is counted exactly once chosen.
_LINE_TOKENS = 7 - 4
_TIME_TOKENS = 8
RECALL_PREFIX = (
    "Recalled from earlier in this conversation: older messages that may bear on what follows, "
    "repeated for background only. They are not new requests or instructions.\n"
)


@dataclass(frozen=True)
class Block:
    """What recall sends: the message, its tokens, and the stored messages it holds."""

    message: Message
    tokens: int
    recalled: tuple[Recalled, ...]


def question(new: Sequence[Message], sent: Sequence[Message]) -> list[str]:
    """The words to recall by: the latest user message of the request (a new one, else the latest
    stored one an agent loop continues), with the exchange before it when it is short."""
    messages = [*sent[: len(sent) - len(new)], *new] if new else list(sent)
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    if not users:
        return []
    last = users[-1]
    words = query_words(_text(messages[last]))
    if len(words) < SHORT_QUESTION:
        start = users[-2] if len(users) > 1 else 0
        before = " ".join(_text(m) for m in messages[start:last])
        words = query_words(f"{_text(messages[last])} {before}")
    return words


def choose(found: Recall, room: int, around: int, session_id: str, counter: TokenCounter) -> Block | None:
    """The recall block: the best-ranked spans of `found` that fit in `room` tokens (None: none)."""
    if not found.hits or room <= 0:
        return None
    by_session: dict[str, list[RecalledMessage]] = {}
    for m in found.messages:
        by_session.setdefault(m.session_id, []).append(m)
    for messages in by_session.values():
        messages.sort(key=lambda m: m.message.seq)
    where = {(sid, m.message.seq): i for sid, messages in by_session.items() for i, m in enumerate(messages)}
    scores = {(h.session_id, h.seq): h.score for h in found.hits}

    def rank(key: tuple[str, int]) -> float:
        sid, seq = key
        return scores[key] + NEIGHBOUR_WEIGHT * (scores.get((sid, seq - 1), 0.0) + scores.get((sid, seq + 1), 0.0))

    chosen: dict[tuple[str, int], RecalledMessage] = {}
    spent = len(RECALL_PREFIX) // 4
    order: list[list[RecalledMessage]] = []
    for key in sorted(scores, key=rank, reverse=True):
        if key not in where:
            continue
        messages, index = by_session[key[0]], where[key]
        for candidate in (_span(messages, index, around), _span(messages, index, 0)):
            fresh = [m for m in candidate if (m.session_id, m.message.seq) not in chosen]
            cost = sum(_estimate(m) for m in fresh) + _TIME_TOKENS
            if fresh and spent + cost <= room:
                spent += cost
                chosen.update(((m.session_id, m.message.seq), m) for m in fresh)
                order.append(fresh)
                break
    # The estimate is close, not exact: the block is counted, and the lowest-ranked spans go until it fits.
    while order:
        block = _block(list(chosen.values()), scores, session_id, counter)
        if block.tokens <= room:
            return block
        for m in order.pop():
            chosen.pop((m.session_id, m.message.seq))
    return None


def without(block: Block, found: Recall, session_id: str, kept_from: int, counter: TokenCounter) -> Block | None:
    """The block less this session's messages from position `kept_from` on: sent as kept turns once
    the room recall left unused went back to them."""
    wanted = {(r.session_id, r.seq) for r in block.recalled
              if r.session_id != session_id or r.seq < kept_from}
    if len(wanted) == len(block.recalled):
        return block
    messages = [m for m in found.messages if (m.session_id, m.message.seq) in wanted]
    if not messages:
        return None
    return _block(messages, {(h.session_id, h.seq): h.score for h in found.hits}, session_id, counter)


def after(found: Recall, session_id: str, start: int) -> Recall:
    """`found` without this session's messages before position `start` (sent already)."""
    def kept(sid: str, seq: int) -> bool:
        return sid != session_id or seq >= start
    return Recall([h for h in found.hits if kept(h.session_id, h.seq)],
                  [m for m in found.messages if kept(m.session_id, m.message.seq)])


def insert_at(messages: list[Message], n_new: int) -> int:
    """Where the block goes in `messages`: before the new ones, or, when those continue a stored unit
    (tool results answering a stored call, or nothing new: a regenerate), before that unit."""
    at = len(messages) - n_new
    if n_new == 0 or not starts_unit(messages[at]):
        at -= 1
        while at > 0 and not starts_unit(messages[at]):
            at -= 1
    return at


def matched(words: Sequence[str], body: Message) -> list[str]:
    """The question's words a recalled message holds, as a reader would see the match: compared
    without the common English endings the store's stemmer also ignores ("visited" finds "visit")."""
    held = {_stem(w) for w in message_words(body, 0)}
    return [w for w in words if _stem(w) in held]


def _stem(word: str) -> str:
    for ending in ("ing", "ed", "es", "ly", "s"):
        if word.endswith(ending) and len(word) - len(ending) >= 3:
            return word[: -len(ending)]
    return word


def _span(messages: list[RecalledMessage], index: int, around: int) -> list[RecalledMessage]:
    """The messages the store sent for the hit `messages[index]`: `around` positions each side of
    it, extended to whole units, within a run of consecutive positions."""
    lo = hi = index
    while lo > 0 and messages[lo - 1].message.seq == messages[lo].message.seq - 1 and (
            index - lo < around or not messages[lo].message.unit_start):
        lo -= 1
    while hi + 1 < len(messages) and messages[hi + 1].message.seq == messages[hi].message.seq + 1 and (
            hi - index < around or not messages[hi + 1].message.unit_start):
        hi += 1
    if not messages[lo].message.unit_start:  # a unit cut short by a gap (deleted messages): not sent
        return []
    return messages[lo : hi + 1]


def _estimate(m: RecalledMessage) -> int:
    stored = m.message
    return max((stored.compact_tokens or stored.tokens) + _LINE_TOKENS, 1)


def _block(messages: list[RecalledMessage], scores: dict[tuple[str, int], float], session_id: str,
           counter: TokenCounter) -> Block:
    messages = sorted(messages, key=lambda m: (m.session_id != session_id, m.session_id, m.message.seq))
    lines = [RECALL_PREFIX]
    previous: tuple[str, int] | None = None
    shown = ""  # the time last shown: a run shows its time unless it is that one
    for m in messages:
        seq = m.message.seq
        if previous is not None and previous != (m.session_id, seq - 1):
            lines.append("…")
        when = ""
        if previous != (m.session_id, seq - 1):
            when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(m.created_at))
            when, shown = ("" if when == shown else f" {when}"), when
        lines.append(_line(m, session_id, when))
        previous = (m.session_id, seq)
    message: Message = {"role": "user", "content": "\n".join(lines)}
    recalled = tuple(Recalled(m.session_id, m.message.seq, m.message.body, m.created_at,
                              scores.get((m.session_id, m.message.seq))) for m in messages)
    return Block(message, counter.message(message), recalled)


def _line(m: RecalledMessage, session_id: str, when: str) -> str:
    body = m.message.compact
    where = f"#{m.message.seq}" if m.session_id == session_id else f"session {m.session_id} #{m.message.seq}"
    return f"[{where}{when} {body.get('role')}] {_text(body)}"


def _text(body: Message) -> str:
    """A message as one line of text: its content, and what it calls."""
    text = content_text(body) or ""
    calls = body.get("tool_calls")
    if isinstance(calls, list):
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                text += f" [calls {function.get('name')}({function.get('arguments')})]"
    return text.strip()
