"""The crash harness: `memproxy serve` killed with SIGKILL at chosen points of a turn, restarted on the
same store, and what the store holds checked against what the clients saw. Shared by
tests/test_crash.py (a few kills per store, in CI) and bench/crash_soak.py (many, bounded by count and
time), so both run the same logic.

Clients are the `openai` SDK (no retries), each on a conversation of its own, streamed or not and in
either history mode (`full`: the client resends its history; `new`: only its new message, so the
server rebuilds the rest from the store, across restarts). Every reply comes from the fake provider's
script, each a distinct whole text, so a stored fragment of one is recognisable.

Kill points (`KillPoint`):
- `before_upstream`: the provider has the request and holds its answer (a gate);
- `mid_stream`: the client has the first piece of a streamed answer, the provider holds the rest;
- `during_recording`: the client has the whole streamed answer but not `[DONE]`: the turn's write is
  held back by a write lock the harness holds (SQLite: `BEGIN IMMEDIATE`; PostgreSQL: a lock on
  `messages`, so the write is halfway: its `turns` row written, its messages waiting);
- `after_last_chunk` / `after_answer`: right after the client received a whole stream / plain answer;
- `anywhere`: three conversations running turns back to back, killed after a random delay.

A turn the client saw complete is "seen"; a turn in flight at the kill is "cut", and its conversation
ends there (whether the turn was stored is the one thing the client cannot know). The checks
(`verify`): each seen conversation is stored exactly as seen (a cut one may hold its cut turn whole, or
not at all), each question once, one `turns` row per stored exchange, no message inactive, the chain
hashes recomputed from the stored bodies, running totals and the session row's length, head hash and
head total consistent, and on SQLite `PRAGMA integrity_check` is `ok`. With `history: new` the
provider must also have received the conversation as seen, whatever restarts came between.
"""

from __future__ import annotations

import asyncio
import json
import random
import sqlite3
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import httpx
import openai

from conftest import PROXY_KEY
from db import rows, write_lock_held, writes_waiting
from fake_upstream import FakeUpstream, Reply
from memproxy.config import StorageConfig
from memproxy.messages import ROOT_HASH, chain_hashes
from memproxy.store.sqlite import sqlite_path
from processes import Served, serve_one, storage_section, write_config

KillPoint = Literal["before_upstream", "mid_stream", "during_recording", "after_last_chunk", "after_answer",
                    "anywhere"]
KILL_POINTS: tuple[KillPoint, ...] = get_args(KillPoint)
Message = dict[str, Any]
# Summaries off: every provider call is a client's turn, and every stored message is one a client sent
# or was answered.
MEMORY = "memory:\n  summaries: false\n  overflow: drop\n  tool_output_max_tokens: 0\n  dedupe_min_tokens: 0\n"
WAIT = 30.0  # the bound on every wait for an effect (a request arriving, a chunk, a lock waited on)
CONVERSATIONS = 3  # live at once
# What a client sees of a server that died: refused, reset, or a stream cut short.
CUT = (openai.APIConnectionError, openai.APITimeoutError, httpx.TransportError)


@dataclass
class Conversation:
    session: str
    history: Literal["full", "new"]
    seen: list[Message] = field(default_factory=list)  # the turns the client saw complete
    cut: Message | None = None  # the question of the turn in flight when the server died
    text: str = ""  # the answer so far of the turn in flight
    story: list[str] = field(default_factory=list)  # what happened to it, for a failure's message

    @property
    def over(self) -> bool:
        return self.cut is not None


@dataclass
class Summary:
    store: str
    kills: Counter[str] = field(default_factory=Counter)
    seen_turns: int = 0
    cut_turns: int = 0
    cut_stored: int = 0  # cut turns found stored (whole)
    conversations: int = 0
    seconds: float = 0.0

    def line(self) -> str:
        kills = ", ".join(f"{point} {n}" for point, n in sorted(self.kills.items()))
        return (f"{self.store}: {sum(self.kills.values())} kills ({kills}); {self.seen_turns} turns seen "
                f"complete, all stored once; {self.cut_turns} cut ({self.cut_stored} stored whole, the rest "
                f"not at all); {self.conversations} conversations consistent; {self.seconds:.1f} s")


class CrashRun:
    def __init__(self, storage: StorageConfig, upstream: FakeUpstream, folder: Path, rng: random.Random) -> None:
        self.storage = storage
        self.upstream = upstream
        self.folder = folder
        self.rng = rng
        # The `big` model (a 100k window): no history is ever left out of what is forwarded.
        self.config = write_config(folder / "crash.yaml", upstream.url, storage_section(storage), memory=MEMORY,
                                   big_model=True)
        self.conversations: list[Conversation] = []
        self.answers: set[str] = set()  # every text the provider was scripted to answer
        self.summary = Summary("postgresql" if storage.is_postgres else "sqlite")
        self.kills = 0
        self._questions = 0

    # --- driving ------------------------------------------------------------------------------

    async def round(self, point: KillPoint) -> None:
        """Start a server on the store, run turns, kill it at `point`."""
        start = time.monotonic()
        served = await asyncio.to_thread(serve_one, self.config, self.folder / f"serve-{self.kills}.log")
        self.upstream.reset()
        live = [c for c in self.conversations if not c.over]
        while len(live) < CONVERSATIONS:
            live.append(Conversation(f"crash-{uuid.uuid4().hex[:10]}", self.rng.choice(["full", "new"])))
            self.conversations.append(live[-1])
        clients = {c.session: self._client(served, c) for c in live}
        try:
            if point == "anywhere":
                await self._anywhere(served, live, clients)
            else:
                self._script(4 * len(live))
                # A few turns first, so the kill falls on a history of some length.
                await asyncio.gather(*(self._turns(clients[c.session], c, self.rng.randint(0, 2)) for c in live))
                victim = self.rng.choice(live)
                await self._targeted(served, point, victim, clients[victim.session])
        finally:
            if served.process.poll() is None:
                served.process.kill()
            served.process.wait()
            served.stop()
            for client in clients.values():
                await client.close()
        self.kills += 1
        self.summary.kills[point] += 1
        self.summary.seconds += time.monotonic() - start

    def _client(self, served: Served, conversation: Conversation) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key=PROXY_KEY, max_retries=0, timeout=WAIT,
                                  default_headers={"X-Session-Id": conversation.session,
                                                   "X-Memproxy-History": conversation.history})

    def _answer(self) -> str:
        text = f"answer {uuid.uuid4().hex} " + " ".join(self.rng.choice(["one", "two", "three"]) for _ in range(8))
        self.answers.add(text)
        return text

    def _script(self, count: int, **held: Any) -> str:
        """Queue `count` whole answers (the first with `held`'s gate); the first one's text."""
        first = self._answer()
        self.upstream.enqueue(Reply(content=first, **held), *(Reply(content=self._answer()) for _ in range(count - 1)))
        return first

    def _drain_arrivals(self) -> None:
        while self.upstream.arrived.acquire(blocking=False):
            pass

    async def _turn(self, client: openai.AsyncOpenAI, conversation: Conversation, stream: bool,
                    watch: Callable[[str], None] | None = None) -> None:
        """One turn; on any failure the conversation ends there, cut."""
        self._questions += 1
        question = {"role": "user", "content": f"question {self._questions} of {conversation.session}"}
        sent: Any = [*conversation.seen, question] if conversation.history == "full" else [question]
        conversation.cut, conversation.text = question, ""
        if stream:
            chunks = await client.chat.completions.create(model="big", messages=sent, stream=True)
            async for chunk in chunks:
                conversation.text += (chunk.choices[0].delta.content or "") if chunk.choices else ""
                if watch is not None:
                    watch(conversation.text)
        else:
            answer = await client.chat.completions.create(model="big", messages=sent)
            conversation.text = answer.choices[0].message.content or ""
        if conversation.history == "new":  # the server rebuilt the history from the store
            [forwarded] = [r for r in self.upstream.chat_requests() if r.messages and r.messages[-1] == question]
            assert forwarded.messages == [*conversation.seen, question], conversation.session
        conversation.seen += [question, {"role": "assistant", "content": conversation.text}]
        conversation.story.append(f"round {self.kills}: {'streamed' if stream else 'plain'} turn seen")
        conversation.cut = None
        self.summary.seen_turns += 1

    async def _turns(self, client: openai.AsyncOpenAI, conversation: Conversation, count: int) -> None:
        for _ in range(count):
            await self._turn(client, conversation, self.rng.random() < 0.5)

    async def _anywhere(self, served: Served, live: list[Conversation],
                        clients: dict[str, openai.AsyncOpenAI]) -> None:
        self._script(2000)

        async def work(conversation: Conversation) -> None:
            while True:
                await self._turn(clients[conversation.session], conversation, self.rng.random() < 0.5)

        workers = [asyncio.create_task(work(c)) for c in live]
        # The random moment of the kill: this wait is the point of the test, not a synchronisation.
        done, _ = await asyncio.wait(workers, timeout=self.rng.uniform(0.05, 1.0))
        for worker in done:
            worker.result()  # a turn that failed while the server was up is a failure of the test
        served.process.kill()
        outcomes = await asyncio.gather(*workers, return_exceptions=True)
        for outcome in outcomes:
            assert isinstance(outcome, CUT), repr(outcome)

    async def _targeted(self, served: Served, point: KillPoint, victim: Conversation,
                        client: openai.AsyncOpenAI) -> None:
        self.upstream.reset()
        self._drain_arrivals()
        gate = threading.Event()
        loop = asyncio.get_running_loop()
        try:
            if point in ("after_last_chunk", "after_answer"):
                self._script(1)
                await self._turn(client, victim, stream=point == "after_last_chunk")
                served.process.kill()
                return
            if point == "before_upstream":
                self._script(1, gate=gate)
                turn = asyncio.create_task(self._turn(client, victim, self.rng.random() < 0.5))
                await asyncio.to_thread(self.upstream.wait_for_request, WAIT)
                served.process.kill()
            elif point == "mid_stream":
                self._script(1, gate_after_first_chunk=gate)
                first = asyncio.Event()

                def started(text: str) -> None:
                    if text:
                        first.set()

                turn = asyncio.create_task(self._turn(client, victim, True, started))
                await asyncio.wait_for(first.wait(), WAIT)
                served.process.kill()
            else:
                answer = self._script(1, gate=gate)
                whole = asyncio.Event()

                def relayed(text: str) -> None:
                    if text == answer:
                        whole.set()

                turn = asyncio.create_task(self._turn(client, victim, True, relayed))
                await asyncio.to_thread(self.upstream.wait_for_request, WAIT)
                with write_lock_held(self.storage, table="messages"):
                    gate.set()
                    await asyncio.wait_for(whole.wait(), WAIT)  # every chunk relayed; the write waits
                    if self.storage.is_postgres:  # the write is halfway: its `turns` row is in
                        deadline = loop.time() + WAIT
                        while not writes_waiting(self.storage, "messages"):
                            assert loop.time() < deadline, "the turn's write never reached the lock"
                            await asyncio.sleep(0.01)
                    served.process.kill()
                    served.process.wait()
            try:
                await turn
            except CUT:
                pass
            assert victim.over, f"{point}: the client saw the turn complete though the server was killed first"
        finally:
            gate.set()

    # --- checking -----------------------------------------------------------------------------

    async def verify(self) -> Summary:
        if self.storage.is_postgres:
            await self._settled()
        await self._restart()
        for conversation in self.conversations:
            self._verify(conversation)
        if not self.storage.is_postgres:
            with closing(sqlite3.connect(sqlite_path(self.storage.url))) as db:
                assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        self.summary.conversations = len(self.conversations)
        self.summary.cut_turns = sum(1 for c in self.conversations if c.over)
        return self.summary

    async def _restart(self) -> None:
        """After the last kill: a server starts on the store, every conversation the clients can go
        on with takes one more turn (with `history: new`, rebuilt from the store), and the session API
        reports each stored session's totals as its rows add them up."""
        served = await asyncio.to_thread(serve_one, self.config, self.folder / "serve-last.log")
        self.upstream.reset()
        live = [c for c in self.conversations if not c.over]
        clients = {c.session: self._client(served, c) for c in live}
        try:
            self._script(len(live) + 1)
            await asyncio.gather(*(self._turns(clients[c.session], c, 1) for c in live))
            async with httpx.AsyncClient(base_url=served.url, timeout=WAIT,
                                         headers={"Authorization": f"Bearer {PROXY_KEY}"}) as http:
                for conversation in self.conversations:
                    await self._check_totals(http, conversation.session)
        finally:
            served.stop()
            for client in clients.values():
                await client.close()

    async def _check_totals(self, http: httpx.AsyncClient, name: str) -> None:
        response = await http.get(f"/v1/sessions/{name}")
        stored = rows(self.storage, "SELECT count(*), coalesce(sum(m.tokens), 0) FROM messages m"
                                    " JOIN sessions s ON s.pk = m.session_pk WHERE s.tenant = 'a'"
                                    " AND s.session_id = ? AND m.active = 1", name)
        [(messages, tokens)] = stored
        if messages == 0:
            assert response.status_code == 404, f"{name}: {response.status_code}"
            return
        assert response.status_code == 200, f"{name}: {response.status_code}"
        shown = response.json()
        [(turns, prompt, completion)] = rows(
            self.storage, "SELECT count(*), coalesce(sum(t.prompt_tokens), 0), coalesce(sum(t.completion_tokens), 0)"
                          " FROM turns t JOIN sessions s ON s.pk = t.session_pk WHERE s.tenant = 'a'"
                          " AND s.session_id = ?", name)
        assert (shown["message_count"], len(shown["messages"]), shown["tokens_stored"]) == (messages, messages, tokens), \
            f"{name}: the session API's counts disagree with the store"
        usage = shown["usage"]
        assert (usage["turns"], usage["prompt_tokens"], usage["completion_tokens"]) == (turns, prompt, completion), \
            f"{name}: the session API's totals disagree with the store"

    async def _settled(self) -> None:
        """A killed server's PostgreSQL backends end their transactions (rolled back) on their own
        time: wait until none holds a lock on this schema's tables."""
        deadline = time.monotonic() + WAIT
        sql = ("SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation"
               " JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = current_schema()"
               " AND l.pid <> pg_backend_pid()")
        while rows(self.storage, sql) != [(0,)]:
            assert time.monotonic() < deadline, "a killed server's transaction never ended"
            await asyncio.sleep(0.05)

    def _verify(self, conversation: Conversation) -> None:
        name = conversation.session
        sessions = rows(self.storage, "SELECT pk, length, head_hash, head_cum FROM sessions"
                                      " WHERE tenant = 'a' AND session_id = ?", name)
        if not sessions:
            assert conversation.seen == [], \
                f"{name}: turns seen but no session: {conversation.history} {conversation.story}"
            return
        [(pk, length, head_hash, head_cum)] = sessions
        found = rows(self.storage, "SELECT seq, body, tokens, cum_before, chain_hash, turn_id, active"
                                   " FROM messages WHERE session_pk = ? ORDER BY id", pk)
        assert all(active == 1 for *_, active in found), f"{name}: a message was superseded"
        assert [seq for seq, *_ in found] == list(range(len(found))), f"{name}: positions not 0..n-1"
        bodies = [json.loads(body) for _, body, *_ in found]
        expected = conversation.seen
        if bodies != expected:
            cut = conversation.cut
            assert cut is not None and len(bodies) == len(expected) + 2 and bodies[:-2] == expected, \
                f"{name}: stored {bodies!r}, the client saw {expected!r}"
            assert bodies[-2] == cut, f"{name}: the stored cut turn is not the question sent"
            assert bodies[-1]["role"] == "assistant" and bodies[-1]["content"] in self.answers, \
                f"{name}: a partial answer was stored: {bodies[-1]!r}"
            self.summary.cut_stored += 1
        questions = [b["content"] for b in bodies if b["role"] == "user"]
        assert len(questions) == len(set(questions)), f"{name}: a question stored twice"
        assert [h for *_, h, _, _ in found] == chain_hashes(ROOT_HASH, bodies), f"{name}: chain hashes"
        cum = 0
        for _, _, tokens, cum_before, *_ in found:
            assert cum_before == cum, f"{name}: running totals"
            cum += tokens
        assert (length, head_hash, head_cum) == (len(found), found[-1][4] if found else ROOT_HASH, cum), \
            f"{name}: the session row disagrees with its messages"
        turns = rows(self.storage, "SELECT id FROM turns WHERE session_pk = ? ORDER BY id", pk)
        assert len(turns) == len(found) // 2, f"{name}: {len(turns)} turns for {len(found)} messages"
        by_turn = Counter(turn_id for *_, turn_id, _ in found)
        assert sorted(by_turn) == [t for (t,) in turns] and set(by_turn.values()) == {2}, \
            f"{name}: messages not two per turn"


async def crash_and_verify(storage: StorageConfig, upstream: FakeUpstream, folder: Path, points: list[KillPoint],
                           seed: int, deadline: float | None = None) -> Summary:
    """Kill a server at each of `points` in turn (stopping early past `deadline`, a `time.monotonic()`),
    then check the store."""
    run = CrashRun(storage, upstream, folder, random.Random(seed))
    for point in points:
        if deadline is not None and time.monotonic() > deadline:
            break
        await run.round(point)
    return await run.verify()
