"""`memproxy serve --workers N`: N server processes sharing one port, for more than one core.

The parent serves nothing; it is their supervisor. Before any worker starts it applies the store's
pending migrations once (workers opening a fresh SQLite file together would each try to), and
reserves the port: a socket bound with SO_REUSEPORT that never listens, so that port 0 resolves to
one port for all and the port stays memproxy's while workers come and go. Each worker is `memproxy
serve` on that port with SO_REUSEPORT, so the kernel spreads new connections across the workers; it
writes one byte to a pipe once it listens. The parent prints its own "listening" line when every
worker has.

Nothing about a session lives in a worker's memory that another worker could contradict: turns are
recorded under the store's own lock and checked against the head they were planned on, summaries
take a lease row, and the caches are keyed by the chained hash of the whole history (docs/storage.md,
"One truth, many replicas"): workers are replicas that share a machine.

A worker that exits while serving is started again (a warning says so, with its exit code); one that
exits before it listens stops the whole start, as a single `serve` would have stopped, but a
replacement that does is tried again, after a wait that doubles up to 30 s, while the others serve. SIGTERM or
SIGINT to the parent is passed to every worker, each finishes what it is serving and exits, and the
parent exits 0 once all have (a worker that does not stop within `STOP_SECONDS` is killed). Metrics
need one directory shared by the workers (`PROMETHEUS_MULTIPROC_DIR`): without one set, the parent
makes a temporary one for the run.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .metrics import MULTIPROCESS_ENV
from .stopping import stop_signals

log = logging.getLogger("memproxy")

STOP_SECONDS = 60.0  # a worker's time to finish what it serves after SIGTERM, then SIGKILL
_RESTART_WAIT = (1.0, 30.0)  # seconds before a replacement that failed to start is tried again: first, most


@dataclass
class _Worker:
    index: int
    process: asyncio.subprocess.Process
    ready: asyncio.Future[bool]  # True once it listens; False if it exited first
    ready_fd: int  # the pipe's end it writes its byte to, until read

    def stop_reading(self) -> None:
        if self.ready_fd >= 0:
            asyncio.get_running_loop().remove_reader(self.ready_fd)
            os.close(self.ready_fd)
            self.ready_fd = -1


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to `host:port` with SO_REUSEPORT, not listening: the port the workers share."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


async def supervise(count: int, host: str, port: int, worker_args: Callable[[int, int], Sequence[str]]) -> int:
    """Run `count` workers on `host:port` until a stop signal; `worker_args(port, ready_fd)` is a
    worker's `memproxy` arguments. Returns the exit code."""
    task = asyncio.current_task()
    assert task is not None
    sock = reserve_port(host, port)
    port = sock.getsockname()[1]
    own_metrics_dir = None
    if not os.environ.get(MULTIPROCESS_ENV):
        own_metrics_dir = os.environ[MULTIPROCESS_ENV] = tempfile.mkdtemp(prefix="memproxy-metrics-")
    workers: list[_Worker] = []
    loop = asyncio.get_running_loop()
    try:
        with stop_signals.on_loop(loop, task.cancel):
            try:
                workers = [await _start(i, port, worker_args) for i in range(count)]
                if not all(await asyncio.gather(*(w.ready for w in workers))):
                    log.error("a worker stopped before it listened; stopping")
                    return 1
                log.info("%d workers listening", count)
                print(f"memproxy listening on http://{host}:{port}", flush=True)
                while True:  # until a stop signal cancels this task
                    exits = {asyncio.ensure_future(w.process.wait()): i for i, w in enumerate(workers)}
                    try:
                        done, _ = await asyncio.wait(exits, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        for waiting in exits:
                            waiting.cancel()
                    for i in (exits[waiting] for waiting in done):
                        log.warning("worker %d exited with %s; starting it again", i, workers[i].process.returncode)
                        workers[i] = await _restarted(i, port, worker_args)
            except asyncio.CancelledError:
                if not stop_signals.requested:
                    raise
                log.info("stopping %d workers", len(workers))
            return 0
    finally:
        await _stop(workers)
        sock.close()
        if own_metrics_dir is not None:
            shutil.rmtree(own_metrics_dir, ignore_errors=True)
            del os.environ[MULTIPROCESS_ENV]


async def _restarted(index: int, port: int, worker_args: Callable[[int, int], Sequence[str]]) -> _Worker:
    """A worker that died, started again. One that stops before it listens (its store locked by
    another process past the busy timeout, its config file gone) is tried again after a wait that
    doubles, up to `_RESTART_WAIT[1]`, while the others serve on: a failed start stops `supervise`,
    but a server that was serving keeps what it has."""
    wait = _RESTART_WAIT[0]
    while True:
        worker = await _start(index, port, worker_args)
        if await worker.ready:
            return worker
        await worker.process.wait()
        log.error("worker %d stopped before it listened; trying again in %.0f s", index, wait)
        await asyncio.sleep(wait)
        wait = min(wait * 2, _RESTART_WAIT[1])


async def _start(index: int, port: int, worker_args: Callable[[int, int], Sequence[str]]) -> _Worker:
    read_fd, write_fd = os.pipe()
    try:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "memproxy.entry", *worker_args(port, write_fd), pass_fds=(write_fd,))
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)  # the worker holds its own copy: at its exit the pipe ends
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[bool] = loop.create_future()

    worker = _Worker(index, process, ready, read_fd)

    def readable() -> None:
        said = os.read(read_fd, 1)
        worker.stop_reading()
        ready.set_result(bool(said))  # nothing: the worker exited without listening

    loop.add_reader(read_fd, readable)
    return worker


async def _stop(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.stop_reading()
        if not worker.ready.done():
            worker.ready.cancel()
    running = [w.process for w in workers if w.process.returncode is None]
    for process in running:
        try:
            process.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
    for process in running:
        try:
            await asyncio.wait_for(process.wait(), STOP_SECONDS)
        except asyncio.TimeoutError:
            log.error("a worker did not stop within %g s; killing it", STOP_SECONDS)
            process.kill()
            await process.wait()
