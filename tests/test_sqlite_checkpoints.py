"""SQLite's log checkpoints never make a turn wait for a reader (issue 12, item 4).

Another process holding a read transaction on the file (a backup, a `sqlite3` shell, `memproxy
sessions`) used to stall every turn for the busy timeout at each checkpoint: RESTART waits for
readers, and writes queued behind it. Here a real second process holds a snapshot open for longer
than the busy timeout while the proxy serves turns across several checkpoint points; every turn must
stay far below the busy timeout, and once the reader lets go the log must be emptied.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiosqlite
from conftest import Proxy, make_config
from fake_upstream import FakeUpstream
from memproxy.store.sqlite import _CHECKPOINT_EVERY, _TRUNCATE_AT_FRAMES, checkpoint_log

BUSY_TIMEOUT_MS = 2000
TURN_BOUND = 1.0  # seconds: half the busy timeout; a turn that waited for the reader takes >= 2 s
PAGE = 4096

# Holds a read transaction (a snapshot taken by its first SELECT) until a line arrives on stdin.
READER = """\
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN")
print(conn.execute("SELECT count(*) FROM messages").fetchone()[0], flush=True)
sys.stdin.readline()
conn.execute("COMMIT")
conn.close()
"""


async def turn(proxy: Proxy, k: int) -> float:
    """One non-streamed turn on a session of its own; the seconds it took."""
    client = proxy.clients[0] if proxy.clients else proxy.client(None)
    start = time.perf_counter()
    reply = await client.chat.completions.create(model="small", messages=[{"role": "user", "content": f"q{k}"}],
                                                 extra_headers={"X-Session-Id": f"s{k}"})
    elapsed = time.perf_counter() - start
    assert reply.choices[0].message.content
    return elapsed


async def test_no_turn_waits_for_a_reader_in_another_process(
    start_proxy: Any, upstream: FakeUpstream, tmp_path: Path
) -> None:
    db = tmp_path / "memproxy.db"
    wal = tmp_path / "memproxy.db-wal"
    config = make_config(db, upstream.url)
    proxy: Proxy = await start_proxy(replace(config, storage=replace(config.storage, busy_timeout_ms=BUSY_TIMEOUT_MS)))
    await turn(proxy, 0)
    reader = subprocess.Popen([sys.executable, "-c", READER, str(db)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout is not None and reader.stdin is not None
        assert reader.stdout.readline().strip() == "2"  # the snapshot is held from here on
        held_since = time.monotonic()
        latencies: list[float] = []
        # Each turn is at least one write: several checkpoint points, and past the busy timeout.
        while len(latencies) < 4 * _CHECKPOINT_EVERY or time.monotonic() - held_since < 1.5 * BUSY_TIMEOUT_MS / 1000:
            latencies.append(await turn(proxy, len(latencies) + 1))
            assert len(latencies) < 20 * _CHECKPOINT_EVERY, "the loop should have ended long ago"
        held_for = time.monotonic() - held_since
        grown = wal.stat().st_size
        assert reader.poll() is None  # the reader held its snapshot all along
    finally:
        if reader.stdin is not None and reader.poll() is None:
            reader.stdin.write("\n")
            reader.stdin.close()
        assert reader.wait(timeout=30) == 0
        if reader.stdout is not None:
            reader.stdout.close()
    slowest = max(latencies)
    print(f"{len(latencies)} turns while a reader held its snapshot {held_for:.1f} s: slowest {slowest * 1000:.0f} ms,"
          f" median {sorted(latencies)[len(latencies) // 2] * 1000:.1f} ms; log grown to {grown / 2**20:.1f} MiB")
    assert held_for > BUSY_TIMEOUT_MS / 1000
    assert slowest < TURN_BOUND, f"a turn took {slowest:.3f} s while a reader held the file"
    # The reader kept every frame since its snapshot in the log; it is now free to go.
    assert grown > _TRUNCATE_AT_FRAMES * PAGE
    done = len(latencies) + 1
    for k in range(done, done + 3 * _CHECKPOINT_EVERY):
        await turn(proxy, k)
        if wal.stat().st_size < grown / 4:
            break
    assert wal.stat().st_size < grown / 4, "the log was not checkpointed after the reader closed"


async def test_the_checkpoint_policy_never_waits_and_empties_a_long_log_once_free(tmp_path: Path) -> None:
    """`checkpoint_log` alone, on plain connections (the checkpointer's through aiosqlite, as the store's): with a reader holding an old snapshot it copies
    what it may and leaves the log (no waiting: the connection has no busy timeout); once the reader
    is gone, a log past the threshold is emptied."""
    db = str(tmp_path / "policy.db")
    writer = sqlite3.connect(db, isolation_level=None)
    writer.execute("PRAGMA journal_mode = WAL").fetchall()
    writer.execute("PRAGMA wal_autocheckpoint = 0").fetchall()
    writer.execute("CREATE TABLE t (x BLOB)")
    reader = sqlite3.connect(db, isolation_level=None)
    checkpointer = await aiosqlite.connect(db, isolation_level=None)
    await checkpointer.execute_fetchall("PRAGMA busy_timeout = 0")
    try:
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM t").fetchall()  # the snapshot: before every row below
        for _ in range(2 * _TRUNCATE_AT_FRAMES):
            writer.execute("INSERT INTO t VALUES (randomblob(3000))")
        start = time.perf_counter()
        frames, copied = await checkpoint_log(checkpointer)
        assert time.perf_counter() - start < 1.0
        assert frames >= 2 * _TRUNCATE_AT_FRAMES and copied < frames  # the reader's frames stay
        assert Path(db + "-wal").stat().st_size >= frames * PAGE
        reader.execute("COMMIT")
        assert await checkpoint_log(checkpointer) == (0, 0)
        assert Path(db + "-wal").stat().st_size == 0
        # A short log is copied but left in place: no truncation for a few frames.
        writer.execute("INSERT INTO t VALUES (randomblob(3000))")
        frames, copied = await checkpoint_log(checkpointer)
        assert 0 < frames < _TRUNCATE_AT_FRAMES and copied == frames
    finally:
        for conn in (reader, writer):
            conn.close()
        await checkpointer.close()
