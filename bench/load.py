"""The load generator: closed loops (N clients back to back), open loops (requests at a fixed rate,
timed from when they were due, so a saturated server cannot hide its queue) and streams.

One `Target` is one path to the same fake upstream. Request bodies are encoded once; what varies per
request (memproxy's session id) comes from `Target.headers_for`. Every loop is bounded in count and
time.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

SYSTEM = "You are a concise assistant. Answer in one sentence."
TURN_LENGTH = 10  # a memory-on client starts a new conversation every 10 requests
REQUEST_TIMEOUT = 30.0


@dataclass
class Target:
    name: str  # direct, memproxy-memory, memproxy-pass, litellm-proxy
    url: str  # the chat completions endpoint
    headers: dict[str, str]
    model: str = "bench"
    sessions: str | None = None  # memory on: session ids start with this

    def headers_for(self, conversation: str) -> dict[str, str]:
        if self.sessions is None:
            return self.headers
        return {**self.headers, "X-Session-Id": f"{self.sessions}-{conversation}",
                "X-Memproxy-History": "new"}


def chat_body(model: str, question: int, stream: bool = False, text: str | None = None, **extra: Any) -> bytes:
    content = f"Question {question}: {text or 'what is the capital of France?'}"
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}],
        "max_tokens": 64,
        **extra,
    }
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()


@dataclass
class Sample:
    """What one loop measured; times in milliseconds."""

    latencies: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)  # streams: time to the first content
    timing: dict[str, list[float]] = field(default_factory=dict)  # memproxy's Server-Timing, by entry
    context_tokens: list[int] = field(default_factory=list)  # memproxy: tokens it sent upstream
    recalled: list[int] = field(default_factory=list)  # memproxy: old messages it recalled (with recall on)
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    wall: float = 0.0
    scheduled: int = 0

    @property
    def completed(self) -> int:
        return len(self.latencies)

    def error(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1


def leading_int(header: str | None) -> int | None:
    """The number a header starts with (`3`, `3; positions=...`), or None."""
    match = re.match(r"\s*(\d+)", header or "")
    return int(match.group(1)) if match else None


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _server_timing(header: str | None, sample: Sample) -> None:
    """Every `name;dur=ms` entry; a stream's `upstream-first-chunk` counts as its `upstream`."""
    if not header:
        return
    for part in header.split(","):
        name, _, rest = part.strip().partition(";dur=")
        if rest:
            name = "upstream" if name.startswith("upstream") else name
            sample.timing.setdefault(name, []).append(float(rest))


async def send(session: aiohttp.ClientSession, target: Target, body: bytes, conversation: str,
               sample: Sample, started: float, stream: bool) -> None:
    try:
        async with session.post(target.url, data=body, headers=target.headers_for(conversation)) as response:
            if response.status != 200:
                await response.read()
                sample.error(f"HTTP {response.status}")
                return
            _server_timing(response.headers.get("Server-Timing"), sample)
            if "X-Memproxy-Context-Tokens" in response.headers:
                sample.context_tokens.append(int(response.headers["X-Memproxy-Context-Tokens"]))
            recalled = leading_int(response.headers.get("X-Memproxy-Recalled"))
            if recalled is not None:
                sample.recalled.append(recalled)
            if stream:
                first = None
                async for line in response.content:
                    if first is None and line.startswith(b"data: {") and _has_content(line):
                        first = time.perf_counter()
                if first is None:
                    sample.error("stream without content")
                    return
                sample.ttft.append((first - started) * 1000)
            else:
                await response.read()
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        sample.error(type(exc).__name__)
        return
    sample.latencies.append((time.perf_counter() - started) * 1000)


def _has_content(line: bytes) -> bool:
    try:
        chunk = json.loads(line[6:])
    except ValueError:
        return False
    for choice in chunk.get("choices") or []:
        if (choice.get("delta") or {}).get("content"):
            return True
    return False


def client_session(limit: int) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=limit, limit_per_host=limit, enable_cleanup_closed=True)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT)
    return aiohttp.ClientSession(connector=connector, timeout=timeout,
                                 headers={"Content-Type": "application/json"})


async def closed_loop(session: aiohttp.ClientSession, target: Target, concurrency: int, count: int,
                      tag: str, stream: bool = False, deadline: float = 300.0) -> Sample:
    """`concurrency` clients send `count` requests in all, each as soon as its previous one is
    answered. A memory-on client holds a conversation of TURN_LENGTH requests, then starts another."""
    sample = Sample(scheduled=count)
    bodies = [chat_body(target.model, i, stream) for i in range(min(count, 64))]
    issued = 0
    stop_at = time.perf_counter() + deadline

    async def client(worker: int) -> None:
        nonlocal issued
        mine = 0
        while issued < count and time.perf_counter() < stop_at:
            issued += 1
            conversation = f"{tag}-w{worker}-c{mine // TURN_LENGTH}"
            await send(session, target, bodies[issued % len(bodies)], conversation, sample,
                       time.perf_counter(), stream)
            mine += 1

    started = time.perf_counter()
    await asyncio.gather(*(client(w) for w in range(concurrency)))
    sample.wall = time.perf_counter() - started
    return sample


async def open_loop(session: aiohttp.ClientSession, target: Target, rate: float, duration: float,
                    tag: str, max_in_flight: int = 2000) -> Sample:
    """Requests due at a fixed rate for `duration` seconds; each latency counts from when the
    request was due. Conversations interleave so that one session's requests are ~0.3 s apart
    (memproxy serialises a session's requests, as it must, which is not what this measures)."""
    count = max(1, int(rate * duration))
    sample = Sample(scheduled=count)
    bodies = [chat_body(target.model, i) for i in range(64)]
    spread = max(1, math.ceil(rate * 0.3))
    tasks: list[asyncio.Task[None]] = []
    in_flight = 0

    async def one(i: int, due: float) -> None:
        nonlocal in_flight
        in_flight += 1
        try:
            conversation = f"{tag}-{i % spread}-{i // (spread * TURN_LENGTH)}"
            await send(session, target, bodies[i % len(bodies)], conversation, sample, due, False)
        finally:
            in_flight -= 1

    started = time.perf_counter()
    for i in range(count):
        due = started + i / rate
        wait = due - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        if in_flight >= max_in_flight:
            sample.error("client backlog")
            continue
        tasks.append(asyncio.create_task(one(i, due)))
    await asyncio.gather(*tasks)
    sample.wall = time.perf_counter() - started
    return sample
