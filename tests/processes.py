"""memproxy as real processes: `memproxy serve` from a config file of the test's own, on 127.0.0.1,
port 0, returned once it prints the address it listens on, and stopped the way a service manager
stops it (SIGTERM). Used by the CLI, sessions-CLI and replica tests.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import openai

from conftest import PROXY_KEY
from db import run_async
from memproxy.config import StorageConfig
from stores import store_under_test

START_TIMEOUT = 60.0
# The memory settings most process tests want: summaries by the small model, every other default.
SUMMARIZER_SMALL = "memory:\n  summarizer_model: small\n"
ONE_KEY = f'auth:\n  keys:\n    - {{key: "{PROXY_KEY}", tenant: a}}\n'


def memproxy_command() -> list[str]:
    script = Path(sys.executable).parent / "memproxy"
    return [str(script)] if script.exists() else [sys.executable, "-c", "import sys; from memproxy.entry "
                                                  "import main; sys.exit(main())"]


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of a memproxy process: the test's, without the test suite's own settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMPROXY_TEST_")}
    env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    env.update(extra)
    return env


def write_config(
    path: Path, upstream_url: str, storage: str, *, api_key: str = "upstream-secret", big_model: bool = False,
    memory: str = SUMMARIZER_SMALL, auth: str = ONE_KEY, extra: str = "",
) -> Path:
    """A config file: `storage` is the body of its storage section (indented YAML lines); the model
    `small` (and `big`, a gpt-4o-mini, if asked) on the fake upstream."""
    big = f"""\
  - name: big
    model: openai/gpt-4o-mini
    api_base: {upstream_url}
    api_key: {api_key}
    context_window: 100000
    max_output_tokens: 1000
""" if big_model else ""
    path.write_text(f"""\
server:
  host: 127.0.0.1
  port: 0
storage:
{storage}models:
  - name: small
    model: openai/small
    api_base: {upstream_url}
    api_key: {api_key}
    context_window: 2000
    max_output_tokens: 256
{big}{memory}{auth}{extra}""", encoding="utf-8")
    return path


def sqlite_storage(db: Path) -> str:
    return f'  url: "sqlite:///{db}"\n'


def storage_section(storage: StorageConfig) -> str:
    """The storage section of a config file for `storage` (SQLite, or PostgreSQL in its schema)."""
    if not storage.is_postgres:
        return f'  url: "{storage.url}"\n'
    return f'  url: "{storage.url}"\n  schema: {storage.schema}\n  pool_max_size: {storage.pool_max_size}\n'


@contextmanager
def store_for_processes(kind: str, folder: Path) -> Iterator[StorageConfig]:
    """An empty store of `kind` for memproxy processes to share: a SQLite file in `folder`, or a fresh
    PostgreSQL schema (created by the first process to open it, dropped at the end)."""
    under_test = run_async(lambda: store_under_test(kind, folder))
    try:
        yield under_test.storage
    finally:
        run_async(under_test.drop)


@dataclass
class Served:
    process: subprocess.Popen[str]
    url: str
    log: Path  # the process's standard error

    def client(self, session: str = "s1") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=PROXY_KEY, max_retries=0,
                             default_headers={"X-Session-Id": session})

    def async_client(self, session: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=PROXY_KEY, max_retries=0,
                                  default_headers={"X-Session-Id": session})

    def stop(self) -> int:
        """SIGTERM (nothing to one already gone); the exit code."""
        return stop(self.process)


def stop(process: subprocess.Popen[str]) -> int:
    """SIGTERM to a `memproxy serve` (nothing to one already gone), SIGKILL past 30 s; its exit code."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        code = process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        code = process.wait()
    assert process.stdout is not None
    process.stdout.close()
    return code


def serve(config: Path, logs: list[Path], *args: str, env: dict[str, str] | None = None,
          cwd: Path | None = None) -> list[Served]:
    """One `memproxy serve` per log file, all launched before any is waited for (so they start, and
    migrate, at the same time); returned once each has printed its address."""
    processes = []
    for log in logs:
        with log.open("w") as err:
            processes.append(subprocess.Popen(
                [*memproxy_command(), "serve", "-c", str(config), "--port", "0", *args],
                stdout=subprocess.PIPE, stderr=err, text=True, env=env or clean_env(), cwd=cwd))
    lines: queue.Queue[tuple[int, str]] = queue.Queue()

    def read(i: int, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        while line := process.stdout.readline():  # readline blocks: read off the test's thread
            if "listening on " in line:
                lines.put((i, line.split("listening on ", 1)[1].strip()))
                return
        lines.put((i, ""))

    for i, process in enumerate(processes):
        threading.Thread(target=read, args=(i, process), daemon=True).start()
    urls: dict[int, str] = {}
    try:
        while len(urls) < len(processes):
            try:
                i, url = lines.get(timeout=START_TIMEOUT)
            except queue.Empty:
                raise AssertionError(f"memproxy did not start within {START_TIMEOUT:g} s") from None
            if not url:
                code = processes[i].wait()
                raise AssertionError(f"memproxy exited with {code}: {logs[i].read_text()}")
            urls[i] = url
    except BaseException:
        for process in processes:
            process.kill()
            process.wait()
            assert process.stdout is not None
            process.stdout.close()
        raise
    return [Served(process, urls[i], logs[i]) for i, process in enumerate(processes)]


def serve_one(config: Path, log: Path, *args: str, env: dict[str, str] | None = None,
              cwd: Path | None = None) -> Served:
    [served] = serve(config, [log], *args, env=env, cwd=cwd)
    return served
