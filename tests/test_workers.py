"""`memproxy serve --workers N`: worker processes sharing one port, on SQLite and on PostgreSQL.

One real `memproxy serve --workers 2` per store kind for the module, driven by the `openai` SDK over
many connections in front of the fake provider. What is checked: both workers accept connections on
the one port, concurrent turns on one session are each kept whole and once (the store's locked,
checked write is what holds a session together across processes, as across replicas), a worker
that dies is started again while the other serves on, and SIGTERM stops them all with exit code 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest

from conftest import PROXY_KEY
from db import rows
from fake_upstream import FakeUpstream, Reply
from helpers import assistant, until, user
from memproxy.config import StorageConfig
from memproxy.workers import supervise
from processes import Served, serve, storage_section, store_for_processes, write_config

WORKERS = 2
CONNECTIONS = 16


@dataclass
class Pool:
    served: Served
    storage: StorageConfig

    @property
    def port(self) -> int:
        return int(self.served.url.rsplit(":", 1)[1])

    def workers(self) -> list[psutil.Process]:
        return psutil.Process(self.served.process.pid).children()


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def pool(request: pytest.FixtureRequest, upstream_server: FakeUpstream,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    folder = tmp_path_factory.mktemp(f"workers-{request.param}")
    with store_for_processes(request.param, folder) as storage:
        config = write_config(folder / "memproxy.yaml", upstream_server.url, storage_section(storage))
        [served] = serve(config, [folder / "serve.log"], "--workers", str(WORKERS))
        try:
            yield Pool(served, storage)
        finally:
            workers = psutil.Process(served.process.pid).children()
            code = served.stop()
        assert code == 0, served.log.read_text()
        assert not [w for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]


def listening(pool: Pool) -> dict[int, int]:
    """Per worker pid: its sockets listening on the pool's port."""
    return {w.pid: sum(1 for c in w.net_connections("tcp") if c.status == psutil.CONN_LISTEN
                       and c.laddr.port == pool.port) for w in pool.workers()}


def connected(pool: Pool) -> dict[int, int]:
    """Per worker pid: the connections it has accepted on the pool's port."""
    return {w.pid: sum(1 for c in w.net_connections("tcp") if c.status == psutil.CONN_ESTABLISHED
                       and c.laddr.port == pool.port) for w in pool.workers()}


def chain(storage: StorageConfig, session: str) -> list[dict[str, Any]]:
    found = rows(storage, "SELECT m.seq, m.body FROM messages m JOIN sessions s ON s.pk = m.session_pk"
                          " WHERE s.tenant = 'a' AND s.session_id = ? AND m.active = 1 ORDER BY m.seq", session)
    assert [seq for seq, _ in found] == list(range(len(found)))
    return [json.loads(body) for _, body in found]


def client(pool: Pool, session: str) -> openai.AsyncOpenAI:
    """A client of its own: a connection of its own."""
    return openai.AsyncOpenAI(base_url=f"{pool.served.url}/v1", api_key=PROXY_KEY, max_retries=0,
                              default_headers={"X-Session-Id": session, "X-Memproxy-History": "new"})


def test_every_worker_listens_on_the_one_port(pool: Pool) -> None:
    assert listening(pool) == {w.pid: 1 for w in pool.workers()}
    assert len(pool.workers()) == WORKERS


async def test_concurrent_turns_on_one_session_across_workers_are_each_kept_once(
    pool: Pool, upstream: FakeUpstream
) -> None:
    session = f"spread-{uuid.uuid4().hex[:8]}"
    clients = [client(pool, session) for _ in range(CONNECTIONS)]
    try:
        # A first request opens each client's connection, so that they are all held at once.
        for i, c in enumerate(clients):
            upstream.enqueue(Reply(content=f"warm answer {i}"))
            await c.chat.completions.create(model="small", messages=[user(f"warm {i}")])  # type: ignore[list-item]
        spread = connected(pool)
        assert sum(spread.values()) >= CONNECTIONS and all(spread.values()), spread  # both workers took some

        async def turn(i: int) -> None:
            await clients[i].chat.completions.create(model="small", messages=[user(f"turn {i}")])  # type: ignore[list-item]

        answers = {f"turn {i}": f"answer {i}" for i in range(CONNECTIONS)}
        upstream.responder = lambda received: Reply(content=answers[received.messages[-1]["content"]])
        await asyncio.gather(*(turn(i) for i in range(CONNECTIONS)))
    finally:
        upstream.responder = None
        for c in clients:
            await c.close()
    kept = chain(pool.storage, session)
    pairs = [kept[i:i + 2] for i in range(0, len(kept), 2)]
    # Every turn whole (its question right before its answer) and exactly once, warm-ups included.
    assert all(q["role"] == "user" and a == assistant(answers.get(q["content"], a["content"]))
               for q, a in pairs)
    assert sorted(q["content"] for q, _ in pairs) == sorted(
        [f"warm {i}" for i in range(CONNECTIONS)] + [f"turn {i}" for i in range(CONNECTIONS)])
    # The next turn, on whichever worker, goes out with all of them.
    last = client(pool, session)
    try:
        await last.chat.completions.create(model="small", messages=[user("after all")])  # type: ignore[list-item]
    finally:
        await last.close()
    assert upstream.last().messages == [*kept, user("after all")]


async def test_a_worker_that_dies_is_started_again_while_the_other_serves(
    pool: Pool, upstream: FakeUpstream
) -> None:
    victim = pool.workers()[0]
    os.kill(victim.pid, signal.SIGKILL)
    # Connections the kernel queued on the dying worker's socket die with it (as they would under any
    # pre-forked server); once it is gone its socket has left the port, and the other takes them all.
    await asyncio.get_running_loop().run_in_executor(None, victim.wait, 30)
    session = f"after-kill-{uuid.uuid4().hex[:8]}"
    c = client(pool, session)
    try:  # the other worker serves meanwhile
        reply = await c.chat.completions.create(model="small", messages=[user("still there?")])  # type: ignore[list-item]
        assert reply.choices[0].message.content
    finally:
        await c.close()

    def replaced() -> bool:
        pids = {w.pid: 1 for w in pool.workers()}
        return victim.pid not in pids and listening(pool) == pids and len(pids) == WORKERS

    await until(replaced, "the dead worker is replaced and listens", timeout=120.0, interval=0.2)
    assert "exited with -9; starting it again" in pool.served.log.read_text()


async def test_workers_stop_when_their_supervisor_is_killed(upstream_server: FakeUpstream, tmp_path: Path) -> None:
    """SIGKILL to the parent of `serve --workers` passes nothing on: its workers, re-parented, would
    serve on beside the next `serve` on the port. They notice it is gone and stop, as on SIGTERM."""
    with store_for_processes("sqlite", tmp_path) as storage:
        config = write_config(tmp_path / "memproxy.yaml", upstream_server.url, storage_section(storage))
        [served] = serve(config, [tmp_path / "serve.log"], "--workers", str(WORKERS))
        workers = psutil.Process(served.process.pid).children()
        assert len(workers) == WORKERS
        os.kill(served.process.pid, signal.SIGKILL)
        assert served.stop() == -signal.SIGKILL  # waited for, its pipe closed

        def gone() -> bool:
            return not [w for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]

        try:
            await until(gone, "every worker stopped", timeout=60.0, interval=0.2)
        finally:
            for worker in workers:  # whatever the outcome, none outlives the test
                if worker.is_running():
                    worker.kill()
        assert served.log.read_text().count("is gone: this worker stops") == WORKERS


async def test_a_replacement_that_cannot_start_is_tried_again_while_the_other_serves(
    pool: Pool, upstream: FakeUpstream
) -> None:
    """A worker dies and its replacement stops before it listens (here its config file is gone; a
    store locked by another process does the same): the server was serving, so it does not stop.
    The other worker serves on, and the replacement is tried again until it starts."""
    config = Path(pool.served.process.args[pool.served.process.args.index("-c") + 1])
    hidden = config.with_suffix(".away")
    victim = pool.workers()[0]
    config.rename(hidden)
    try:
        os.kill(victim.pid, signal.SIGKILL)
        await until(lambda: "stopped before it listened; trying again" in pool.served.log.read_text(),
                    "the replacement failed and is to be tried again", timeout=60.0, interval=0.1)
        c = client(pool, f"while-retrying-{uuid.uuid4().hex[:8]}")
        try:  # the other worker serves meanwhile
            reply = await c.chat.completions.create(model="small", messages=[user("still there?")])  # type: ignore[list-item]
            assert reply.choices[0].message.content
        finally:
            await c.close()
        assert pool.served.process.poll() is None  # the server did not stop
    finally:
        hidden.rename(config)

    def replaced() -> bool:
        pids = {w.pid: 1 for w in pool.workers()}
        return victim.pid not in pids and listening(pool) == pids and len(pids) == WORKERS

    await until(replaced, "the replacement started once it could", timeout=120.0, interval=0.2)


async def test_a_worker_that_stops_before_it_listens_stops_the_start(tmp_path: Path) -> None:
    """The supervisor itself, its workers given a config that does not exist: each exits at once
    without listening, and the start fails with exit code 1 rather than restarting them forever."""
    missing = tmp_path / "missing.yaml"
    code = await supervise(WORKERS, "127.0.0.1", 0, lambda port, ready_fd: [
        "serve", "-c", str(missing), "--port", str(port), "--ready-fd", str(ready_fd)])
    assert code == 1
