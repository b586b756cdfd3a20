"""The `memproxy` command as a user runs it: `serve` as a real process driven by the synchronous
`openai` client, memory across a restart (on SQLite and on PostgreSQL), and config validation at
start (`check-config`, `serve`)."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit

import openai
import pytest

import processes
from conftest import PROXY_KEY
from fake_upstream import FakeUpstream
from memproxy.config import StorageConfig
from processes import Served, clean_env, memproxy_command, serve_one, storage_section, store_for_processes


def write_config(path: Path, upstream_url: str, storage: StorageConfig, extra: str = "") -> Path:
    """The upstream key comes from the environment, as a deployment would take it."""
    return processes.write_config(path, upstream_url, storage_section(storage),
                                  api_key="${MEMPROXY_TEST_UPSTREAM_KEY}", extra=extra)


def sqlite_at(path: Path) -> StorageConfig:
    return StorageConfig(url=f"sqlite:///{path}")


def start_server(config: Path, log: Path) -> Served:
    return serve_one(config, log, env=clean_env(MEMPROXY_TEST_UPSTREAM_KEY="upstream-secret"))


def run_cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*memproxy_command(), *args], capture_output=True, text=True, timeout=60,
                          env=clean_env(**env))


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def server(
    request: pytest.FixtureRequest, upstream_server: FakeUpstream, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp("cli-server")
    with store_for_processes(request.param, folder) as storage:
        running = start_server(write_config(folder / "memproxy.yaml", upstream_server.url, storage),
                               folder / "stderr.log")
        yield running
        assert running.stop() == 0, running.log.read_text()


# --- the synchronous SDK against a real process ----------------------------------------------------


def test_serve_prints_a_loopback_address(server: Served) -> None:
    assert server.url.startswith("http://127.0.0.1:")
    assert int(server.url.rsplit(":", 1)[1]) > 0  # --port 0 picked a free port and says which


def test_sync_client_non_stream_remembers(server: Served, upstream: FakeUpstream) -> None:
    with server.client(session="sync-plain") as client:
        first = client.chat.completions.create(model="small", messages=[{"role": "user", "content": "hi"}])
        assert first.choices[0].message.content == "reply 1"
        raw = client.chat.completions.with_raw_response.create(
            model="small", messages=[{"role": "user", "content": "again"}])
        second = raw.parse()
    assert raw.headers["X-Session-Id"] == "sync-plain"
    assert second.choices[0].message.content == "reply 2"
    assert upstream.last().messages == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "reply 1"},
        {"role": "user", "content": "again"},
    ]
    assert upstream.last().headers["Authorization"] == "Bearer upstream-secret"  # from ${ENV_VAR}


def test_sync_client_stream(server: Served, upstream: FakeUpstream) -> None:
    with server.client(session="sync-stream") as client:
        stream = client.chat.completions.create(model="small", stream=True,
                                                messages=[{"role": "user", "content": "count"}])
        with stream:
            chunks = [c.choices[0].delta.content or "" for c in stream if c.choices]
        assert len([c for c in chunks if c]) >= 3
        assert "".join(chunks) == "reply 1"
        client.chat.completions.create(model="small", messages=[{"role": "user", "content": "next"}])
    assert upstream.last().messages == [
        {"role": "user", "content": "count"},
        {"role": "assistant", "content": "reply 1"},  # assembled from the stream
        {"role": "user", "content": "next"},
    ]


def test_sync_client_errors(server: Served, upstream: FakeUpstream) -> None:
    with server.client() as client:
        with pytest.raises(openai.NotFoundError) as caught:
            client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
        assert caught.value.code == "model_not_found"
        assert [m.id for m in client.models.list().data] == ["small"]
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong-key-here", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    assert upstream.received == []


# --- restart ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_memory_survives_a_restart(upstream: FakeUpstream, tmp_path: Path, kind: str) -> None:
    with store_for_processes(kind, tmp_path) as storage:
        if kind == "sqlite":  # in a folder that does not exist yet
            storage = sqlite_at(tmp_path / "data" / "memproxy.db")
        restart(upstream, write_config(tmp_path / "memproxy.yaml", upstream.url, storage), tmp_path)
    if kind == "sqlite":
        assert (tmp_path / "data" / "memproxy.db").exists()


def restart(upstream: FakeUpstream, config: Path, tmp_path: Path) -> None:
    first = start_server(config, tmp_path / "first.log")
    try:
        with first.client(session="durable") as client:
            client.chat.completions.create(
                model="small", messages=[{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "my name is Ada"}])
    finally:
        assert first.stop() == 0, first.log.read_text()

    second = start_server(config, tmp_path / "second.log")
    try:
        assert second.url != "" and second.process.pid != first.process.pid
        with second.client(session="durable") as client:
            client.chat.completions.create(model="small",
                                           messages=[{"role": "user", "content": "what is my name?"}])
    finally:
        assert second.stop() == 0, second.log.read_text()
    assert upstream.last().messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "my name is Ada"},
        {"role": "assistant", "content": "reply 1"},
        {"role": "user", "content": "what is my name?"},
    ]


# --- config validation --------------------------------------------------------------------------


def test_check_config_accepts_a_good_file(tmp_path: Path) -> None:
    config = write_config(tmp_path / "ok.yaml", "http://127.0.0.1:9/v1", sqlite_at(tmp_path / "x.db"))
    result = run_cli("check-config", "-c", str(config), MEMPROXY_TEST_UPSTREAM_KEY="k")
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout and "1 models" in result.stdout
    assert not (tmp_path / "x.db").exists()  # checking a config opens no store


def test_check_config_accepts_the_example(tmp_path: Path) -> None:
    example = Path(__file__).resolve().parent.parent / "config.example.yaml"
    result = run_cli("check-config", "-c", str(example))
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("extra, replace, message", [
    ("", ("context_window: 2000", "context_window: lots"),
     "models[0].context_window: must be an integer, got 'lots'"),
    ("", ("port: 0", "port: 70000"), "server.port: must be <= 65535"),
    ("", ("api_key: ${MEMPROXY_TEST_UPSTREAM_KEY}", "api_key: ${MEMPROXY_TEST_UNSET}"),
     "models[0].api_key: environment variable MEMPROXY_TEST_UNSET is not set"),
    ("", ("port: 0", "port: 0\n  hots: 0.0.0.0"), "server.hots: unknown key"),
    ("colour: blue\n", ("", ""), "colour: unknown key"),
    ("", ("summarizer_model: small", "summarizer_model: large"), "memory.summarizer_model: 'large'"),
    ("", ("model: openai/small", "modle: openai/small"), "models[0].model: is required"),
], ids=["not-an-integer", "port-range", "unset-env-var", "unknown-nested-key", "unknown-top-key",
        "unknown-summarizer", "typo-in-required-key"])
def test_bad_config_is_reported_by_key(
    tmp_path: Path, extra: str, replace: tuple[str, str], message: str
) -> None:
    config = write_config(tmp_path / "bad.yaml", "http://127.0.0.1:9/v1", sqlite_at(tmp_path / "x.db"), extra)
    config.write_text(config.read_text().replace(*replace, 1))
    result = run_cli("check-config", "-c", str(config), MEMPROXY_TEST_UPSTREAM_KEY="k")
    assert result.returncode == 2
    assert message in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("command", ["check-config", "serve"])
def test_check_config_refuses_what_serve_refuses_a_window_litellm_does_not_know(tmp_path: Path, command: str) -> None:
    config = write_config(tmp_path / "ollama.yaml", "http://127.0.0.1:9/v1", sqlite_at(tmp_path / "x.db"))
    config.write_text(config.read_text().replace("model: openai/small", "model: ollama/some-local-model")
                      .replace("context_window: 2000", "context_window: null"))
    result = run_cli(command, "-c", str(config), "--port", "0", MEMPROXY_TEST_UPSTREAM_KEY="k") \
        if command == "serve" else run_cli(command, "-c", str(config), MEMPROXY_TEST_UPSTREAM_KEY="k")
    assert result.returncode == 2, result.stderr
    assert "models[0].context_window: litellm knows no context window for 'ollama/some-local-model'" in result.stderr
    assert str(config) in result.stderr or command == "serve"
    # Known to litellm's local model info, the window may be left out.
    config.write_text(config.read_text().replace("ollama/some-local-model", "openai/gpt-4o-mini"))
    if command == "check-config":
        assert run_cli(command, "-c", str(config), MEMPROXY_TEST_UPSTREAM_KEY="k").returncode == 0


def test_light_commands_start_without_the_server_the_planner_or_litellm(tmp_path: Path) -> None:
    """A command imports what it needs when it runs (memproxy.cli): `migrate` and the `sessions`
    verbs but `context` start with the config and the store alone, not aiohttp's server, the
    planner (numpy) or litellm, in about half the time."""
    config = tmp_path / "memproxy.yaml"
    config.write_text(f"storage:\n  url: sqlite:///{tmp_path / 'memproxy.db'}\n", encoding="utf-8")
    code = ("import sys; from memproxy.entry import main\n"
            "for args in (['migrate'], ['sessions', 'list'], ['sessions', 'usage'], ['sessions', 'search', 'x']):\n"
            "    assert main([*args[:1], '-c', 'memproxy.yaml', *args[1:]]) == 0, args\n"
            "heavy = [m for m in ('aiohttp', 'numpy', 'litellm') if m in sys.modules]\n"
            "assert not heavy, heavy")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            cwd=tmp_path, env=clean_env())
    assert result.returncode == 0, result.stderr


def test_check_config_reports_a_missing_file(tmp_path: Path) -> None:
    result = run_cli("check-config", "-c", str(tmp_path / "absent.yaml"))
    assert result.returncode == 2
    assert "absent.yaml" in result.stderr and "cannot read" in result.stderr


def test_serve_validates_the_config_before_starting(tmp_path: Path) -> None:
    config = write_config(tmp_path / "bad.yaml", "http://127.0.0.1:9/v1", sqlite_at(tmp_path / "x.db"))
    config.write_text(config.read_text().replace("context_window: 2000", "context_window: -5"))
    result = run_cli("serve", "-c", str(config), "--port", "0", MEMPROXY_TEST_UPSTREAM_KEY="k")
    assert result.returncode == 2
    assert "models[0].context_window: must be >= 1" in result.stderr
    assert "listening" not in result.stdout
    assert not (tmp_path / "x.db").exists()


@pytest.mark.parametrize("in_config", [False, True], ids=["host-flag", "host-in-config"])
def test_serve_refuses_a_public_address_without_keys(tmp_path: Path, in_config: bool) -> None:
    config = write_config(tmp_path / "open.yaml", "http://127.0.0.1:9/v1", sqlite_at(tmp_path / "x.db"))
    text = (config.read_text().replace(f'    - {{key: "{PROXY_KEY}", tenant: a}}\n', "")
            .replace("  keys:\n", "  keys: []\n"))
    config.write_text(text.replace("host: 127.0.0.1", "host: 0.0.0.0") if in_config else text)
    checked = run_cli("check-config", "-c", str(config), MEMPROXY_TEST_UPSTREAM_KEY="k")
    if in_config:  # check-config refuses what serve would
        assert checked.returncode == 2
        assert f"{config}: server.host: refusing to bind 0.0.0.0 with no auth.keys configured" in checked.stderr
    else:  # the address comes from serve's flag, which check-config does not see
        assert checked.returncode == 0, checked.stderr
    host = [] if in_config else ["--host", "0.0.0.0"]
    result = run_cli("serve", "-c", str(config), *host, "--port", "0", MEMPROXY_TEST_UPSTREAM_KEY="k")
    assert result.returncode == 2
    assert "server.host: refusing to bind 0.0.0.0" in result.stderr
    assert "listening" not in result.stdout
    assert not (tmp_path / "x.db").exists()  # it stopped before opening anything


def check_then_serve(config: Path) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
    """`check-config` and `serve` on one file, which both must refuse."""
    checked = run_cli("check-config", "-c", str(config), MEMPROXY_TEST_UPSTREAM_KEY="k")
    served = run_cli("serve", "-c", str(config), "--port", "0", MEMPROXY_TEST_UPSTREAM_KEY="k")
    for result in (checked, served):
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr and "listening" not in result.stdout
    return checked, served


@pytest.mark.parametrize("where, why", [
    ("file/x.db", "cannot create {dir}/file/x.db: {dir}/file is not a folder"),
    ("not-sqlite.db", "{dir}/not-sqlite.db is not a SQLite database"),
    ("folder", "{dir}/folder is not a file"),
], ids=["folder-is-a-file", "not-a-database", "a-folder"])
def test_a_sqlite_file_serve_cannot_open_is_refused_by_both(tmp_path: Path, where: str, why: str) -> None:
    (tmp_path / "file").write_text("a file, not a folder")
    (tmp_path / "not-sqlite.db").write_text("some text, not a database")
    (tmp_path / "folder").mkdir()
    config = write_config(tmp_path / "bad.yaml", "http://127.0.0.1:9/v1", sqlite_at(tmp_path / where))
    for result in check_then_serve(config):
        assert f"{config}: storage.url: {why.format(dir=tmp_path)}" in result.stderr
    assert (tmp_path / "not-sqlite.db").read_text() == "some text, not a database"


def test_check_config_accepts_a_sqlite_file_in_folders_serve_will_create(tmp_path: Path) -> None:
    config = write_config(tmp_path / "ok.yaml", "http://127.0.0.1:9/v1", sqlite_at(tmp_path / "a" / "b" / "x.db"))
    result = run_cli("check-config", "-c", str(config), MEMPROXY_TEST_UPSTREAM_KEY="k")
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "a").exists()  # checked, not created


def test_an_unreachable_postgresql_is_refused_by_both_without_its_password(tmp_path: Path) -> None:
    with socket.socket() as held:  # a port bound but not listening: connections to it are refused
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        url = f"postgresql://memproxy:hunter2-secret@127.0.0.1:{port}/memproxy"
        config = write_config(tmp_path / "pg.yaml", "http://127.0.0.1:9/v1", StorageConfig(url=url))
        for result in check_then_serve(config):
            assert f"{config}: storage.url: cannot connect to PostgreSQL: ConnectionRefusedError" in result.stderr
            assert "hunter2" not in result.stderr + result.stdout


def test_check_config_reaches_postgresql_and_hides_its_password(tmp_path: Path) -> None:
    with store_for_processes("postgres", tmp_path) as storage:
        config = write_config(tmp_path / "pg.yaml", "http://127.0.0.1:9/v1", storage)
        result = run_cli("check-config", "-c", str(config), MEMPROXY_TEST_UPSTREAM_KEY="k")
        assert result.returncode == 0, result.stderr
        assert "store postgresql://" in result.stdout
        # With a password in the URL (a server that trusts this address ignores it): never shown.
        parts = urlsplit(storage.url)
        password = parts.password or "pw-never-shown"
        url = parts._replace(netloc=f"{parts.username}:{password}@{parts.hostname}:{parts.port}").geturl()
        config = write_config(tmp_path / "pg.yaml", "http://127.0.0.1:9/v1", replace(storage, url=url))
        result = run_cli("check-config", "-c", str(config), MEMPROXY_TEST_UPSTREAM_KEY="k")
        assert password not in result.stdout + result.stderr
        assert result.returncode == 2 or ":***@" in result.stdout, result.stderr


def test_check_config_reports_every_failure_by_key(tmp_path: Path) -> None:
    """All of them, each naming its key, not only the first; serve refuses the same."""
    (tmp_path / "file").write_text("a file, not a folder")
    config = tmp_path / "bad.yaml"
    config.write_text(f"""\
server:
  host: 0.0.0.0
storage:
  url: "sqlite:///{tmp_path}/file/x.db"
models:
  - name: small
    model: openai/small
    context_window: 2000
  - name: local
    model: ollama/some-local-model
""", encoding="utf-8")
    for result in check_then_serve(config):
        lines = result.stderr.splitlines()
        assert [line.split(": ")[3] for line in lines] == ["server.host", "storage.url", "models[1].context_window"]
        assert all(line.startswith(f"memproxy: config error: {config}: ") for line in lines)


def test_a_store_or_file_the_cli_cannot_open_is_one_line_never_a_traceback(tmp_path: Path) -> None:
    """Operators' mistakes get a line saying what failed and a non-zero exit, and a command whose
    target store cannot be reached exits instead of hanging on the source it had opened."""
    with socket.socket() as held:  # a port bound but not listening: connections to it are refused
        held.bind(("127.0.0.1", 0))
        unreachable = f"postgresql://memproxy:hunter2-secret@127.0.0.1:{held.getsockname()[1]}/memproxy"
        source = f"sqlite:///{tmp_path / 'source.db'}"
        config = write_config(tmp_path / "sqlite.yaml", "http://127.0.0.1:9/v1", StorageConfig(url=source))
        assert run_cli("sessions", "-c", str(config), "list", MEMPROXY_TEST_UPSTREAM_KEY="k").returncode == 0
        pg = write_config(tmp_path / "pg.yaml", "http://127.0.0.1:9/v1", StorageConfig(url=unreachable))
        missing = tmp_path / "typo" / "source.db"
        for args, words in [
            (("migrate-store", "--from", source, "--to", unreachable), "Connect call failed"),
            (("migrate-store", "--from", f"sqlite:///{missing}", "--to", source), "does not exist"),
            (("migrate-store", "--from", "mysql://x", "--to", source), "not a sqlite URL"),
            (("sessions", "-c", str(pg), "list"), "Connect call failed"),
            (("sessions", "-c", str(config), "import", str(tmp_path / "absent.jsonl")), "No such file"),
        ]:
            result = run_cli(*args, MEMPROXY_TEST_UPSTREAM_KEY="k")
            assert result.returncode == 1 and words in result.stderr, (args, result.stderr)
            assert "Traceback" not in result.stderr and "hunter2" not in result.stderr, args
        assert not missing.parent.exists()  # a mistyped source is never made


@pytest.mark.parametrize(("text", "why"), [
    (b'storage:\n  url: "postgresql://[::1"\n', "storage.url: cannot connect to PostgreSQL: the URL is not valid"),
    (b"models: []\n# caf\xe9\n", "not UTF-8 text"),
], ids=["url-that-is-not-one", "not-utf-8"])
def test_check_config_reports_a_file_it_cannot_read_as_a_config_error(tmp_path: Path, text: bytes, why: str) -> None:
    config = tmp_path / "memproxy.yaml"
    config.write_bytes(text)
    result = run_cli("check-config", "-c", str(config))
    assert result.returncode == 2 and why in result.stderr and "Traceback" not in result.stderr, result.stderr
