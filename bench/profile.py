"""Where memproxy's time goes: memproxy under pyinstrument, driven by the bench's load generator.

    python bench/profile.py                       # memory on, 1 client, 0 ms upstream, 15 s
    python bench/profile.py --pass-through --clients 10 --seconds 20 --out /tmp/profile.txt
    python bench/profile.py --history 10000       # one session seeded with 10,000 long messages
    python bench/profile.py --own-client          # memory on, through memproxy's own client
    python bench/profile.py --recall 10000        # recall on one session of 10,000 LoCoMo turns

Starts the fake upstream and `memproxy serve` under `python -m pyinstrument`, sends requests for the
given time, stops memproxy (pyinstrument writes its report as the process exits) and prints the
report's top. Not part of `run.py`: a profiler slows what it watches, so its numbers are not
benchmark numbers, only the shares of time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import aiohttp  # noqa: E402

import load  # noqa: E402
import seed  # noqa: E402
import servers  # noqa: E402
from memproxy.config import MemoryConfig  # noqa: E402
import replay  # noqa: E402
from run import (BENCH_MEMORY, ENCODING, MEMORY, PASS, RECALL_SESSION, TENANT, OWN, WINDOW,  # noqa: E402
                 make_targets,
                 memproxy_config, recall_texts, summarize)


async def profile(args: argparse.Namespace) -> Path:
    workdir = Path(tempfile.mkdtemp(prefix="memproxy-profile-"))
    out = Path(args.out) if args.out else Path(tempfile.gettempdir()) / "memproxy-profile.txt"
    processes = servers.Processes(workdir)
    try:
        upstream = servers.start_upstream(processes)
        db = workdir / "memproxy.db"
        if args.history:
            await seed.seed_sessions(f"sqlite:///{db}", TENANT, [args.history], MemoryConfig(**BENCH_MEMORY), ENCODING)
        questions: list[str] = []
        if args.recall:
            texts, questions = recall_texts(replay.data_path(None))
            await seed.seed_recall_store(f"sqlite:///{db}", TENANT, RECALL_SESSION, args.recall, args.recall,
                                         args.recall, texts, MemoryConfig(**BENCH_MEMORY), ENCODING, "bench-sweep")
        config = workdir / "memproxy.yaml"
        config.write_text(memproxy_config(upstream.url, db, BENCH_MEMORY, WINDOW))
        memproxy = processes.start(
            "memproxy", [sys.executable, "-m", "pyinstrument", "-r", args.renderer, "--show-all", "-o", str(out),
                         "-m", "memproxy.cli", "serve", "-c", str(config), "--port", "0"],
            env={"LITELLM_LOCAL_MODEL_COST_MAP": "True"}, ready_line="memproxy listening on")
        target = make_targets(upstream.url, memproxy.url, None)[
            PASS if args.pass_through else OWN if args.own_client else MEMORY]
        async with load.client_session(limit=1000) as session:
            async with session.post(f"{upstream.url}/_control", json={"delay_ms": args.delay_ms}) as response:
                response.raise_for_status()
            await load.closed_loop(session, target, 4, 100, "warm")
            if args.history:
                sample = await _history_loop(session, target, args.history, args.seconds)
            elif args.recall:
                sample = await _recall_loop(session, target, questions, args.seconds)
            else:
                sample = await load.closed_loop(session, target, args.clients, 10_000_000, "profile",
                                                deadline=args.seconds)
        print(f"profile: {summarize(sample)}", flush=True)
        memproxy.stop()  # SIGTERM: memproxy shuts down, and pyinstrument writes its report
    finally:
        processes.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)
    return out


async def _history_loop(session: aiohttp.ClientSession, target: load.Target, size: int,
                        seconds: float) -> load.Sample:
    """One client on the seeded session `hist-SIZE`, through the sweep model."""
    history = load.Target("history", target.url, target.headers, model="bench-sweep", sessions="hist")
    sample, stop, question = load.Sample(), time.perf_counter() + seconds, 0
    while time.perf_counter() < stop:
        question += 1
        await load.send(session, history, load.chat_body("bench-sweep", question), str(size), sample,
                        time.perf_counter(), False)
    return sample


async def _recall_loop(session: aiohttp.ClientSession, target: load.Target, questions: list[str],
                       seconds: float) -> load.Sample:
    """One client asking the recall session `questions` in turn, through the sweep model (the recall
    speed phase of `run.py`)."""
    recall = load.Target("recall", target.url, target.headers, model="bench-sweep", sessions="recall")
    sample, stop, question = load.Sample(), time.perf_counter() + seconds, 0
    while time.perf_counter() < stop:
        body = load.chat_body("bench-sweep", question, text=questions[question % len(questions)])
        question += 1
        await load.send(session, recall, body, RECALL_SESSION.removeprefix("recall-"), sample, time.perf_counter(), False)
    return sample


def main() -> int:
    parser = argparse.ArgumentParser(description="profile memproxy under load with pyinstrument")
    parser.add_argument("--pass-through", action="store_true", help="no session header (memory off)")
    parser.add_argument("--own-client", action="store_true",
                        help="memory on, through memproxy's own client (`transport: openai`); default: litellm")
    parser.add_argument("--clients", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--delay-ms", type=float, default=0.0, help="the fake upstream's delay")
    parser.add_argument("--history", type=int, default=0,
                        help="profile one session seeded with this many ~400-token messages instead")
    parser.add_argument("--recall", type=int, default=0,
                        help="profile recall on one session seeded with this many LoCoMo turns instead")
    parser.add_argument("--renderer", choices=("text", "pstats"), default="text",
                        help="pyinstrument's report: a call tree, or pstats for `python -m pstats` (sort by tottime)")
    parser.add_argument("--out", help="where the text report goes (default: memproxy-profile.txt in the temp dir)")
    args = parser.parse_args()
    out = asyncio.run(profile(args))
    print(f"profile: report in {out}")
    if args.renderer == "pstats":
        print(f"profile: read it with `python -m pstats {out}` (sort tottime, stats 40)")
    else:
        text = out.read_text(encoding="utf-8") if out.exists() else "(no report written)"
        print("\n".join(text.splitlines()[:80]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
