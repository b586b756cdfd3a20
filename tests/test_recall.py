"""Recall's pure half (`memproxy.memory.recall`) and the fit's room for it, without a store.

`choose` gets what a store's `recall` answers, built here from a list of messages the way the store
builds it (each hit with its neighbours, extended to whole units, nothing at or after `before`), so
hypothesis can try many conversations: with recall on, the request still fits the budget exactly,
the system prompt goes first, the new messages verbatim and last, no tool result goes without its
call, and no recalled unit is split. The store's half is tested on both stores in
tests/test_recall_store.py; recall end to end through the proxy in tests/test_recall_proxy.py.
"""

from __future__ import annotations

import dataclasses

from hypothesis import event, given, settings
from hypothesis import strategies as st

from helpers import assistant, tool, user
from memproxy.config import MemoryConfig
from memproxy.errors import ContextLengthExceeded
from memproxy.memory import recall
from memproxy.memory.fit import Budget, drop_unanswered_calls, fit
from memproxy.messages import Message, starts_unit
from memproxy.store import Recall, RecalledMessage, RecallHit, StoredMessage
from memproxy.tokens import REPLY_PRIMING
from test_plan import COUNTER, SYSTEM, conversations, fixed_of, snapshot_of, stored

SESSION = "s1"


def recall_of(messages: list[StoredMessage], hits: dict[int, float], around: int, before: int) -> Recall:
    """What a store's `recall` answers for these hits: each with `around` messages each side,
    extended to whole units, none at or after `before`."""
    hits = {seq: score for seq, score in hits.items() if seq < before}
    wanted: set[int] = set()
    for seq in hits:
        lo, hi = max(seq - around, 0), min(seq + around, before - 1)
        while lo > 0 and not messages[lo].unit_start:
            lo -= 1
        while hi + 1 < before and not messages[hi + 1].unit_start:
            hi += 1
        wanted.update(range(lo, hi + 1))
    ranked = sorted(hits.items(), key=lambda item: -item[1])
    return Recall([RecallHit(SESSION, seq, score) for seq, score in ranked],
                  [RecalledMessage(SESSION, 1_700_000_000.0 + seq, messages[seq]) for seq in sorted(wanted)])


def recalled_units_whole(messages: list[StoredMessage], chosen: set[int]) -> bool:
    """Every recalled tool result comes with its call, every recalled call with its results."""
    for seq in chosen:
        if not messages[seq].unit_start and seq - 1 not in chosen:
            return False
        if seq + 1 < len(messages) and not messages[seq + 1].unit_start and seq + 1 in [m.seq for m in messages] \
                and messages[seq + 1].seq not in chosen:
            return False
    return True


@settings(max_examples=300, deadline=None)
@given(conversation=conversations(), window=st.integers(300, 2500), reserve=st.integers(1, 400),
       room=st.integers(0, 2000), around=st.integers(0, 2), system=st.booleans(), head_turns=st.integers(0, 2),
       data=st.data())
def test_recall_keeps_the_budget_properties(
    conversation: tuple[list[Message], list[Message]], window: int, reserve: int, room: int, around: int,
    system: bool, head_turns: int, data: st.DataObject,
) -> None:
    history, new = conversation
    memory = MemoryConfig(tool_output_max_tokens=64, dedupe_min_tokens=0)
    messages = stored(history, memory)
    budget = Budget(window, min(reserve, window - 1), 20)
    fixed = fixed_of([SYSTEM] if system else [], new)
    snapshot = snapshot_of(messages, new)
    users = [m.seq for m in messages if m.body.get("role") == "user"]
    head = messages[: users[head_turns]] if head_turns and len(users) > head_turns else []
    try:
        held = fit(snapshot, fixed, budget, "small", COUNTER, memory, use_marker=True, reserve=room, head=head)
    except ContextLengthExceeded:
        event("refused")
        return
    assert held.recall_room <= room
    assert held.tokens + held.recall_room <= budget.input_tokens
    assert held.tokens == sum(COUNTER.message(m) for m in held.messages) + REPLY_PRIMING
    if held.head:  # the opening turns, verbatim, right after the system prompt
        event("head sent")
        n_system = int(system)
        opening, _ = drop_unanswered_calls([m.body for m in head], [m.tokens for m in head], [], COUNTER)
        assert held.messages[n_system : n_system + held.head] == opening
        assert held.first_sent >= held.head_end == len(head)
    before = held.first_sent
    if before == 0:
        event("nothing left out")
        return
    hits = data.draw(st.dictionaries(st.integers(0, max(before - 1, 0)), st.floats(0.1, 20), max_size=12))
    found = recall.after(recall_of(messages, hits, around, before), SESSION, held.head_end)
    block = recall.choose(found, held.recall_room, around, SESSION, COUNTER)
    if block is None:
        event("nothing recalled")
        return
    event("recalled")
    assert block.tokens == COUNTER.message(block.message) <= held.recall_room
    at = recall.insert_at(held.messages, len(new))
    sent = [*held.messages[:at], block.message, *held.messages[at:]]
    assert held.tokens + block.tokens == sum(COUNTER.message(m) for m in sent) + REPLY_PRIMING
    assert held.tokens + block.tokens <= budget.input_tokens
    if system:
        assert sent[0] == SYSTEM
    assert sent[len(sent) - len(new):] == new
    called: set[str] = set()
    for message in sent:
        if message.get("role") == "tool":
            assert message["tool_call_id"] in called, "a tool result without its call"
        elif message.get("role") == "assistant":
            called = {c["id"] for c in message.get("tool_calls") or []}
        else:
            called = set()
    chosen = {r.seq for r in block.recalled}
    assert all(held.head_end <= seq < before for seq in chosen)
    assert recalled_units_whole(messages, chosen)
    assert [r.seq for r in block.recalled] == sorted(chosen)  # chronological


def test_choose_ranks_a_run_of_hits_above_a_lone_mention_and_sends_it_in_order() -> None:
    memory = MemoryConfig()
    history = [m for i in range(40) for m in (user(f"question {i}"), assistant(f"answer {i}"))]
    messages = stored(history, memory)
    # A lone strong hit at 10, and a run of three weaker ones around 60 that together rank higher.
    found = recall_of(messages, {10: 3.0, 59: 2.0, 60: 2.5, 61: 2.0}, around=1, before=70)
    span = sum(m.tokens for m in messages[58:63]) + 5 * 8 + 40
    block = recall.choose(found, span, around=1, session_id=SESSION, counter=COUNTER)
    assert block is not None
    assert [r.seq for r in block.recalled] == [58, 59, 60, 61, 62]
    assert [r.score for r in block.recalled] == [None, 2.0, 2.5, 2.0, None]
    text = block.message["content"]
    assert text.startswith(recall.RECALL_PREFIX)
    assert text.index("question 29") < text.index("answer 29") < text.index("answer 30")  # chronological
    assert "[#58 " in text and "#59 assistant]" in text  # positions, the time on the first of a run


def test_choose_sends_a_tool_call_with_its_results_or_not_at_all() -> None:
    memory = MemoryConfig(tool_output_max_tokens=0)
    history = [user("look it up"), assistant(None, ["c1", "c2"]), tool("c1", "first result"),
               tool("c2", "the secret is 42"), assistant("done"), user("thanks"), assistant("welcome")]
    messages = stored(history, memory)
    found = recall_of(messages, {3: 5.0}, around=0, before=5)  # a hit on the second tool result
    block = recall.choose(found, 1000, around=0, session_id=SESSION, counter=COUNTER)
    assert block is not None and [r.seq for r in block.recalled] == [1, 2, 3]
    assert "[calls " in block.message["content"] and "the secret is 42" in block.message["content"]
    unit = sum(m.tokens for m in messages[1:4])
    assert recall.choose(found, unit // 2, around=0, session_id=SESSION, counter=COUNTER) is None


def test_the_block_goes_before_the_new_messages_or_the_unit_they_continue() -> None:
    kept = [SYSTEM, user("a"), assistant("b")]
    assert recall.insert_at([*kept, user("new")], 1) == 3
    call = assistant(None, ["c9"])
    assert recall.insert_at([*kept, user("go"), call, tool("c9", "out")], 1) == 4  # before the call
    assert recall.insert_at([*kept, user("again")], 0) == 3  # a regenerate: before the message answered


def test_a_short_follow_up_is_looked_up_with_the_exchange_before_it() -> None:
    sent = [SYSTEM, user("tell me about the lighthouse keeper"), assistant("he lived alone on the cape")]
    assert recall.question([user("and then?")], [*sent, user("and then?")]) == [
        "tell", "lighthouse", "keeper", "lived", "alone", "cape"]
    long = user("what colour was the keeper's boat")
    assert recall.question([long], [*sent, long]) == ["colour", "keeper", "boat"]
    assert recall.question([], [*sent, long]) == ["colour", "keeper", "boat"]  # the latest stored one


def test_matched_words_ignore_common_endings() -> None:
    assert recall.matched(["visited", "rome", "paris"], user("I visit Rome every May")) == ["visited", "rome"]


def test_the_fit_holds_room_for_recall_only_from_older_turns() -> None:
    memory = MemoryConfig(tool_output_max_tokens=0, dedupe_min_tokens=0)
    history = [m for i in range(30) for m in (user(f"question {i} " * 5), assistant(f"answer {i} " * 5))]
    new = [user("what was question 3?")]
    snapshot = snapshot_of(stored(history, memory), new)
    budget = Budget(1000, 100, 20)
    plain = fit(snapshot, fixed_of([SYSTEM], new), budget, "small", COUNTER, memory, use_marker=True)
    held = fit(snapshot, fixed_of([SYSTEM], new), budget, "small", COUNTER, memory, use_marker=True, reserve=400)
    assert 0 < held.recall_room <= 400 and held.first_sent > plain.first_sent
    assert held.tokens + held.recall_room <= budget.input_tokens
    # The exchange before the new message stays, whatever recall asks for.
    greedy = fit(snapshot, fixed_of([SYSTEM], new), budget, "small", COUNTER, memory, use_marker=True,
                 reserve=10_000)
    assert greedy.messages[-3:] == [*history[-2:], *new]
    assert dataclasses.replace(held, recall_room=0) != plain  # the cut moved
