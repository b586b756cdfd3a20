"""The README's commands, run for real, in the order a reader meets them.

What counts as a command: every fenced block in README.md is labelled, and
- each line of a ```sh block is one command (a line ending in `\\` continues on the next; blank lines
  and lines starting with `#` are skipped, and so is a trailing ` # ...` comment);
- each ```python block is a program, run in a fresh interpreter;
- ```text (diagrams), ```ini (the systemd unit) and ```yaml blocks are not commands. The unit's
  `ExecStart` must be, with its paths mapped (UNIT_PATHS), a command this test ran.
Commands written inline in prose (`memproxy check-config -c FILE`) are synopses, not run.

Where they run: a temporary working directory holding copies of the files the README names, a fake
provider (tests/fake_upstream.py, a real HTTP server) that every model of config.example.yaml
reaches through `OPENAI_BASE_URL` and `SMALL_API_BASE`, and `memproxy` on the PATH. A `memproxy
serve` command is started with `--port 0` appended (argparse keeps the last), checked on /healthz,
and serves the commands after it, which reach it at the address the README writes (ADDRESS); it is
stopped with SIGTERM, and must exit 0, when the next one starts or at the end.

A command this test cannot run is listed in NOT_RUN with the reason, or in RUN_AS with what runs in
its place; every other command is run and must succeed, so a command added to the README is either
run or listed here. A listing whose command left the README fails too.
"""

from __future__ import annotations

import configparser
import queue
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from fake_upstream import FakeUpstream
from memproxy.config import parse_config
import processes
from processes import clean_env

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BIN = Path(sys.executable).parent

# The files the README's commands name, copied into the working directory.
FILES = ("config.example.yaml", "deploy/docker.yaml")
# The address the README's commands and clients use; the running `memproxy serve` is put in its place.
ADDRESS = "http://127.0.0.1:8080"
# Paths the README writes for a reader's machine, and what they are here.
PATHS = {".venv/bin/": f"{BIN}/"}
UNIT_PATHS = {"/opt/memproxy/bin/memproxy": "memproxy", "/etc/memproxy/config.yaml": "config.yaml"}
FENCES = {"sh", "python", "text", "ini", "yaml"}

QUICKSTART_INSTALL = ("python3 -m venv .venv && .venv/bin/pip install . && "
                      ".venv/bin/memproxy serve -c config.example.yaml")
RUN_AS: dict[str, tuple[str, str]] = {
    QUICKSTART_INSTALL: (".venv/bin/memproxy serve -c config.example.yaml",
                         "installing into a fresh virtualenv is what .ci/run does first (a minute, and "
                         "the network); the daemon it then starts is run"),
}
DOCKER = "needs a Docker daemon and a minute of building; tests/test_dockerignore.py checks what the build sends"
NOT_RUN: dict[str, str] = {
    "python3 -m venv .venv && .venv/bin/pip install '.[test]' && .venv/bin/python -m pytest":
        "the test suite itself, this test included; .ci/run runs it, installed the same way",
    "memproxy migrate-store --from sqlite:///./memproxy.db --to postgresql://memproxy@db.internal/memproxy":
        "needs a PostgreSQL server at db.internal; tests/test_postgres.py runs migrate-store into PostgreSQL",
    "sudo python3 -m venv /opt/memproxy && sudo /opt/memproxy/bin/pip install .":
        "installs into /opt as root",
    "sudo systemctl daemon-reload && sudo systemctl enable --now memproxy":
        "needs root and the machine's service manager; the unit's ExecStart is checked instead",
    "journalctl -u memproxy -f": "follows the system journal and never ends",
    "docker build -t memproxy .": DOCKER,
    "docker run -d --name memproxy -p 8080:8080 -v memproxy-data:/data -e MEMPROXY_API_KEY=change-me-please "
    "-e OPENAI_API_KEY=sk-... memproxy": DOCKER,
    "docker run -d --name memproxy -p 8080:8080 -v memproxy-data:/data -v "
    "\"$PWD/memproxy.yaml:/etc/memproxy/config.yaml:ro\" -e MEMPROXY_API_KEY=change-me-please "
    "-e OPENAI_API_KEY=sk-... memproxy": DOCKER,
    "docker exec memproxy memproxy sessions -c /etc/memproxy/config.yaml list": DOCKER,
    "pip install -e '.[bench]' && python bench/run.py":
        "about 15 minutes on 2 cores; tests/test_bench_smoke.py runs its --quick form",
}
# What some commands must print, beyond exiting 0.
EXPECT = {
    "curl -fsS http://127.0.0.1:8080/healthz": "ok",
    "memproxy sessions -c config.yaml list": "chat-42",
    "memproxy sessions -c config.yaml metadata chat-42": '"plan"',
    "memproxy sessions -c config.yaml search \"name\" --session chat-42": "Ada",
}
COMMAND_TIMEOUT = 60.0


@dataclass
class Block:
    fence: str
    text: str
    line: int  # of the opening fence, 1-based


def blocks(markdown: str) -> Iterator[Block]:
    lines = markdown.split("\n")
    opened: tuple[str, int] | None = None
    body: list[str] = []
    for number, line in enumerate(lines, 1):
        if not line.startswith("```"):
            body.append(line)
        elif opened is None:
            opened, body = (line[3:].strip(), number), []
        else:
            yield Block(opened[0], "\n".join(body), opened[1])
            opened = None
    assert opened is None, f"README.md:{opened[1]}: a fence that is never closed"


def sh_commands(text: str) -> list[str]:
    commands, pending = [], ""
    for line in text.split("\n"):
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        commands.append(re.sub(r"\s+# .*$", "", pending + line).strip())  # a trailing comment is the reader's
        pending = ""
    assert not pending, f"a continued line with nothing after it: {pending!r}"
    return commands


def mapped(command: str, address: str) -> str:
    command = command.replace(ADDRESS, address)
    for written, here in PATHS.items():
        command = command.replace(written, here)
    return command


class Daemon:
    """One `memproxy serve` started from a README command."""

    def __init__(self, command: str, cwd: Path, env: dict[str, str]) -> None:
        self.log = cwd / f"serve-{time.monotonic_ns()}.log"
        with self.log.open("w") as err:
            self.process = subprocess.Popen([*shlex.split(command), "--port", "0"], cwd=cwd, env=env,
                                            stdout=subprocess.PIPE, stderr=err, text=True)
        lines: queue.Queue[str] = queue.Queue()

        def read() -> None:
            assert self.process.stdout is not None
            while line := self.process.stdout.readline():  # blocks: read off the test's thread
                if "listening on " in line:
                    lines.put(line.split("listening on ", 1)[1].strip())
                    return
            lines.put("")

        threading.Thread(target=read, daemon=True).start()
        try:
            self.url = lines.get(timeout=COMMAND_TIMEOUT)
        except queue.Empty:
            self.stop()
            raise AssertionError(f"{command!r} did not start within {COMMAND_TIMEOUT:g} s") from None
        if not self.url:
            self.stop()
            raise AssertionError(f"{command!r} exited: {self.log.read_text()}")
        with urllib.request.urlopen(f"{self.url}/healthz", timeout=10) as response:
            assert response.status == 200

    def stop(self) -> int:
        return processes.stop(self.process)


def run(argv: str | list[str], cwd: Path, env: dict[str, str], what: str) -> str:
    result = subprocess.run(argv, shell=isinstance(argv, str), cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=COMMAND_TIMEOUT)
    assert result.returncode == 0, f"{what} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture
def upstream() -> Iterator[FakeUpstream]:
    fake = FakeUpstream().start()
    yield fake
    fake.stop()


def test_every_fence_is_labelled_with_a_known_kind() -> None:
    """An unlabelled or `bash` block would hide a command from the test below."""
    for block in blocks(README.read_text(encoding="utf-8")):
        assert block.fence in FENCES, f"README.md:{block.line}: fence {block.fence!r}, not one of {sorted(FENCES)}"


def test_every_listed_command_is_still_in_the_readme() -> None:
    commands = {c for b in blocks(README.read_text(encoding="utf-8")) if b.fence == "sh" for c in sh_commands(b.text)}
    for listed in (*NOT_RUN, *RUN_AS, *EXPECT):
        assert listed in commands, f"listed here but no longer in the README: {listed!r}"


def test_the_readme_commands_run(tmp_path: Path, upstream: FakeUpstream) -> None:
    for name in FILES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    env = clean_env(PATH=f"{BIN}:{clean_env()['PATH']}", OPENAI_API_KEY="sk-readme-test",
                    OPENAI_BASE_URL=upstream.url, SMALL_API_BASE=upstream.url)
    env.pop("OPENAI_API_BASE", None)
    daemon: Daemon | None = None
    ran: list[str] = []
    skipped: list[str] = []
    unit: configparser.ConfigParser | None = None
    try:
        for block in blocks(README.read_text(encoding="utf-8")):
            if block.fence == "ini":
                unit = configparser.ConfigParser(interpolation=None)
                unit.read_string(block.text)
                continue
            if block.fence == "python":
                assert daemon is not None, f"README.md:{block.line}: a client before any `memproxy serve`"
                run([sys.executable, "-c", mapped(block.text, daemon.url)], tmp_path, env,
                    f"the python block at README.md:{block.line}")
                continue
            if block.fence != "sh":
                continue
            for command in sh_commands(block.text):
                if command in NOT_RUN:
                    skipped.append(command)
                    continue
                runs = RUN_AS[command][0] if command in RUN_AS else command
                ran.append(runs)
                if runs.split(" -c ")[0].endswith("memproxy serve"):
                    if daemon is not None:
                        assert daemon.stop() == 0, daemon.log.read_text()
                    daemon = Daemon(mapped(runs, ADDRESS), tmp_path, env)
                    continue
                address = daemon.url if daemon is not None else ADDRESS
                output = run(mapped(runs, address), tmp_path, env, f"{command!r} (README.md:{block.line})")
                if command in EXPECT:
                    assert EXPECT[command] in output, f"{command!r} printed {output!r}"
    finally:
        stopped = daemon.stop() if daemon is not None else None
    assert daemon is not None and stopped == 0, "the last `memproxy serve` did not stop cleanly"
    print(f"\nran {len(ran)} README commands; not run: {len(skipped)} (listed with the reason in this test)")

    # The clients' conversation was real: the second question reached the provider with the first.
    questions = [r.messages for r in upstream.chat_requests()
                 if r.messages and r.messages[-1].get("content") == "What is my name?"]
    assert questions and any(m.get("content") == "My name is Ada." for m in questions[0])
    # The systemd unit starts what this test started.
    assert unit is not None, "the README has no systemd unit"
    exec_start = unit["Service"]["ExecStart"]
    for written, here in UNIT_PATHS.items():
        exec_start = exec_start.replace(written, here)
    assert exec_start in ran, f"the unit's ExecStart ({exec_start!r}) is not a command the README runs"
    # The config the Docker section mounts is a valid one, given the key the README passes.
    docker_config = (tmp_path / "memproxy.yaml").read_text(encoding="utf-8")
    config = parse_config(docker_config, {"MEMPROXY_API_KEY": "change-me-please", "OPENAI_API_KEY": "sk-..."})
    assert config.server.host == "0.0.0.0" and config.storage.url.startswith("sqlite:////data/")

