"""The memory steps called directly, without a server: `reconcile`, the pure `fit`, and `plan`.

`fit` gets plain data: a `Snapshot` built here from a list of messages the way the store builds one
(running totals, compact forms), so hypothesis can try hundreds of conversations a second. Its
properties: the request fits the budget (or `ContextLengthExceeded` is raised exactly when what must
be sent cannot fit), the system prompt goes first and the new messages verbatim and last, stored
history is sent in whole units with no orphan tool result, the count it reports is the count of what
it sends, and the bounded tail a store reads gives the very same request as the whole history.
`reconcile` reads the store, so it runs against a real SQLite store in a temp directory, as does
`prepare_turn`, whose budget rule (the output reserve) the chat endpoint and the preview share.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from conftest import make_config
from helpers import assistant, tool, user
from memproxy.concurrency import BackgroundTasks
from memproxy.config import MemoryConfig, ModelConfig
from memproxy.errors import BadRequest, ContextLengthExceeded
from memproxy.memory.fit import (Budget, Fixed, fit, marker_message, must_send_last_unit, room_for_history,
                                 summary_message)
from memproxy.memory.plan import PreparedTurn, output_reserve, prepare_turn, request_budget
from memproxy.memory import reconcile as reconciling
from memproxy.memory.reconcile import reconcile
from memproxy.memory.shrink import new_message
from memproxy.memory.summaries import Summarizer
from memproxy.messages import ROOT_HASH, Message, chain_hashes, starts_unit, wire_form
from memproxy.provider import Provider
from memproxy.store import (
    NewMessage,
    SessionState,
    Snapshot,
    SQLiteStore,
    StoredMessage,
    Summary,
    Totals,
    TurnRecord,
    TurnStore,
    Usage,
)
from memproxy.tokens import REPLY_PRIMING, TiktokenCounter, encoding_name_for

COUNTER = TiktokenCounter(encoding_name_for("openai/small"))
MODEL = ModelConfig(name="small", model="openai/small", context_window=2000, max_output_tokens=256)
SYSTEM: Message = {"role": "system", "content": "You are terse."}




# --- plain snapshots -----------------------------------------------------------------------------


def stored(history: list[Message], memory: MemoryConfig) -> list[StoredMessage]:
    """`history` as the store keeps it: counted once, compact forms, running totals."""
    out: list[StoredMessage] = []
    cum = compact_cum = 0
    for seq, (body, chain) in enumerate(zip(history, chain_hashes(ROOT_HASH, history))):
        new = new_message(body, chain, COUNTER, memory)
        compact_tokens = new.tokens if new.compact_tokens is None else new.compact_tokens
        out.append(StoredMessage(seq, body, new.tokens, cum, new.unit_start, chain, new.compact_body,
                                 compact_tokens, compact_cum))
        cum, compact_cum = cum + new.tokens, compact_cum + compact_tokens
    return out


def snapshot_of(
    messages: list[StoredMessage], new: list[Message], summary_covers: int = 0, room: int | None = None,
    deleted: int = 0,
) -> Snapshot:
    """The snapshot of a session holding `messages`, as `Store.snapshot` reads it: the whole history,
    or (`room`) only the tail the store's rule bounds: unless the whole history fits as stored, the
    earliest of the last unit and the first unit start whose tail fits `room` as stored or compact.
    `deleted`: the first messages are gone, as the message cap deletes them."""
    base = len(messages)
    head = Totals(sum(m.tokens for m in messages), sum(m.compact_tokens for m in messages))
    units = [m.seq for m in messages if m.unit_start]
    must_start = (units[-1] if units else base) if must_send_last_unit(new) else base
    users = [m.seq for m in messages if m.body.get("role") == "user"]
    summary = summary_totals = None
    if 0 < summary_covers <= must_start:
        last = messages[summary_covers - 1]
        summary = Summary(1, f"They talked about {summary_covers} things.", summary_covers, last.chain_hash,
                          10, 100, "small")
        summary_totals = Totals(last.cum_before + last.tokens, last.compact_cum_before + last.compact_tokens)
    start = 0
    if room is not None and head.full > room:  # else the whole history fits: all of it is read
        fits = [s for s in units if messages[s].cum_before >= head.full - room]
        fits_compact = [s for s in units if messages[s].compact_cum_before >= head.compact - room]
        start = min(must_start, fits[0] if fits else base, fits_compact[0] if fits_compact else base)
    kept = [m for m in messages[start:] if m.seq >= deleted]  # `deleted`: the first ones are gone
    return Snapshot(base, head, must_start, users[-1] if users else None, summary, summary_totals, start, kept)


def fixed_of(system: list[Message], new: list[Message]) -> Fixed:
    return Fixed(system, new, sum(COUNTER.message(m) for m in system + new) + REPLY_PRIMING)


# --- fit: examples -------------------------------------------------------------------------------


def test_a_summary_ending_inside_a_unit_never_leaves_its_results_without_their_call() -> None:
    """A summary folded an unanswered call; an edit then answered it right after it. Its results,
    after the summary's end, cannot go without their call: they are left out, and the marker says
    so, where the agent loop's next step would otherwise have sent them first."""
    memory = MemoryConfig(tool_output_max_tokens=0, dedupe_min_tokens=0)
    history = [user("deploy it"), assistant(None, ["d1_0", "d1_1"]), tool("d1_0", "ok"), tool("d1_1", "ok"),
               assistant(None, ["d2_0"])]
    new = [tool("d2_0", "done")]
    snapshot = snapshot_of(stored(history, memory), new, summary_covers=2)
    context = fit(snapshot, fixed_of([], new), Budget(4000, 100, 20), "small", COUNTER, memory, use_marker=True)
    assert context.summary is not None and context.marker
    assert context.messages[-2:] == [wire_form(history[-1]), *new]  # as sent: no `content: null`
    assert not any(m.get("role") == "tool" for m in context.messages[:-1])
    assert context.unsummarised_omitted == 2 and context.messages[1] == marker_message(2)


def test_tool_results_that_do_not_follow_their_call_are_refused_before_anything_is_sent() -> None:
    """A client sending only its new messages returns a call's results after another request
    continued the session: sent so, the results would follow no call (a provider's 400, after the
    call was paid for) and the call would go without them. The client is told instead."""
    memory = MemoryConfig(tool_output_max_tokens=0, dedupe_min_tokens=0)
    history = [user("deploy it"), assistant(None, ["c1"]), user("meanwhile, hi"), assistant("hello")]
    new = [tool("c1", "deployed")]
    snapshot = snapshot_of(stored(history, memory), new)
    with pytest.raises(BadRequest) as refused:
        fit(snapshot, fixed_of([], new), Budget(4000, 100, 20), "small", COUNTER, memory, use_marker=True)
    assert refused.value.param == "messages" and "c1" in refused.value.message
    # Right after their call, the same results go, with it.
    history = history[:2]
    context = fit(snapshot_of(stored(history, memory), new), fixed_of([], new), Budget(4000, 100, 20), "small",
                  COUNTER, memory, use_marker=True)
    assert context.messages == [*map(wire_form, history), *new]


def test_fit_sends_everything_that_fits_and_nothing_else_when_it_all_does() -> None:
    memory = MemoryConfig(tool_output_max_tokens=0, dedupe_min_tokens=0)
    history = [user("hi"), assistant("hello"), user("how are you?"), assistant("fine")]
    new = [user("good")]
    context = fit(snapshot_of(stored(history, memory), new), fixed_of([SYSTEM], new), Budget(2000, 256, 20),
                  "small", COUNTER, memory, use_marker=True)
    assert context.messages == [SYSTEM, *history, *new]
    assert (context.included, context.omitted, context.first_sent, context.marker) == (4, 0, 0, False)
    assert context.tokens == sum(COUNTER.message(m) for m in context.messages) + REPLY_PRIMING


def test_messages_the_cap_deleted_with_no_summary_for_them_are_marked_as_left_out() -> None:
    """An edit below the newest summary of a capped session: no summary in use stands for the
    messages the cap deleted, and the rest fits. What is sent says that earlier messages are
    missing (a marker), never that the history starts where the store's rows do."""
    memory = MemoryConfig(tool_output_max_tokens=0, dedupe_min_tokens=0)
    history = [m for i in range(6) for m in (user(f"q{i}"), assistant(f"a{i}"))]
    new = [user("next")]
    context = fit(snapshot_of(stored(history, memory), new, deleted=8), fixed_of([SYSTEM], new),
                  Budget(2000, 256, 20), "small", COUNTER, memory, use_marker=True)
    assert context.messages[1]["content"].startswith("[8 earlier messages")
    assert context.messages[2:] == [*history[8:], *new]
    assert (context.first_sent, context.omitted, context.unsummarised_omitted, context.marker) == (8, 8, 8, True)


def test_fit_cuts_at_a_unit_and_marks_what_it_left_out() -> None:
    memory = MemoryConfig(tool_output_max_tokens=0, dedupe_min_tokens=0)
    history = [user("read it"), assistant(None, ["c1"]), tool("c1", "word " * 300), assistant("done"),
               user("and now?"), assistant("now this")]
    new = [user("next")]
    context = fit(snapshot_of(stored(history, memory), new), fixed_of([], new), Budget(400, 100, 20),
                  "small", COUNTER, memory, use_marker=True)
    # The tool output does not fit, nor its call; nor the answer after them without its question:
    # what is kept opens with the user's next message.
    assert context.first_sent == 4 and context.marker
    assert context.messages[0]["content"].startswith("[4 earlier messages")
    assert context.messages[1:] == [*history[4:], *new]


def budget_with_room(fixed: Fixed, room: int) -> Budget:
    """A budget that leaves `room` tokens for stored history beside `fixed`."""
    return Budget(fixed.tokens + room + 276, 256, 20)


def test_kept_turns_and_opening_turns_give_way_to_the_marker_in_its_short_form_if_need_be() -> None:
    """Where history is left out the request says so: kept turns make room for the marker, the
    opening turns never take its room, and where the sentence does not fit its short form does."""
    memory = MemoryConfig(tool_output_max_tokens=0, dedupe_min_tokens=0)
    history = [m for i in range(6) for m in (user(f"q{i} " + "word " * 20), assistant(f"a{i}"))]
    messages, new = stored(history, memory), [user("next")]
    fixed = fixed_of([], new)
    long, short = (COUNTER.message(marker_message(12, short=s)) for s in (False, True))
    # Room for the short marker, not for the long one.
    assert short < long - 1
    context = fit(snapshot_of(messages, new), fixed, budget_with_room(fixed, long - 1), "small", COUNTER, memory,
                  use_marker=True)
    assert context.marker and context.messages[0] == marker_message(context.unsummarised_omitted, short=True)
    # The opening turn fits, and so does the marker, not both: the marker goes, the opening turn not.
    opening = messages[0].tokens + messages[1].tokens
    room = max(long, opening + short - 1)
    context = fit(snapshot_of(messages, new), fixed, budget_with_room(fixed, room), "small", COUNTER,
                  memory, use_marker=True, head=messages[:2])
    assert opening <= room and context.head == 0
    assert context.messages[0] == marker_message(context.unsummarised_omitted)


def test_a_marker_beside_the_summary_says_its_messages_are_not_summarised() -> None:
    memory = MemoryConfig(tool_output_max_tokens=0, dedupe_min_tokens=0)
    history = [m for i in range(8) for m in (user(f"q{i} " + "word " * 30), assistant(f"a{i}"))]
    new = [user("next")]
    snapshot = snapshot_of(stored(history, memory), new, summary_covers=4)
    context = fit(snapshot, fixed_of([], new), Budget(450, 256, 20), "small", COUNTER, memory, use_marker=True)
    assert context.summary is not None and context.marker
    assert context.messages[1]["content"].endswith("and have not been summarised yet.]")


def test_fit_refuses_what_cannot_fit_whatever_is_stored() -> None:
    memory = MemoryConfig(tool_output_max_tokens=0, dedupe_min_tokens=0)
    new = [user("word " * 500)]
    with pytest.raises(ContextLengthExceeded):
        fit(None, fixed_of([], new), Budget(400, 100, 20), "small", COUNTER, memory, use_marker=True)


def test_fit_sends_the_summary_and_only_what_it_does_not_cover() -> None:
    memory = MemoryConfig(tool_output_max_tokens=0, dedupe_min_tokens=0)
    history = [m for i in range(3) for m in (user(f"question {i}"), assistant(f"answer {i}"))]
    new = [user("next")]
    snapshot = snapshot_of(stored(history, memory), new, summary_covers=4)
    assert snapshot.summary is not None
    context = fit(snapshot, fixed_of([], new), Budget(2000, 256, 20), "small", COUNTER, memory, use_marker=True)
    assert context.messages == [summary_message(snapshot.summary.text), *history[4:], *new]
    assert (context.summary, context.first_sent, context.unsummarised_omitted) == (snapshot.summary, 4, 0)


# --- fit: properties -----------------------------------------------------------------------------


FILES = [f"file {n}: " + f"line {n} " * 120 for n in range(2)]  # read more than once: deduplicated
outputs = st.one_of(st.sampled_from(FILES), st.integers(1, 400).map(lambda n: "out " * n))


@st.composite
def conversations(draw: st.DrawFn) -> tuple[list[Message], list[Message]]:
    """A stored agent conversation and the next request's new messages."""
    history: list[Message] = []
    calls = 0
    for _ in range(draw(st.integers(0, 12))):
        history.append(user("word " * draw(st.integers(1, 120))))
        for _ in range(draw(st.integers(0, 2))):
            ids = [f"call{calls + i}" for i in range(draw(st.integers(1, 3)))]
            calls += len(ids)
            history.append(assistant(None, ids))
            unanswered = draw(st.booleans()) and draw(st.booleans()) and draw(st.booleans())
            history += [tool(c, draw(outputs)) for c in ids[: len(ids) - unanswered]]
        history.append(assistant("said " * draw(st.integers(1, 80))))
    ending = draw(st.sampled_from(["user", "regenerate", "tool results"]))
    if ending == "user" or not history:
        return history, [user("next " * draw(st.integers(1, 60)))]
    if ending == "regenerate":
        return history, []
    ids = [f"call{calls + i}" for i in range(draw(st.integers(1, 2)))]
    history.append(assistant(None, ids))
    return history, [tool(c, "result " * draw(st.integers(1, 200))) for c in ids]


@settings(max_examples=300, deadline=None)
@given(conversation=conversations(), window=st.integers(300, 6000), reserve=st.integers(1, 400),
       trim=st.sampled_from([0, 64]), dedupe=st.sampled_from([0, 50]), marker=st.booleans(),
       system=st.booleans(), summarised=st.integers(0, 30), mid_unit=st.booleans())
def test_fit_properties(
    conversation: tuple[list[Message], list[Message]], window: int, reserve: int, trim: int, dedupe: int,
    marker: bool, system: bool, summarised: int, mid_unit: bool,
) -> None:
    """`mid_unit`: the summary's end falls inside a unit, as after an edit: it folded a call whose
    results the edited branch then gave right after it."""
    history, new = conversation
    memory = MemoryConfig(tool_output_max_tokens=trim, dedupe_min_tokens=dedupe)
    messages = stored(history, memory)
    units = [m.seq for m in messages if m.unit_start]
    covers = min(summarised, len(messages)) if mid_unit else max([u for u in units if u <= summarised] or [0])
    budget = Budget(window, min(reserve, window - 1), 20)
    fixed = fixed_of([SYSTEM] if system else [], new)
    whole = snapshot_of(messages, new, covers)
    try:
        context = fit(whole, fixed, budget, "small", COUNTER, memory, use_marker=marker)
    except ContextLengthExceeded:
        must = sum(m.tokens for m in messages[whole.must_start:])
        assert fixed.tokens + must > budget.input_tokens  # refused only when the mandatory part is too big
        event("refused")
        return
    sent = context.messages
    event(f"left out: {'some' if context.omitted else 'none'}, summary: {context.summary is not None}, "
          f"marker: {context.marker}, trimmed: {context.trimmed > 0}, deduplicated: {context.deduplicated > 0}")
    # Fits, and the count reported is the count of what is sent.
    assert context.tokens == sum(COUNTER.message(m) for m in sent) + REPLY_PRIMING
    assert context.tokens <= budget.input_tokens
    # System first, the new messages verbatim and last.
    if system:
        assert sent[0] == SYSTEM
    assert sent[len(sent) - len(new):] == new
    assert context.first_sent <= whole.must_start  # the call new tool results answer is sent
    # Whole units: the first stored message sent is no tool result, and none is an orphan.
    history_sent = sent[len(sent) - len(new) - context.included : len(sent) - len(new)]
    if history_sent:
        assert starts_unit(history_sent[0])
    called: set[str] = set()
    for message in sent:
        if message.get("role") == "tool":
            assert message["tool_call_id"] in called, "a tool result without its call"
        elif message.get("role") == "assistant":
            called = {c["id"] for c in message.get("tool_calls") or []}
        else:
            called = set()
    # The bounded tail a store reads gives the very same request as the whole history.
    bounded = snapshot_of(messages, new, covers, room=room_for_history(fixed, budget))
    assert len(bounded.messages) <= len(messages)
    assert fit(bounded, fixed, budget, "small", COUNTER, memory, use_marker=marker) == context
    # `max_messages_per_session` deletes what the summary in use stands for but its last message:
    # positions then have gaps, and a request the summary goes in is the same.
    if context.summary is not None and covers > 1:
        capped = snapshot_of(messages, new, covers, room=room_for_history(fixed, budget), deleted=covers - 1)
        assert fit(capped, fixed, budget, "small", COUNTER, memory, use_marker=marker) == context


# --- plan: the budget rule the chat endpoint and the preview share --------------------------------


@pytest.mark.parametrize(("params", "reserve"), [
    ({}, 256),
    ({"max_tokens": 900}, 900),
    ({"max_completion_tokens": 300, "max_tokens": 900}, 900),  # both: the larger
    ({"max_tokens": None, "max_completion_tokens": 5}, 5),
])
def test_output_reserve_follows_the_request_else_the_model(params: dict[str, Any], reserve: int) -> None:
    assert output_reserve(params, MODEL, 2000) == reserve
    budget = request_budget(params, MODEL, 2000, MemoryConfig(safety_margin_tokens=20))
    assert budget == Budget(2000, reserve, 20) and budget.input_tokens == 2000 - reserve - 20


def test_output_reserve_is_at_most_the_window_less_one() -> None:
    assert output_reserve({}, MODEL, 100) == 99


@pytest.mark.parametrize(("params", "error", "param"), [
    ({"max_tokens": 0}, BadRequest, "max_tokens"),
    ({"max_tokens": True}, BadRequest, "max_tokens"),
    ({"max_completion_tokens": "lots"}, BadRequest, "max_completion_tokens"),
    ({"max_tokens": 2000}, ContextLengthExceeded, "max_tokens"),
])
def test_output_reserve_refuses_what_is_no_reserve(params: dict[str, Any], error: type[Exception], param: str) -> None:
    with pytest.raises(error) as raised:
        output_reserve(params, MODEL, 2000)
    assert getattr(raised.value, "param") == param


# --- reconcile and prepare_turn on a real SQLite store --------------------------------------------


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SQLiteStore]:
    opened = await SQLiteStore.open(f"sqlite:///{tmp_path / 'plan.db'}")
    yield opened
    await opened.close()


async def session_with(store: SQLiteStore, history: list[Message]) -> SessionState:
    hashes = chain_hashes(ROOT_HASH, history)
    news = [NewMessage(m, COUNTER.message(m), starts_unit(m), h) for m, h in zip(history, hashes)]
    await store.record_turn(TurnRecord(
        tenant="t", session_id="s", expected_length=0, expected_head_hash="", base=0, base_totals=Totals(0, 0),
        base_hash=ROOT_HASH, messages=news, system=None, model="small", kind="new", context_tokens=1,
        latency_ms=1.0, usage=Usage()))
    session = await store.get_session("t", "s")
    assert session is not None
    return session


HISTORY = [user("a"), assistant("1"), user("b"), assistant("2")]


@pytest.mark.parametrize(("sent", "mode", "kind", "base", "new", "superseded"), [
    (HISTORY + [user("c")], "auto", "continue", 4, [user("c")], 0),
    ([user("c")], "auto", "append", 4, [user("c")], 0),
    (HISTORY[2:] + [user("c")], "auto", "window", 4, [user("c")], 0),
    ([user("a"), assistant("1"), user("b edited")], "auto", "edit", 2, [user("b edited")], 2),
    (HISTORY[:3], "auto", "regenerate", 3, [], 1),
    ([user("c")], "new", "append", 4, [user("c")], 0),
    (HISTORY[2:] + [user("c")], "new", "window", 4, [user("c")], 0),
])
@pytest.mark.parametrize("held_from", [None, 0, 2])
async def test_reconcile_against_a_real_store(
    store: SQLiteStore, sent: list[Message], mode: str, kind: str, base: int, new: list[Message], superseded: int,
    held_from: int | None,
) -> None:
    """The same reading whether the stored messages are read here or held from the session's read
    (`held`, from position 0 or a tail of them); held from the start, nothing is read at all."""
    session = await session_with(store, HISTORY)
    held = [] if held_from is None else await store.active_range(session, held_from, session.length)
    reads: TurnStore = cast(TurnStore, _Unreadable()) if held_from == 0 else store
    reconciled = await reconcile(reads, session, sent, mode, held)
    assert (reconciled.kind, reconciled.base, reconciled.new, reconciled.superseded) == (kind, base, new, superseded)
    assert reconciled.base_hash == chain_hashes(ROOT_HASH, HISTORY)[base - 1]


@pytest.mark.parametrize("sent", [
    HISTORY, HISTORY[:1], HISTORY[:3] + [user("c")], [user("a"), assistant("1 edited")] + HISTORY[2:],
    [user("other")], HISTORY[2:], [],
])
async def test_the_matched_prefix_held_is_the_stores(store: SQLiteStore, sent: list[Message]) -> None:
    """How much of the stored history the client's messages repeat, answered from the whole history
    held with the session (nothing read), is the store's own answer."""
    session = await session_with(store, HISTORY)
    held = await store.active_range(session, 0, session.length)
    hashes = chain_hashes(ROOT_HASH, sent)
    expected = await store.matched_prefix(session, hashes)
    assert await reconciling._matched_prefix(cast(TurnStore, _Unreadable()), session, hashes, held) == expected


class _Unreadable:
    """A store that must not be read: every lookup fails the test."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"read the store: {name}")


async def test_reconcile_of_a_new_session_stores_everything(store: SQLiteStore) -> None:
    reconciled = await reconcile(store, None, HISTORY)
    assert (reconciled.kind, reconciled.base, reconciled.new) == ("new", 0, HISTORY)


async def test_snapshot_of_a_real_store_fits_as_the_whole_history_does(store: SQLiteStore) -> None:
    """What `Store.snapshot` reads is the bounded tail `snapshot_of` models: the same request."""
    memory = MemoryConfig(tool_output_max_tokens=0, dedupe_min_tokens=0)
    history = [m for i in range(40) for m in (user(f"question {i} " + "w " * 30), assistant(f"answer {i}"))]
    session = await session_with(store, history)
    new = [user("next")]
    fixed, budget = fixed_of([], new), Budget(1000, 200, 20)
    snapshot = await store.snapshot(session, session.length, must_send_last_unit(new), room_for_history(fixed, budget))
    assert 0 < len(snapshot.messages) < len(history)  # a tail, not the history
    whole = snapshot_of(stored(history, memory), new)
    assert (fit(snapshot, fixed, budget, "small", COUNTER, memory, use_marker=True)
            == fit(whole, fixed, budget, "small", COUNTER, memory, use_marker=True))


async def test_prepare_turn_plans_on_a_real_store_and_writes_nothing(store: SQLiteStore, tmp_path: Path) -> None:
    """`prepare_turn` end to end without a server: reconcile, the budget from the request's
    parameters, one snapshot, the fit. With overflow `marker` no summariser is called."""
    config = make_config(tmp_path / "unused.db", "http://127.0.0.1:9/v1", overflow="marker")
    provider = Provider(config)
    try:
        summarizer = Summarizer(config, store, provider, BackgroundTasks())
        model = config.models[0]
        history = [m for i in range(10) for m in (user(f"question {i} " + "w " * 40), assistant(f"answer {i}"))]
        session = await session_with(store, history)
        counter = provider.counter(model)

        async def plan(params: dict[str, Any]) -> PreparedTurn:
            return await prepare_turn(store, summarizer, model, counter, provider.window(model), config.memory, "t",
                                      "s", [SYSTEM, user("next")], params, "new")

        roomy = await plan({})
        assert roomy.budget == Budget(2000, 256, 20) and roomy.reconciled.kind == "append"
        assert roomy.context.messages == [SYSTEM, *history, user("next")] and not roomy.context.marker
        tight = await plan({"max_tokens": 1500})
        assert tight.budget.input_tokens == 480 and tight.context.tokens <= 480
        assert tight.context.marker and 0 < tight.context.included < len(history)
        assert tight.context.messages[-1] == user("next") and tight.context.messages[0] == SYSTEM
        assert await store.get_session("t", "s") == session  # planning wrote nothing
    finally:
        await provider.close()
