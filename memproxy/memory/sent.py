"""The older messages of a history as they are sent, worked out once and kept between turns.

A request sends the stored messages older than its newest exchange in their settled compact form
(`StoredMessage.settled_compact`), later copies of a large content as references to the first
(`shrink.dedupe_repeats`), in the form they go upstream (`messages.wire_form`). Each of those is a
step per message, and with a large window a long conversation is sent whole: measured at 1,000
stored messages, 0.45 ms of every turn went to working out again what the turn before had worked
out for all but its last exchange (issue 17). So `SentHistories` keeps, for recently planned
histories, the older part as sent with its token counts and what the rest of the plan needs of it
(which messages call tools, how many were trimmed or deduplicated), and a turn extends it with the
messages that became older since.

It can never serve another history: an entry is used only for a list of older messages that starts
with the very `StoredMessage` object it was made from and holds, at the position the entry ends,
the very object it ended with (a stored message's chain hash names every message before it, so
the ones between are those it was made from too). Stored messages are never changed once built,
and a session's are the same objects from turn to turn only while the store's history cache keeps
them (`memproxy.store.history_cache`): a history read again, edited, forked, imported, capped or
cleared is other objects, and is worked out afresh. The result also depends on the counter (a reference's tokens) and on the memory settings
(compact forms or not, the least tokens deduplicated), which are part of the key. An answer with
audio is sent by its id until the provider forgets it, then as its transcript (`wire_form`): its
form is worked out on every turn.

Bounded by the history cache: an entry is dropped as soon as the first message it was made from
is no longer held (the cache evicted its session, or read it again), so what it holds beyond that
cache is a few references a message (some 30 bytes) and the few messages it had to change (a
reference to an earlier copy, a form without a field). And at most `MAX_ENTRIES` are kept, the
least recently used going first.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from ..messages import Message, starts_unit, wire_form
from ..store import StoredMessage
from ..tokens import TokenCounter, holds_media
from .shrink import dedupe_repeats

# Histories kept at most: as many as there are sessions in the store's history cache, and a few
# more (a window that slides turn by turn starts each turn's older part at a new message).
MAX_ENTRIES = 1024


@dataclass
class Older:
    """Stored messages older than the newest exchange, as sent (`older`)."""

    bodies: list[Message]  # in wire form (`messages.wire_form`)
    tokens: list[int]  # each one's tokens, as stored (compact, or settled: `StoredMessage.settled_tokens`)
    saved: int  # the tokens the references to earlier copies saved
    trimmed: int  # sent in a compact form with a tool output trimmed
    deduplicated: int  # sent as a reference to an earlier copy
    callers: list[int]  # the positions in `bodies` of messages that call tools
    media: int = 0  # messages holding a media part or a spoken answer (`tokens.holds_media`)
    # What the deduplication has seen (a content's text -> where), to go on with it.
    seen: dict[str, int] = field(default_factory=dict)
    clocked: dict[int, Message] = field(default_factory=dict)  # answers with audio, before `wire_form`


def older(messages: Sequence[StoredMessage], trim: bool, min_tokens: int, counter: TokenCounter,
          before: Older | None = None) -> Older:
    """`messages` as sent when older than the newest exchange: compact (`trim`, the memory setting
    `tool_output_max_tokens` above 0) or settled, repeats of at least `min_tokens` sent once.
    `before`: the same worked out for the messages before `messages`, extended in place."""
    out = before if before is not None else Older([], [], 0, 0, 0, [])
    offset = len(out.bodies)
    forms = [m.settled_compact for m in messages] if trim else [m.settled for m in messages]
    tokens = [m.compact_tokens for m in messages] if trim else [m.settled_tokens for m in messages]
    sent, saved = dedupe_repeats(forms, tokens, min_tokens, counter, out.seen, offset)
    bodies = out.bodies
    for i, (body, form, message) in enumerate(zip(sent, forms, messages), offset):
        if body is not form:  # a reference to an earlier copy
            out.deduplicated += 1
            bodies.append(wire_form(body))
            continue
        if trim and message.compact_body is not None and body is message.compact_body and not starts_unit(body):
            out.trimmed += 1
        if body.get("tool_calls"):
            out.callers.append(i)
        if "audio" in body:  # its form is the clock's: worked out on every turn (`SentHistories.older`)
            out.clocked[i] = body
            out.media += holds_media((body,))
            bodies.append(wire_form(body))
            continue
        if body.get("content").__class__ is list and holds_media((body,)):
            out.media += 1
        bodies.append(message.wire_settled_compact if trim else message.wire_settled)
    out.tokens += tokens
    out.saved += saved
    return out


class _Entry(NamedTuple):
    first: weakref.ref[StoredMessage]
    last: weakref.ref[StoredMessage]
    older: Older


class SentHistories:
    """The older part of recently planned histories as sent (`older`), each kept while its first
    message is (the store's history cache holds it), and at most `max_entries` of them, the least
    recently used going first (0: none kept)."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[int, bool, int, str], _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def _forget(self, key: tuple[int, bool, int, str]) -> Callable[[object], None]:
        """What drops the entry under `key` once its first message is gone (the history cache let
        its session go)."""
        entries = self._entries

        def forget(_: object) -> None:
            gone = entries.get(key)
            if gone is not None and gone.first() is None:
                del entries[key]
        return forget

    def older(self, messages: Sequence[StoredMessage], trim: bool, min_tokens: int, counter: TokenCounter) -> Older:
        """`older(messages, ...)`, from what an earlier turn of the same history worked out where
        there is one. The result is the caller's to read, never to change."""
        if not messages or self.max_entries <= 0:
            return older(messages, trim, min_tokens, counter)
        key = (id(messages[0]), trim, min_tokens, counter.name)
        entry = self._entries.pop(key, None)
        done = len(entry.older.bodies) if entry is not None else 0
        if entry is not None and entry.first() is messages[0] and done <= len(messages) \
                and entry.last() is messages[done - 1]:
            result, first = older(messages[done:], trim, min_tokens, counter, entry.older), entry.first
        else:
            result, first = older(messages, trim, min_tokens, counter), weakref.ref(messages[0], self._forget(key))
        self._entries[key] = _Entry(first, weakref.ref(messages[-1]), result)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        if not result.clocked:
            return result
        # An answer's audio goes by its id until the provider forgets it: its form is the clock's.
        bodies = list(result.bodies)
        for i, body in result.clocked.items():
            bodies[i] = wire_form(body)
        return Older(bodies, result.tokens, result.saved, result.trimmed, result.deduplicated, result.callers,
                     media=result.media)
