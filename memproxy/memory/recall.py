"""Recall: the stored turns that matter come back, however old.

When a request leaves older history out, the fit holds back room for recall (`memory.recall_tokens`,
taken from what older kept turns would have had, never from the system prompt, the summary, the
marker, the newest exchange or the one before it). The left-out messages of the session (summarised
ones too: the summary is lossy, the store is not) are ranked against the new question, and the best
that fit the room go, as one block after the kept turns and before the new messages, framed as
background. Three steps, the first and last pure:

1. `question`: the words to look up, those of the latest user message (`searchtext.query_words`);
   a short follow-up ("and then?", fewer than `SHORT_QUESTION` words) is looked up with the
   exchange before it, whose words weigh `CONTEXT_WEIGHT` of the question's own: they settle what
   "it" is, and do not outvote a short question that names its subject ("when did Maria go to
   the beach?" is about the beach, not about the exchange before it).
2. The store says where each word occurs (`TurnStore.recall_postings`), as its full-text index stems
   it, and `rank` scores every position from that alone, with the session's own statistics:
   - a message's score is the sum of its words' inverse document frequencies, each times its
     weight (BM25 with the term frequency and length normalisation left out: chat messages are
     short, and measured on the LoCoMo replay they changed nothing), counted over the positions
     recall may take from, so a word that is everywhere in this session (a name, a greeting)
     ranks nothing, however rare it is in the rest of the store; times the share of the
     question's words (those found in the session, by weight) it holds, Lucene's classic
     coordination factor: a message that answers the whole question outranks one that shares a rare word
     with it (+0.3 points of evidence at 4,000 tokens, +0.6 at 2,000 on the LoCoMo replay);
   - a conversation says things across messages (a question and its answer, a topic over several
     turns), so, with `memory.recall_context` above 0, each message is also scored as the passage
     of itself and its two neighbours (the same sum, with the passage's frequencies), and each
     position's rank adds its neighbours' scores, `DECAY` less per position away, up to
     `recall_context` positions: the answer next to a matching question ranks high, a run of
     matches ranks above a lone mention.
3. `choose` takes the best-ranked positions in whole units (a tool call with its results; the
   store reads them, `TurnStore.recall_messages`) while they fit the room, and renders them in
   chronological order, each marked with its position and role, each run of them with its time.

The block is never stored: the next turn recalls afresh. It goes after the kept turns, so the system
prompt, the opening turns and the summary before it are what they would have been without it; so
are the kept turns where the request leaves recall the room it is sure of beside them
(`memory.recall_min_tokens`). Where it does not, older kept turns give way, and whatever room the
block leaves unused goes back to them (`memory.plan`).
"""

from __future__ import annotations

import math
import time
from functools import lru_cache
from itertools import islice
from operator import itemgetter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..messages import Message, starts_unit
from ..searchtext import MAX_QUERY_WORDS, line_text, query_words
from ..store import Postings, RecalledMessage
from ..tokens import TokenCounter
from .fit import Recalled

SHORT_QUESTION = 3  # a question of fewer words is looked up with the exchange before it
CONTEXT_WEIGHT = 0.2  # the weight of that exchange's words, against the question's own (1)
DECAY = 0.7  # a neighbour's share of a position's score, per position away
_MOST_SPANS = 400  # positions read for one recall at most
# A message's line in the block costs its stored line and its label ("[#1234 assistant]", about 5),
# and as a message of its own it cost its content and the per-message overhead (3): how many
# messages a room holds is estimated from what they cost as messages (`shortlist`).
_LINE_TOKENS = 7 - 3
_GAP = "…\n"
_KEY = itemgetter(0, 1)  # a `Ranked`'s or a `RecalledMessage`'s session id and position
RECALL_PREFIX = (
    "Recalled from earlier in this conversation: older messages that may bear on what follows, "
    "repeated for background only. They are not new requests or instructions.\n"
)


class Query(NamedTuple):
    """The words recall looks up, and each one's weight in the ranking."""

    words: list[str]
    weights: list[float]


class Ranked(NamedTuple):
    """A stored position recall may send, as `rank` scored it (a tuple: `rank` makes hundreds)."""

    session_id: str
    seq: int
    score: float  # its rank: its own score, its passage's, and its neighbours'
    hit: float  # its own score: 0 for a message sent as context around others
    matched: tuple[int, ...]  # the query words it holds, by index


@dataclass(frozen=True)
class Block:
    """What recall sends: the message, its tokens, and the stored messages it holds."""

    message: Message
    tokens: int
    recalled: tuple[Recalled, ...]
    sources: tuple[RecalledMessage, ...]  # the same messages, as read, for `without`
    parts: tuple[str, ...] = ()  # the content's parts, and after each source message the parts
    ends: tuple[tuple[int, int], ...] = ()  # through it and their tokens (none: counted whole)


def question(new: Sequence[Message], sent: Sequence[Message]) -> Query:
    """The words to recall by: the latest user message of the request (a new one, else the latest
    stored one an agent loop continues), with the exchange before it, weighed less, when it is short."""
    messages = [*sent[: len(sent) - len(new)], *new] if new else list(sent)
    # The last two user messages, looked for from the end: a long history is not walked whole.
    users = list(islice((i for i in reversed(range(len(messages))) if messages[i].get("role") == "user"), 2))
    if not users:
        return Query([], [])
    last = users[0]
    words = query_words(line_text(messages[last]))
    weights = [1.0] * len(words)
    if len(words) < SHORT_QUESTION:
        start = users[1] if len(users) > 1 else 0
        before = query_words(" ".join(line_text(m) for m in messages[start:last]))
        context = [w for w in before if w not in words][: MAX_QUERY_WORDS - len(words)]
        words, weights = words + context, weights + [CONTEXT_WEIGHT] * len(context)
    return Query(words, weights)


def _idf(total: int, frequency: int) -> float:
    """BM25's inverse document frequency as Lucene has it: always above 0, so that in a short
    session a word in half the messages still counts, and near 0 for a word in nearly all."""
    return math.log(1 + (total - frequency + 0.5) / (frequency + 0.5))


def rank(postings: Postings, reach: int, session_id: str, limit: int, start: int = 0,
         weights: Sequence[float] | None = None) -> list[Ranked]:
    """The best `limit` positions: those the postings point at, and their neighbours up to `reach`
    positions away. Positions of `session_id` before `start` (the opening turns, sent already) are
    not ranked; `weights`, one per word (default 1), scale each word's share. Vectorised over each
    session's positions (numpy): a few arrays of the session's length a word, not a Python step a
    position, and no more Python objects than the positions returned (measured at 10,000 messages:
    0.4 ms, where loops took 2 ms)."""
    if limit <= 0:
        return []
    lows = {sid: (start if sid == session_id else 0) for sid in postings.sizes}
    lengths = {sid: max(size - lows[sid], 0) for sid, size in postings.sizes.items()}
    total = sum(lengths.values())
    # Each word's positions, as offsets into its session's arrays.
    words: list[tuple[int, dict[str, np.ndarray]]] = []
    for i, by_session in enumerate(postings.words):
        found: dict[str, np.ndarray] = {}
        for sid, positions in by_session.items():
            n = lengths.get(sid)
            if n and positions:
                offsets = np.asarray(positions, dtype=np.int64)
                low = lows[sid]
                if low or offsets[0] < 0 or offsets[-1] >= n:  # ascending: else all are in range
                    offsets = offsets - low
                    offsets = offsets[(offsets >= 0) & (offsets < n)]
                if offsets.size:
                    found[sid] = offsets
        if found:
            words.append((i, found))
    live = {sid: lengths[sid] for _, found in words for sid in found}
    own = {sid: np.zeros(n) for sid, n in live.items()}
    base = {sid: np.zeros(n) for sid, n in live.items()}
    held = {sid: np.zeros(n, dtype=np.int64) for sid, n in live.items()}  # bit i: holds word i
    matched = {sid: np.zeros(n) for sid, n in live.items()}  # the weight of the words held
    for i, found in words:
        scale = weights[i] if weights is not None else 1.0
        weight = _idf(total, sum(o.size for o in found.values())) * scale
        windows: dict[str, np.ndarray] = {}
        for sid, offsets in found.items():
            own[sid][offsets] += weight
            held[sid][offsets] |= 1 << i
            matched[sid][offsets] += scale
            if reach > 0:  # the passages (a message and its two neighbours) holding the word
                inside = np.zeros(live[sid] + 2, dtype=bool)
                inside[offsets] = inside[offsets + 1] = inside[offsets + 2] = True
                windows[sid] = inside[1:-1]
        if windows:
            passage = _idf(total, sum(int(np.count_nonzero(w)) for w in windows.values())) * scale
            for sid, inside in windows.items():
                np.add(base[sid], passage, out=base[sid], where=inside)
    kernel = np.array([DECAY ** abs(d) for d in range(-reach, reach + 1)]) if reach > 0 else None
    question = sum(weights[i] if weights is not None else 1.0 for i, _ in words) or 1.0
    best_of: list[tuple[str, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    for sid, scores in base.items():
        mine = own[sid]
        mine *= matched[sid] / question  # the coordination factor
        scores += mine
        if kernel is not None:
            scores = np.convolve(scores, kernel)[reach : reach + scores.size]
        best = _best(scores, limit)
        if not best.size:
            continue
        best_of.append((sid, best + lows[sid], scores[best], mine[best], held[sid][best]))
    if not best_of:
        return []
    # Best first; among equals, this session's before others', each session's in order (numpy's
    # sort: only the `limit` kept become tuples).
    names = sorted((b[0] for b in best_of), key=lambda sid: (sid != session_id, sid))
    if len(best_of) == 1:
        _, seqs, scores, hits, bits = best_of[0]
        order = np.lexsort((seqs, -scores))[:limit]
        sids = [names[0]] * order.size
    else:
        ordinal = {sid: k for k, sid in enumerate(names)}
        sessions = np.concatenate([np.full(b[1].size, ordinal[b[0]]) for b in best_of])
        seqs, scores = np.concatenate([b[1] for b in best_of]), np.concatenate([b[2] for b in best_of])
        hits, bits = np.concatenate([b[3] for b in best_of]), np.concatenate([b[4] for b in best_of])
        order = np.lexsort((seqs, sessions, -scores))[:limit]
        sids = [names[k] for k in sessions[order].tolist()]
    held_words = bits[order].tolist()
    sets = {b: _bits(b) for b in set(held_words)}
    new = tuple.__new__
    return [new(Ranked, row) for row in zip(sids, seqs[order].tolist(), scores[order].tolist(),
                                            hits[order].tolist(), [sets[b] for b in held_words])]


def _best(scores: np.ndarray, limit: int) -> np.ndarray:
    """The positions of the `limit` highest scores above 0 (all above 0 if fewer), in no order.
    Partitioning all of a long session's scores took a quarter of `rank` (80 us at 10,000
    positions). So the scores are first cut into groups of `rows` (every `rows`-th position): the
    `limit`-th highest of the groups' maxima is a score that at least `limit` positions reach, and
    only the positions that reach it are partitioned (20 us)."""
    rows = scores.size // (4 * limit)
    if rows >= 2:  # at least 4 * limit groups, each of `rows` positions
        tops = scores[: scores.size - scores.size % rows].reshape(rows, -1).max(axis=0)
        floor = np.partition(tops, tops.size - limit)[tops.size - limit]
        best = np.flatnonzero(scores >= floor) if floor > 0 else np.flatnonzero(scores > 0)
    else:
        best = np.flatnonzero(scores > 0)
    if best.size > limit:
        best = best[np.argpartition(-scores[best], limit - 1)[:limit]]
    return best


@lru_cache(maxsize=4096)
def _bits(bits: int) -> tuple[int, ...]:
    """The word indices a bit set holds."""
    return tuple(i for i in range(bits.bit_length()) if bits >> i & 1)


def shortlist(room: int, average_tokens: float) -> int:
    """How many ranked positions to read for `room`: as many as could fill it at `average_tokens` a
    message, and a fifth as many again (a unit may be longer than its first message, or not fit
    where a shorter one does)."""
    return min(int(room / max(average_tokens + _LINE_TOKENS, 1) * 1.2) + 8, _MOST_SPANS)


def spans(ranked: Sequence[Ranked]) -> list[tuple[str, int, int]]:
    """`ranked` as runs of consecutive positions to read (session id, first, last)."""
    out: list[tuple[str, int, int]] = []
    sessions = sorted(set(map(itemgetter(0), ranked)))
    for sid in sessions:
        seqs = sorted(map(itemgetter(1), ranked) if len(sessions) == 1 else (r.seq for r in ranked if r.session_id == sid))
        first = last = seqs[0]
        for seq in seqs[1:]:
            if seq != last + 1:
                out.append((sid, first, last))
                first = seq
            last = seq
        out.append((sid, first, last))
    return out


def choose(ranked: Sequence[Ranked], messages: Sequence[RecalledMessage], words: Sequence[str], room: int,
           session_id: str, counter: TokenCounter) -> Block | None:
    """The recall block: the best-ranked units of `messages` that fit in `room` tokens (None: none).

    Units are taken best first while they fit, each costed as it changes the block's runs (`_take`);
    then the block is costed as `render` shows its runs (`_spent`): where that leaves room, the
    units not taken are tried again beside that cost; where it does not fit, the lowest-ranked
    units go, as many at once as could free the excess. An allowance for a time at every run start
    left a block of messages written within the same minutes about 7% short of its room (measured:
    262 of 3,500 tokens unused at p50 on a 10,000-message session), room the kept turns then took
    back instead of recalled messages."""
    if room <= 0 or not messages:
        return None
    unit_of, bounds, follows = _units(messages, session_id, counter)
    by_key = dict(zip(map(_KEY, messages), range(len(messages))))
    order: dict[int, None] = {}  # the units read, best first (a dict: in order, once each)
    for r in ranked:
        index = by_key.get(_KEY(r))
        if index is not None and unit_of[index] >= 0:  # -1: cut short by a gap (deleted messages)
            order.setdefault(unit_of[index], None)
    taken: list[int] = []  # the units chosen, best first
    chosen: set[int] = set()
    gap = counter.text(_GAP)
    spent = _opening(counter)
    # A pass may cost what it took too high: two runs it joins show one time, not two, only where
    # the run after shows a minute of its own. Costed as shown, the room it left goes to the units
    # not taken, in another pass.
    estimate = _take(order, messages, bounds, follows, unit_of, chosen, taken, spent, room, gap, counter)
    while estimate > spent:
        spent = _spent(messages, bounds, follows, unit_of, chosen, gap, session_id, counter)
        if spent >= estimate:
            break
        estimate = _take(order, messages, bounds, follows, unit_of, chosen, taken, spent, room, gap, counter)
        if estimate > spent:  # what this pass took may rank above what the last did
            rank = {unit: i for i, unit in enumerate(order)}
            taken.sort(key=rank.__getitem__)
    while spent > room and taken:  # the runs' times are more than allowed for: the lowest-ranked go,
        over = spent - room  # as many as could free what is over (each at most its messages, a gap
        while over > 0 and taken:  # and a time), then the whole is costed again
            unit = taken.pop()
            chosen.discard(unit)
            over -= bounds[unit][2] + gap + _time_tokens(messages[bounds[unit][0]], counter)
        spent = _spent(messages, bounds, follows, unit_of, chosen, gap, session_id, counter)
    info = dict(zip(map(_KEY, ranked), ranked))
    # What `render` counts is that cost where the counter cuts labels as tiktoken does; where it
    # does not, the block is counted, and the lowest-ranked units go until it fits.
    while taken:
        block = render([m for m, u in zip(messages, unit_of) if u in chosen], info, words, session_id, counter)
        if block.tokens <= room:
            return block
        chosen.discard(taken.pop())
    return None


def _take(order: dict[int, None], messages: Sequence[RecalledMessage], bounds: list[tuple[int, int, int]],
          follows: list[bool], unit_of: list[int], chosen: set[int], taken: list[int], spent: int, room: int,
          gap: int, counter: TokenCounter) -> int:
    """Add to `chosen` and `taken` the units of `order` not chosen yet that fit in `room` beside the
    `spent` tokens, best first; returns `spent` with what they cost. Each costs its labels and
    lines; where it starts a run, the gap before it and its time unless the message read before it
    was said in the same minute (the first unit taken pays the one every block shows); where it
    joins two runs, a gap less, and the time the run after showed where its first message was said
    in another minute than the one before it (times only grow along a session)."""
    end = len(messages)
    for unit in order:
        if unit in chosen:
            continue
        lo, hi, cost = bounds[unit]
        joins_before = lo > 0 and follows[lo] and unit_of[lo - 1] in chosen
        joins_after = hi < end and follows[hi] and unit_of[hi] in chosen
        if joins_before and joins_after:
            same = _minute_of(messages[hi]) == _minute_of(messages[hi - 1])
            cost -= gap + (0 if same else _time_tokens(messages[hi], counter))
        elif not (joins_before or joins_after):
            before = messages[lo - 1] if lo and chosen else None
            same = before is not None and before.session_id == messages[lo].session_id \
                and _minute_of(before) == _minute_of(messages[lo])
            cost += gap + (0 if same else _time_tokens(messages[lo], counter))
        if spent + cost <= room:
            spent += cost
            chosen.add(unit)
            taken.append(unit)
    return spent


def _times(messages: Sequence[RecalledMessage], bounds: list[tuple[int, int, int]], follows: list[bool],
           chosen: set[int], session_id: str, counter: TokenCounter) -> int:
    """The tokens of the times the runs of the `chosen` units show, as `render` shows them: a run
    shows its time (to the minute) unless it is the time shown last."""
    first = {u: messages[bounds[u][0]] for u in chosen}
    order = sorted(chosen, key=lambda u: (first[u].session_id != session_id, first[u].session_id, first[u].seq))
    tokens, shown, last = 0, -1, -2
    for unit in order:
        lo, hi, _ = bounds[unit]
        if lo != last or not follows[lo]:  # a run starts (`last`: the message after the previous unit)
            minute = _minute_of(messages[lo])
            if minute != shown:
                tokens += _time_tokens(messages[lo], counter)
                shown = minute
        last = hi
    return tokens


def _opening(counter: TokenCounter) -> int:
    """What every block costs before its messages: a message's overhead and `RECALL_PREFIX`."""
    return counter.message({"role": "user", "content": ""}) + counter.text(RECALL_PREFIX)


def _minute_of(message: RecalledMessage) -> int:
    return int(message.created_at // 60)


def _time_tokens(message: RecalledMessage, counter: TokenCounter) -> int:
    """The tokens of the time a run starting with `message` shows (" 2026-11-24 09:30")."""
    return counter.text(f" {_minute(_minute_of(message))}")


def _spent(messages: Sequence[RecalledMessage], bounds: list[tuple[int, int, int]], follows: list[bool],
           unit_of: list[int], chosen: set[int], gap: int, session_id: str, counter: TokenCounter) -> int:
    """The tokens of a block of the `chosen` units, as `choose` costs them."""
    tokens = _opening(counter)
    for unit in chosen:
        lo, _, cost = bounds[unit]
        tokens += cost + (0 if lo > 0 and follows[lo] and unit_of[lo - 1] in chosen else gap)
    return tokens - gap + _times(messages, bounds, follows, chosen, session_id, counter) if chosen else tokens


def without(block: Block, ranked: Sequence[Ranked], words: Sequence[str], session_id: str, kept_from: int,
            counter: TokenCounter) -> Block | None:
    """The block less this session's messages from position `kept_from` on: sent as kept turns once
    the room recall held back from them but left unused went back to them."""
    kept = [m for m in block.sources if m.session_id != session_id or m.seq < kept_from]
    if len(kept) == len(block.sources):
        return block
    if not kept:
        return None
    n = len(kept)
    if block.ends and all(a is b for a, b in zip(kept, block.sources)):
        # What goes is the end of the block (this session's latest, where no other session follows):
        # the block up to there, as rendered, its tokens summed so far.
        parts, tokens = block.ends[n - 1]
        return Block({"role": "user", "content": "".join(block.parts[:parts])},
                     block.tokens - block.ends[-1][1] + tokens, block.recalled[:n], block.sources[:n],
                     block.parts[:parts], block.ends[:n])
    return render(kept, {(r.session_id, r.seq): r for r in ranked}, words, session_id, counter)


def insert_at(messages: list[Message], n_new: int) -> int:
    """Where the block goes in `messages`: before the new ones, or, when those continue a stored unit
    (tool results answering a stored call, or nothing new: a regenerate), before that unit."""
    at = len(messages) - n_new
    if n_new == 0 or not starts_unit(messages[at]):
        at -= 1
        while at > 0 and not starts_unit(messages[at]):
            at -= 1
    return at


def _units(messages: Sequence[RecalledMessage], session_id: str, counter: TokenCounter
           ) -> tuple[list[int], list[tuple[int, int, int]], list[bool]]:
    """Each message's unit (an index into the second list, -1 for a unit cut short by a gap), each
    unit's messages (`messages[lo:hi]`) and tokens (its labels and lines, as `render` counts them),
    and whether each message directly follows the one before it (the next position of the same
    session). A unit runs from a unit start to the next, within consecutive positions of one
    session (the store read units whole)."""
    follows: list[bool] = []
    unit_of: list[int] = []
    bounds: list[tuple[int, int, int]] = []
    previous_sid, previous_seq = None, -2
    labels: dict[tuple[str, str, int], int] = {}
    for i, (sid, seq, role, unit_start, _, tokens, compact_tokens, _) in enumerate(messages):
        follows.append(seq == previous_seq + 1 and sid == previous_sid)
        previous_sid, previous_seq = sid, seq
        # A label's tokens, as its role's with a number of as many digits: tiktoken's encodings cut
        # numbers into pieces of three digits, each one token, so this is exact for them, close
        # for other counters (`render` counts the block exactly either way).
        shape = (sid, role, len(str(seq)))
        label = labels.get(shape)
        if label is None:
            number = "9" * shape[2]
            label = labels[shape] = counter.text(f"[#{number} {role}]" if sid == session_id
                                                 else f"[session {sid} #{number} {role}]")
        cost = max((tokens if tokens is not None else compact_tokens) + label, 1)
        if unit_start:
            unit_of.append(len(bounds))
            bounds.append((i, i + 1, cost))
        elif follows[i] and unit_of[-1] >= 0:
            lo, _, total = bounds[-1]
            bounds[-1] = (lo, i + 1, total + cost)
            unit_of.append(len(bounds) - 1)
        else:
            unit_of.append(-1)
    return unit_of, bounds, follows


@lru_cache(maxsize=4096)
def _minute(minute: int) -> str:
    """A run's time, to the minute (a block shows dozens, and many share one)."""
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(minute * 60))


def render(messages: list[RecalledMessage], info: dict[tuple[str, int], Ranked], words: Sequence[str],
           session_id: str, counter: TokenCounter) -> Block:
    """The block holding `messages`, this session's first, each session's in order, counted.

    Each message is a label ("[#12 2026-11-24 09:30 user]") and its stored line (`recall_line`: a
    space, its text, a newline). tiktoken's encodings cut a text into pieces before they encode
    it, and no piece spans a label's closing bracket and the space after it, nor a newline and a
    line that starts with "[" or "…": so the block's tokens are the sum of its parts', and each
    line's, counted once when the message was stored, is not counted again. A counter that cannot
    say so (`TokenCounter.sums_lines`) counts the block whole."""
    mine = all(m.session_id == session_id for m in messages)
    messages = sorted(messages, key=itemgetter(1) if mine else  # by position: this session's alone
                      lambda m: (m.session_id != session_id, m.session_id, m.seq))
    sums = counter.sums_lines
    text = counter.text
    parts = [RECALL_PREFIX]
    tokens = text(RECALL_PREFIX) if sums else 0
    gap = text(_GAP) if sums else 0
    ends: list[tuple[int, int]] = []
    recalled: list[Recalled] = []
    said: dict[tuple[int, ...], tuple[str, ...]] = {(): ()}  # the matched words, by word indices
    previous_sid, previous_seq = None, -2
    shown = ""  # the time last shown: a run shows its time unless it is that one
    new = tuple.__new__
    for sid, seq, role, _, text_line, line_tokens, _, created_at in messages:
        plain = f"[#{seq} {role}]" if mine or sid == session_id else f"[session {sid} #{seq} {role}]"
        line = f" {text_line}\n"
        if seq == previous_seq + 1 and sid == previous_sid:  # the run goes on
            when = ""
            parts += (plain, line)
        else:  # a run starts: after a gap, with its time unless that is the one shown last
            if previous_sid is not None:
                parts.append(_GAP)
                tokens += gap
            when = _minute(int(created_at // 60))
            if when == shown:
                when = ""
                parts += (plain, line)
            else:
                shown = when
                parts += (f"{plain[:-len(role) - 2]} {when} {role}]", line)
        if sums:
            # No piece spans a number and the space after it either: a label with its time counts
            # as the label without it and the time apart, so each position's label is counted once
            # whatever runs it starts in.
            # Another session's stored counts may be another model's counter's (this session's are
            # this counter's, or the plan counts the request again): its lines are counted here.
            own = line_tokens if sid == session_id else None
            tokens += text(plain) + (text(f" {when}") if when else 0) + (own if own is not None else text(line))
            ends.append((len(parts), tokens))
        previous_sid, previous_seq = sid, seq
        r = info.get((sid, seq))
        if r is None:
            recalled.append(new(Recalled, (sid, seq, role, created_at, None, ())))
            continue
        matched = said.get(r.matched)
        if matched is None:
            matched = said[r.matched] = tuple(words[i] for i in r.matched)
        recalled.append(new(Recalled, (sid, seq, role, created_at, r.hit if r.hit > 0 else None, matched)))
    message: Message = {"role": "user", "content": "".join(parts)}
    tokens = counter.message({"role": "user", "content": ""}) + tokens if sums else counter.message(message)
    return Block(message, tokens, tuple(recalled), tuple(messages), tuple(parts), tuple(ends))
