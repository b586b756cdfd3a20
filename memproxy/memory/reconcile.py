"""Reconciling what a client sends with what the session has stored.

Clients differ: some resend the whole conversation every time, some send only the new turn, some trim
their own history to a window or echo the last answer before their tool results, and people edit and
regenerate. `reconcile` decides, from a few indexed lookups, which of the client's messages are
already stored and where the new ones continue (lookups that the history read with the session
answers, `Loaded.messages`, read nothing: on most turns reconciling reads nothing at all):

- `new`: the session has nothing stored yet; everything is new.
- `continue`: the client resent the stored history (its hash at the stored length is the head's);
  only what follows is new.
- `window`: the client's messages start with a tail of the stored history, up to its head (a client
  that trims its history, or echoes the last answer before its tool results), or its messages
  without the assistant's up to the head's tool calls, then results of those calls or a user
  message (a client that resends its turn but holds the assistant's messages to be the server's:
  the Vercel AI SDK on a Responses `conversation`, instructor retrying a structured answer), or with a history all
  stored, in order, among the newest messages (a chat UI resending its own exchanges on a session
  another client writes to between them; where it edited one of them, what is stored up to there),
  or a stored prefix and, past a gap, the stored tail up to the head (a client that dropped the
  middle of its history), or the stored history less its tool calls and results (a chat UI that
  keeps only the text of earlier turns; whole, or its newest messages); only what follows is new,
  after the head.
- `append`: the client's messages continue nothing stored, or nothing they show proves otherwise;
  they follow the head.
- `edit` / `regenerate`: the client's history matches a stored prefix and then diverges (edit) or
  stops short (regenerate), or repeats the stored messages before the head, an answer, and then
  has its own version of it (a client trimming its history that reformats answers: an edit of the
  head) or stops there (a regenerate of the head). The stored tail after the fork point is
  superseded when the turn is recorded, never before, so a failed upstream call changes nothing.

Forgetting is the worst failure, so superseding needs proof, and where a request reads two ways the
one that forgets nothing wins: an echoed tail is looked for before a prefix that diverges, and a
prefix supersedes only if it, or the client's message where it diverges, is or holds an assistant
message (the client is resending its history, not repeating a first "hi") or the client says
`X-Memproxy-History: full` (then a request that matches
nothing stored is an edit from the start). Anything else is appended. Each request is read on its
own: no earlier request changes how a later one is read, so no single odd request (a window, a tool
echo) can make a later one wipe the history. `X-Memproxy-History: new` says the client never resends
history: an echoed stored tail is stripped and the rest appended.

Messages are compared loosely (`loose_json`) when recognising an echo, a resent tail or where a
resent history leaves the stored one, so a client that re-serialises tool-call arguments, or trims
the whitespace around an answer, is not taken for one that edited them; the stored forms and their
hashes stay. So is a user message resent without lines added before or after it (`said_within`)
before an unchanged stored answer: the question without the context a RAG UI added to it when it
was new.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ..messages import (ROOT_HASH, Message, chain_hash, chain_hashes, history_end, loose_json, loosely_equal,
                        said_within)
from ..store import ChatKind, SessionState, StoredMessage, TurnStore

HistoryMode = Literal["auto", "full", "new"]
HISTORY_MODES: tuple[HistoryMode, ...] = ("auto", "full", "new")
Kind = ChatKind  # the store keeps it with the turn (`TurnRecord.kind`), so it is declared there
_WINDOW_CANDIDATES = 3


@dataclass(frozen=True)
class Reconciled:
    kind: Kind
    base: int  # active stored messages that stay, before the new ones
    base_hash: str  # chained hash of the message at base - 1
    new: list[Message]  # the client's messages that are not stored yet
    superseded: int = 0  # stored messages after `base` that the turn supersedes (edit, regenerate)


async def reconcile(
    store: TurnStore, session: SessionState | None, conversation: list[Message], requested: str = "auto",
    held: Sequence[StoredMessage] = (),
) -> Reconciled:
    """`held`: active messages of `session` read with it (`Loaded.messages`: consecutive, up to its
    head); a lookup they answer reads nothing from the store."""
    held = held if session is not None and held and held[-1].seq == session.length - 1 \
        and held[-1].seq - held[0].seq == len(held) - 1 else ()
    if session is None or session.length == 0:
        return Reconciled("new", 0, ROOT_HASH, conversation)
    stored = session.length
    head = session.head_hash
    if not conversation:  # a system prompt alone: nothing to match, and nothing to forget
        return Reconciled("append", stored, head, conversation)
    if requested == "new":
        echoed = await _echoed_tail(store, session, conversation, held) \
            or await _echoed_before_calls(store, session, conversation, held)
        return Reconciled("window" if echoed else "append", stored, head, conversation[echoed:])
    hashes = chain_hashes(ROOT_HASH, conversation)
    if len(hashes) >= stored and hashes[stored - 1] == head:
        return Reconciled("continue", stored, head, conversation[stored:])
    # An echoed tail first: where a request reads both as an echo and as an edit, keep the memory.
    # But with `full` a history that is a stored prefix from the start, shorter than the session,
    # is what the client says it is, the whole history: a regenerate, though it also ends as the
    # stored tail begins (`ok`, `Sure.`, `ok` after two such exchanges).
    echoed = await _echoed_tail(store, session, conversation, held)
    if echoed == stored:  # the whole history, spelt differently (re-serialised tool arguments)
        return Reconciled("continue", stored, head, conversation[stored:])
    matched = await _matched_prefix(store, session, hashes, held) if echoed and requested == "full" else None
    if echoed and matched != len(hashes):
        return Reconciled("window", stored, head, conversation[echoed:])
    echoed = await _echoed_before_calls(store, session, conversation, held)
    if echoed:
        return Reconciled("window", stored, head, conversation[echoed:])
    if matched is None:
        matched = await _matched_prefix(store, session, hashes, held)
    history = history_end(conversation)
    if matched == 0 and requested != "full":
        if await _edited_where_capped(store, session, conversation, held):
            return Reconciled("edit", 0, ROOT_HASH, conversation, superseded=stored)
        respelt = await _echoed_before_answer(store, session, conversation, held)
        if respelt:
            return Reconciled("regenerate" if respelt[0] == len(conversation) else "edit", stored - 1, respelt[1],
                              conversation[respelt[0]:], superseded=1)
        resent = await _resent_among(store, session, conversation, held)
        if resent < history:  # not all found there: perhaps the calls it leaves out are between
            without_tools = await _echoed_without_tools(store, session, conversation, held)
            if without_tools is not None:
                return without_tools
        if resent:
            return Reconciled("window", stored, head, conversation[resent:])
        if not history:  # new messages of the client's own: nothing to match, nothing read
            return Reconciled("append", stored, head, conversation)
    # `full` with nothing matched: the client says its messages are the whole history, so its first
    # message changed (an edit at 0), unless it only spelt the stored ones differently.
    fork, fork_hash = await _loose_fork(store, session, conversation, matched,
                                        hashes[matched - 1] if matched else ROOT_HASH, held)
    if fork < stored and requested != "full":
        # Before anything is superseded: a history that skips from its start to the stored tail.
        resent = await _resent_tail(store, session, conversation, held, fork)
        if resent:
            return Reconciled("window", stored, head, conversation[resent:])
        if fork == 0:
            return Reconciled("append", stored, head, conversation)
        # Or one that leaves tool calls and their results out of what it resends (a chat UI that
        # keeps only the text of each turn): read as an edit at the first call, they would go.
        without_tools = await _resent_without_tools(store, session, conversation, held, fork)
        if without_tools is not None:
            return without_tools
        # Or one that leaves the stored prefix before its latest question, yet lies whole among the
        # newest messages: a chat UI's own exchanges between another client's, whose first message
        # happened to equal the session's ("ok"). Read as an edit, the other client's would go.
        if fork < history:
            resent = await _resent_among(store, session, conversation, held)
            if resent >= history:
                return Reconciled("window", stored, head, conversation[resent:])
    # An assistant message up to and at the fork proves a resent history: the client's own version
    # of the session's first answer (trimmed, reformatted by its UI) is an edit of it, not new. So
    # does a message put in at the fork before the stored rest with an answer in it (a system note
    # a few messages from the end): an edit there, sent as the client wrote it.
    shows_history = requested == "full" or any(m.get("role") == "assistant" for m in conversation[:fork + 1]) \
        or await _inserted_at(store, session, conversation, fork, held)
    if not shows_history:
        # A client sending new messages only, whose message happens to equal the session's first
        # ("hi", "continue"): nothing proves it resent history, so nothing is superseded.
        return Reconciled("append", stored, head, conversation)
    if fork == stored:
        return Reconciled("continue", stored, head, conversation[stored:])
    kind: Kind = "regenerate" if fork == len(conversation) else "edit"
    return Reconciled(kind, fork, fork_hash, conversation[fork:], superseded=stored - fork)


async def _edited_where_capped(store: TurnStore, session: SessionState, conversation: Sequence[Message],
                               held: Sequence[StoredMessage]) -> bool:
    """A resent history that matches nothing stored, on a session whose opening the message cap
    deleted (`retention.max_messages_per_session`): the client edited a message memproxy no longer
    holds, so where it forked cannot be told. Its messages are the conversation (read as an edit
    at 0), not new ones after the stored branch it edited away (`history_end`)."""
    return bool(history_end(conversation)) and not await _active_range(store, session, held, 0, 1)


async def _active_range(store: TurnStore, session: SessionState, held: Sequence[StoredMessage], start: int,
                        stop: int) -> Sequence[StoredMessage]:
    """`TurnStore.active_range`, from the held messages where they cover it."""
    if held and held[0].seq <= start:
        return held[start - held[0].seq : max(stop - held[0].seq, 0)]
    return await store.active_range(session, start, stop)


async def _matched_prefix(store: TurnStore, session: SessionState, hashes: Sequence[str],
                          held: Sequence[StoredMessage]) -> int:
    """`TurnStore.matched_prefix`, from the held messages where they are the whole active history:
    the newest of them whose hash the client's messages make, looked for from the head back."""
    if held and held[0].seq == 0:
        wanted = set(hashes)
        return next((m.seq + 1 for m in reversed(held) if m.chain_hash in wanted), 0)
    return await store.matched_prefix(session, hashes)


async def _echoed_tail(store: TurnStore, session: SessionState, conversation: Sequence[Message],
                       held: Sequence[StoredMessage]) -> int:
    """The longest k such that the client's first k messages repeat the newest k stored ones, up to
    the head (loosely compared); 0 if none.

    Only the few client positions that equal the stored head (read with the session) are tried, and
    one read covers them all (as many stored messages as the client sent at most), so the cost
    follows the request, not the history; a request that repeats nothing reads nothing here.
    """
    head = session.head_message  # read with the session
    if head is None:
        return 0
    candidates = [j for j in range(min(len(conversation), session.length) - 1, -1, -1)
                  if loosely_equal(conversation[j], head)][:_WINDOW_CANDIDATES]
    if not candidates:
        return 0
    tail = await _active_range(store, session, held, session.length - 1 - candidates[0], session.length)
    for j in candidates:  # longest first; a capped session may hold fewer than were asked for
        # Message by message, from the first: a history that differs there (a question the client
        # resends without the context it was sent with) costs one comparison, not the history's.
        if j < len(tail) and _resends(tail[len(tail) - 1 - j:], conversation[: j + 1]):
            return j + 1
    return 0


def _resends(stored: Sequence[StoredMessage], sent: Sequence[Message]) -> bool:
    """Whether the client's messages repeat the stored ones, message by message from the first (a
    history that differs there costs one comparison): loosely, or a question without the context
    added to it when it was new (`said_within`), where the stored answer right after it follows
    unchanged, as `_loose_fork` reads a whole history. A RAG UI that also trims its history to its
    newest messages resends them so: read as new, each exchange was stored and sent twice."""
    respelt = False  # a question spelt differently, until the unchanged answer after it vouches for it
    for message, said in zip(stored, sent):
        same = loosely_equal(message.body, said)
        if respelt and not (same and message.body.get("role") == "assistant"):
            return False
        respelt = not same
        if respelt and not (message.body.get("role") == "user" and said_within(said, message.body)):
            return False
    return not respelt


async def _echoed_before_answer(store: TurnStore, session: SessionState, conversation: Sequence[Message],
                                held: Sequence[StoredMessage]) -> tuple[int, str] | None:
    """Where the stored head is an answer (no tool calls): the k >= 1 such that the client's first k
    messages repeat the k stored ones before the head (loosely) and its next is an answer of its
    own, without calls, or that are all its messages, an answer among them and a question last;
    and the chained hash of the stored message before the head; else None. A client that trims its
    history to its newest messages and keeps its own copy of the last answer (reassembled from the
    stream, its markdown normalised): its version of the head, as a client resending its whole
    history has its version of an answer read, an edit of it. Read as the newest messages among
    the stored ones up to where they differ (`_resent_among`), its copy was stored after the stored
    answer, and both were sent from then on. Or the same client asking for the last answer again
    (regenerate, or a retry of a turn whose answer it never got): read so, the question was stored
    again after the answer, and both sent. One read, as long as the echo."""
    head = session.head_message
    if head is None or head.get("role") != "assistant" or head.get("tool_calls"):
        return None
    candidates = [j for j in range(min(len(conversation), session.length) - 1, 0, -1)
                  if conversation[j].get("role") == "assistant" and not conversation[j].get("tool_calls")
                  and not loosely_equal(conversation[j], head)][:_WINDOW_CANDIDATES]
    if 2 <= len(conversation) < session.length and conversation[-1].get("role") == "user" \
            and any(m.get("role") == "assistant" for m in conversation):
        candidates.insert(0, len(conversation))
    if not candidates:
        return None
    before = await _active_range(store, session, held, session.length - 1 - candidates[0], session.length - 1)
    for j in candidates:  # longest first
        if j <= len(before) and _resends(before[len(before) - j:], conversation[:j]):
            return j, before[-1].chain_hash
    return None


async def _echoed_before_calls(store: TurnStore, session: SessionState, conversation: Sequence[Message],
                               held: Sequence[StoredMessage]) -> int:
    """Where the stored head is an assistant message's tool calls: the k >= 1 such that the client's
    first k messages, its assistant messages left aside, repeat the stored messages before the head,
    theirs left aside too, and its next message is a result of one of the head's calls or a user
    message; 0 if none. What a client sends that resends its turn but holds the assistant's
    messages to be the server's: the Vercel AI SDK's next step on a Responses `conversation` (the
    results; at a later step, the earlier results too), instructor's retry of a structured answer
    on the Responses API (the validation errors, as user messages), a full-history client that
    leaves out the call it answers. Read as new, its messages would be stored twice, and results
    after anything but their call are refused; read as an echo, nothing is lost (the calls stay,
    and go as text where no result follows). One read, of at most twice the echo's length."""
    head = session.head_message
    if head is None or head.get("role") != "assistant" or not isinstance(head.get("tool_calls"), list):
        return 0
    ids = {call.get("id") for call in head["tool_calls"] if isinstance(call, dict)}
    answer = next((i for i, m in enumerate(conversation) if m.get("role") == "tool" and m.get("tool_call_id") in ids),
                  None)
    if answer is not None:
        candidates = [answer] if answer > 0 else []
    else:  # a user message after the echo: one of the newest (new ones come last)
        candidates = [k for k in range(len(conversation) - 1, 0, -1)
                      if conversation[k].get("role") == "user"][:_WINDOW_CANDIDATES]
    if not candidates:
        return 0
    reach = min(2 * candidates[0] + 2, session.length - 1)  # an assistant message before each, and more
    stored = [loose_json(m.body) for m in await _active_range(store, session, held, session.length - 1 - reach,
                                                             session.length - 1)
              if m.body.get("role") != "assistant"]
    sent = [loose_json(m) for m in conversation[:candidates[0]] if m.get("role") != "assistant"]
    for k in candidates:  # longest first; a shorter echo is a prefix of the longest's messages
        n = sum(1 for m in conversation[:k] if m.get("role") != "assistant")
        if 0 < n <= len(stored) and stored[len(stored) - n:] == sent[:n]:
            return k
    return 0


async def _resent_among(store: TurnStore, session: SessionState, conversation: Sequence[Message],
                        held: Sequence[StoredMessage]) -> int:
    """How much of the client's history (`history_end`: its messages before its latest user
    message, an answer among them) is stored, in its order, among the session's newest messages,
    from its start: all of it, or up to where the client edited it, if an answer is among what is
    stored; else 0. A chat UI that resends its whole conversation on a session another client also
    writes to (a script, a second window) matches neither the session's start nor its tail: its
    exchanges lie between the other client's. Appended whole, its history would be stored and sent
    again on every turn. Where it edited a message, what follows is appended from there (its own
    messages between others' cannot be told superseded: they stay, as forgetting nothing needs).
    One read, as long as the request's history and as much again for the other client's messages
    between them (four times as many, and a few more)."""
    end = history_end(conversation)
    if not end:
        return 0
    found = 0
    read = await _active_range(store, session, held, max(session.length - 4 * end - 8, 0), session.length)
    for i, message in enumerate(read):
        if loosely_equal(message.body, conversation[found]):
            found += 1
            if found == end:
                return end + _tail_after(read[i + 1:], conversation[end:])
    return found if any(m.get("role") == "assistant" for m in conversation[:found]) else 0


def _tail_after(after: Sequence[StoredMessage], rest: Sequence[Message]) -> int:
    """How many of `rest` (the client's messages after its history: its latest question, then
    perhaps the tool calls it made and their results) are the session's newest stored messages,
    which come after that history: a tool loop going on, its question and calls stored by the turn
    before. Up to its last answer, which must be among them; what follows it (results) is new. 0
    where they are not the very tail: a question equal to an older one is the client's new one."""
    answered = max((j + 1 for j, m in enumerate(rest) if m.get("role") == "assistant"), default=0)
    if not answered or answered > len(after):
        return 0
    tail = after[len(after) - answered:]
    return answered if all(loosely_equal(m.body, c) for m, c in zip(tail, rest)) else 0


async def _resent_tail(store: TurnStore, session: SessionState, conversation: Sequence[Message],
                       held: Sequence[StoredMessage], fork: int) -> int:
    """Where the client's history is the stored prefix it matched (`fork`, at least one message),
    then perhaps its own versions of the stored messages that follow it (each where the stored one
    is, in its role), then a gap, then the session's newest stored messages up to the head, an
    answer among them: a client that keeps its first exchange and drops the middle of its history
    to fit its own budget (Cline, which also rewrites the first answer into a note that history was
    removed). The position after that tail (what follows is new: a user message, or results of
    the head's calls), or 0. Read as an edit, the middle would be superseded: forgotten; read so,
    the stored forms stay. Nothing of the client's is left out but its versions of stored
    messages: a message it put in (a system note) is its edit, and a history that matched no
    stored prefix (its own summary in place of the older messages) is appended whole. One read of
    the tail, as long as the client's messages, and one of its versions' stored counterparts."""
    head = session.head_message
    if not fork or head is None:
        return 0
    candidates = [j for j in range(len(conversation) - 1, fork, -1)
                  if loosely_equal(conversation[j], head)][:_WINDOW_CANDIDATES]
    if not candidates:
        return 0
    tail = await _active_range(store, session, held, max(session.length - candidates[0], 0), session.length)
    for j in candidates:  # latest first
        end = j + 1
        n = 0
        while n < min(len(tail), end - fork) and loosely_equal(tail[-1 - n].body, conversation[end - 1 - n]):
            n += 1
        start = end - n  # where the tail starts among the client's messages
        if n < 2 or session.length <= end or not any(m.get("role") == "assistant" for m in conversation[start:end]):
            continue  # no gap (`session.length - n > start` fails): not a dropped middle
        if any(m.get("role") == "assistant" for m in conversation[end:]):
            continue  # what follows a resent tail is new (a question, results), never an answer: an earlier copy
        if start > fork:  # the client's versions of the stored messages after its prefix
            own = await _active_range(store, session, held, fork, start)
            if len(own) != start - fork or any(m.body.get("role") != c.get("role")
                                               for m, c in zip(own, conversation[fork:start])):
                continue
        return end
    return 0


async def _resent_without_tools(store: TurnStore, session: SessionState, conversation: Sequence[Message],
                                held: Sequence[StoredMessage], fork: int) -> Reconciled | None:
    """Where the client's history is the whole stored one from `fork` (where it left it, at a tool
    call), less tool calls and their results: each stored message resent (loosely, or a question
    without the context added to it, `said_within`), or left out if it is a result or an assistant
    message that only calls tools, or resent without its calls (its text kept). A chat UI that
    keeps only the text of each turn, and in a tool loop the current turn's calls and results.
    Up to the head, what follows is new (a question, results, never an answer): a `window`. Ending
    at a question before the head, a `regenerate` of what followed it, as a whole history would
    be. Read as an edit at the first call, every result since would be superseded, never sent
    again; and `_resent_among` looks only among the newest messages, too few where a turn made
    many calls. None for any other history. One read of the first stored message the client
    left, and where it is a call or result, one of the rest."""
    first = await _active_range(store, session, held, fork, fork + 1)
    if not first or not (first[0].body.get("role") == "tool" or first[0].body.get("tool_calls")):
        return None
    rest = await _active_range(store, session, held, fork, session.length)
    walked = _without_tools(rest, conversation, fork)
    if walked is None:
        return None
    position, last = walked
    if last.seq == session.length - 1:  # the head: what follows is new, never an answer
        return _new_after_head(session, conversation, position)
    after = last.seq + 1
    if position < len(conversation) or conversation[-1].get("role") != "user" \
            or not any(m.body.get("role") == "assistant" for m in rest[after - fork:]):
        return None
    return Reconciled("regenerate", after, last.chain_hash, [], superseded=session.length - after)


async def _echoed_without_tools(store: TurnStore, session: SessionState, conversation: Sequence[Message],
                                held: Sequence[StoredMessage]) -> Reconciled | None:
    """`_resent_without_tools` for a client that also trims its history to its newest messages:
    its first message is a stored one, and from there to the head the stored history is the
    client's less tool calls and their results; what follows is new (a `window`). Looked for
    among the newest sixteen times as many stored messages as the client sent, and a few more (a
    turn that made many calls); a history that matches no echoed tail, as the calls it leaves
    out are in the stored one, was appended whole, and in a tool loop its call stored again
    before its results. One read."""
    read = await _active_range(store, session, held, max(session.length - 16 * len(conversation) - 32, 0),
                               session.length)
    if not any(m.body.get("role") == "tool" for m in read):
        return None
    starts = [i for i in range(len(read) - 1, -1, -1) if loosely_equal(read[i].body, conversation[0])]
    for start in starts[:_WINDOW_CANDIDATES]:  # the newest first
        walked = _without_tools(read[start:], conversation, 0)
        if walked is not None and walked[1].seq == session.length - 1:
            return _new_after_head(session, conversation, walked[0])
    return None


def _without_tools(stored: Sequence[StoredMessage], conversation: Sequence[Message],
                   position: int) -> tuple[int, StoredMessage] | None:
    """The client's messages from `position` walked along the stored ones, where they are those
    less tool calls and their results (some left out): how far the client's go, and the last
    stored message they resend (an answer among them); None where they differ."""
    left_out, last = False, None
    for message in stored:
        if position == len(conversation):
            break
        body, sent = message.body, conversation[position]
        if loosely_equal(body, sent) or body.get("role") == "user" and said_within(sent, body):
            position, last = position + 1, message
        elif body.get("tool_calls") and not sent.get("tool_calls") \
                and loosely_equal({k: v for k, v in body.items() if k != "tool_calls"}, sent):
            position, last, left_out = position + 1, message, True
        elif body.get("role") == "tool" or _only_calls(body):
            left_out = True
        else:
            return None
    if not left_out or last is None or not any(m.get("role") == "assistant" for m in conversation[:position]):
        return None
    return position, last


def _new_after_head(session: SessionState, conversation: Sequence[Message], position: int) -> Reconciled | None:
    """A `window` whose new messages are the client's from `position`, after the head: some, and
    never an answer (that would be an earlier copy)."""
    if position == len(conversation) or any(m.get("role") == "assistant" for m in conversation[position:]):
        return None
    return Reconciled("window", session.length, session.head_hash, list(conversation[position:]))


def _only_calls(message: Message) -> bool:
    """An assistant message that calls tools and says nothing."""
    return message.get("role") == "assistant" and bool(message.get("tool_calls")) \
        and loose_json({k: v for k, v in message.items() if k != "tool_calls"}) == loose_json({"role": "assistant"})


async def _inserted_at(store: TurnStore, session: SessionState, conversation: Sequence[Message], fork: int,
                       held: Sequence[StoredMessage]) -> bool:
    """Whether the client put a message of its own in at `fork` (SillyTavern's author's note: a system
    message a few messages from the end) and then resent the stored messages from there, an answer
    among them. One read, as long as the rest of the client's messages."""
    k = min(len(conversation) - fork - 1, session.length - fork)
    if k < 1 or not any(m.get("role") == "assistant" for m in conversation[fork + 1:fork + 1 + k]):
        return False
    stored = await _active_range(store, session, held, fork, fork + k)
    return len(stored) == k and all(loosely_equal(m.body, c)
                                    for m, c in zip(stored, conversation[fork + 1:fork + 1 + k]))


async def _loose_fork(
    store: TurnStore, session: SessionState, conversation: Sequence[Message], matched: int, matched_hash: str,
    held: Sequence[StoredMessage],
) -> tuple[int, str]:
    """Where the client's history really leaves the stored one: past the hash-matched prefix, the
    messages that equal the stored ones loosely (tool arguments spelt differently) still match, and
    so does a user message the client resends without lines the stored one has before or after it
    (`said_within`) where the stored answer after it follows unchanged: a chat UI that adds retrieved context or a file to the
    newest user message alone (Open WebUI by default) resends the plain question in its history,
    and no answer survives a real edit of its question (the UI asks again). The position and the
    stored chain hash before it (the stored forms stay: they hold all the client sent)."""
    stop = min(len(conversation), session.length)
    if matched >= stop:
        return matched, matched_hash
    fork, fork_hash = matched, matched_hash
    position, parent = matched, matched_hash
    respelt = False  # a user message spelt differently, until an unchanged answer after it vouches for it
    for message in await _active_range(store, session, held, matched, stop):
        if message.seq != position:
            break
        sent = conversation[position]
        position += 1
        # The same message makes the stored hash from the stored parent's (one side serialised);
        # else it may still be the same, spelt differently.
        same = chain_hash(parent, sent) == message.chain_hash or loose_json(message.body) == loose_json(sent)
        parent = message.chain_hash
        if same:
            if not respelt or message.body.get("role") == "assistant":
                fork, fork_hash, respelt = position, message.chain_hash, False
        elif message.body.get("role") == "user" and said_within(sent, message.body):
            respelt = True
        else:
            break
    return fork, fork_hash
