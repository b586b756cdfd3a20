"""The crash soak: tests/test_crash.py's harness (tests/crash.py) for many kills instead of six.

    python bench/crash_soak.py                        # SQLite and PostgreSQL, 60 kills or 10 minutes each
    python bench/crash_soak.py --store sqlite --kills 200 --minutes 30 --seed 7

`memproxy serve` runs as a real process on a store of its own (a SQLite file in a temporary folder, or a
fresh schema on MEMPROXY_TEST_POSTGRES_URL, default postgresql://postgres@127.0.0.1:5432/postgres,
dropped at the end) in front of the tests' fake provider, and is SIGKILLed at kill points drawn at
random (each point equally likely), restarted, and killed again, until `--kills` or `--minutes` is
reached. The store is then checked as the test checks it. One summary line per store; the exit code
is 1 if a check failed (its message says which conversation and how, with the seed to replay).
Everything binds 127.0.0.1; every process started is stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the harness and its helpers live with the tests

from crash import KILL_POINTS, KillPoint, crash_and_verify  # noqa: E402
from fake_upstream import FakeUpstream  # noqa: E402
from processes import store_for_processes  # noqa: E402


def soak(kind: str, kills: int, minutes: float, seed: int) -> bool:
    rng = random.Random(seed)
    points: list[KillPoint] = [rng.choice(KILL_POINTS) for _ in range(kills)]
    upstream = FakeUpstream().start()
    try:
        with tempfile.TemporaryDirectory(prefix="crash-soak-") as folder, \
                store_for_processes(kind, Path(folder)) as storage:
            deadline = time.monotonic() + minutes * 60
            summary = asyncio.run(crash_and_verify(storage, upstream, Path(folder), points, seed, deadline))
    except AssertionError:
        traceback.print_exc()
        print(f"{kind}: FAILED (seed {seed})", flush=True)
        return False
    finally:
        upstream.stop()
    print(summary.line() + f" (seed {seed})", flush=True)
    return True


def main() -> int:
    # The fake provider, in this process, logs each answer it could not finish writing to a killed
    # server: expected here, every time.
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", choices=["sqlite", "postgres", "both"], default="both")
    parser.add_argument("--kills", type=int, default=60, help="kills per store (default 60)")
    parser.add_argument("--minutes", type=float, default=10.0, help="time bound per store (default 10)")
    parser.add_argument("--seed", type=int, help="replay a run (default: a random seed, printed)")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    kinds = ["sqlite", "postgres"] if args.store == "both" else [args.store]
    results = [soak(kind, args.kills, args.minutes, seed) for kind in kinds]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
