"""The processes a run starts: the fake upstream, memproxy, and LiteLLM's proxy in its own virtualenv.

Each is a child process in a session of its own, bound to 127.0.0.1, so stopping it stops its
workers too (LiteLLM forks one per core). `Processes` owns them all and stops every one at exit.
LiteLLM's proxy is installed by pip into `bench/.venv-litellm` on first use (pinned below); a failed
install is reported, never faked.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import psutil

BENCH = Path(__file__).resolve().parent
LITELLM_PIN = "1.100.5"  # the release memproxy itself runs on; 1.82.7/1.82.8 must never be installed
LITELLM_VENV = BENCH / ".venv-litellm"


@dataclass
class Server:
    name: str
    url: str  # base URL, e.g. http://127.0.0.1:1234
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def tree(self) -> list[psutil.Process]:
        """The process and its workers."""
        try:
            root = psutil.Process(self.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def cpu_seconds(self) -> float:
        total = 0.0
        for proc in self.tree():
            try:
                times = proc.cpu_times()
                total += times.user + times.system
            except psutil.NoSuchProcess:
                pass
        return total

    def rss_bytes(self) -> int:
        total = 0
        for proc in self.tree():
            try:
                total += proc.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total

    def stop(self) -> None:
        if self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)  # the group this process leads: it and its workers
        except ProcessLookupError:
            return
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(5)


@dataclass(frozen=True)
class Launch:
    """A server to start (`Processes.start`)."""

    name: str
    argv: list[str]
    env: dict[str, str] | None = None
    ready_line: str | None = None  # ready once it prints a line starting so (its last word: its URL)
    health_url: str | None = None  # ready once this answers 200
    url: str = ""


@dataclass
class Processes:
    workdir: Path
    servers: list[Server] = field(default_factory=list)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None,
              ready_line: str | None = None, health_url: str | None = None, url: str = "",
              timeout: float = 120.0) -> Server:
        """Start `argv`; it is ready when it prints a line starting with `ready_line` (whose last
        word is its URL) or when `health_url` answers 200."""
        return self.start_all([Launch(name, argv, env, ready_line, health_url, url)], timeout)[0]

    def start_all(self, launches: list[Launch], timeout: float = 120.0) -> list[Server]:
        """Start every one of `launches` at once, then wait until each is ready: servers that each
        import litellm (seconds of CPU) start side by side instead of one after another."""
        started = []
        for launch in launches:
            log = open(self.workdir / f"{launch.name}.log", "ab")
            process = subprocess.Popen(
                launch.argv, stdout=subprocess.PIPE if launch.ready_line else log, stderr=log,
                stdin=subprocess.DEVNULL, env={**os.environ, **(launch.env or {})}, start_new_session=True,
                cwd=self.workdir,
            )
            server = Server(launch.name, launch.url, process, self.workdir / f"{launch.name}.log")
            self.servers.append(server)
            started.append((launch, server, log))
        try:
            for launch, server, log in started:
                if launch.ready_line:
                    assert server.process.stdout is not None
                    server.url = _wait_for_line(launch.name, server.process, server.process.stdout,
                                                launch.ready_line, timeout, log).split()[-1]
                if launch.health_url:
                    _wait_for_health(launch.name, server.process, launch.health_url, timeout)
        except Exception:
            for _, server, _ in started:
                server.stop()
            raise
        return [server for _, server, _ in started]

    def stop_all(self) -> None:
        for server in reversed(self.servers):
            server.stop()


def _wait_for_line(name: str, process: subprocess.Popen[bytes], stream: IO[bytes], prefix: str,
                   timeout: float, log: IO[bytes]) -> str:
    found: list[str] = []
    done = threading.Event()

    def read() -> None:
        for raw in stream:
            line = raw.decode(errors="replace").strip()
            if not found and line.startswith(prefix):
                found.append(line)
                done.set()
            else:
                log.write(raw)
                log.flush()
        done.set()

    threading.Thread(target=read, daemon=True).start()  # keeps draining stdout afterwards
    if not done.wait(timeout) or not found:
        raise RuntimeError(f"{name} did not start (exit {process.poll()}); see its log")
    return found[0]


def _wait_for_health(name: str, process: subprocess.Popen[bytes], url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode} while starting; see its log")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer within {timeout:.0f} s")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_upstream(processes: Processes) -> Server:
    return processes.start("upstream", [sys.executable, str(BENCH / "upstream.py"), "--port", "0"],
                           ready_line="listening on")


def start_memproxy(processes: Processes, name: str, config: Path) -> Server:
    return start_memproxies(processes, [(name, config)])[0]


def start_memproxies(processes: Processes, configs: list[tuple[str, Path]]) -> list[Server]:
    """memproxies of the given names and configs, started side by side."""
    return processes.start_all([Launch(name, [sys.executable, "-m", "memproxy.cli", "serve", "-c", str(config),
                                              "--port", "0"],
                                       env={"LITELLM_LOCAL_MODEL_COST_MAP": "True"},
                                       ready_line="memproxy listening on") for name, config in configs])


def litellm_executable() -> tuple[Path | None, str]:
    """LiteLLM's proxy CLI in its own virtualenv, installed if missing; else None and why."""
    exe = LITELLM_VENV / "bin" / "litellm"
    python = LITELLM_VENV / "bin" / "python"
    if exe.exists() and _installed_version(python) == LITELLM_PIN:
        return exe, f"litellm[proxy]=={LITELLM_PIN} in {LITELLM_VENV.relative_to(BENCH.parent)}"
    print(f"bench: installing litellm[proxy]=={LITELLM_PIN} into {LITELLM_VENV} (once; a few minutes)",
          flush=True)
    try:
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(LITELLM_VENV)], check=True,
                           capture_output=True, timeout=300)
        done = subprocess.run([str(python), "-m", "pip", "install", "-q", f"litellm[proxy]=={LITELLM_PIN}"],
                              capture_output=True, text=True, timeout=1500)
    except (subprocess.SubprocessError, OSError) as exc:
        return None, f"could not create the virtualenv for LiteLLM's proxy: {exc}"
    if done.returncode != 0 or not exe.exists():
        tail = " ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        return None, f"pip install litellm[proxy]=={LITELLM_PIN} failed: {tail[-400:]}"
    return exe, f"litellm[proxy]=={LITELLM_PIN} in {LITELLM_VENV.relative_to(BENCH.parent)} (installed now)"


def _installed_version(python: Path) -> str | None:
    if not python.exists():
        return None
    done = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
                          capture_output=True, text=True, timeout=60)
    return done.stdout.strip() if done.returncode == 0 else None


LITELLM_ENV = {
    # Production settings from LiteLLM's "best practices for production" page: no .env loading,
    # error-level logs only, JSON logs; no database, so no spend or error logs are written.
    "LITELLM_MODE": "PRODUCTION",
    "LITELLM_LOG": "ERROR",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "JSON_LOGS": "True",
}


# The proxy's settings besides its model and master key: written into its config and stated in the
# report from this one place.
LITELLM_SETTINGS: dict[str, dict[str, Any]] = {
    "general_settings": {"proxy_batch_write_at": 60, "disable_error_logs": True},
    "litellm_settings": {"request_timeout": 600, "set_verbose": False, "json_logs": True},
}


def litellm_config(upstream: str, master_key: str) -> str:
    config = {
        "model_list": [{"model_name": "bench", "litellm_params": {
            "model": "openai/bench-model", "api_base": f"{upstream}/v1", "api_key": "upstream-key"}}],
        "general_settings": {"master_key": master_key, **LITELLM_SETTINGS["general_settings"]},
        "litellm_settings": LITELLM_SETTINGS["litellm_settings"],
    }
    return json.dumps(config, indent=2)  # YAML is a superset of JSON


def litellm_settings_text() -> str:
    """`master key, proxy_batch_write_at 60, ...; no database`: the settings as `litellm_config` writes them."""
    settings = [f"{key} {json.dumps(value)}" for section in LITELLM_SETTINGS.values() for key, value in section.items()]
    database = "a database" if "database_url" in LITELLM_SETTINGS["general_settings"] else "no database"
    return f"master key, {', '.join(settings)}; {database}"


def start_litellm(processes: Processes, exe: Path, config: Path, workers: int) -> Server:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    return processes.start(
        "litellm-proxy",
        [str(exe), "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
         "--num_workers", str(workers)],
        env=LITELLM_ENV, health_url=f"{url}/health/liveliness", url=url, timeout=180,
    )
