"""SIGKILL at chosen points of streamed and plain turns, on SQLite and on PostgreSQL: every turn a client
saw complete is stored exactly once, no partial answer is stored, the chain and totals are consistent
and SQLite's file passes `PRAGMA integrity_check` (the harness and its checks: tests/crash.py).

Each kill point once per store, in an order drawn from the seed (printed; set MEMPROXY_CRASH_SEED to
replay one). bench/crash_soak.py runs the same harness for many kills.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from crash import KILL_POINTS, crash_and_verify
from fake_upstream import FakeUpstream
from processes import store_for_processes

pytestmark = pytest.mark.both_stores


async def test_kills_at_every_point_lose_and_corrupt_nothing(
    store_kind: str, upstream: FakeUpstream, tmp_path: Path
) -> None:
    seed = int(os.environ.get("MEMPROXY_CRASH_SEED") or random.randrange(1 << 30))
    print(f"crash seed {seed} (MEMPROXY_CRASH_SEED={seed} replays it)")
    points = list(KILL_POINTS)
    random.Random(seed).shuffle(points)
    with store_for_processes(store_kind, tmp_path) as storage:
        summary = await crash_and_verify(storage, upstream, tmp_path, points, seed)
    print(summary.line())
    assert sum(summary.kills.values()) == len(KILL_POINTS)
    assert summary.seen_turns > 0 and summary.cut_turns > 0
