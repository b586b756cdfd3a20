"""The older part of a history as sent, kept between turns (`memproxy.memory.sent`): never another
history's, whatever happened to the session in between, and never held longer than its messages."""

from __future__ import annotations

import gc
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memproxy.config import MemoryConfig
from memproxy.memory.fit import Budget, fit
from memproxy.memory.sent import Older, SentHistories, older
from memproxy.messages import AUDIO_EXPIRY_MARGIN, Message
from memproxy.store import StoredMessage
from memproxy.tokens import TiktokenCounter
from test_plan import fixed_of, snapshot_of, stored

COUNTER = TiktokenCounter("o200k_base")
MEMORY = MemoryConfig(tool_output_max_tokens=64, dedupe_min_tokens=20)
LONG = "the same long tool output, line after line, " * 30  # deduplicated and trimmed alike


def _messages(kinds: list[int], tag: str) -> list[Message]:
    """A conversation of turns of a few kinds: a plain exchange, a long repeated tool output, a call
    left unanswered, an answer with reasoning, an image."""
    out: list[Message] = []
    for i, kind in enumerate(kinds):
        out.append({"role": "user", "content": f"question {tag} {i}"})
        if kind == 0:
            out.append({"role": "assistant", "content": f"answer {tag} {i}"})
        elif kind == 1:
            call = {"id": f"c{tag}{i}", "type": "function", "function": {"name": "read", "arguments": "{}"}}
            out += [{"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": f"c{tag}{i}", "content": LONG},
                    {"role": "assistant", "content": "read it"}]
        elif kind == 2:
            call = {"id": f"u{tag}{i}", "type": "function", "function": {"name": "ask", "arguments": '{"q": 1}'}}
            out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == 3:
            out.append({"role": "assistant", "content": f"thought through {i}", "reasoning_content": "hmm " * 20})
        else:
            picture = {"type": "image_url", "image_url": {"url": "https://example.invalid/a.png"}}
            out += [{"role": "user", "content": [{"type": "text", "text": "and this?"}, picture]},
                    {"role": "assistant", "content": "a picture"}]
    return out


def _same(got: Older, expected: Older) -> None:
    assert (got.bodies, got.tokens, got.saved, got.trimmed, got.deduplicated, got.callers, got.media) == (
        expected.bodies, expected.tokens, expected.saved, expected.trimmed, expected.deduplicated, expected.callers,
        expected.media)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["grow", "edit", "reread", "slide"]),
                          st.lists(st.integers(0, 4), min_size=1, max_size=4), st.integers(0, 40)),
                min_size=1, max_size=12),
       st.booleans())
def test_what_it_gives_is_what_working_it_out_afresh_gives(steps: list[tuple[str, list[int], int]], trim: bool) -> None:
    """Turn after turn of a session whose history grows, is edited (a suffix of new messages), is
    read again by the store (the same messages as new objects: a history cache miss, an import),
    or is sent from a later message on (a window that slides), the kept result is the one worked
    out afresh, for compact forms and full ones alike."""
    histories = SentHistories()
    least = MEMORY.dedupe_min_tokens
    bodies: list[Message] = _messages([1, 0], "s")
    messages = stored(bodies, MEMORY)
    start = 0
    for n, (step, kinds, at) in enumerate(steps):
        if step == "grow":  # the turn's exchange: new objects after the same ones
            bodies = bodies + _messages(kinds, str(n))
            messages = messages + stored(bodies, MEMORY)[len(messages):]
        elif step == "edit":  # from a position on, other messages
            cut = at % len(bodies)
            bodies = bodies[:cut] + _messages(kinds, f"e{n}")
            messages = messages[:cut] + stored(bodies, MEMORY)[cut:]
            start = min(start, cut)
        elif step == "reread":  # the same history, other objects
            messages = stored(bodies, MEMORY)
        else:
            start = min(at, len(messages) - 1)
        old = messages[start:]
        _same(histories.older(old, trim, least, COUNTER), older(old, trim, least, COUNTER))
        # The newest exchange is never among the older messages: the older part ends before it.
        shorter = old[: max(1, len(old) - 2)]
        _same(histories.older(shorter, trim, least, COUNTER), older(shorter, trim, least, COUNTER))


def test_a_later_turn_works_out_only_what_became_older() -> None:
    histories = SentHistories()
    messages = stored(_messages([1, 0, 1, 3, 4], "a"), MEMORY)
    first = histories.older(messages[:6], True, 20, COUNTER)
    assert first.deduplicated == 0 and first.trimmed == 1 and first.callers == [1] and first.media == 0
    later = histories.older(messages, True, 20, COUNTER)
    assert later is first  # extended, not made again
    assert later.deduplicated == 1 and later.callers == [1, 7] and later.media == 1
    _same(later, older(messages, True, 20, COUNTER))
    # The same history read again by the store (other objects): worked out afresh.
    again = stored(_messages([1, 0, 1, 3, 4], "a"), MEMORY)
    fresh = histories.older(again, True, 20, COUNTER)
    assert fresh is not later
    _same(fresh, later)


def test_another_setting_or_counter_is_another_entry() -> None:
    histories = SentHistories()
    messages = stored(_messages([1, 1], "b"), MEMORY)
    compact = histories.older(messages, True, 20, COUNTER)
    full = histories.older(messages, False, 20, COUNTER)
    undeduplicated = histories.older(messages, True, 0, COUNTER)
    other = histories.older(messages, True, 20, TiktokenCounter("cl100k_base"))
    assert len(histories) == 4
    assert compact.trimmed == 1 and full.trimmed == 0 and undeduplicated.deduplicated == 0
    assert other.tokens == compact.tokens  # the counts are the stored ones; a reference's is the counter's
    _same(other, older(messages, True, 20, TiktokenCounter("cl100k_base")))


def test_an_entry_goes_with_its_first_message_and_there_are_at_most_so_many() -> None:
    histories = SentHistories(max_entries=2)
    messages = stored(_messages([0, 0], "c"), MEMORY)
    histories.older(messages, True, 20, COUNTER)
    assert len(histories) == 1
    del messages
    gc.collect()
    assert len(histories) == 0  # the store's history cache let the session go: so does this
    kept = [stored(_messages([0], f"d{i}"), MEMORY) for i in range(3)]
    for messages in kept:
        histories.older(messages, True, 20, COUNTER)
    assert len(histories) == 2  # the least recently used went
    assert SentHistories(max_entries=0).older(kept[0], True, 20, COUNTER).bodies == older(
        kept[0], True, 20, COUNTER).bodies


class _Clock:
    """A clock the test sets: what `time.time()` says to `memproxy.messages`."""

    def __init__(self) -> None:
        self.now = time.time()

    def time(self) -> float:
        return self.now


def test_an_answers_audio_goes_by_its_id_until_the_provider_forgets_it_whatever_was_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import memproxy.messages

    clock = _Clock()
    monkeypatch.setattr(memproxy.messages, "time", clock)
    spoken: dict[str, Any] = {"role": "assistant", "content": None,
                              "audio": {"id": "audio_1", "data": "AAAA", "transcript": "Hello",
                                        "expires_at": int(clock.now + AUDIO_EXPIRY_MARGIN) + 60}}
    messages: list[StoredMessage] = stored([{"role": "user", "content": "say hello"}, spoken], MEMORY)
    histories = SentHistories()
    assert histories.older(messages, True, 20, COUNTER).bodies[1] == {"role": "assistant", "audio": {"id": "audio_1"}}
    clock.now += 120  # the provider has forgotten it
    assert histories.older(messages, True, 20, COUNTER).bodies[1] == {"role": "assistant", "content": "Hello"}


@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=3), min_size=1, max_size=8),
       st.sampled_from([300, 1500, 20_000]))
def test_a_fit_with_what_earlier_turns_kept_is_the_fit_without(turns: list[list[int]], window: int) -> None:
    """Turn after turn of a growing session, at a window that sends it whole and at ones that cut
    it (a summary's start, a marker), the plan made with the kept older part is the one made
    without: the same messages, counts and notes (media among them)."""
    histories = SentHistories()
    bodies: list[Message] = []
    messages: list[StoredMessage] = []
    for n, kinds in enumerate(turns):
        bodies = bodies + _messages(kinds, str(n))
        messages = messages + stored(bodies, MEMORY)[len(messages):]
        new = [{"role": "user", "content": f"next {n}"}]
        snapshot = snapshot_of(messages, new, summary_covers=2 if n % 3 == 2 else 0)
        args = (fixed_of([{"role": "system", "content": "Be brief."}], new), Budget(window, 100, 20), "small",
                COUNTER, MEMORY, True)
        assert fit(snapshot, *args, histories=histories) == fit(snapshot, *args)
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.invalid/b.png"}}]}
    plain = fit(snapshot_of(messages, new), fixed_of([], new), Budget(20_000, 100, 20), "small", COUNTER, MEMORY, True,
                histories=histories)
    assert plain.media == any(4 in kinds for kinds in turns)
    assert fit(snapshot_of(messages, [image]), fixed_of([], [image]), Budget(20_000, 100, 20), "small", COUNTER,
               MEMORY, True, histories=histories).media
