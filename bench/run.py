"""Run memproxy's benchmark suite and write `docs/benchmarks.md` with its plots.

    python bench/run.py                 # the full run (about 12 minutes on 2 cores)
    python bench/run.py --quick         # seconds: the CI smoke run
    python bench/run.py --no-litellm-proxy --out /tmp/bench
    python bench/run.py --only recall   # phases 8 and 9, into the saved run's page
    python bench/run.py --only recall-quality   # phase 8 alone (no timing: any machine)

Every path talks to one fake upstream process (`upstream.py`) and is measured in the same run,
interleaved (each round visits every path, in a rotated order) and summarised as the median of the
rounds: direct to the upstream, memproxy with a session (memory on) and without (pass-through), and
LiteLLM's own proxy (installed into `bench/.venv-litellm`). Then the history sweep on sessions seeded
through the Store, a soak for memory growth, and the LoCoMo token-cost replay on a memproxy of its
own (summaries on, a 4,000-token window). Last, recall: its quality on the LoCoMo replay at three
windows (`recall.py`) and its speed on stores of up to a million messages, each on memproxies of
their own (`--only recall` runs just these). `report.py` turns the results into tables, targets and
plots.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import aiohttp  # noqa: E402
import psutil  # noqa: E402

import load  # noqa: E402
import recall  # noqa: E402
import replay  # noqa: E402
import report  # noqa: E402
import seed  # noqa: E402
import servers  # noqa: E402
import upstream  # noqa: E402
from memproxy.config import MemoryConfig  # noqa: E402
from memproxy.tokens import TiktokenCounter  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TENANT = "bench"
PROXY_KEY = "bench-proxy-key"
LITELLM_KEY = "sk-bench-master-key"
ENCODING = "o200k_base"  # what memproxy's tokenizer picks for `openai/bench-model`
DIRECT, MEMORY, PASS, LITELLM = "direct", "memproxy-memory", "memproxy-pass", "litellm-proxy"
OWN = "memproxy-own"  # memory on, through memproxy's own client (`transport: openai`)

# The latency paths' memproxy: defaults, except that no summary is folded (the history sweep's
# 100,000-message sessions would otherwise be summarised in the background during the run); turns
# that do not fit get the marker instead.
BENCH_MEMORY: dict[str, Any] = {"summaries": False, "overflow": "marker"}
WINDOW = 8192
SWEEP_WINDOW = 4096
REPLAY_WINDOW = 4000
REPLAY_OUTPUT = 256
# The recall replay's models: context window -> the answer's reserve (`max_output_tokens`).
RECALL_WINDOWS = {4000: 256, 2000: 256, 1000: 128}
# What the recall replay's questions are asked under, on the one replayed store: recall off, plain
# BM25 (the hits alone, no neighbouring messages), recall as it ships.
RECALL_MODES: dict[str, dict[str, Any]] = {"off": {"recall_tokens": 0}, "bm25": {"recall_context": 0}, "recall": {}}
RECALL_SESSION = "recall-speed"
# The long-session sweep (issue 17): sessions that all fit a 128k window and are sent whole, of
# ~95 tokens a turn, through memproxy's own client and through litellm, on SQLite and PostgreSQL.
LONG_WINDOW = 131_072
LONG_MODELS = {"litellm": "bench-long", "openai": "bench-long-own"}
LONG_WORDS = 40  # words a seeded message: ~47 tokens
POSTGRES_URL = os.environ.get("MEMPROXY_BENCH_POSTGRES_URL", "postgresql://root@127.0.0.1:5432/test")  # the speed phase's measured session (its client's `X-Session-Id`)


@dataclass(frozen=True)
class Plan:
    rounds: int
    cpu_requests: int  # 0 ms upstream, one client: per path and round
    concurrency: dict[int, int]  # at the upstream delay: clients -> requests per path and round
    streams: dict[int, int]
    rates: tuple[float, ...]  # the throughput ladder, requests/s
    step_seconds: float
    throughput_rounds: int  # odd: the median round is one that was run
    history_sizes: tuple[int, ...]
    history_requests: int  # per session size and round
    soak_seconds: float
    replay_exchanges: int | None
    replay_conversations: int | None
    warmup: int
    recall_conversations: int | None = None  # the recall replay: None is every conversation,
    recall_sessions: int | None = None  # every session of each,
    recall_questions: int | None = None  # every question with evidence
    recall_session_size: int = 10_000  # the speed phase: messages in the measured session,
    recall_store_size: int = 1_000_000  # messages in the big store (the rest in other sessions,
    recall_other_size: int = 1_000  # of this many each)
    recall_requests: int = 60  # per store, mode and round
    long_turns: tuple[int, ...] = (10, 100, 500, 1_000)  # the long-session sweep's sessions, in turns
    long_requests: int = 10  # per session size, store, transport and round
    upstream_delay_ms: float = 50.0  # a fast model; every phase but the CPU cost and the history sweep
    p99_limit_ms: float = 100.0  # the throughput ladder's bar
    stream_chunks: int = 10
    stream_pace_ms: float = 5.0
    stream_rounds: int = 3  # at most: streams vary less than closed loops
    soak_clients: int = 20

    def __post_init__(self) -> None:
        if self.throughput_rounds % 2 == 0:
            raise ValueError("throughput_rounds must be odd, so that the median round is one that was run")


# About 15 minutes on 2 cores: the ladder's three rounds take about 6, the two soaks 3.5.
FULL = Plan(rounds=5, cpu_requests=200, concurrency={1: 40, 10: 200, 100: 500}, streams={1: 30, 10: 100},
            rates=(20, 40, 50, 60, 80, 100, 125, 150, 200, 300, 400, 600, 800), step_seconds=2.0,
            throughput_rounds=3,
            history_sizes=(10, 1_000, 10_000, 100_000), history_requests=30, soak_seconds=100.0,
            replay_exchanges=None, replay_conversations=None, warmup=100)
QUICK = Plan(rounds=1, cpu_requests=10, concurrency={1: 3, 10: 20, 100: 100}, streams={1: 3, 10: 10},
             rates=(50, 200), step_seconds=0.4, throughput_rounds=1, history_sizes=(10, 1_000),
             history_requests=5, soak_seconds=1.0, replay_exchanges=25, replay_conversations=1, warmup=10,
             recall_conversations=1, recall_sessions=3, recall_questions=12, recall_session_size=500,
             recall_store_size=5_000, recall_other_size=500, recall_requests=5, long_turns=(10, 100),
             long_requests=2)


def memproxy_config(upstream: str, db: Path | str, memory: dict[str, Any], window: int,
                    extra_models: dict[str, tuple[int, int]] | None = None, own_client: tuple[str, ...] = (),
                    schema: str | None = None, workers: int = 1) -> str:
    """The config of a memproxy run by the bench; `db` a SQLite file or a database URL,
    `extra_models` name -> (window, output reserve), those in `own_client` with `transport: openai`
    (the others on the default, litellm); `workers` its processes (`serve --workers`)."""
    memory_lines = "".join(f"  {k}: {json.dumps(v)}\n" for k, v in memory.items())
    extra = "".join(f"""\
  - name: {name}
    model: openai/bench-model
    api_base: {upstream}/v1
    api_key: upstream-key
    context_window: {context}
    max_output_tokens: {output}
""" + ("    transport: openai\n" if name in own_client else "")
        for name, (context, output) in (extra_models or {}).items())
    url = db if isinstance(db, str) else f"sqlite:///{db}"
    schema_line = f"  schema: {schema}\n" if schema else ""
    return f"""\
server:
  host: 127.0.0.1
  port: 0
  workers: {workers}
storage:
  url: "{url}"
{schema_line}models:
  - name: bench
    model: openai/bench-model
    api_base: {upstream}/v1
    api_key: upstream-key
    context_window: {window}
    max_output_tokens: {REPLAY_OUTPUT if window == REPLAY_WINDOW else 512}
  - name: bench-sweep
    model: openai/bench-model
    api_base: {upstream}/v1
    api_key: upstream-key
    context_window: {SWEEP_WINDOW}
    max_output_tokens: 256
  - name: bench-own
    model: openai/bench-model
    transport: openai
    api_base: {upstream}/v1
    api_key: upstream-key
    context_window: {window}
    max_output_tokens: 512
{extra}memory:
{memory_lines or "  {}"}
auth:
  keys:
    - key: {PROXY_KEY}
      tenant: {TENANT}
"""


class RssSampler:
    """Samples every server's resident memory (its workers' summed) twice a second."""

    def __init__(self, watched: dict[str, servers.Server], interval: float = 0.5) -> None:
        self.watched = watched
        self.interval = interval
        self.started = time.monotonic()
        self.series: dict[str, list[tuple[float, float]]] = {name: [] for name in watched}
        self.marks: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def now(self) -> float:
        return time.monotonic() - self.started

    def mark(self, label: str) -> None:
        self.marks.append((round(self.now(), 2), label))
        print(f"bench: {self.now():6.1f} s  {label}", flush=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            t = round(self.now(), 2)
            for name, server in self.watched.items():
                rss = server.rss_bytes()
                if rss:
                    self.series[name].append((t, round(rss / 2**20, 1)))

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(5)


T = TypeVar("T")


def rotate(items: list[T], round_: int) -> list[T]:
    """The order a round visits things in: shifted by one each round, so none is always first."""
    shift = round_ % len(items)
    return items[shift:] + items[:shift]


def summarize(sample: load.Sample) -> dict[str, Any]:
    p = load.percentile
    out: dict[str, Any] = {"n": sample.completed, "errors": sample.errors, "wall_s": round(sample.wall, 3)}
    if sample.error_kinds:
        out["error_kinds"] = sample.error_kinds
    series = {"": sample.latencies, "ttft_": sample.ttft, **{f"{k}_": v for k, v in sample.timing.items()}}
    for name, values in series.items():
        if values:
            out[f"{name}p50"] = round(p(values, 50), 3)
            out[f"{name}p99"] = round(p(values, 99), 3)
            out[f"{name}mean"] = round(sum(values) / len(values), 3)
    if sample.context_tokens:
        out["context_tokens_p50"] = p([float(t) for t in sample.context_tokens], 50)
    if sample.recalled:
        out["recalled_p50"] = p([float(n) for n in sample.recalled], 50)
    return out


@dataclass
class Bench:
    plan: Plan
    upstream: servers.Server
    memproxy: servers.Server
    litellm: servers.Server | None
    sampler: RssSampler
    sessions: dict[str, aiohttp.ClientSession] = field(default_factory=dict)
    # One connection per path for the one-client loops: a single client reuses one keep-alive
    # connection, as the OpenAI SDKs do, so it stays on one of a server's workers. The shared pool
    # above holds the many connections of the concurrent phases, which a one-client loop would
    # take in turn, landing on each worker alternately (measured here at 1 client, 0 ms upstream,
    # memproxy --workers 2: memory on 5.4-5.9 ms p50 alternating, 3.9-4.1 ms on one connection).
    single: dict[str, aiohttp.ClientSession] = field(default_factory=dict)
    targets: dict[str, load.Target] = field(default_factory=dict)

    def server_of(self, path: str) -> servers.Server:
        if path == DIRECT:
            return self.upstream
        if path == LITELLM:
            assert self.litellm is not None
            return self.litellm
        return self.memproxy

    def session(self, path: str, clients: int) -> aiohttp.ClientSession:
        """The client session a loop of `clients` clients on `path` uses."""
        return self.single[path] if clients == 1 else self.sessions[path]

    def rotated(self, round_: int) -> list[str]:
        return rotate(list(self.targets), round_)

    async def control(self, **settings: Any) -> None:
        async with self.sessions[DIRECT].post(f"{self.upstream.url}/_control", json=settings) as response:
            response.raise_for_status()


@contextlib.asynccontextmanager
async def client_sessions(bench: Bench) -> AsyncIterator[None]:
    for name in bench.targets:
        bench.sessions[name] = load.client_session(limit=2000)
        bench.single[name] = load.client_session(limit=1)
    try:
        yield
    finally:
        for session in [*bench.sessions.values(), *bench.single.values()]:
            await session.close()


def make_targets(upstream: str, memproxy: str, litellm: str | None) -> dict[str, load.Target]:
    targets = {
        DIRECT: load.Target(DIRECT, f"{upstream}/v1/chat/completions",
                            {"Authorization": "Bearer upstream-key"}, model="bench-model"),
        MEMORY: load.Target(MEMORY, f"{memproxy}/v1/chat/completions",
                            {"Authorization": f"Bearer {PROXY_KEY}"}, sessions="lat"),
        PASS: load.Target(PASS, f"{memproxy}/v1/chat/completions", {"Authorization": f"Bearer {PROXY_KEY}"}),
        OWN: load.Target(OWN, f"{memproxy}/v1/chat/completions",
                         {"Authorization": f"Bearer {PROXY_KEY}"}, model="bench-own", sessions="own"),
    }
    if litellm:
        targets[LITELLM] = load.Target(LITELLM, f"{litellm}/v1/chat/completions",
                                       {"Authorization": f"Bearer {LITELLM_KEY}"})
    return targets


async def warm_up(bench: Bench) -> None:
    await bench.control(delay_ms=0)
    for name, target in bench.targets.items():
        await load.closed_loop(bench.sessions[name], target, 10, bench.plan.warmup, "warm")
        await load.closed_loop(bench.session(name, 1), target, 1, 5, "warm-stream", stream=True)


async def measure(bench: Bench, path: str, run: Callable[[], Any]) -> tuple[load.Sample, dict[str, float]]:
    """Run one loop; also the CPU seconds the path's server (and the upstream) spent meanwhile."""
    server = bench.server_of(path)
    cpu_before, upstream_before = server.cpu_seconds(), bench.upstream.cpu_seconds()
    sample: load.Sample = await run()
    cpu = {"server_cpu_s": round(server.cpu_seconds() - cpu_before, 4),
           "upstream_cpu_s": round(bench.upstream.cpu_seconds() - upstream_before, 4)}
    return sample, cpu


async def phase_cpu(bench: Bench) -> dict[str, list[dict[str, Any]]]:
    """0 ms upstream, one client: what each path costs in latency and CPU per request."""
    await bench.control(delay_ms=0)
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in bench.targets}
    for r in range(bench.plan.rounds):
        for name in bench.rotated(r):
            target, session = bench.targets[name], bench.session(name, 1)
            sample, cpu = await measure(bench, name, lambda: load.closed_loop(
                session, target, 1, bench.plan.cpu_requests, f"cpu{r}"))
            row = {**summarize(sample), **cpu}
            row["server_cpu_ms_per_request"] = round(1000 * cpu["server_cpu_s"] / max(1, sample.completed), 3)
            rounds[name].append(row)
    return rounds


async def phase_bare(bench: Bench) -> list[dict[str, float]]:
    """The litellm path's reference (`bare.py`): `litellm.acompletion` in a plain loop, in a process
    of its own, against the same upstream at 0 ms, as many calls as a round of `phase_cpu`."""
    await bench.control(delay_ms=0)
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "bench" / "bare.py"), "--api-base", f"{bench.upstream.url}/v1",
        "--requests", str(bench.plan.cpu_requests), "--rounds", str(bench.plan.rounds),
        "--warmup", str(bench.plan.warmup), stdout=subprocess.PIPE)
    out, _ = await process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"bench/bare.py exited with {process.returncode}")
    rounds: list[dict[str, float]] = json.loads(out.decode().strip().splitlines()[-1])
    return rounds


async def phase_concurrency(bench: Bench) -> dict[str, dict[str, list[dict[str, Any]]]]:
    plan = bench.plan
    await bench.control(delay_ms=plan.upstream_delay_ms)
    out: dict[str, dict[str, list[dict[str, Any]]]] = {str(c): {n: [] for n in bench.targets}
                                                       for c in plan.concurrency}
    for r in range(plan.rounds):
        for c, count in plan.concurrency.items():
            for name in bench.rotated(r):
                target, session = bench.targets[name], bench.session(name, c)
                sample, cpu = await measure(bench, name, lambda: load.closed_loop(
                    session, target, c, count, f"c{c}r{r}"))
                out[str(c)][name].append({
                    **summarize(sample), **cpu, "throughput_rps": round(sample.completed / max(sample.wall, 1e-9), 1),
                    "requests_per_cpu_s": round(sample.completed / cpu["server_cpu_s"], 1) if cpu["server_cpu_s"] else None,
                })
    return out


async def phase_streams(bench: Bench) -> dict[str, dict[str, list[dict[str, Any]]]]:
    plan = bench.plan
    await bench.control(delay_ms=plan.upstream_delay_ms, chunks=plan.stream_chunks, pace_ms=plan.stream_pace_ms)
    out: dict[str, dict[str, list[dict[str, Any]]]] = {str(c): {n: [] for n in bench.targets}
                                                       for c in plan.streams}
    for r in range(max(1, min(plan.rounds, plan.stream_rounds))):
        for c, count in plan.streams.items():
            for name in bench.rotated(r):
                sample = await load.closed_loop(bench.session(name, c), bench.targets[name], c, count,
                                                f"s{c}r{r}", stream=True)
                out[str(c)][name].append(summarize(sample))
    return out


async def phase_throughput(bench: Bench) -> dict[str, list[dict[str, Any]]]:
    """Open-loop rate ladder at the upstream delay: the highest rate whose p99 stays under the plan's
    limit with no error, and requests per CPU-second of the path's server at that rate."""
    plan = bench.plan
    await bench.control(delay_ms=plan.upstream_delay_ms)
    out: dict[str, list[dict[str, Any]]] = {name: [] for name in bench.targets}
    for r in range(plan.throughput_rounds):
        active = list(bench.targets)
        failures = dict.fromkeys(active, 0)
        steps: dict[str, list[dict[str, Any]]] = {name: [] for name in active}
        for rate in plan.rates:
            if active == [DIRECT]:
                break  # the direct path only shows the harness is not the limit
            for name in rotate(active, r):
                target, session = bench.targets[name], bench.sessions[name]
                sample, cpu = await measure(bench, name, lambda: load.open_loop(
                    session, target, rate, plan.step_seconds, f"t{r}-{rate}"))
                row: dict[str, Any] = {"rate": rate, **summarize(sample), **cpu,
                       "achieved_rps": round(sample.completed / max(sample.wall, 1e-9), 1)}
                row["ok"] = (sample.errors == 0 and sample.completed >= 0.98 * sample.scheduled
                             and row.get("p99", 1e9) < plan.p99_limit_ms)
                row["requests_per_cpu_s"] = round(sample.completed / cpu["server_cpu_s"], 1) if cpu["server_cpu_s"] else None
                steps[name].append(row)
                failures[name] = 0 if row["ok"] else failures[name] + 1
                if failures[name] == 2:  # one failed step may be a hiccup of a shared machine; two end the climb
                    active.remove(name)
            if not active:
                break
        for name, rows in steps.items():
            passed = [row for row in rows if row["ok"]]
            best = passed[-1] if passed else None
            out[name].append({"max_rate": best["rate"] if best else 0.0,
                              "requests_per_cpu_s": best["requests_per_cpu_s"] if best else None,
                              "ceiling": bool(rows) and rows[-1]["ok"] and rows[-1]["rate"] == max(plan.rates),
                              "steps": rows})
    return out


async def phase_history(bench: Bench) -> dict[str, list[dict[str, Any]]]:
    """One client, 0 ms upstream, on sessions seeded with 10 ... 100,000 messages, interleaved
    request by request so every session gets the same requests in the same order."""
    plan = bench.plan
    await bench.control(delay_ms=0)
    base = bench.targets[MEMORY]
    target = load.Target("history", base.url, base.headers, model="bench-sweep", sessions="hist")
    session = bench.session(MEMORY, 1)
    out: dict[str, list[dict[str, Any]]] = {str(size): [] for size in plan.history_sizes}
    rng = random.Random(4)
    question = 0
    for r in range(plan.rounds):
        samples = {size: load.Sample() for size in plan.history_sizes}
        for _ in range(plan.history_requests):
            # As long as the seeded messages, so the window keeps holding about as many messages.
            body = load.chat_body("bench-sweep", question, text=seed.message_text(rng, 400))
            question += 1
            for size in rotate(list(plan.history_sizes), r):
                await load.send(session, target, body, str(size), samples[size], time.perf_counter(), False)
        for size, sample in samples.items():
            out[str(size)].append(summarize(sample))
    return out


async def phase_long(processes: servers.Processes, upstream: servers.Server, workdir: Path,
                     plan: Plan) -> dict[str, Any]:
    """Memory work on long sessions sent whole: sessions of `plan.long_turns` turns (~95 tokens
    each) that all fit a 128k window, on SQLite and on PostgreSQL, through memproxy's own client and
    through litellm. One client, 0 ms upstream; each request goes to every (transport, size) in turn,
    rotated from round to round. Every round has sessions of its own, so a session grows by at most
    `long_requests` turns while it is measured. Last, the body memproxy sent for each size is sent
    straight to the upstream, to set what serialising it costs beside the direct path's own cost."""
    memory = MemoryConfig(**BENCH_MEMORY)
    out: dict[str, Any] = {"turns": list(plan.long_turns), "window": LONG_WINDOW, "words": LONG_WORDS,
                           "stores": {}, "direct": {}, "seed_s": {}, "notes": []}
    stores: dict[str, tuple[str, str | None]] = {"sqlite": (f"sqlite:///{workdir / 'long.db'}", None)}
    if await seed.postgres_reachable(POSTGRES_URL):
        stores["postgres"] = (POSTGRES_URL, f"bench_long_{os.getpid()}")
    else:
        out["notes"].append(f"PostgreSQL was not reachable at {POSTGRES_URL}: its rows were not measured")
    models = {name: (LONG_WINDOW, 512) for name in LONG_MODELS.values()}
    pairs = [(transport, turns) for transport in LONG_MODELS for turns in plan.long_turns]
    rng = random.Random(17)
    try:
        for store, (url, schema) in stores.items():
            print(f"bench: seeding the long sessions ({store})", flush=True)
            started = time.perf_counter()
            await seed.seed_long_sessions(url, schema, TENANT, [f"long-{transport}-{turns}-{r}" for transport, turns
                                                                 in pairs for r in range(plan.rounds)],
                                          [2 * turns for _, turns in pairs for _ in range(plan.rounds)],
                                          LONG_WORDS, memory, ENCODING)
            out["seed_s"][store] = round(time.perf_counter() - started, 1)
            config = workdir / f"memproxy-long-{store}.yaml"
            config.write_text(memproxy_config(upstream.url, url, BENCH_MEMORY, WINDOW, models,
                                              own_client=(LONG_MODELS["openai"],), schema=schema))
            server = servers.start_memproxy(processes, f"memproxy-long-{store}", config)
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
                await _control(session, upstream.url, delay_ms=0, replies={})
                results: dict[str, dict[str, list[dict[str, Any]]]] = {
                    transport: {str(turns): [] for turns in plan.long_turns} for transport in LONG_MODELS}
                question = 0
                for r in range(plan.rounds):
                    samples = {pair: load.Sample() for pair in pairs}
                    for _ in range(plan.long_requests):
                        text = seed.message_text(rng, LONG_WORDS // 2)
                        question += 1
                        for transport, turns in rotate(pairs, r):
                            target = load.Target(store, f"{server.url}/v1/chat/completions",
                                                 {"Authorization": f"Bearer {PROXY_KEY}"},
                                                 model=LONG_MODELS[transport], sessions=f"long-{transport}-{turns}")
                            await load.send(session, target, load.chat_body(target.model, question, text=text),
                                            str(r), samples[(transport, turns)], time.perf_counter(), False)
                    for (transport, turns), sample in samples.items():
                        results[transport][str(turns)].append(summarize(sample))
                out["stores"][store] = results
                if store == "sqlite":
                    out["direct"] = await _direct_long(session, server, upstream, plan)
            server.stop()
    finally:
        if "postgres" in stores:
            await seed.drop_schema(POSTGRES_URL, stores["postgres"][1] or "")
    return out


async def _direct_long(session: aiohttp.ClientSession, server: servers.Server, upstream: servers.Server,
                       plan: Plan) -> dict[str, dict[str, Any]]:
    """For each size: one more turn through memproxy's own client, the body it sent as the upstream
    received it, and that body sent straight to the upstream `rounds x long_requests` times."""
    direct: dict[str, dict[str, Any]] = {}
    headers = {"Authorization": "Bearer upstream-key", "Content-Type": "application/json"}
    for turns in plan.long_turns:
        await _control(session, upstream.url, keep_last=True)
        target = load.Target("long", f"{server.url}/v1/chat/completions", {"Authorization": f"Bearer {PROXY_KEY}"},
                             model=LONG_MODELS["openai"], sessions=f"long-openai-{turns}")
        sample = load.Sample()
        await load.send(session, target, load.chat_body(target.model, 0), "0", sample, time.perf_counter(), False)
        async with session.get(f"{upstream.url}/_last") as response:
            body = await response.read()
        await _control(session, upstream.url, keep_last=False)
        latencies = []
        for _ in range(plan.rounds * plan.long_requests):
            started = time.perf_counter()
            async with session.post(f"{upstream.url}/v1/chat/completions", data=body, headers=headers) as response:
                await response.read()
                response.raise_for_status()
            latencies.append((time.perf_counter() - started) * 1000)
        direct[str(turns)] = {"bytes": len(body), "p50": round(load.percentile(latencies, 50), 3)}
    return direct


async def _control(session: aiohttp.ClientSession, upstream: str, **settings: Any) -> None:
    async with session.post(f"{upstream}/_control", json=settings) as response:
        response.raise_for_status()


async def phase_soak(bench: Bench) -> dict[str, dict[str, Any]]:
    """A steady load on one path at a time, to see resident memory settle (or grow)."""
    plan = bench.plan
    await bench.control(delay_ms=plan.upstream_delay_ms)
    out: dict[str, dict[str, Any]] = {}
    for name in [MEMORY, LITELLM]:
        if name not in bench.targets:
            continue
        start = bench.sampler.now()
        sample = await load.closed_loop(bench.sessions[name], bench.targets[name], plan.soak_clients,
                                        count=int(plan.soak_seconds * 5000), tag=f"soak-{name}",
                                        deadline=plan.soak_seconds)
        out[name] = {"start_s": round(start, 2), "end_s": round(bench.sampler.now(), 2),
                     "requests": sample.completed, "errors": sample.errors, "clients": plan.soak_clients,
                     "server": "memproxy" if name == MEMORY else "litellm-proxy"}
        await asyncio.sleep(1.0)  # a last sample or two after the load
    return out


async def phase_replay(processes: servers.Processes, upstream: servers.Server, workdir: Path,
                       plan: Plan, data: Path) -> dict[str, Any]:
    if not data.exists():
        return {"skipped": f"the LoCoMo data is not at {data}; the replay was skipped"}
    conversations = replay.load_conversations(data, plan.replay_exchanges, plan.replay_conversations)
    config = workdir / "memproxy-replay.yaml"
    config.write_text(memproxy_config(upstream.url, workdir / "replay.db", {}, REPLAY_WINDOW))
    server = servers.start_memproxy(processes, "memproxy-replay", config)
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{upstream.url}/_control", json={
            "delay_ms": 0, "replies": replay.replies(conversations), "count_tokens": ENCODING,
            "reset_stats": True,
        }) as response:
            response.raise_for_status()
        started = time.perf_counter()
        results = await replay.replay_all(f"{server.url}/v1/chat/completions",
                                          {"Authorization": f"Bearer {PROXY_KEY}"}, "bench", conversations,
                                          ENCODING, REPLAY_WINDOW, REPLAY_OUTPUT)
        elapsed = time.perf_counter() - started
        stats = await _settled_stats(session, upstream.url)
        async with session.post(f"{upstream.url}/_control", json={"replies": {}, "count_tokens": None}):
            pass
    server.stop()
    return {
        "data": os.path.relpath(data, ROOT), "licence": replay.licence(data),
        "window": REPLAY_WINDOW, "output_reserve": REPLAY_OUTPUT, "seconds": round(elapsed, 1),
        "conversations": [asdict(r) for r in results], "upstream": stats,
        "memory": "memproxy defaults (summaries on, overflow: summarize)",
    }


def recall_modes(modes: dict[str, dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], str | None]:
    """The modes this build can run, and why any were left out: before recall, memproxy refuses
    its keys (an unknown key), and its one mode is recall off with no key set."""
    if "recall_tokens" in MemoryConfig.__dataclass_fields__:
        return modes, None
    return ({"off": {}} if "off" in modes else {}), "this memproxy has no recall (no `memory.recall_tokens`)"


async def phase_recall(processes: servers.Processes, upstream: servers.Server, workdir: Path, plan: Plan,
                       data: Path) -> dict[str, Any]:
    """LoCoMo told to memproxy turn by turn at each window, once, with every memory default; then
    every question asked through the context endpoint under each mode, on the same store (a memproxy
    of its own for each mode, all on the same database file)."""
    if not data.exists():
        return {"skipped": f"the LoCoMo data is not at {data}; the recall replay was skipped"}
    scripts = recall.load_scripts(data, plan.recall_conversations, plan.recall_sessions, plan.recall_questions)
    modes, missing = recall_modes(RECALL_MODES)
    script_replies, clashes = recall.replies(scripts)
    models = {f"recall-{window}": (window, output) for window, output in RECALL_WINDOWS.items()}
    db = workdir / "recall.db"
    headers = {"Authorization": f"Bearer {PROXY_KEY}"}
    runs = [(window, script, f"recall-{script.name}-{window}") for window in RECALL_WINDOWS for script in scripts]
    out: dict[str, Any] = {
        "data": os.path.relpath(data, ROOT), "licence": replay.licence(data),
        "windows": {str(w): {"output_reserve": o} for w, o in RECALL_WINDOWS.items()},
        "conversations": [{"name": s.name, "sessions": s.sessions, "requests": len(s.exchanges),
                           "questions": len(s.questions), "opened_by_b": s.opened_by_b,
                           "evidence_dropped": s.evidence_dropped} for s in scripts],
        "reply_clashes": clashes, "modes": {}, "mode_settings": modes, "modes_missing": missing,
    }
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        async with session.post(f"{upstream.url}/_control", json={
            "delay_ms": 0, "replies": script_replies, "count_tokens": None, "reset_stats": True,
        }) as response:
            response.raise_for_status()
        config = workdir / "memproxy-recall.yaml"
        config.write_text(memproxy_config(upstream.url, db, {}, WINDOW, models))
        server = servers.start_memproxy(processes, "memproxy-recall", config)
        started = time.perf_counter()
        told = await asyncio.gather(*(recall.tell(session, server.url, headers, f"recall-{window}", sid, script)
                                      for window, script, sid in runs))
        out["replay_seconds"] = round(time.perf_counter() - started, 1)
        out["upstream"] = await _settled_stats(session, upstream.url)  # the summaries folded by now
        server.stop()
        out["replay"] = {}
        for window in RECALL_WINDOWS:
            counts = [c for (w, _, _), c in zip(runs, told) if w == window]
            recalled = [n for c in counts for n in c.recalled]
            errors: dict[str, int] = {}
            for c in counts:
                for kind, n in c.errors.items():
                    errors[kind] = errors.get(kind, 0) + n
            out["replay"][str(window)] = {
                "requests": sum(c.requests for c in counts), "overflows": sum(c.overflows for c in counts),
                "errors": errors, "recalled_mean": round(sum(recalled) / len(recalled), 2) if recalled else None,
                "context_tokens_max": max((t for c in counts for t in c.context_tokens), default=0),
            }
        started = time.perf_counter()
        # One memproxy a mode, all on the replayed file and started side by side: the context
        # endpoint only reads, so they may share it.
        configs = []
        for mode, memory in modes.items():
            config = workdir / f"memproxy-recall-{mode}.yaml"
            config.write_text(memproxy_config(upstream.url, db, memory, WINDOW, models))
            configs.append((f"memproxy-recall-{mode}", config))
        for (mode, _), server in zip(modes.items(), servers.start_memproxies(processes, configs)):
            asked = await asyncio.gather(*(recall.ask(session, server.url, headers, f"recall-{window}", sid, script)
                                           for window, script, sid in runs))
            server.stop()
            by_window: dict[str, Any] = {}
            for window in RECALL_WINDOWS:
                total, overflows = recall.Score(), 0
                for (w, _, _), (score, overflowed) in zip(runs, asked):
                    if w == window:
                        total.merge(score)
                        overflows += overflowed
                by_window[str(window)] = {**total.summary(), "overflows": overflows}
            out["modes"][mode] = by_window
        out["question_seconds"] = round(time.perf_counter() - started, 1)
        async with session.post(f"{upstream.url}/_control", json={"replies": {}}):
            pass
    return out


def recall_texts(data: Path) -> tuple[list[str], list[str]]:
    """Message texts and questions for the speed phase: LoCoMo's turns and questions where the file
    is, else sentences of the history sweep's words."""
    if data.exists():
        raw = json.loads(data.read_text(encoding="utf-8"))
        turns = [turn["text"] for item in raw for key, value in item["conversation"].items()
                 if re.fullmatch(r"session_\d+", key) for turn in value]
        questions = [str(qa["question"]) for item in raw for qa in item.get("qa", [])]
        return turns, questions
    rng = random.Random(9)
    return [seed.message_text(rng, 25) for _ in range(5000)], [seed.message_text(rng, 10) for _ in range(500)]


async def phase_recall_speed(processes: servers.Processes, upstream: servers.Server, workdir: Path, plan: Plan,
                             data: Path) -> dict[str, Any]:
    """Memory work for a turn on one session of `recall_session_size` messages, recall on and off, in
    a store holding that session alone and in one of `recall_store_size` messages. Each (store, mode)
    is a memproxy of its own on a copy of its store, all running at once; one client, 0 ms upstream,
    each request sent to every one in turn (rotated from round to round), so drift hits all alike."""
    texts, questions = recall_texts(data)
    memory = MemoryConfig(**BENCH_MEMORY)
    modes, missing = recall_modes({"on": {}, "off": RECALL_MODES["off"]})
    stores = {"small": plan.recall_session_size, "big": plan.recall_store_size}
    out: dict[str, Any] = {"session_size": plan.recall_session_size, "store_sizes": stores,
                           "other_session_size": plan.recall_other_size, "modes_missing": missing,
                           "texts": "LoCoMo turns and questions" if data.exists() else "random words (no LoCoMo data)",
                           "seed_s": {}, "results": {}}
    configs: dict[str, Path] = {}
    for store, size in stores.items():
        db = workdir / f"recall-speed-{store}.db"
        print(f"bench: seeding {size:,} messages for the recall speed phase", flush=True)
        out["seed_s"][store] = round(await seed.seed_recall_store(
            f"sqlite:///{db}", TENANT, RECALL_SESSION, plan.recall_session_size, size, plan.recall_other_size,
            texts, memory, ENCODING, "bench-sweep"), 1)
        for i, (mode, settings) in enumerate(modes.items()):
            copy = db if i == 0 else workdir / f"recall-speed-{store}-{mode}.db"
            if copy != db:
                shutil.copyfile(db, copy)  # the seeding store is closed: its WAL is checkpointed away
            config = workdir / f"memproxy-recall-speed-{store}-{mode}.yaml"
            config.write_text(memproxy_config(upstream.url, copy, {**BENCH_MEMORY, **settings}, WINDOW))
            configs[f"{store}-{mode}"] = config
    names = list(configs)
    live = dict(zip(names, servers.start_memproxies(
        processes, [(f"memproxy-recall-speed-{name}", config) for name, config in configs.items()])))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        async with session.post(f"{upstream.url}/_control", json={"delay_ms": 0, "replies": {}}) as response:
            response.raise_for_status()
        targets = {name: load.Target(name, f"{server.url}/v1/chat/completions",
                                     {"Authorization": f"Bearer {PROXY_KEY}"}, model="bench-sweep", sessions="recall")
                   for name, server in live.items()}
        rng = random.Random(5)
        results: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
        question = 0
        for r in range(plan.rounds):
            samples = {name: load.Sample() for name in names}
            for _ in range(plan.recall_requests):
                body = load.chat_body("bench-sweep", question, text=rng.choice(questions))
                question += 1
                for name in rotate(names, r):
                    await load.send(session, targets[name], body, "speed", samples[name], time.perf_counter(), False)
            for name, sample in samples.items():
                results[name].append(summarize(sample))
        out["results"] = results
    for server in live.values():
        server.stop()
    return out


async def _settled_stats(session: aiohttp.ClientSession, upstream: str, limit: float = 20.0) -> dict[str, int]:
    """The upstream's counts once background summaries have stopped arriving."""
    deadline, last = time.monotonic() + limit, None
    while time.monotonic() < deadline:
        async with session.get(f"{upstream}/_stats") as response:
            stats: dict[str, int] = await response.json()
        if stats == last:
            return stats
        last = stats
        await asyncio.sleep(1.0)
    return last or {}


def machine() -> dict[str, Any]:
    model = platform.processor() or "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {"cores": os.cpu_count(), "cpu": model, "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "os": platform.platform(), "load_at_start": round(os.getloadavg()[0], 2)}


def commit() -> str:
    """The checkout's commit (`git describe --always --dirty`), or "-"."""
    try:
        described = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                                   text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "-"
    return described or "-"


def versions(litellm_status: str) -> dict[str, str]:
    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "-"

    return {"python": platform.python_version(), "memproxy": f"{version('memproxy')} ({commit()})",
            "litellm": version("litellm"), "aiohttp": version("aiohttp"), "matplotlib": version("matplotlib"),
            "litellm_proxy": litellm_status}


def settings(plan: Plan, litellm_workers: int, workers: int) -> dict[str, Any]:
    return {
        "plan": asdict(plan),
        "memproxy": {"process": f"`memproxy serve --workers {workers}` (one per core, as LiteLLM's proxy), SQLite"
                                " store in a temp dir, log level INFO; the long sessions, token replay and recall"
                                " phases on memproxies of one process each",
                     "workers": workers,
                     "model": "openai/bench-model through litellm (the default transport), context"
                              f" window {WINDOW} (sweep model: {SWEEP_WINDOW}); the \"own client\" path: the same model"
                              " with `transport: openai`",
                     "memory": BENCH_MEMORY, "auth": "one proxy key", "sweep_window": SWEEP_WINDOW},
        "litellm_proxy": {"workers": litellm_workers, "env": servers.LITELLM_ENV,
                          "config": servers.litellm_settings_text()},
        "client": "aiohttp in the bench process, keep-alive connections; memory-on clients send only their new "
                  f"message (X-Memproxy-History: new) and start a new session every {load.TURN_LENGTH} requests",
        "upstream": "bench/upstream.py, one aiohttp process; answers with one sentence of "
                    f"{TiktokenCounter(ENCODING).text(upstream.ANSWER)} tokens ({ENCODING})",
    }


async def measure_paths(args: argparse.Namespace, plan: Plan, processes: servers.Processes,
                        upstream: servers.Server, workdir: Path, results: dict[str, Any]) -> None:
    """Phases 1-7: every path side by side, then the history sweep, the soak and the token replay."""
    notes: list[str] = results["meta"]["notes"]
    litellm_status = "not run (--no-litellm-proxy)"
    workers = os.cpu_count() or 1
    db = workdir / "memproxy.db"
    print(f"bench: seeding sessions of {', '.join(map(str, plan.history_sizes))} messages", flush=True)
    results["history_seed_s"] = await seed.seed_sessions(
        f"sqlite:///{db}", TENANT, plan.history_sizes, MemoryConfig(**BENCH_MEMORY), ENCODING)
    config = workdir / "memproxy.yaml"
    config.write_text(memproxy_config(upstream.url, db, BENCH_MEMORY, WINDOW, workers=workers))
    memproxy = servers.start_memproxy(processes, "memproxy", config)
    litellm = None
    if not args.no_litellm_proxy:
        exe, litellm_status = servers.litellm_executable()
        if exe is None:
            notes.append(f"LiteLLM's proxy was not measured: {litellm_status}")
        else:
            litellm_config = workdir / "litellm.yaml"
            litellm_config.write_text(servers.litellm_config(upstream.url, LITELLM_KEY))
            try:
                litellm = servers.start_litellm(processes, exe, litellm_config, workers)
            except RuntimeError as exc:
                litellm_status += f"; failed to start: {exc}"
                notes.append(f"LiteLLM's proxy was not measured: {exc}")
    if litellm is None and not args.no_litellm_proxy:
        print(f"bench: LiteLLM's proxy is not measured: {litellm_status}", file=sys.stderr, flush=True)
    results["meta"]["versions"] = versions(litellm_status)
    results["meta"]["settings"] = settings(plan, workers, workers)
    watched = {"memproxy": memproxy, "upstream": upstream}
    if litellm is not None:
        watched["litellm-proxy"] = litellm
    with RssSampler(watched) as sampler:
        bench = Bench(plan, upstream, memproxy, litellm, sampler,
                      targets=make_targets(upstream.url, memproxy.url, litellm.url if litellm else None))
        async with client_sessions(bench):
            sampler.mark("warm-up")
            await warm_up(bench)
            sampler.mark("cpu cost (0 ms upstream)")
            results["cpu"] = await phase_cpu(bench)
            sampler.mark("bare litellm loop")
            results["bare"] = await phase_bare(bench)
            sampler.mark(f"concurrency ({plan.upstream_delay_ms:g} ms upstream)")
            results["concurrency"] = await phase_concurrency(bench)
            sampler.mark("streams")
            results["streams"] = await phase_streams(bench)
            sampler.mark("throughput ladder")
            results["throughput"] = await phase_throughput(bench)
            sampler.mark("history sweep")
            results["history"] = await phase_history(bench)
            sampler.mark("soak")
            results["soak"] = await phase_soak(bench)
            sampler.mark("done")
    memproxy.stop()  # the recall phases' servers need the cores
    if litellm is not None:
        litellm.stop()
    print("bench: long sessions sent whole", flush=True)
    results["long"] = await phase_long(processes, upstream, workdir, plan)
    notes.extend(results["long"]["notes"])
    results["paths"] = list(bench.targets)
    results["rss"] = {"series": sampler.series, "marks": sampler.marks}
    print("bench: token-cost replay", flush=True)
    results["replay"] = await phase_replay(processes, upstream, workdir, plan, replay.data_path(args.locomo))
    if "skipped" in results["replay"]:
        notes.append(results["replay"]["skipped"])
        print(f"bench: {results['replay']['skipped']}", file=sys.stderr, flush=True)


async def measure_recall(args: argparse.Namespace, plan: Plan, processes: servers.Processes,
                         upstream: servers.Server, workdir: Path, results: dict[str, Any]) -> None:
    """Phases 8 and 9: recall's quality on the LoCoMo replay, and its speed on big stores."""
    data = replay.data_path(args.locomo)
    print("bench: recall replay", flush=True)
    started = time.monotonic()
    results["recall"] = await phase_recall(processes, upstream, workdir, plan, data)
    for skipped in (results["recall"].get("skipped"), results["recall"].get("modes_missing")):
        if skipped:
            results["meta"]["notes"].append(f"recall replay: {skipped}")
            print(f"bench: recall replay: {skipped}", file=sys.stderr, flush=True)
    if args.only == "recall-quality":
        return
    print(f"bench: recall speed (replay took {time.monotonic() - started:.0f} s)", flush=True)
    results["recall_speed"] = await phase_recall_speed(processes, upstream, workdir, plan, data)


# The phases each `--only` runs: the recall replay alone counts tokens and evidence, not time, so
# it may be rerun on any machine beside a saved run measured on another.
ONLY_PHASES = {"recall": ("recall", "recall_speed"), "recall-quality": ("recall",)}


def merged(results: dict[str, Any], saved: Path, quick: bool, only: str) -> dict[str, Any]:
    """`--only`'s results put into a saved run's (of the same kind), so that the page keeps every
    other section as that run measured it; else the recall results alone."""
    if not saved.exists():
        return results
    previous: dict[str, Any] = json.loads(saved.read_text(encoding="utf-8"))
    if previous.get("meta", {}).get("quick") != quick or "concurrency" not in previous:
        return results
    meta = results["meta"]
    previous.update({phase: results[phase] for phase in ONLY_PHASES[only]})
    previous["meta"]["recall_run"] = {"only": only, "started": meta["started"], "duration_s": meta["duration_s"],
                                      "commit": commit(), "notes": meta["notes"],
                                      "load_at_start": meta["machine"]["load_at_start"],
                                      "load_at_end": meta["machine"]["load_at_end"]}
    return previous


async def run(args: argparse.Namespace) -> Path:
    plan = QUICK if args.quick else FULL
    for option in ("rounds", "soak_seconds", "upstream_delay_ms"):
        if getattr(args, option) is not None:
            plan = Plan(**{**asdict(plan), option: getattr(args, option)})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="memproxy-bench-"))
    processes = servers.Processes(workdir)
    started = time.monotonic()
    results: dict[str, Any] = {"meta": {"started": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "quick": args.quick, "machine": machine(), "notes": []}}
    try:
        upstream = servers.start_upstream(processes)
        if args.only is None:
            await measure_paths(args, plan, processes, upstream, workdir, results)
        await measure_recall(args, plan, processes, upstream, workdir, results)
    finally:
        processes.stop_all()
        if args.keep_workdir:
            print(f"bench: logs and databases kept in {workdir}", flush=True)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    took = results["meta"]["duration_s"] = round(time.monotonic() - started, 1)
    results["meta"]["machine"]["load_at_end"] = round(os.getloadavg()[0], 2)
    if args.only is not None:
        results["meta"]["only"] = args.only
        results["meta"]["plan"] = asdict(plan)
        results = merged(results, out / "bench-results.json", args.quick, args.only)
    path = report.write(results, out, small=args.quick)
    print(f"bench: wrote {path} in {took:.0f} s", flush=True)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="memproxy's benchmark suite")
    parser.add_argument("--quick", action="store_true", help="a seconds-long run (CI smoke test)")
    parser.add_argument("--no-litellm-proxy", action="store_true", help="leave LiteLLM's proxy out")
    parser.add_argument("--out", default=str(ROOT / "docs"), help="where benchmarks.md and the plots go")
    parser.add_argument("--rounds", type=int, help="rounds per phase (default: 5, quick: 1)")
    parser.add_argument("--soak-seconds", type=float, help="length of each soak (default: 100, quick: 1)")
    parser.add_argument("--upstream-delay-ms", type=float,
                        help="the fake upstream's delay in every phase but the CPU cost and the history sweep"
                             " (default: 50)")
    parser.add_argument("--locomo", help=f"the LoCoMo file (default: {replay.DATA})")
    parser.add_argument("--keep-workdir", action="store_true", help="keep the logs and databases")
    parser.add_argument("--only", choices=list(ONLY_PHASES),
                        help="run only the recall phases (recall: 8 and 9; recall-quality: 8, which measures no"
                             " time); their results replace those of the saved run in OUT/bench-results.json (of"
                             " the same kind, quick or full), and the page is rewritten")
    args = parser.parse_args(argv)
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
