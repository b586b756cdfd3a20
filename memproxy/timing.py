"""Where a chat request's time goes, part by part: its `Server-Timing` header, its log line and its
metrics (`memproxy.observe`).

The time a request spends outside the upstream call is cut into contiguous laps, each charged to the
part of the memory work it ran: `parse` (reading and validating the body), `reconcile` (the session
lock and lookup, matching the client's messages with the stored ones), `budget` (counting the new
messages and building the context), `recall` (choosing the older messages recalled into it,
`memory.recall`), `record` (after the upstream call: describing the turn and
writing it). What the store takes inside a lap is carved out of it and charged to `store`, so the
parts do not overlap and add up to `memory`, the request's whole time but the upstream call.

The store learns which request it serves from a context variable, so nothing is passed down through
memory's functions; a store call costs two clock reads and a float add. Work that outlives the
request (a background summary) runs in a context of its own and charges nothing here.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

LAPS = ("parse", "reconcile", "budget", "recall", "record")
PARTS = ("parse", "reconcile", "budget", "recall", "store", "record")
BEFORE_UPSTREAM = PARTS[:5]  # what a stream's headers can tell: they leave before the record


class Timings:
    """One request's clock; times in seconds until they are reported (in ms)."""

    __slots__ = ("started", "laps", "store", "upstream", "_earlier", "_failed", "_mark", "_store_mark")

    def __init__(self) -> None:
        self.started = self._mark = time.perf_counter()
        self.laps = dict.fromkeys(LAPS, 0.0)
        self.store = 0.0
        self.upstream = 0.0
        self._earlier = 0.0  # calls refused before this one and sent again (a refusal for length)
        self._failed = 0.0  # the last call that failed, until it is known to be sent again
        self._store_mark = 0.0

    def lap(self, part: str) -> None:
        """Charge the time since the last lap to `part`, less what the store took meanwhile."""
        now = time.perf_counter()
        self.laps[part] += now - self._mark - (self.store - self._store_mark)
        self._mark, self._store_mark = now, self.store

    def upstream_ended(self, started: float) -> float:
        """The upstream call (or the part of it so far) took from `started` until now; returns its ms.
        The next lap starts now. `upstream` holds too the calls refused before it and sent again."""
        now = time.perf_counter()
        self.upstream = self._earlier + now - started
        self._mark, self._store_mark = now, self.store
        return (now - started) * 1000

    def upstream_failed(self, started: float) -> None:
        """The upstream call that began at `started` failed just now: a request that ends with its
        error had no upstream answer (`upstream` stays as it was)..."""
        self._failed = time.perf_counter() - started

    def upstream_retried(self) -> None:
        """...but one that sends the call again (a refusal for length, planned again) spent it
        upstream: it is upstream time, not the next part's."""
        self._earlier += self._failed
        self._mark += self._failed  # the call came after the last lap
        self._failed = 0.0

    def memory_ms(self) -> float:
        """Everything so far but the upstream call."""
        return (time.perf_counter() - self.started - self.upstream) * 1000

    def split(self, parts: tuple[str, ...] = PARTS, upstream_name: str = "upstream") -> dict[str, float]:
        """The parts, `memory`, then the upstream call, in ms."""
        split = {part: 1000 * (self.store if part == "store" else self.laps[part]) for part in parts}
        return {**split, "memory": self.memory_ms(), upstream_name: self.upstream * 1000}

    def header(self, parts: tuple[str, ...] = PARTS, upstream_name: str = "upstream") -> str:
        """`Server-Timing`: `parse;dur=0.05, ..., memory;dur=0.61, upstream;dur=50.20`."""
        return ", ".join(f"{name};dur={ms:.2f}" for name, ms in self.split(parts, upstream_name).items())


_current: ContextVar[Timings | None] = ContextVar("memproxy_timings", default=None)


@contextmanager
def measured() -> Iterator[Timings]:
    """Time the request being handled: laps and store calls until the block ends go to it."""
    timings = Timings()
    token = _current.set(timings)
    try:
        yield timings
    finally:
        _current.reset(token)


def lap(part: str) -> None:
    """End the current lap of the request being timed, if any (the admin preview is not)."""
    timings = _current.get()
    if timings is not None:
        timings.lap(part)


def charge_store(started: float) -> None:
    """A store call that began at `started` (`time.perf_counter()`) has just ended."""
    timings = _current.get()
    if timings is not None:
        timings.store += time.perf_counter() - started
