"""Property test of issue 11: whatever clients do on one session, memory never vanishes on a guess.

Hypothesis plays random interleavings of client behaviours on one session (a fresh session per
example) through the real proxy with the SDK: a full resend (with or without a history header), new
messages only, a resent window (a tail of the history, then the new message), a tool loop (new
messages or full resends; the call echoed as the SDK returned it, re-serialised as LangChain does, or
not at all), an edit of an earlier user message and a regenerate by a full-history client, the first
message sent again by a new-messages client, and any request first failing upstream and then retried.
Each step is a different client style, so the session keeps switching between them.

A model tracks the active history each step must leave. After every request it checks that the
stored active chain is exactly the model (so every message the client never edited away is still
active and in order, and none is stored twice), that the superseded messages are exactly those the
client edited or regenerated away, that the upstream received exactly the kept history and then the
new messages (nothing sent twice; the newest user message last and verbatim), and that the reported
kind and `X-Memproxy-Superseded` are the ones the rules of `memproxy/memory/reconcile.py` give.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import openai
import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from conftest import Proxy, make_config
from db import table_query
from fake_upstream import FakeUpstream, Reply
from memproxy.config import Config, StorageConfig
from memproxy.messages import wire_form
from memproxy.typedefs import CONFIG

pytestmark = pytest.mark.both_stores

Message = dict[str, Any]
Behaviour = Literal["full", "new", "window", "tool_loop", "edit", "regenerate", "repeat_first"]
Header = Literal["auto", "full", "new"]
Echo = Literal["none", "sdk", "spaced"]

# The headers each behaviour may send: a client never says the opposite of what it does (a client
# sending only new messages that says `full` asks for its first message to be read as an edit).
HEADERS: dict[str, tuple[Header, ...]] = {
    "full": ("auto", "full", "new"), "new": ("auto", "new"), "window": ("auto", "full", "new"),
    "tool_loop/full": ("auto", "full", "new"), "tool_loop/new": ("auto", "new"), "edit": ("auto", "full"),
    "regenerate": ("auto", "full"), "repeat_first": ("auto", "new"),
}
TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look something up",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "integer"}}},
}}]


@dataclass(frozen=True)
class Step:
    behaviour: Behaviour
    header: int  # index into the behaviour's HEADERS (modulo)
    fail: int | None  # which of the step's requests fails upstream first (then is retried)
    size: int  # window: stored messages resent; edit: which user message; tool loop: parallel calls
    echo: Echo  # tool loop: how the call is sent back
    full_style: bool  # tool loop: the client resends everything (else only new messages)


steps = st.builds(
    Step,
    st.sampled_from(["full", "new", "window", "tool_loop", "edit", "regenerate", "repeat_first"]),
    st.integers(0, 5),
    st.one_of(st.none(), st.none(), st.integers(0, 1)),
    st.integers(1, 6),
    st.sampled_from(["none", "sdk", "spaced"]),
    st.booleans(),
)


def user(text: str) -> Message:
    return {"role": "user", "content": text}


def calls(tag: str, count: int, spaced: bool = False) -> list[dict[str, Any]]:
    separators = (", ", ": ") if spaced else (",", ":")
    return [{"id": f"call_{tag}_{k}", "type": "function",
             "function": {"name": "lookup", "arguments": json.dumps({"q": f"{tag} {k}", "n": k},
                                                                   separators=separators)}}
            for k in range(count)]


def snapshot(config: Config, session: str) -> tuple[list[Message], list[Message]]:
    """The session's active chain in order, and its superseded messages, read from a connection of
    the test's own (tests/db.py)."""
    sql = ("SELECT m.body FROM messages m JOIN sessions s ON s.pk = m.session_pk"
           " WHERE s.tenant = 'a' AND s.session_id = ? AND m.active = ? ORDER BY m.seq, m.id")
    active, superseded = table_query(config, [(sql, (session, 1)), (sql, (session, 0))])
    return [json.loads(b) for (b,) in active], [json.loads(b) for (b,) in superseded]


def key(message: Message) -> str:
    return json.dumps(message, sort_keys=True)


@dataclass
class Expected:
    """What one request must do: its kind, what it supersedes, and the model afterwards."""

    kind: str
    superseded: int
    kept: int  # model messages that stay before the new ones
    new: list[Message]  # stored as sent


class Session:
    """One session, its model, and the client requests of each behaviour."""

    def __init__(self, proxy: Proxy, client: openai.AsyncOpenAI, upstream: FakeUpstream) -> None:
        self.proxy, self.client, self.upstream = proxy, client, upstream
        self.config: Config = proxy.app[CONFIG]
        self.id = f"rec-{uuid.uuid4().hex}"
        self.active: list[Message] = []  # the model of the active chain, in stored form
        self.superseded: list[Message] = []
        self.step = 0

    async def play(self, step: Step) -> None:
        self.step += 1
        tag = f"s{self.step}"
        behaviour = step.behaviour
        if behaviour in ("window", "edit", "regenerate", "repeat_first") and not self.active:
            behaviour = "new"  # nothing stored to resend yet
        if behaviour == "tool_loop":
            await self.tool_loop(step, tag)
            return
        group = behaviour
        header = HEADERS[group][step.header % len(HEADERS[group])]
        sent, expected = self.plan(behaviour, header, step.size, tag)
        await self.request(sent, header, expected, Reply(content=f"answer {tag}"), step.fail == 0)

    def plan(self, behaviour: str, header: Header, size: int, tag: str) -> tuple[list[Message], Expected]:
        n, fresh = len(self.active), user(f"message {tag}")
        if behaviour == "full":
            if not n:
                return [fresh], Expected("new", 0, 0, [fresh])
            return [*self.active, fresh], Expected("window" if header == "new" else "continue", 0, n, [fresh])
        if behaviour == "new":
            return [fresh], Expected("append" if n else "new", 0, n, [fresh])
        if behaviour == "window":
            k = min(size, n)
            kind = "continue" if k == n and header != "new" else "window"
            return [*self.active[n - k:], fresh], Expected(kind, 0, n, [fresh])
        if behaviour == "repeat_first":
            first = self.active[0]
            return [first], Expected("append", 0, n, [first])
        users = [j for j, m in enumerate(self.active) if m["role"] == "user"]
        if behaviour == "edit":
            at = users[size % len(users)]
            edited = user(f"message {tag}, an edit of position {at}")
            sent = [*self.active[:at], edited]
            if at == 0 and header != "full":
                return sent, Expected("append", 0, n, sent)  # nothing proves the client resends history
            return sent, Expected("edit", n - at, at, [edited])
        assert behaviour == "regenerate"
        last = users[-1]
        sent = self.active[: last + 1]
        shows = header == "full" or any(m["role"] == "assistant" for m in sent)
        if not shows:
            return sent, Expected("append", 0, n, sent)
        return sent, Expected("regenerate", n - last - 1, last + 1, [])

    async def tool_loop(self, step: Step, tag: str) -> None:
        group = "tool_loop/full" if step.full_style else "tool_loop/new"
        header = HEADERS[group][step.header % len(HEADERS[group])]
        n, question = len(self.active), user(f"message {tag}, with tools")
        asked = calls(tag, min(step.size, 3))
        if step.full_style:
            sent = [*self.active, question]
            kind = "new" if not n else "window" if header == "new" else "continue"
        else:
            sent, kind = [question], "append" if n else "new"
        reply = await self.request(sent, header, Expected(kind, 0, n, [question]), Reply(tool_calls=asked),
                                   step.fail == 0)
        call_message = {"role": "assistant", "content": None, "tool_calls": asked}
        assert self.active[-1] == call_message
        results = [{"role": "tool", "tool_call_id": c["id"], "content": f"result of {c['id']}"} for c in asked]
        echo: Message | None = None
        if step.echo == "sdk":
            echo = reply.choices[0].message.model_dump()  # refusal, audio, annotations... as None
        elif step.echo == "spaced":
            echo = {"role": "assistant", "content": None, "tool_calls": calls(tag, len(asked), spaced=True)}
        n = len(self.active)
        if step.full_style:
            history = self.active if echo is None else [*self.active[:-1], echo]
            sent, kind = [*history, *results], "window" if header == "new" else "continue"
        elif echo is None:
            sent, kind = results, "append"
        else:
            sent, kind = [echo, *results], "window"
        await self.request(sent, header, Expected(kind, 0, n, results), Reply(content=f"answer {tag}"),
                           step.fail == 1)

    async def request(
        self, sent: list[Message], header: Header, expected: Expected, reply: Reply, fail_first: bool
    ) -> Any:
        headers = {"X-Session-Id": self.id}
        if header != "auto":
            headers["X-Memproxy-History"] = header
        if fail_first:
            before = snapshot(self.config, self.id)
            self.upstream.enqueue(Reply(status=500))
            with pytest.raises(openai.InternalServerError):
                await self.client.chat.completions.create(model="big", messages=sent, tools=TOOLS,  # type: ignore[arg-type]
                                                          extra_headers=headers)
            assert snapshot(self.config, self.id) == before, "a failed call changed what is stored"
        self.upstream.enqueue(reply)
        raw = await self.client.chat.completions.with_raw_response.create(
            model="big", messages=sent, tools=TOOLS, extra_headers=headers)  # type: ignore[arg-type]
        completion = raw.parse()
        assert (raw.headers["X-Memproxy-Reconcile"], int(raw.headers["X-Memproxy-Superseded"])) == \
            (expected.kind, expected.superseded), f"{header}: {[m['role'] for m in sent]}"
        event(f"{expected.kind}{' after a failed call' if fail_first else ''}"
              f"{', superseding' if expected.superseded else ''}")

        answer: Message = {"role": "assistant", "content": reply.content}
        if reply.tool_calls:
            answer = {"role": "assistant", "content": None, "tool_calls": reply.tool_calls}
        self.superseded += self.active[expected.kept:] if expected.superseded else []
        assert not expected.superseded or len(self.active) - expected.kept == expected.superseded
        self.active = [*self.active[: expected.kept], *expected.new, answer]

        # What the upstream got: the kept history, then the new messages, each once, the newest last.
        got = self.upstream.last().messages
        assert got == [wire_form(m) for m in self.active[:-1]]
        newest_user = next(m for m in reversed(sent) if m["role"] in ("user", "tool"))
        assert got[-1] == wire_form(newest_user)
        # What is stored: exactly the model; what was superseded, exactly what the client left behind.
        active, superseded = snapshot(self.config, self.id)
        assert active == self.active, "the active history is not the one the client's requests give"
        assert sorted(map(key, superseded)) == sorted(map(key, self.superseded))
        return completion


@pytest.fixture
def proxies() -> dict[str, Proxy]:
    """One proxy per test (per store), started on first use and shared by its examples."""
    return {}


@settings(max_examples=120, deadline=None, database=None,
          phases=[Phase.explicit, Phase.generate, Phase.shrink],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(script=st.lists(steps, min_size=1, max_size=10))
async def test_no_interleaving_of_client_styles_loses_or_repeats_a_message(
    make_storage: Callable[..., StorageConfig], start_proxy: Any, upstream: FakeUpstream,
    proxies: dict[str, Proxy], script: list[Step],
) -> None:
    upstream.reset()  # a shrinking run may have left replies behind
    if "proxy" not in proxies:
        proxies["proxy"] = await start_proxy(make_config(make_storage("reconcile"), upstream.url))
    proxy = proxies["proxy"]
    client = proxy.clients[0] if proxy.clients else proxy.client(session=None)
    session = Session(proxy, client, upstream)
    for step in script:
        await session.play(step)
