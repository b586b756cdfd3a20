"""SIGTERM and SIGINT for `memproxy serve`, honoured from the process's first line to its last.

A service manager may stop memproxy at any moment: while its modules are imported (half a second),
while litellm is (seconds), while the store opens and migrates, or once it listens. Each must end
the process promptly with exit code 0, the store closed, and no traceback. Python's defaults do not:
SIGTERM kills at once (and is ignored outright when memproxy is a container's PID 1, where the
kernel skips default actions), SIGINT raises KeyboardInterrupt wherever the code happens to be.

One handler covers every phase. Before the event loop runs, start-up is synchronous code (imports,
config, litellm's import): the first signal raises `Stopped` there, which unwinds it (nothing that
needs closing is open yet). While the loop runs, the handler only schedules the loop's own stop
callback (`memproxy.cli` cancels the task that starts or runs the server, whose cleanup closes what
it opened); raising inside the loop could interrupt it anywhere. Any later signal is ignored: the
stop already under way finishes. `memproxy.entry` installs the handler before importing anything
heavy; this module imports only the few standard modules it needs, for that reason.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # not imported for real: asyncio alone takes 40 ms, while a signal would kill
    import asyncio

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(BaseException):
    """A stop signal arrived during synchronous start-up. A BaseException, as KeyboardInterrupt is:
    no `except Exception` on the way out may swallow it."""


class StopSignals:
    def __init__(self) -> None:
        self.requested = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_stop: Callable[[], object] | None = None

    def install(self) -> None:
        for sig in SIGNALS:
            signal.signal(sig, self._handle)

    @contextmanager
    def on_loop(self, loop: asyncio.AbstractEventLoop, on_stop: Callable[[], object]) -> Iterator[None]:
        """Within: a stop signal calls `on_stop` on `loop`, the running one."""
        self._loop, self._on_stop = loop, on_stop
        try:
            yield
        finally:
            # Before the loop closes: a handler must never call into a closed loop.
            self._loop = self._on_stop = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            return  # a stop is under way already
        self.requested = True
        if self._loop is None or self._on_stop is None:
            raise Stopped(signal.Signals(signum).name)
        # Thread-safe (it writes to the loop's wake-up pipe), so safe from a handler that runs
        # between two bytecodes of the loop itself; asyncio.run's own SIGINT handler does the same.
        self._loop.call_soon_threadsafe(self._on_stop)


stop_signals = StopSignals()  # signals are the process's: one handler for it
