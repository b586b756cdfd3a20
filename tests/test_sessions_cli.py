"""`memproxy sessions ...` (issue 4) on the store of a running server.

One `memproxy serve` process runs for the module on each store, a SQLite file and a PostgreSQL
schema (at log level DEBUG, so its log shows whatever could leak); the tests chat with it through the
synchronous `openai` SDK, then run the CLI on the same store while the server keeps running, and check the CLI's tables, its `--json` output, what the server sends upstream
afterwards, and the database itself (`tests/db.py`). Every session id is unique to its test, as the
store is shared.

The CLI runs in the test's process, through `memproxy.entry.main` as the installed `memproxy` script
calls it, its standard streams swapped for strings: as a process of its own each call costs half a
second of imports (three for `context`, which imports litellm), some 40 s a store for this module.
Where the process itself is what is tested (a reader that closes the pipe), it is one.
"""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

import db
from conftest import OTHER_KEY, PROXY_KEY
from fake_upstream import FakeUpstream, Reply
from memproxy.config import StorageConfig
from memproxy.entry import main as memproxy_main
from processes import Served, clean_env, memproxy_command, serve_one, storage_section, store_for_processes, write_config

Message = dict[str, Any]
ADMIN_KEY = "cli-admin-key-123"
SYSTEM: Message = {"role": "system", "content": "You are terse."}


def user(text: str) -> Message:
    return {"role": "user", "content": text}


def assistant(text: str) -> Message:
    return {"role": "assistant", "content": text}


# --- the server and the CLI ---------------------------------------------------------------------


@dataclass
class Setup:
    server: Served
    config: Path
    storage: StorageConfig
    printed: list[str]  # the server's standard output so far

    def server_output(self) -> str:
        """Everything the server logged (standard error) and printed (standard output) so far."""
        return self.server.log.read_text(encoding="utf-8") + "".join(self.printed)

    def chat(self, session: str, messages: list[Message], key: str = PROXY_KEY, model: str = "small",
             **headers: str) -> str:
        with openai.OpenAI(base_url=f"{self.server.url}/v1", api_key=key, max_retries=0,
                           default_headers={"X-Session-Id": session, **headers}) as client:
            sent: Any = messages
            completion = client.chat.completions.create(model=model, messages=sent)
        return completion.choices[0].message.content or ""

    def http(self, method: str, path: str, key: str = PROXY_KEY, **kwargs: Any) -> httpx.Response:
        with httpx.Client(base_url=f"{self.server.url}/v1", headers={"Authorization": f"Bearer {key}"}) as client:
            return client.request(method, path, **kwargs)

    def sessions(self, *args: str, stdin: str | None = None, ok: bool = True) -> subprocess.CompletedProcess[str]:
        """`memproxy sessions -c CONFIG ARGS...`; asserts it succeeded (or failed, `ok=False`)."""
        argv = ["sessions", "-c", str(self.config), *args]
        out, err, was_stdin = io.StringIO(), io.StringIO(), sys.stdin
        sys.stdin = io.StringIO(stdin or "")
        try:
            with redirect_stdout(out), redirect_stderr(err):
                code = memproxy_main(argv)
        finally:
            sys.stdin = was_stdin
        result = subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())
        if ok:
            assert result.returncode == 0, result.stderr
        else:
            assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
            assert result.stdout == ""
        return result

    def json(self, *args: str, tenant: str = "a") -> Any:
        return json.loads(self.sessions("--tenant", tenant, "--json", *args).stdout)

    def count(self, sql: str, *params: Any) -> int:
        """The one number `sql` selects, read from the store by a connection of the test's own."""
        [(value,)] = db.rows(self.storage, sql, *params)
        return int(value)


AUTH = f"""\
auth:
  keys:
    - {{key: "{PROXY_KEY}", tenant: a}}
    - {{key: "{OTHER_KEY}", tenant: b}}
  admin_keys: ["{ADMIN_KEY}"]
"""


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def setup(
    request: pytest.FixtureRequest, upstream_server: FakeUpstream, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Setup]:
    folder = tmp_path_factory.mktemp("sessions-cli")
    with store_for_processes(request.param, folder) as storage:
        yield from _serve(upstream_server, folder, storage)


def _serve(upstream_server: FakeUpstream, folder: Path, storage: StorageConfig) -> Iterator[Setup]:
    config = write_config(folder / "memproxy.yaml", upstream_server.url, storage_section(storage),
                          big_model=True, auth=AUTH)
    server = serve_one(config, folder / "server.log", "--log-level", "DEBUG")
    # At DEBUG litellm prints to standard output: drain it, or the server blocks on a full pipe.
    stdout = server.process.stdout
    assert stdout is not None
    printed: list[str] = []
    drain = threading.Thread(target=lambda: printed.extend(stdout), name="drain-server-stdout", daemon=True)
    drain.start()
    try:
        yield Setup(server, config, storage, printed)
    finally:
        server.process.send_signal(signal.SIGTERM)
        code = server.process.wait(timeout=30)
        drain.join(10)
        server.stop()
    assert code == 0, server.log.read_text()


@pytest.fixture
def cli(setup: Setup, upstream: FakeUpstream) -> Setup:
    """The module's server and CLI, with the fake upstream reset for the test."""
    return setup


# --- list and show ------------------------------------------------------------------------------


def test_list_as_a_table_and_as_json_with_pages(cli: Setup, upstream: FakeUpstream) -> None:
    upstream.enqueue(*[Reply(content=f"answer {i}", usage={"prompt_tokens": 1000, "completion_tokens": 200})
                       for i in range(4)])
    cli.chat("list-1", [user("Plan a trip to Kyoto " + "with many stops " * 10)], model="big")
    cli.chat("list-2", [user("second conversation")])
    cli.chat("list-2", [user("more of it")])
    cli.chat("list-b", [user("tenant b's")], key=OTHER_KEY)

    listed = cli.json("list")
    mine = [s for s in listed["data"] if s["id"].startswith("list-")]
    assert [s["id"] for s in mine] == ["list-2", "list-1"]  # newest activity first, tenant a only
    first, second = mine[1], mine[0]
    assert first["title"] == ("Plan a trip to Kyoto " + "with many stops " * 10)[:100]
    assert (first["message_count"], second["message_count"]) == (2, 4)
    assert first["usage"]["prompt_tokens"] == 1000 and first["usage"]["cost"] > 0
    assert second["usage"]["cost"] is None and second["usage"]["turns"] == 2
    assert second["tokens_stored"] == cli.count(
        "SELECT sum(tokens) FROM messages m JOIN sessions s ON s.pk = m.session_pk"
        " WHERE s.tenant = 'a' AND s.session_id = 'list-2' AND m.active = 1")

    # Pages of one, followed with the printed cursor, list every session exactly once.
    seen: list[str] = []
    page = cli.json("list", "--limit", "1")
    while True:
        seen += [s["id"] for s in page["data"]]
        if page["next"] is None:
            break
        page = cli.json("list", "--limit", "1", "--after", page["next"])
    assert seen == [s["id"] for s in listed["data"]] and len(set(seen)) == len(seen)

    # For people: an aligned table of every tenant, with a hint for the next page.
    table = cli.sessions("list", "--limit", "2").stdout.splitlines()
    header = table[0]
    assert header.split() == ["TENANT", "SESSION", "UPDATED", "(UTC)", "MESSAGES", "TOKENS", "SPENT",
                              "SUMMARY", "TITLE"]
    assert table[3].startswith("more: --after ") and len(table) == 4
    table += cli.sessions("list", "--limit", "2", "--after", table[3].split()[-1]).stdout.splitlines()[1:]
    rows = {line.split()[1]: line for line in table[1:3] + table[4:5]}
    assert list(rows) == ["list-b", "list-2", "list-1"]
    assert rows["list-b"].startswith("b ") and rows["list-2"].startswith("a ")
    for line in rows.values():  # the columns line up under their headings
        assert line.index(line.split()[1]) == header.index("SESSION")
        assert line[header.index("UPDATED"):].split()[0].startswith("20")  # a date, e.g. 2026-11-22
    assert rows["list-1"][header.index("MESSAGES"):].split()[0] == "2"
    assert rows["list-1"][header.index("SPENT"):].split()[0] == "1200"
    assert rows["list-1"].endswith("Plan a trip to Kyoto with many stops wit")  # titles cut to 40
    assert cli.json("list", "--limit", "3", tenant="b")["data"][0]["id"] == "list-b"
    # --tenant and --json after the verb too.
    after_verb = json.loads(cli.sessions("list", "--limit", "3", "--tenant", "b", "--json").stdout)
    assert after_verb == cli.json("list", "--limit", "3", tenant="b")
    assert cli.sessions("list", "--limit", "0", ok=False).stderr == (
        "memproxy: 'limit' must be an integer from 1 to 1000\n")
    assert cli.sessions("list", "--after", "yesterday", ok=False).stderr == (
        "memproxy: 'after' is not a cursor this API returned\n")


def test_show_as_a_table_and_as_json(cli: Setup, upstream: FakeUpstream) -> None:
    history = [SYSTEM, user("q1")]
    history.append(assistant(cli.chat("show-1", history)))
    history.append(user("q2"))
    history.append(assistant(cli.chat("show-1", history)))
    cli.chat("show-1", history[:3] + [user("q2, edited")])  # supersedes q2 and its answer
    assert cli.http("PUT", "/sessions/show-1/metadata", json={"step": "waiting", "city": "Oslo"}).status_code == 200

    shown = cli.json("show", "show-1")
    over_http = cli.http("GET", "/sessions/show-1").json()
    assert shown == over_http  # the CLI and the API say the same
    assert [m["message"] for m in shown["messages"]] == [user("q1"), assistant("reply 1"), user("q2, edited"),
                                                          assistant("reply 3")]
    assert [[m["message"] for m in b["messages"]] for b in shown["superseded"]] == [[user("q2"),
                                                                                     assistant("reply 2")]]
    assert shown["metadata"] == {"step": "waiting", "city": "Oslo"}

    text = cli.sessions("--tenant", "a", "show", "show-1").stdout.splitlines()
    assert text[0].startswith("session show-1 (tenant a): 4 messages")
    assert text[1] == "  [system] You are terse."
    assert [line.split(None, 2) for line in text[2:6]] == [
        ["0", "user", "q1"], ["1", "assistant", "reply 1"], ["2", "user", "q2, edited"], ["3", "assistant", "reply 3"]]
    assert text[6] == "  superseded branch from position 2: 2 messages"
    assert text[7] == "  metadata keys: city, step"  # keys only: the values are the agent's
    # Then each turn, with what its request was made of.
    assert [line.split()[:3] for line in text[8:]] == [["turn", "1", "new"], ["turn", "2", "continue"],
                                                       ["turn", "3", "edit"]]
    assert text[10].endswith(": 2 stored from position 0; left out 0 (0 unsummarised); 0 trimmed, 0 deduplicated")
    assert shown["turns"][2]["sent"]["stored_included"] == 2 and shown["turns"][2]["stored_from_position"] == 2
    assert "Oslo" not in "\n".join(text)


def test_what_clients_wrote_reaches_the_terminal_escaped(cli: Setup, upstream: FakeUpstream) -> None:
    """Messages, titles and metadata keys are the clients' text: escape sequences in them would set
    the operator's terminal title, clear it, overwrite lines, or write the clipboard (OSC 52), and a
    bidi override would show text in another order. Shown escaped in every table; JSON as it is."""
    hostile = "pay \x1b]0;owned\x07now\x1b[2J \u202eevil\r\x9b31m"
    cli.chat("terminal-1", [user(hostile)])
    assert cli.http("PUT", "/sessions/terminal-1/metadata", json={"key\x1b[1A": 1}).status_code == 200
    outputs = [cli.sessions("--tenant", "a", *args).stdout
               for args in (["show", "terminal-1"], ["list"], ["search", "pay", "--session", "terminal-1"])]
    for out in outputs:
        assert not any(c in out for c in "\x1b\x07\r\x9b\u202e"), out
    shown = outputs[0]
    assert "pay \\u001b]0;owned\\u0007now\\u001b[2J \\u202eevil\\u000d\\u009b31m" in shown
    assert "metadata keys: key\\u001b[1A" in shown
    assert cli.json("show", "terminal-1")["messages"][0]["message"]["content"] == hostile


def test_output_its_reader_stops_reading_ends_quietly(cli: Setup, upstream: FakeUpstream) -> None:
    """`memproxy sessions --json show big | head`: more than a pipe holds, and the reader goes."""
    cli.chat("piped", [user("x " * 40_000)], model="big")
    process = subprocess.Popen([*memproxy_command(), "sessions", "-c", str(cli.config), "--tenant", "a", "--json",
                                "show", "piped"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=clean_env())
    assert process.stdout is not None and process.stderr is not None
    with process.stderr:
        assert process.stdout.read(10)
        process.stdout.close()
        error = process.stderr.read()
    assert process.wait(timeout=60) == 1
    assert error == b""  # no "memproxy: Broken pipe"


def test_a_session_of_another_tenant_or_none_is_an_error(cli: Setup, upstream: FakeUpstream) -> None:
    cli.chat("private-1", [user("mine")])
    for verb in (["show"], ["export"], ["rm"], ["clear"], ["fork"], ["context"]):
        args = [*verb, "private-1", *(["private-2"] if verb == ["fork"] else [])]
        result = cli.sessions("--tenant", "b", *args, ok=False)
        assert result.stderr == "memproxy: no session 'private-1' in tenant 'b'\n"
    assert cli.sessions("--tenant", "a", "show", "nobody", ok=False).stderr == (
        "memproxy: no session 'nobody' in tenant 'a'\n")
    assert cli.count("SELECT count(*) FROM messages m JOIN sessions s ON s.pk = m.session_pk"
                     " WHERE s.session_id = 'private-1' AND m.active = 1") == 2
    assert cli.count("SELECT count(*) FROM sessions WHERE session_id = 'private-2'") == 0


# --- what the model saw ---------------------------------------------------------------------------


def test_context_shows_what_the_model_is_sent_in_one_command(cli: Setup, upstream: FakeUpstream) -> None:
    cli.chat("ctx-1", [SYSTEM, user("my name is Ada")])
    cli.chat("ctx-1", [user("I live in Paris")])

    # "What does the model see in session ctx-1?" One command, for a script ...
    preview = cli.json("context", "ctx-1", "--model", "small", "--message", "where do I live?")
    assert preview == cli.http("POST", "/sessions/ctx-1/context",
                               json={"model": "small", "messages": [user("where do I live?")]}).json()
    cli.chat("ctx-1", [user("where do I live?")])
    assert json.dumps(upstream.last().messages) == json.dumps(preview["messages"])
    assert preview["messages"] == [SYSTEM, user("my name is Ada"), assistant("reply 1"), user("I live in Paris"),
                                   assistant("reply 2"), user("where do I live?")]

    # ... and for a person: the budget, then each part with its token count.
    lines = cli.sessions("--tenant", "a", "context", "ctx-1").stdout.splitlines()
    assert lines[0].startswith("model small: ") and "of 1724 input tokens (window 2000 - output 256 - margin 20)" in lines[0]
    parts = {line.split()[0]: line for line in lines[1:]}
    assert list(parts) == ["system", "kept", "left_out", "recalled", "new", "tools_and_priming"]
    assert "messages=1" in parts["system"] and "messages=6" in parts["kept"] and "messages=0" in parts["new"]
    tokens = [int(field.split("=")[1]) for line in lines[1:] for field in line.replace(",", "").split()
              if field.startswith("tokens=")]
    assert sum(tokens) == int(lines[0].split()[2])
    assert cli.sessions("--tenant", "a", "context", "ctx-1", "--model", "nope", ok=False).stderr == (
        "memproxy: The model 'nope' does not exist on this proxy.\n")


# --- export, import, rm, clear, fork --------------------------------------------------------------


def test_export_and_import_round_trip(cli: Setup, upstream: FakeUpstream, tmp_path: Path) -> None:
    history = [SYSTEM, user("q1 with ünïcode")]
    history.append(assistant(cli.chat("export-1", history)))
    cli.chat("export-1", history + [user("q2")])
    cli.chat("export-1", history + [user("q2, edited")])  # a superseded branch travels too
    assert cli.http("PATCH", "/sessions/export-1/metadata", json={"k": [1, 2]}).status_code == 200

    target = tmp_path / "export-1.jsonl"
    assert cli.sessions("--tenant", "a", "export", "export-1", "-o", str(target)).stdout == ""
    exported = target.read_text(encoding="utf-8")
    assert exported == cli.http("GET", "/sessions/export-1/export").text
    assert exported == cli.sessions("--tenant", "a", "export", "export-1").stdout
    assert [json.loads(line)["type"] for line in exported.splitlines()] == [
        "session", "turn", "turn", "turn", "message", "message", "message", "message", "message", "message"]

    assert cli.sessions("--tenant", "a", "import", str(target), "--id", "export-1-copy").stdout == (
        "imported export-1-copy\n")
    copy = cli.sessions("--tenant", "a", "export", "export-1-copy").stdout
    assert copy == exported.replace('"session_id":"export-1"', '"session_id":"export-1-copy"', 1)
    # From standard input, under the exported id, into another tenant; JSON for scripts.
    result = cli.sessions("--tenant", "b", "--json", "import", "-", stdin=exported)
    assert json.loads(result.stdout) == {"id": "export-1", "imported": True}

    # The running server serves the imported copy like the original.
    cli.chat("export-1-copy", [user("q3")], **{"X-Memproxy-History": "new"})
    assert upstream.last().messages == history + [user("q2, edited"), assistant("reply 3"), user("q3")]

    taken = cli.sessions("--tenant", "a", "import", str(target), ok=False)
    assert taken.stderr == "memproxy: a session 'export-1' already exists\n"
    # An id given but empty (a shell variable unset) is refused, not taken for the export's.
    assert cli.sessions("--tenant", "a", "import", str(target), "--id", "", ok=False).stderr == (
        "memproxy: not a session id: ''\n")
    broken = tmp_path / "broken.jsonl"
    broken.write_text(exported.splitlines()[1] + "\n{not json\n", encoding="utf-8")
    assert cli.sessions("--tenant", "a", "import", str(broken), "--id", "x1", ok=False).stderr.startswith(
        "memproxy: not JSON lines")
    broken.write_text(exported.splitlines()[1] + "\n", encoding="utf-8")
    assert "one session record" in cli.sessions("--tenant", "a", "import", str(broken), "--id", "x1", ok=False).stderr
    assert cli.count("SELECT count(*) FROM sessions WHERE session_id = 'x1'") == 0


def test_rm_and_clear(cli: Setup, upstream: FakeUpstream) -> None:
    for session in ("rm-1", "clear-1"):
        cli.chat(session, [SYSTEM, user(f"{session}: remember the code 1234")])
        cli.chat(session, [user("and more")])
    pk = cli.count("SELECT pk FROM sessions WHERE tenant = 'a' AND session_id = 'rm-1'")

    assert cli.sessions("--tenant", "a", "rm", "rm-1").stdout == "deleted rm-1\n"
    for table in ("turns", "messages", "summaries"):
        assert cli.count(f"SELECT count(*) FROM {table} WHERE session_pk = ?", pk) == 0
    assert cli.count("SELECT count(*) FROM sessions WHERE pk = ?", pk) == 0
    assert cli.http("GET", "/sessions/rm-1").status_code == 404
    assert cli.sessions("--tenant", "a", "rm", "rm-1", ok=False).stderr == "memproxy: no session 'rm-1' in tenant 'a'\n"

    assert json.loads(cli.sessions("--tenant", "a", "--json", "clear", "clear-1").stdout) == {
        "id": "clear-1", "cleared": True}
    cli.chat("clear-1", [user("what was the code?")])
    assert upstream.last().messages == [user("what was the code?")]  # nothing from before the clear
    detail = cli.json("show", "clear-1")
    assert detail["title"] == "clear-1: remember the code 1234"  # the record is kept
    assert [m["message"] for m in detail["messages"]] == [user("what was the code?"), assistant("reply 5")]


def test_fork(cli: Setup, upstream: FakeUpstream) -> None:
    cli.chat("fork-1", [user("q1")])
    cli.chat("fork-1", [user("q2")])
    assert cli.sessions("--tenant", "a", "fork", "fork-1", "fork-1b", "--at", "2").stdout == (
        "forked fork-1 at 2 into fork-1b\n")
    cli.chat("fork-1b", [user("q2, differently")])
    assert upstream.last().messages == [user("q1"), assistant("reply 1"), user("q2, differently")]
    cli.chat("fork-1", [user("q3")])
    assert upstream.last().messages == [user("q1"), assistant("reply 1"), user("q2"), assistant("reply 2"),
                                        user("q3")]
    assert cli.json("fork", "fork-1", "fork-1c") == {"id": "fork-1c", "forked_from": "fork-1", "messages": 6}
    assert cli.sessions("--tenant", "a", "fork", "fork-1", "fork-1b", ok=False).stderr == (
        "memproxy: a session 'fork-1b' already exists\n")
    assert cli.sessions("--tenant", "a", "fork", "fork-1", "x2", "--at", "7", ok=False).stderr == (
        "memproxy: 'at' must be an integer from 0 to 6\n")

    # Never between a tool call and its results: the fork would send a call without them.
    upstream.enqueue(Reply(tool_calls=[{"id": "call_1", "type": "function",
                                        "function": {"name": "search", "arguments": "{}"}}]))
    cli.chat("fork-2", [user("search")])
    cli.chat("fork-2", [{"role": "tool", "tool_call_id": "call_1", "content": "found"}])
    assert "'at' must be the position of a message that starts a unit" in cli.sessions(
        "--tenant", "a", "fork", "fork-2", "fork-2b", "--at", "2", ok=False).stderr
    assert cli.count("SELECT count(*) FROM sessions WHERE session_id = 'fork-2b'") == 0
    assert cli.json("fork", "fork-2", "fork-2b", "--at", "3")["messages"] == 3


# --- prune and rm --all: what is old, or everything about a tenant ------------------------------


def age_sessions(cli: Setup, seconds: float, *session_ids: str) -> None:
    """Move sessions' last activity by `seconds` (into the past when positive), while the server runs."""
    db.execute(cli.storage, f"UPDATE sessions SET updated_at = updated_at - ? WHERE session_id IN "
               f"({','.join('?' * len(session_ids))})", seconds, *session_ids)


def test_prune_acts_on_one_tenant_unless_told_every_one(cli: Setup, upstream: FakeUpstream) -> None:
    for session in ("prune-old", "prune-new"):
        cli.chat(session, [user(f"{session} in a")])
    cli.chat("prune-b-old", [user("old in b")], key=OTHER_KEY)
    exported = cli.sessions("--tenant", "a", "export", "prune-new").stdout
    cli.sessions("import", "-", "--id", "prune-default", stdin=exported)  # into the tenant `default`
    age_sessions(cli, 172800, "prune-old", "prune-b-old", "prune-default")  # idle for two days
    tenant_a = cli.count("SELECT count(*) FROM sessions WHERE tenant = 'a'")

    assert cli.sessions("--tenant", "a", "prune", "--older-than", "1d").stdout == "deleted 1 sessions\n"
    assert cli.count("SELECT count(*) FROM sessions WHERE session_id = 'prune-old'") == 0
    assert cli.count("SELECT count(*) FROM sessions WHERE tenant = 'a'") == tenant_a - 1
    for table in ("turns", "messages", "summaries"):
        assert cli.count(f"SELECT count(*) FROM {table} WHERE session_pk NOT IN (SELECT pk FROM sessions)") == 0

    # Without --tenant: the tenant `default`, as for every verb but `list`; not every tenant.
    assert cli.sessions("prune", "--older-than", "1d").stdout == "deleted 1 sessions\n"
    assert cli.count("SELECT count(*) FROM sessions WHERE session_id IN ('prune-default', 'prune-b-old')") == 1
    age_sessions(cli, 172800, "prune-new")
    assert json.loads(cli.sessions("prune", "--older-than", "1d", "--all-tenants", "--json").stdout) == {
        "deleted": 2}
    assert cli.count("SELECT count(*) FROM sessions WHERE session_id LIKE 'prune-%'") == 0
    assert "--all-tenants and --tenant" in cli.sessions("--tenant", "a", "prune", "--older-than", "1d",
                                                        "--all-tenants", ok=False).stderr
    assert "--older-than takes a duration" in cli.sessions("prune", "--older-than", "soon", ok=False).stderr


def test_rm_all_deletes_everything_about_a_tenant_whatever_its_clock(cli: Setup, upstream: FakeUpstream) -> None:
    for session in ("rm-all-1", "rm-all-future"):
        cli.chat(session, [user(f"{session} in b")], key=OTHER_KEY)
    cli.chat("rm-all-a", [user("in a")])
    age_sessions(cli, -86400, "rm-all-future")  # written by a replica whose clock is a day ahead
    tenant_a = cli.count("SELECT count(*) FROM sessions WHERE tenant = 'a'")
    assert cli.json("prune", "--older-than", "0s", tenant="b")["deleted"] >= 1
    assert cli.count("SELECT count(*) FROM sessions WHERE session_id = 'rm-all-future'") == 1  # skipped

    # "Delete everything about tenant b": one command, whatever the clocks say.
    assert cli.sessions("rm", "--all", "--tenant", "b").stdout == "deleted 1 sessions\n"
    assert cli.count("SELECT count(*) FROM sessions WHERE tenant = 'b'") == 0
    for table in ("turns", "messages", "summaries"):
        assert cli.count(f"SELECT count(*) FROM {table} WHERE session_pk NOT IN (SELECT pk FROM sessions)") == 0
    assert cli.count("SELECT count(*) FROM sessions WHERE tenant = 'a'") == tenant_a  # a is untouched
    assert cli.http("GET", "/sessions", key=OTHER_KEY).json()["data"] == []
    assert cli.json("rm", "--all", tenant="b") == {"tenant": "b", "deleted": 0}
    cli.chat("rm-all-1", [user("back")], key=OTHER_KEY)
    assert upstream.last().messages == [user("back")]  # nothing about it is left
    assert "rm takes a session id, or --all" in cli.sessions("--tenant", "b", "rm", ok=False).stderr
    assert "rm takes a session id, or --all" in cli.sessions("--tenant", "b", "rm", "rm-all-1", "--all",
                                                            ok=False).stderr


# --- metadata and usage ---------------------------------------------------------------------------


def test_metadata_shown_replaced_and_merged(cli: Setup, upstream: FakeUpstream) -> None:
    cli.chat("meta-cli", [user("hello")])
    assert cli.json("metadata", "meta-cli") == {}
    replaced = cli.sessions("--tenant", "a", "metadata", "meta-cli", "--set", '{"step": 1, "city": "Oslo"}')
    assert json.loads(replaced.stdout) == {"step": 1, "city": "Oslo"}
    # Options after the verb, as before it.
    merged = cli.sessions("metadata", "meta-cli", "--merge", '{"step": null, "seen": [1]}', "--tenant", "a")
    assert json.loads(merged.stdout) == {"city": "Oslo", "seen": [1]}
    assert cli.http("GET", "/sessions/meta-cli/metadata").json() == {"city": "Oslo", "seen": [1]}
    assert cli.json("show", "meta-cli")["messages"][0]["message"] == user("hello")  # the chat is kept
    cli.sessions("--tenant", "a", "metadata", "meta-cli-new", "--set", "{}")  # creates the session
    assert cli.http("GET", "/sessions/meta-cli-new").status_code == 200

    assert cli.sessions("--tenant", "a", "metadata", "meta-cli", "--set", "[1]", ok=False).stderr == (
        "memproxy: --set takes a JSON object\n")
    # What the HTTP API refuses is refused here too, and nothing is written: stored, it would break
    # the session's metadata reads and its exports.
    for option, text in [("--set", '{"x": NaN}'), ("--merge", '{"x": "\\ud800"}'), ("--set", "[" * 100 + "]" * 100)]:
        refused = cli.sessions("--tenant", "a", "metadata", "meta-cli", option, text, ok=False).stderr
        assert refused.startswith(f"memproxy: {option} takes a JSON object") and "Traceback" not in refused
    assert cli.sessions("--tenant", "b", "metadata", "meta-cli", "--merge", '{"k": 1}', ok=False).stderr == (
        "memproxy: no session 'meta-cli' in tenant 'b'\n")
    assert cli.sessions("--tenant", "b", "metadata", "meta-cli", ok=False).stderr == (
        "memproxy: no session 'meta-cli' in tenant 'b'\n")
    assert cli.http("GET", "/sessions/meta-cli/metadata").json() == {"city": "Oslo", "seen": [1]}


def test_usage_as_a_table_and_as_json(cli: Setup, upstream: FakeUpstream) -> None:
    upstream.enqueue(Reply(content="spent", usage={"prompt_tokens": 300, "completion_tokens": 30}))
    cli.chat("usage-1", [user("what does it cost?")])
    usage = cli.json("usage")
    assert usage == cli.http("GET", "/usage").json()
    assert usage["tenant"] == "a" and usage["prompt_tokens"] >= 300
    everyone = json.loads(cli.sessions("usage", "--all-tenants", "--json").stdout)
    assert everyone == cli.http("GET", "/usage", key=ADMIN_KEY).json() and everyone["tenant"] is None

    cli.sessions("--tenant", "a", "rm", "usage-1")
    after = cli.json("usage")
    assert after["prompt_tokens"] == usage["prompt_tokens"]  # deleting a session keeps what it cost
    assert after["deleted_sessions"]["prompt_tokens"] >= 300

    table = cli.sessions("usage", "--tenant", "a").stdout.splitlines()
    assert table[0].split() == ["TENANT", "a", "TOTAL", "OF", "WHICH", "DELETED", "SESSIONS"]
    rows = {line[: table[0].index("TOTAL")].strip(): line[table[0].index("TOTAL"):].split() for line in table[1:]}
    assert rows["prompt tokens"] == [str(after["prompt_tokens"]), str(after["deleted_sessions"]["prompt_tokens"])]
    assert rows["sessions"] == [str(after["sessions"]), str(after["deleted_sessions"]["sessions"])]

    # A call to another endpoint belongs to no session: it counts in the totals, and apart.
    with openai.OpenAI(base_url=f"{cli.server.url}/v1", api_key=PROXY_KEY, max_retries=0) as client:
        client.embeddings.create(model="small", input="three little words")
    spent = cli.json("usage")
    assert spent["endpoints"] == {"embeddings": {"calls": 1, "prompt_tokens": 3, "completion_tokens": 0,
                                                 "cost": None}}
    assert spent["prompt_tokens"] == after["prompt_tokens"] + 3
    lines = cli.sessions("usage", "--tenant", "a").stdout.splitlines()
    endpoints = lines[lines.index("") + 1:]
    assert endpoints[0].split() == ["ENDPOINT", "CALLS", "PROMPT", "TOKENS", "COMPLETION", "TOKENS", "COST"]
    assert endpoints[1].split() == ["embeddings", "1", "3", "0", "None"]


# --- metadata stays out of the logs ---------------------------------------------------------------


def test_metadata_values_never_reach_the_server_log(cli: Setup, upstream: FakeUpstream) -> None:
    secrets = ["sk-live-77aa88bb99cc", "hunter2-passphrase", "4111-1111-1111-1111"]
    put = cli.http("PUT", "/sessions/meta-1/metadata", json={"api_key": secrets[0], "note": [secrets[1]]})
    assert put.status_code == 200
    cli.chat("meta-1", [user("hello")])
    patched = cli.http("PATCH", "/sessions/meta-1/metadata", json={"card": secrets[2], "note": None})
    assert patched.json() == {"api_key": secrets[0], "card": secrets[2]}
    assert cli.http("GET", "/sessions/meta-1").json()["metadata"] == patched.json()
    assert secrets[2] in cli.http("GET", "/sessions/meta-1/export").text
    assert cli.json("show", "meta-1")["metadata"] == patched.json()
    assert cli.http("GET", "/sessions/meta-1/metadata", key=ADMIN_KEY, params={"tenant": "a"}).json() == patched.json()

    output = cli.server_output()
    assert " DEBUG " in output and "route=/v1/chat/completions status=200" in output  # it logged, at every level
    for secret in secrets:
        assert secret not in output


def test_search_one_session_or_every_session_of_the_tenant(cli: Setup, upstream: FakeUpstream) -> None:
    upstream.enqueue(*[Reply(content=f"noted {i}") for i in range(3)])
    cli.chat("search-1", [user("The lighthouse keeper painted the door green.")])
    cli.chat("search-2", [user("A lighthouse stood on the cape.")])
    cli.chat("search-b", [user("The lighthouse of tenant b.")], key=OTHER_KEY)

    found = cli.json("search", "lighthouse keeper", "--session", "search-1")
    assert found["query"] == ["lighthouse", "keeper"]
    [hit] = found["data"]
    assert (hit["session_id"], hit["position"], hit["matched"]) == ("search-1", 0, ["lighthouse", "keeper"])
    mine = {h["session_id"] for h in cli.json("search", "lighthouse", "--limit", "50")["data"]}
    assert {"search-1", "search-2"} <= mine and "search-b" not in mine
    every = {(h["tenant"], h["session_id"]) for h in json.loads(cli.sessions("search", "lighthouse", "--all-tenants",
                                                                              "--json").stdout)["data"]}
    assert {("a", "search-1"), ("a", "search-2"), ("b", "search-b")} <= every
    table = cli.sessions("search", "keeper", "--tenant", "a").stdout.splitlines()
    assert table[0].split() == ["TENANT", "SESSION", "POS", "ROLE", "WHEN", "(UTC)", "SCORE", "MATCHED", "TEXT"]
    assert table[1].split()[:2] == ["a", "search-1"] and "The lighthouse keeper painted" in table[1]
    assert cli.sessions("search", "keeper", "--session", "nope", "--tenant", "a", ok=False).stderr == (
        "memproxy: no session 'nope' in tenant 'a'\n")
