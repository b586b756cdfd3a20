"""Reconciling what a client sends with what the session has stored.

Clients differ: some resend the whole conversation every time, some send only the new turn, some trim
their own history to a window, and people edit and regenerate. `reconcile` decides, from a few indexed
lookups, which of the client's messages are already stored and where the new ones continue:

- `new`: the session has nothing stored yet; everything is new.
- `continue`: the client resent the stored history (its hash at the stored length is the head's);
  only what follows is new. This is a full-history client.
- `window`: the client's messages start inside the stored history and reach its head (a client that
  trims its own history); only what follows the head is new.
- `append`: nothing the client sent is stored; it sends only new turns, which follow the head.
- `edit` / `regenerate`: the client's history matches a stored prefix and then diverges (edit) or
  stops short (regenerate). The stored tail after the fork point is superseded when the turn is
  recorded, never before, so a failed upstream call changes nothing.

A prefix match that stops short is ambiguous for a client that sends only new turns and happens to
repeat its first message; the session remembers which kind of client it has (`history_mode`) and a
client can say so with `X-Memproxy-History: full|new`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .messages import ROOT_HASH, Message, canonical_json, chain_hashes
from .store import SessionState, Store

HISTORY_MODES = ("auto", "full", "new")
_WINDOW_CANDIDATES = 3


@dataclass(frozen=True)
class Reconciled:
    kind: str
    base: int  # active stored messages that stay, before the new ones
    base_hash: str  # chained hash of the message at base - 1
    new: list[Message]  # the client's messages that are not stored yet
    history_mode: str | None  # what was learned about the client, to remember


async def reconcile(
    store: Store, session: SessionState | None, conversation: list[Message], requested: str = "auto"
) -> Reconciled:
    if session is None or session.length == 0:
        return Reconciled("new", 0, ROOT_HASH, conversation, None)
    stored = session.length
    head = session.head_hash
    if requested == "new":
        return Reconciled("append", stored, head, conversation, "new")
    hashes = chain_hashes(ROOT_HASH, conversation)
    if len(hashes) >= stored and hashes[stored - 1] == head:
        return Reconciled("continue", stored, head, conversation[stored:], "full")
    matched = await store.matched_prefix(session, hashes)
    if matched == 0:
        overlap = await _window_overlap(store, session, conversation)
        if overlap:
            return Reconciled("window", stored, head, conversation[overlap:], "full")
        if requested == "full" or (requested == "auto" and session.history_mode == "full"):
            # A client known to resend everything changed its very first message.
            return Reconciled("edit", 0, ROOT_HASH, conversation, "full")
        return Reconciled("append", stored, head, conversation, "new")
    if session.history_mode == "new" and requested != "full":
        return Reconciled("append", stored, head, conversation, "new")
    kind = "regenerate" if matched == len(conversation) else "edit"
    return Reconciled(kind, matched, hashes[matched - 1], conversation[matched:], "full")


async def _window_overlap(store: Store, session: SessionState, conversation: Sequence[Message]) -> int:
    """How many leading client messages repeat the newest stored ones, up to the head; 0 if none.

    Only the few client positions that equal the stored head are tried, and each try reads as many
    stored messages as the client sent, so the cost follows the request, not the history.
    """
    last = await store.active_range(session, session.length - 1, session.length)
    if not last:
        return 0
    head = canonical_json(last[0].body)
    candidates = [j for j in range(len(conversation) - 1, -1, -1)
                  if canonical_json(conversation[j]) == head][:_WINDOW_CANDIDATES]
    for j in candidates:
        start = session.length - 1 - j
        if start <= 0:
            continue  # a full match from the start would have been found by hash
        stored = await store.active_range(session, start, session.length)
        if [canonical_json(m.body) for m in stored] == [canonical_json(m) for m in conversation[: j + 1]]:
            return j + 1
    return 0
