"""SQLite's log checkpoints never make a turn wait for a reader (issue 12, item 4).

Another process holding a read transaction on the file (a backup, a `sqlite3` shell, `memproxy
sessions`) used to stall every turn for the busy timeout at each checkpoint: RESTART waits for
readers, and writes queued behind it. Here a real second process holds a snapshot open for longer
than the busy timeout while the proxy serves turns across several checkpoint points; every turn must
stay far below the busy timeout, and once the reader lets go the log must be emptied.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from conftest import Proxy, make_config
from fake_upstream import FakeUpstream
from memproxy.store.sqlite import _CHECKPOINT_EVERY, _TRUNCATE_AT_FRAMES

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
