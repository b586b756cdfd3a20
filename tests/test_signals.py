"""`memproxy serve` stopped by SIGTERM or SIGINT at any moment after it starts, as a service manager
stops it: each time it must end promptly, with exit code 0, its store closed and no traceback.

Each moment is one the process shows (the kernel's record of its handlers, a start-up log line at
DEBUG, its address), never a guess at timing. While the store opens is made a lasting moment: the
test holds what the store needs to open (the SQLite file, the PostgreSQL schema's migration lock), so
it cannot finish opening until the signal has come. The store's two kinds are tested where it is open.
"""

from __future__ import annotations

import queue
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest

from db import opening_held
from fake_upstream import FakeUpstream
from memproxy.config import StorageConfig
from memproxy.store.sqlite import sqlite_path
from processes import clean_env, memproxy_command, sqlite_storage, storage_section, store_for_processes, write_config

START_TIMEOUT = 60.0  # to reach a moment: litellm's import alone takes seconds on a busy machine
STOP_BOUND = 15.0  # from the signal to the process's end


class Starting:
    """`memproxy serve` at DEBUG, its output (standard output and error together) read line by line."""

    def __init__(self, config: Path) -> None:
        self.process = subprocess.Popen(
            [*memproxy_command(), "serve", "-c", str(config), "--port", "0", "--log-level", "DEBUG"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=clean_env(PYTHONFAULTHANDLER="1"))  # SIGABRT prints every thread's stack (`stop`)
        self.lines: list[str] = []
        self._new: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:  # blocks: off the test's thread
            self._new.put(line)
        self._new.put(None)

    def wait_for(self, text: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                line = self._new.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {text!r} within {START_TIMEOUT:g} s:\n{''.join(self.lines)}") from None
            if line is None:
                raise AssertionError(f"memproxy ended before {text!r}:\n{''.join(self.lines)}")
            self.lines.append(line)
            if text in line:
                return

    def catches(self, sig: signal.Signals) -> bool:
        """Whether the process has a handler for `sig` (the kernel's SigCgt mask in /proc)."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
        return False

    def stop(self, sig: signal.Signals) -> tuple[int, str, float]:
        """Send `sig`; the exit code, everything the process wrote, and how long it took to end."""
        sent = time.monotonic()
        self.process.send_signal(sig)
        try:
            code = self.process.wait(timeout=STOP_BOUND)
        except subprocess.TimeoutExpired:
            # Where it is stuck: faulthandler writes each thread's stack on SIGABRT, then it ends.
            self.process.send_signal(signal.SIGABRT)
            try:
                self.process.wait(timeout=STOP_BOUND)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self._drain()
            raise AssertionError(f"{sig.name} did not end memproxy within {STOP_BOUND:g} s:\n"
                                 f"{''.join(self.lines)}") from None
        took = time.monotonic() - sent
        self._drain()
        return code, "".join(self.lines), took

    def _drain(self) -> None:
        """Every line the process wrote, once it has ended (its pipe closes at exit)."""
        while (line := self._new.get(timeout=STOP_BOUND)) is not None:
            self.lines.append(line)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        assert self.process.stdout is not None
        self.process.stdout.close()


@pytest.fixture
def config(tmp_path: Path, upstream_server: FakeUpstream) -> Path:
    return write_config(tmp_path / "memproxy.yaml", upstream_server.url, sqlite_storage(tmp_path / "memproxy.db"))


@pytest.fixture(params=["sqlite", "postgres"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StorageConfig]:
    """An empty store, a SQLite file that waits up to two minutes for a lock, or a PostgreSQL schema."""
    with store_for_processes(request.param, tmp_path) as storage:
        yield storage if storage.is_postgres else replace(storage, busy_timeout_ms=120_000)


def config_for(storage: StorageConfig, folder: Path, upstream: FakeUpstream) -> Path:
    section = storage_section(storage)
    if not storage.is_postgres:
        section += f"  busy_timeout_ms: {storage.busy_timeout_ms}\n"
    return write_config(folder / "memproxy.yaml", upstream.url, section)


@contextmanager
def starting(config: Path) -> Iterator[Starting]:
    process = Starting(config)
    try:
        yield process
    finally:
        process.kill()


def assert_clean_stop(code: int, output: str, took: float) -> None:
    assert code == 0, output
    assert "Traceback" not in output, output
    assert took < STOP_BOUND


def test_stop_as_soon_as_memproxy_catches_sigterm(config: Path) -> None:
    """The handler is in place before the command's own imports (half a second) begin. (SIGINT has
    no such sign: Python catches it from its own start, as KeyboardInterrupt.)"""
    if not Path("/proc/self/status").exists():
        pytest.skip("no /proc here to see when memproxy's handler is in place")
    with starting(config) as process:
        deadline = time.monotonic() + START_TIMEOUT
        # Polls the kernel's record of the process, the only sign of this moment it gives.
        while not process.catches(signal.SIGTERM):
            assert process.process.poll() is None and time.monotonic() < deadline, "".join(process.lines)
            time.sleep(0.002)
        assert_clean_stop(*process.stop(signal.SIGTERM))
    assert not (config.parent / "memproxy.db").exists()  # it stopped before the store opened


def test_stop_right_after_spawn(config: Path) -> None:
    """Sent as soon as the process exists. Before Python runs memproxy's first line (some tens of
    milliseconds), the kernel's default action ends the process at once, with nothing opened;
    after it, memproxy's handler does, with exit code 0. Either way: at once, and quietly."""
    with starting(config) as process:
        code, output, took = process.stop(signal.SIGTERM)
    assert code in (0, -signal.SIGTERM), output
    assert "Traceback" not in output and took < STOP_BOUND
    assert not (config.parent / "memproxy.db").exists()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stop_while_litellm_is_imported(config: Path, sig: signal.Signals) -> None:
    with starting(config) as process:
        process.wait_for("starting: importing litellm")
        code, output, took = process.stop(sig)
    assert_clean_stop(code, output, took)
    assert "stopped while starting" in output
    assert "listening" not in output
    assert not (config.parent / "memproxy.db").exists()  # the import was cut short: nothing opened after it


def test_stop_while_the_store_opens(storage: StorageConfig, tmp_path: Path, upstream_server: FakeUpstream) -> None:
    """What the store needs to open is held (the SQLite file, the PostgreSQL schema's migration
    lock), so it waits there until the signal comes; what had opened then closes."""
    config = config_for(storage, tmp_path, upstream_server)
    with opening_held(storage), starting(config) as process:
        process.wait_for("starting: opening the store")
        code, output, took = process.stop(signal.SIGTERM)
    assert_clean_stop(code, output, took)
    assert "listening" not in output


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stop_once_listening(storage: StorageConfig, tmp_path: Path, upstream_server: FakeUpstream,
                             sig: signal.Signals) -> None:
    config = config_for(storage, tmp_path, upstream_server)
    db = Path(sqlite_path(storage.url)) if not storage.is_postgres else None
    with starting(config) as process:
        process.wait_for("memproxy listening on")
        assert db is None or Path(f"{db}-wal").exists()
        code, output, took = process.stop(sig)
    assert_clean_stop(code, output, took)
    assert "stopping" in output
    # SQLite removes the write-ahead log when the last connection closes: the store was closed.
    assert db is None or (db.exists() and not Path(f"{db}-wal").exists())
