"""The suite itself: a failing test ends the run with its failure, never a hang.

A test that opens a SQLite store outside a fixture and fails before closing it leaves aiosqlite's
worker thread running (the failure's traceback holds the store), and that thread is not a daemon:
without `conftest.pytest_unconfigure` the interpreter waits for it at exit, forever, and CI sees a
timeout instead of the failure. Run as a pytest of its own, with this suite's conftest as a plugin.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

PROBE = '''
import asyncio

from memproxy.config import StorageConfig
from memproxy.store import open_store


def test_fails_with_a_store_left_open(tmp_path):
    async def go():
        store = await open_store(StorageConfig(url=f"sqlite:///{tmp_path}/left-open.db"))
        assert store is None, "failed on purpose, its store left open"
    asyncio.run(go())
'''


def test_a_failure_with_a_store_left_open_ends_the_run(tmp_path: Path) -> None:
    probe = tmp_path / "test_probe.py"
    probe.write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    ran = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-o", "addopts=",
                          "-q", str(probe)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 1, ran.stdout + ran.stderr  # failed, and exited
    assert "1 failed" in ran.stdout
    assert "failed on purpose" in ran.stdout
