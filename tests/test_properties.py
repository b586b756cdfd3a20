"""Property tests of context building (issue item 14), through the real proxy and the SDK.

Hypothesis writes random agent conversations: a random system prompt (or none), user and assistant
texts of random lengths, rounds of 1-3 parallel tool calls with random argument and output sizes, and
a random `max_tokens` per request, played by a client that resends the whole history or one that
sends only the new turn. Every request either reaches the upstream as a valid request that fits the
budget (system prompt first, no orphan tool result, no unanswered call, the newest stored units that
fit, the new messages verbatim and last), or is refused with 400 `context_length_exceeded` without
calling the upstream and without storing anything, and that happens exactly when the mandatory part
(system, tools, new messages, and the stored call that new tool results answer) cannot fit.

A refused user turn is dropped by the client; refused tool results are retried once, shortened,
with the default reserve, and if even that cannot fit, the conversation ends there.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

import openai
import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from conftest import Proxy
from fake_upstream import FakeUpstream, Reply
from helpers import assistant_from
from memproxy.tokens import REPLY_PRIMING
from test_budget import (
    COUNTER,
    DEFAULT_RESERVE,
    MARGIN,
    TOOLS,
    WINDOW,
    Message,
    assert_context_length_exceeded,
    check_sent,
    db_state,
    mandatory_tail,
    tokens,
    tool_call,
    words,
)

pytestmark = pytest.mark.both_stores


@dataclass(frozen=True)
class Call:
    argument_words: int
    output_words: int


@dataclass(frozen=True)
class Round:
    calls: tuple[Call, ...]
    preamble_words: int  # text the assistant says along with its calls
    max_tokens: int | None  # of the request that sends this round's results


@dataclass(frozen=True)
class Turn:
    user_words: int
    max_tokens: int | None
    rounds: tuple[Round, ...]
    answer_words: int


@dataclass(frozen=True)
class Script:
    style: str  # "full": resends the whole history; "new": sends only the new turn
    system_role: str
    system_words: int | None
    system_every_request: bool
    description_words: int
    salt: int
    turns: tuple[Turn, ...]


max_tokens = st.one_of(st.none(), st.integers(1, 1700), st.integers(1, WINDOW + 100))
calls = st.builds(Call, st.integers(0, 150), st.integers(0, 500))
rounds = st.builds(Round, st.lists(calls, min_size=1, max_size=3).map(tuple),
                   st.one_of(st.just(0), st.integers(1, 200)), max_tokens)
turns = st.builds(Turn, st.integers(0, 250), max_tokens, st.lists(rounds, max_size=2).map(tuple),
                  st.integers(0, 120))
scripts = st.builds(
    Script,
    st.sampled_from(["full", "new"]),
    st.sampled_from(["system", "developer"]),
    st.one_of(st.none(), st.integers(0, 300)),
    st.booleans(),
    st.integers(0, 100),
    st.integers(0, 1000),
    st.lists(turns, min_size=1, max_size=6).map(tuple),
)


class Client:
    """Plays a script against the proxy and checks every request it makes."""

    def __init__(self, proxy: Proxy, upstream: FakeUpstream, script: Script) -> None:
        # One SDK client for all examples: the session is a per-request header.
        self.client = proxy.clients[0] if proxy.clients else proxy.client(session=None)
        self.upstream = upstream
        self.proxy = proxy
        self.script = script
        self.session = f"prop-{uuid.uuid4().hex}"
        self.system: list[Message] = []
        if script.system_words is not None:
            self.system = [{"role": script.system_role,
                            "content": f"system: {words(script.system_words, script.salt)}"}]
        self.tools = [{**TOOLS[0], "function": {**TOOLS[0]["function"],
                                                 "description": words(script.description_words)}}]
        self.history: list[Message] = []  # what the proxy has stored, as the client echoes it
        self.stored_system: list[Message] = []  # the session's last system prompt
        self.requests = 0

    async def play(self) -> None:
        salt = self.script.salt
        for t, turn in enumerate(self.script.turns):
            replies = [Reply(content=words(round_.preamble_words, salt) or None, tool_calls=[
                tool_call(f"call_{t}_{r}_{k}", json.dumps({"q": words(c.argument_words, salt + k)}))
                for k, c in enumerate(round_.calls)
            ]) for r, round_ in enumerate(turn.rounds)]
            replies.append(Reply(content=f"answer {t}: {words(turn.answer_words, salt + t)}"))
            user = {"role": "user", "content": f"turn {t}: {words(turn.user_words, salt + 2 * t)}"}
            if not await self.exchange([user], turn.max_tokens, replies[0]):
                continue
            for r, round_ in enumerate(turn.rounds):
                asked = replies[r].tool_calls or []
                results = [{"role": "tool", "tool_call_id": call["id"],
                            "content": f"out {call['id']}: {words(c.output_words, salt + k)}"}
                           for k, (call, c) in enumerate(zip(asked, round_.calls))]
                if await self.exchange(results, round_.max_tokens, replies[r + 1]):
                    continue
                short = [{**m, "content": "too long to show"} for m in results]
                if not await self.exchange(short, None, replies[r + 1]):
                    event("conversation ended: a call cannot be answered within the window")
                    return  # the stored call stays unanswered: this conversation cannot go on

    async def exchange(self, new: list[Message], reserve: int | None, reply: Reply) -> bool:
        """One request; True if it went upstream, False if it was refused as too long."""
        first = self.requests == 0
        self.requests += 1
        sent_system = self.system if (self.style_full or self.script.system_every_request or first) else []
        system = sent_system or self.stored_system
        refused, budget = self.oracle(system, new, reserve)
        history = self.history if self.style_full else []
        params: dict[str, Any] = {} if reserve is None else {"max_tokens": reserve}
        calls, state = len(self.upstream.chat_requests()), db_state(self.proxy)
        if not refused:
            self.upstream.enqueue(reply)
        try:
            raw = await self.client.chat.completions.with_raw_response.create(
                model="small", messages=[*sent_system, *history, *new], tools=self.tools,  # type: ignore[arg-type]
                extra_headers={"X-Session-Id": self.session}, **params)
        except openai.BadRequestError as exc:
            assert refused, f"refused though the mandatory part fits: {exc.response.text}"
            assert_context_length_exceeded(exc)
            assert len(self.upstream.chat_requests()) == calls, "refused after calling upstream"
            assert db_state(self.proxy) == state, "a refused request changed the store"
            event("refused: " + ("output reserve" if reserve is not None and reserve >= WINDOW
                                 else "tool results and their call" if new[0]["role"] == "tool"
                                 else "new turn"))
            return False
        assert not refused, "sent though the mandatory part cannot fit"
        raw.parse()
        requests = self.upstream.chat_requests()
        assert len(requests) == calls + 1
        kept = check_sent(requests[-1], raw.headers, system=system, history=self.history, new=new,
                          budget=budget)
        if kept < len(self.history):
            event("older history left out" + (" in an agent loop" if new[0]["role"] == "tool" else ""))
        if new[0]["role"] == "tool" and kept == mandatory_tail(self.history, new) < len(self.history):
            event("only the stored call went with its results")
        self.history += [*new, assistant_from(reply)]
        if sent_system:
            self.stored_system = sent_system
        return True

    @property
    def style_full(self) -> bool:
        return self.script.style == "full"

    def oracle(self, system: list[Message], new: list[Message], reserve: int | None) -> tuple[bool, int]:
        """Whether the request must be refused, and its input budget."""
        if reserve is not None and reserve >= WINDOW:
            return True, 0
        budget = WINDOW - (reserve or DEFAULT_RESERVE) - MARGIN
        must = mandatory_tail(self.history, new)
        mandatory = (tokens(system) + tokens(new) + COUNTER.tools(self.tools) + REPLY_PRIMING
                     + tokens(self.history[len(self.history) - must:]))
        return mandatory > budget, budget


@settings(max_examples=40, deadline=None, database=None,
          phases=[Phase.explicit, Phase.generate, Phase.shrink],  # "explain" replays hundreds of runs
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(script=scripts)
async def test_every_request_fits_and_keeps_units_whole_or_is_refused_up_front(
    proxy: Proxy, upstream: FakeUpstream, script: Script
) -> None:
    upstream.reset()  # a shrinking run may have left replies behind
    await Client(proxy, upstream, script).play()
