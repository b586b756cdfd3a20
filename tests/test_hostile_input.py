"""Hostile input, against `memproxy serve` as a real process, on SQLite and on PostgreSQL.

Whatever bytes a client sends, memproxy answers without a 5xx; every 4xx carries the OpenAI error
shape `{"error": {"message", "type", "code", "param"}}`; and a rejected request changes nothing that
is stored (every table is read before and after through `tests/db.py`). Requests go out as raw
aiohttp requests, so the bodies can be what no SDK would send: any JSON value at any field of a
valid request, unicode edge cases (NUL, lone surrogates as escapes or as raw bytes, BOM, RTL marks,
line separators, long strings), deep nesting, NaN and huge numbers, wrong types, wrong content types
and content encodings, hostile session ids in paths, queries and headers.

`test_hostile_requests` is the hypothesis property over every endpoint; `test_reproductions` pins
the cases issue 12 reported (each a 500 before) and the errors aiohttp raises before memproxy's
handlers run (an oversized header, a bad header, a bad request line, br/zstd bodies), sent over a
plain socket. CI runs the same 120 hypothesis examples per store every time; a soak sets
MEMPROXY_HOSTILE_EXAMPLES to run that many fresh ones.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import gzip
import json
import os
import socket
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from yarl import URL

from conftest import OTHER_KEY, PROXY_KEY
from db import table_rows
from fake_upstream import FakeUpstream
from memproxy.config import StorageConfig
from processes import Served, serve_one, storage_section, store_for_processes, write_config

pytestmark = pytest.mark.both_stores

ADMIN_KEY = "test-admin-key-z"
AUTH = (f'auth:\n  keys:\n    - {{key: "{PROXY_KEY}", tenant: a}}\n    - {{key: "{OTHER_KEY}", tenant: b}}\n'
        f'  admin_keys: ["{ADMIN_KEY}"]\n')
TABLES = ("sessions", "turns", "messages", "summaries", "summary_leases", "tenant_usage")
SOAK = os.environ.get("MEMPROXY_HOSTILE_EXAMPLES")  # a soak: this many examples, new ones each run
EXAMPLES = int(SOAK or "120")
SEED = "seed"

Snapshot = dict[str, list[tuple[Any, ...]]]


# --- the proxy under attack ----------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # percent-encoded, with its query
    headers: tuple[tuple[str, str], ...]
    body: bytes | None


@dataclass
class Answer:
    status: int
    content_type: str
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class Target:
    """A running `memproxy serve`, a client loop of the test's own, and the seeded session."""

    def __init__(self, served: Served, storage: StorageConfig) -> None:
        self.served, self.storage = served, storage
        self.loop = asyncio.new_event_loop()
        self.http = self.loop.run_until_complete(self._session())
        self.export = b""

    async def _session(self) -> aiohttp.ClientSession:
        # A connection per request: a refused body may close its connection, and a pooled one that
        # the server closed would fail the next request for the client's reasons, not the server's.
        return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60), auto_decompress=False,
                                     connector=aiohttp.TCPConnector(force_close=True))

    def send(self, request: Request) -> Answer:
        return self.loop.run_until_complete(self._send(request))

    async def _send(self, request: Request) -> Answer:
        url = URL(self.served.url + request.path, encoded=True)
        async with self.http.request(request.method, url, data=request.body, headers=list(request.headers),
                                     skip_auto_headers=("Content-Type",)) as response:
            return Answer(response.status, response.headers.get("Content-Type", ""), await response.read())

    def seed(self) -> None:
        """The session most requests address, with a turn, metadata and its export to damage."""
        if any(row[1:3] == ("a", SEED) for row in table_rows(self.storage, "sessions")["sessions"]):
            return
        chat = {"model": "small", "messages": [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "hello"}]}
        for request in (Request("POST", "/v1/chat/completions", _auth(("X-Session-Id", SEED)), _json(chat)),
                        Request("PUT", f"/v1/sessions/{SEED}/metadata", _auth(), _json({"k": "v"}))):
            answer = self.send(request)
            assert answer.status == 200, answer.body
        self.export = self.send(Request("GET", f"/v1/sessions/{SEED}/export", _auth(), None)).body

    def snapshot(self) -> Snapshot:
        return table_rows(self.storage, *TABLES)

    def close(self) -> None:
        self.loop.run_until_complete(self.http.close())
        self.loop.close()


@pytest.fixture
def target(store_kind: str, tmp_path: Path, upstream: FakeUpstream) -> Iterator[Target]:
    with store_for_processes(store_kind, tmp_path) as storage:
        config = write_config(tmp_path / "memproxy.yaml", upstream.url, storage_section(storage), auth=AUTH)
        served = serve_one(config, tmp_path / "memproxy.log")
        target = Target(served, storage)
        try:
            target.seed()
            yield target
        finally:
            target.close()
            served.stop()
        # What a rejected request logs: never its content (the hostile strings carry this mark).
        assert "hostile" not in (tmp_path / "memproxy.log").read_text(errors="replace")


def _auth(*headers: tuple[str, str], key: str = PROXY_KEY) -> tuple[tuple[str, str], ...]:
    """The tenant's key, JSON unless `headers` name another Content-Type, and `headers`."""
    typed = any(name == "Content-Type" for name, _ in headers)
    return (("Authorization", f"Bearer {key}"), *(() if typed else (("Content-Type", "application/json"),)),
            *headers)


def _json(value: Any) -> bytes:
    return json.dumps(value).encode()


def check(target: Target, request: Request) -> Answer:
    """Send `request`; no 5xx, the error shape on a 4xx, and nothing stored changed by a refusal."""
    target.seed()
    before = target.snapshot()
    answer = target.send(request)
    assert answer.status < 500, (request, answer)
    if answer.status >= 400:
        assert answer.content_type.startswith("application/json"), (request, answer)
        assert_error_shape(answer.json())
        assert target.snapshot() == before, (request, answer)
    elif answer.content_type.startswith("text/event-stream"):
        assert b"HTTP/1.1" not in answer.body, (request, answer)  # never a second response inside
    return answer


def assert_error_shape(body: Any) -> None:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "code", "param"}, body
    assert isinstance(error["message"], str) and error["message"], body
    assert isinstance(error["type"], str) and error["type"], body
    assert error["code"] is None or isinstance(error["code"], str), body
    assert error["param"] is None or isinstance(error["param"], str), body


# --- what an attacker sends ----------------------------------------------------------------------

EDGE_STRINGS = [
    "", " ", "hostile\x00", "\x00", "hostile\ud800", "\udfff", "\ud83d", "x\udc00y", "\ufeffhostile", "\ufeff",
    "\u202ehostile\u200f", "\u2028\u2029", "\uffff", "\U0001f600", "a" * 70_000, SEED, "nosuch", "../seed",
    "%00", "' OR 1=1 --", "small", "user", "assistant", "tool", "null", "true", "1e400", "NaN",
]
strings = st.one_of(st.sampled_from(EDGE_STRINGS), st.text(max_size=20))
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(),
    st.sampled_from([0, -1, 1, 2**31, 2**63, -(2**63) - 1, 10**30, 2**64]),
    st.floats(allow_nan=False, allow_infinity=False), strings,
)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(strings, inner, max_size=3), max_leaves=6)

USER = {"role": "user", "content": "next"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
TEMPLATES: dict[str, Any] = {
    "chat": {"model": "small", "max_tokens": 20, "stream": False, "tools": [TOOL], "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "user", "content": [{"type": "text", "text": "and?"}], "name": "u"}]},
    "context": {"model": "small", "max_tokens": 50, "tools": [TOOL], "messages": [USER]},
    "fork": {"new_id": "forked", "at": 2},
    "compact": {"model": "small"},
    "metadata": {"k": "v", "n": 1, "deep": {"list": [1, 2]}},
}


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in `value` a field can be changed: the value itself, then each member's."""
    found = [prefix]
    if isinstance(value, dict):
        for key, member in value.items():
            found += paths(member, (*prefix, key))
    elif isinstance(value, list):
        for i, member in enumerate(value):
            found += paths(member, (*prefix, i))
    return found


@st.composite
def damaged(draw: st.DrawFn, template: Any) -> Any:
    """`template` with one field replaced by any JSON value, removed, or a new field added."""
    body = copy.deepcopy(template)
    path = draw(st.sampled_from(paths(body)))
    action = draw(st.sampled_from(["replace", "remove", "add"]))
    value = draw(values)
    if not path:
        return value if action == "replace" else body
    parent = body
    for step in path[:-1]:
        parent = parent[step]
    if action == "replace":
        parent[path[-1]] = value
    elif action == "remove":
        del parent[path[-1]]
    elif isinstance(parent, dict):
        parent[draw(strings)] = value
    else:
        parent.append(value)
    return body


RAW_BODIES = [
    b"", b"{", b"}", b"null", b"[]", b'"text"', b"\xff\xfe{}", b"\xef\xbb\xbf{}", b'{"a":NaN}', b'{"a":-Infinity}',
    b'{"a":1e400}', b'{"a":' + b"9" * 5000 + b"}", b'{"a":"\\ud800"}', b'{"\\udc00":1}', b'{"a":"\\u0000"}',
    b'{"a":"\xed\xa0\x80"}', b"[" * 990 + b"]" * 990, b'{"a":' + b"[" * 65 + b"]" * 65 + b"}",
    b"[" * 100_000, b'{"a":1,"a":2}', b"\x00" * 16,
]


@st.composite
def bodies(draw: st.DrawFn, template: Any | None) -> bytes:
    kind = draw(st.sampled_from(["damaged", "damaged", "damaged", "raw", "binary", "value", "nested"]))
    if kind == "damaged" and template is not None:
        value = draw(damaged(template))
        raw_unicode = draw(st.booleans())  # lone surrogates as raw (invalid UTF-8) bytes, not escapes
        return (json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass") if raw_unicode
                else json.dumps(value).encode())
    if kind == "binary":
        return draw(st.binary(max_size=64))
    if kind == "value":
        return json.dumps(draw(values)).encode()
    if kind == "nested":
        depth = draw(st.sampled_from([63, 64, 65, 128, 989, 5000]))
        inner = "[" * depth + "]" * depth
        return f'{{"model":"small","messages":[{{"role":"user","content":"hi"}}],"metadata":{inner}}}'.encode()
    return draw(st.sampled_from(RAW_BODIES))


@st.composite
def encoded(draw: st.DrawFn, body: bytes) -> tuple[tuple[tuple[str, str], ...], bytes]:
    """Content-Type and Content-Encoding headers, honest or not, and the bytes they describe."""
    content_type = draw(st.sampled_from([
        "application/json", "application/json", "application/json", None, "text/plain",
        "application/json; charset=latin-1", "application/json; charset=bogus", "multipart/form-data; boundary=x",
        "application/x-www-form-urlencoded", "application/x-ndjson"]))
    headers: list[tuple[str, str]] = [("Content-Type", content_type)] if content_type else []
    encoding = draw(st.sampled_from([None, None, None, None, "gzip", "gzip-bad", "deflate", "br", "zstd",
                                     "bogus"]))
    if encoding == "gzip":
        body = gzip.compress(body)
    elif encoding == "deflate":
        body = zlib.compress(body)
    if encoding:
        headers.append(("Content-Encoding", encoding.removesuffix("-bad")))
    return tuple(headers), body


header_values = st.one_of(
    st.sampled_from(["", SEED, "nosuch", "new", "full", "auto", "x" * 129, "a b", "hostile;drop"]),
    st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7e), max_size=40),
)
session_ids = st.one_of(st.sampled_from([SEED, SEED, "nosuch", "forked", "imported"]), strings)


def quoted(text: str) -> str:
    return quote(text.encode("utf-8", "surrogatepass"), safe="")


@st.composite
def requests(draw: st.DrawFn) -> Request:
    endpoint = draw(st.sampled_from([
        "chat", "chat-session", "models", "list", "delete-all", "import", "show", "delete", "clear", "fork",
        "export", "context-get", "context", "compact", "metadata-get", "metadata-put", "metadata-patch", "usage",
        "unknown-route"]))
    session = quoted(draw(session_ids))
    extra: list[tuple[str, str]] = []
    body: bytes | None = None
    template: Any = None
    query: dict[str, str] = {}
    if draw(st.integers(0, 3)) == 0:  # a query parameter any endpoint may be sent
        query[draw(st.sampled_from(["tenant", "limit", "after", "all", "session_id", "model", "message"]))] = \
            draw(strings)
    if endpoint.startswith("chat"):
        method, path, template = "POST", "/v1/chat/completions", TEMPLATES["chat"]
        if endpoint == "chat-session":
            extra.append(("X-Session-Id", draw(st.one_of(st.just(SEED), header_values))))
        if draw(st.booleans()):
            extra.append(("X-Memproxy-History", draw(header_values)))
        if draw(st.integers(0, 4)) == 0:
            template = {**template, "stream": True}
    elif endpoint == "models":
        method, path = "GET", "/v1/models"
    elif endpoint in ("list", "usage", "delete-all"):
        method, path = ("DELETE", "/v1/sessions") if endpoint == "delete-all" else ("GET", f"/v1/{endpoint}")
        if endpoint == "list":
            path = "/v1/sessions"
            query.setdefault("limit", draw(st.sampled_from(["1", "2", "0", "1001", "x", "1e3", "-1", "٣"])))
            query.setdefault("after", draw(strings))
        if endpoint == "delete-all":
            query.setdefault("all", draw(st.sampled_from(["false", "", "TRUE", "yes"])))
    elif endpoint == "import":
        method, path = "POST", "/v1/sessions/import"
        query.setdefault("session_id", draw(st.sampled_from(["imported", "", "x" * 200, "hostile\x00"])))
    elif endpoint == "unknown-route":
        method, path = draw(st.sampled_from(["GET", "POST", "PUT", "OPTIONS"])), f"/v1/{session}"
    else:
        method, suffix = {
            "show": ("GET", ""), "delete": ("DELETE", ""), "clear": ("POST", "/clear"), "fork": ("POST", "/fork"),
            "export": ("GET", "/export"), "context-get": ("GET", "/context"), "context": ("POST", "/context"),
            "compact": ("POST", "/compact"), "metadata-get": ("GET", "/metadata"),
            "metadata-put": ("PUT", "/metadata"), "metadata-patch": ("PATCH", "/metadata"),
        }[endpoint]
        path = f"/v1/sessions/{session}{suffix}"
        template = TEMPLATES.get(endpoint.split("-")[0])
    if method in ("POST", "PUT", "PATCH"):
        if endpoint == "import":
            body = draw(export_bodies())
        else:
            body = draw(bodies(template))
    key = draw(st.sampled_from([PROXY_KEY, PROXY_KEY, PROXY_KEY, OTHER_KEY, ADMIN_KEY, None, "hostile-key"]))
    if key == ADMIN_KEY and draw(st.booleans()):
        query.setdefault("tenant", "a")
    headers: list[tuple[str, str]] = [("Authorization", f"Bearer {key}")] if key else []
    if body is not None:
        content, body = draw(encoded(body))
        headers += content
    if query:
        path += "?" + "&".join(f"{quoted(k)}={quoted(v)}" for k, v in query.items())
    return Request(method, path, (*headers, *extra), body)


@st.composite
def export_bodies(draw: st.DrawFn) -> bytes:
    """An export of a plausible session with one record damaged, or anything else."""
    records = [
        {"type": "session", "format": 2, "session_id": "imported", "created_at": 1.0, "updated_at": 2.0,
         "length": 1, "head_hash": "h1", "head_cum": 5, "head_compact_cum": 5, "system_prompt": None,
         "history_mode": None, "title": "t", "metadata": {"k": "v"}},
        {"type": "turn", "id": 1, "created_at": 1.0, "model": "small", "kind": "chat", "context_tokens": 5,
         "prompt_tokens": 5, "completion_tokens": 1, "latency_ms": 1.0, "cost": None, "full_tokens": 5},
        {"type": "message", "id": 1, "turn": 1, "parent": None, "seq": 0, "active": 1, "role": "user",
         "body": {"role": "user", "content": "hi"}, "tokens": 5, "cum_before": 0, "unit_start": 1,
         "chain_hash": "h1", "created_at": 1.0, "compact_body": None, "compact_tokens": 5,
         "compact_cum_before": 0},
    ]
    if draw(st.integers(0, 4)) == 0:
        return draw(bodies(None))
    line = draw(st.integers(0, len(records) - 1))
    records[line] = draw(damaged(records[line]))
    raw_unicode = draw(st.booleans())
    lines = [json.dumps(r, ensure_ascii=not raw_unicode).encode("utf-8", "surrogatepass") for r in records]
    return b"\n".join(lines) + draw(st.sampled_from([b"\n", b"", b"\r\n", b"\n\n{", b"\n\xff"]))


@settings(max_examples=EXAMPLES, deadline=None, derandomize=SOAK is None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(request=requests())
def test_hostile_requests(target: Target, request: Request) -> None:
    check(target, request)


# --- the reproductions of issue 12 ---------------------------------------------------------------

CHAT = {"model": "small", "messages": [{"role": "user", "content": "hi"}]}


def _chat_with(**changes: Any) -> bytes:
    return _json({**CHAT, **changes})


# A DDS header whose pixel format flags no reader knows: Pillow raises NotImplementedError opening it.
_DDS = (b"DDS " + struct.pack("<7I", 124, 0x1007, 4, 4, 0, 0, 0) + bytes(44)
        + struct.pack("<2I4s5I", 32, 0x18, bytes(4), 0, 0, 0, 0, 0) + struct.pack("<5I", 0x1000, 0, 0, 0, 0))
UNSIZED = "data:image/png;base64," + base64.b64encode(_DDS).decode()


# (name, method, path, extra headers, body, status, param)
REPRODUCTIONS: list[tuple[str, str, str, tuple[tuple[str, str], ...], bytes, int, str | None]] = [
    ("surrogate in content", "POST", "/v1/chat/completions", (("X-Session-Id", SEED),),
     b'{"model":"small","messages":[{"role":"user","content":"\\ud800"}]}', 400, "messages[0].content"),
    ("surrogate in model", "POST", "/v1/chat/completions", (),
     b'{"model":"\\udfff","messages":[{"role":"user","content":"hi"}]}', 400, "model"),
    ("surrogate in a param", "POST", "/v1/chat/completions", (("X-Session-Id", SEED),),
     _chat_with(user="u1", stop=["ok", "\udc00"]), 400, "stop[1]"),
    ("surrogate in a response's input", "POST", "/v1/responses", (("X-Session-Id", SEED),),
     b'{"model":"small","input":"\\ud800"}', 400, "input"),
    ("a response's item a string", "POST", "/v1/responses", (("X-Session-Id", SEED),),
     _json({"model": "small", "input": ["hi"]}), 400, "input[0]"),
    ("a response's item role a list", "POST", "/v1/responses", (("X-Session-Id", SEED),),
     _json({"model": "small", "input": [{"role": [], "content": "x"}]}), 400, "input[0].role"),
    ("a response's item type an object", "POST", "/v1/responses", (("X-Session-Id", SEED),),
     _json({"model": "small", "input": [{"type": {}, "role": "user", "content": "x"}]}), 400, "input[0].type"),
    ("a response's call arguments an object", "POST", "/v1/responses", (("X-Session-Id", SEED),),
     _json({"model": "small", "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]}),
     400, "input[0].arguments"),
    ("a response's call output an object", "POST", "/v1/responses", (("X-Session-Id", SEED),),
     _json({"model": "small", "input": [{"type": "function_call_output", "call_id": "c", "output": {}}]}),
     400, "input[0].output"),
    ("a previous response of nobody", "POST", "/v1/responses", (),
     _json({"model": "small", "input": "x", "previous_response_id": "resp_nobody"}), 400, "previous_response_id"),
    ("surrogate pair is fine", "POST", "/v1/chat/completions", (("X-Session-Id", SEED),),
     _chat_with(messages=[{"role": "user", "content": "\U0001f600"}]), 200, None),
    ("escaped backslash before u is fine", "POST", "/v1/chat/completions", (),
     b'{"model":"small","messages":[{"role":"user","content":"\\\\ud800"}]}', 200, None),
    ("surrogate in a metadata key", "PATCH", f"/v1/sessions/{SEED}/metadata", (), b'{"\\ud800x":1}', 400, None),
    ("surrogate in a metadata value", "PUT", f"/v1/sessions/{SEED}/metadata", (),
     b'{"k":{"deep":["\\udbff"]}}', 400, "k.deep[0]"),
    ("surrogate in a preview", "POST", f"/v1/sessions/{SEED}/context", (),
     b'{"messages":[{"role":"user","content":"\\ud800"}]}', 400, "messages[0].content"),
    ("surrogate in a fork id", "POST", f"/v1/sessions/{SEED}/fork", (), b'{"new_id":"\\ud800"}', 400, "new_id"),
    ("surrogate in an import", "POST", "/v1/sessions/import", (), b'{"type":"session","title":"\\ud800"}\n',
     400, "title"),
    ("nested 990 levels", "POST", "/v1/chat/completions", (), b"[" * 990 + b"]" * 990, 400, None),
    ("nested 65 levels in a field", "PUT", f"/v1/sessions/{SEED}/metadata", (),
     b'{"k":' + b"[" * 64 + b"]" * 64 + b"}", 400, "k" + "[0]" * 63),
    ("nested 64 levels is fine", "PUT", "/v1/sessions/deep/metadata", (),
     b'{"k":' + b"[" * 63 + b"]" * 63 + b"}", 200, None),
    ("NaN", "PUT", f"/v1/sessions/{SEED}/metadata", (), b'{"k":NaN}', 400, None),
    ("1e400", "PUT", f"/v1/sessions/{SEED}/metadata", (), b'{"k":1e400}', 400, None),
    ("role a list", "POST", "/v1/chat/completions", (), _chat_with(messages=[{"role": [], "content": "x"}]),
     400, "messages[0].role"),
    ("role an object", "POST", "/v1/chat/completions", (), _chat_with(messages=[{"role": {}, "content": "x"}]),
     400, "messages[0].role"),
    ("role a number", "POST", "/v1/chat/completions", (), _chat_with(messages=[{"role": 1, "content": "x"}]),
     400, "messages[0].role"),
    ("tool_call_id an object", "POST", "/v1/chat/completions", (),
     _chat_with(messages=[{"role": "user", "content": "x", "tool_call_id": {}}]), 400, "messages[0].tool_call_id"),
    ("text part not text", "POST", "/v1/chat/completions", (),
     _chat_with(messages=[{"role": "user", "content": [{"type": "text", "text": {}}]}]), 400,
     "messages[0].content[0].text"),
    ("tool call arguments an object", "POST", "/v1/chat/completions", (),
     _chat_with(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
         {"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}]}]), 400,
     "messages[1].tool_calls[0].function.arguments"),
    # A session named "." or "..": every HTTP client resolves those path segments away.
    ("a session named ..", "POST", "/v1/chat/completions", (("X-Session-Id", ".."),), _json(CHAT), 400,
     "X-Session-Id"),
    ("a session named .", "POST", "/v1/chat/completions", (("X-Session-Id", "."),), _json(CHAT), 400,
     "X-Session-Id"),
    ("a fork named ..", "POST", f"/v1/sessions/{SEED}/fork", (), b'{"new_id":".."}', 400, "new_id"),
    ("a conversation named .", "POST", "/v1/responses", (), b'{"model":"small","input":"x","conversation":"."}',
     400, "conversation"),
    ("preview messages a number", "POST", f"/v1/sessions/{SEED}/context", (), b'{"messages":5}', 400, "messages"),
    ("preview messages an object", "POST", f"/v1/sessions/{SEED}/context", (), b'{"messages":{}}', 400,
     "messages"),
    ("preview role a list", "POST", f"/v1/sessions/{SEED}/context", (), b'{"messages":[{"role":[]}]}', 400,
     "messages[0].role"),
    ("preview tools a number", "POST", f"/v1/sessions/{SEED}/context", (), b'{"tools":5}', 400, "tools"),
    # litellm read these in its own code, and refused them as a failed upstream call (a 502 the SDKs retry):
    # null means the default, and a tool choice names its type.
    ("web_search_options null", "POST", "/v1/chat/completions", (), _chat_with(web_search_options=None), 200, None),
    ("tool_choice an empty object", "POST", "/v1/chat/completions", (("X-Session-Id", SEED),),
     _chat_with(tool_choice={}), 400, "tool_choice"),
    # tiktoken's pre-tokenizer gives up on a run of a million spaces (a ValueError, answered 500):
    # counted in pieces, the request is read, and refused only as too long for the model.
    ("a million spaces in a row", "POST", "/v1/chat/completions", (("X-Session-Id", SEED),),
     _chat_with(messages=[{"role": "user", "content": "x" + " " * 1_000_000 + "y"}]), 400, "messages"),
    ("a million spaces in a preview", "POST", f"/v1/sessions/{SEED}/context", (),
     _json({"messages": [{"role": "user", "content": " " * 1_000_000}]}), 400, "messages"),
    # An inline image is sized by Pillow, whose readers raise more than OSError on bytes they cannot
    # read (here NotImplementedError): an image of unknown size, counted as a photo, not a 500.
    ("an image Pillow cannot size", "POST", "/v1/chat/completions", (("X-Session-Id", SEED),),
     _chat_with(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": UNSIZED}}]}]),
     200, None),
    ("gzip that is not gzip", "POST", "/v1/chat/completions", (("Content-Encoding", "gzip"),), b"not gzip",
     400, None),
    ("import, gzip that is not gzip", "POST", "/v1/sessions/import", (("Content-Encoding", "gzip"),), b"nope",
     400, None),
    ("import in a bogus charset", "POST", "/v1/sessions/import", (("Content-Type", "text/plain; charset=bogus"),),
     b'{"type":"session"}\n', 400, None),
    ("gzip that is gzip", "POST", "/v1/chat/completions", (("Content-Encoding", "gzip"),), gzip.compress(_json(CHAT)),
     200, None),
    # An encoding nothing decodes was read as plain bytes: stored as such, or refused as "not UTF-8".
    ("a made-up encoding", "POST", "/v1/chat/completions", (("Content-Encoding", "bogus"),), _json(CHAT), 400, None),
    ("x-gzip", "POST", "/v1/chat/completions", (("Content-Encoding", "x-gzip"),), gzip.compress(_json(CHAT)),
     400, None),
    ("gzip twice", "POST", "/v1/chat/completions", (("Content-Encoding", "gzip, gzip"),),
     gzip.compress(gzip.compress(_json(CHAT))), 400, None),
]


# An admin key names the tenant in the query: a name with a control character is refused; one not
# UTF-8 arrives with replacement characters, a tenant without sessions (None: any answer but a 5xx).
ADMIN_REPRODUCTIONS: list[tuple[str, str, str, tuple[tuple[str, str], ...], bytes | None, int | None, str | None]] = [
    (f"tenant {name}", method, f"{path}{'&' if '?' in path else '?'}tenant={tenant}", (), None, status, "tenant")
    for name, tenant, status in (("with a surrogate", "%ED%A0%80", None), ("with a NUL", "a%00", 400),
                                 ("with a newline", "a%0A", 400), ("not UTF-8", "%FF", None))
    for method, path in (("GET", "/v1/sessions"), ("GET", "/v1/usage"), ("GET", f"/v1/sessions/{SEED}"),
                         ("DELETE", "/v1/sessions?all=true"))
]


def test_reproductions(target: Target) -> None:
    cases = [(case, PROXY_KEY) for case in REPRODUCTIONS] + [(case, ADMIN_KEY) for case in ADMIN_REPRODUCTIONS]
    for (name, method, path, extra, body, status, param), key in cases:
        answer = check(target, Request(method, path, _auth(*extra, key=key), body))
        if status is None:
            continue
        assert answer.status == status, (name, answer)
        if status >= 400:
            assert answer.json()["error"]["param"] == param, (name, answer)
            assert answer.json()["error"]["type"] == "invalid_request_error", (name, answer)


def test_an_import_holding_a_nul_where_a_hash_goes_is_refused(target: Target) -> None:
    """A summary's `covers_hash` was written as it came: PostgreSQL refused its NUL with an error,
    answered 503 `store_unavailable` (a store failure, retried), and SQLite stored it. A hash is
    32 hex digits, or the import is the client's mistake."""
    summary = {"type": "summary", "version": 1, "text": "s", "covers": 1, "covers_hash": "hostile\x00",
               "tokens": 1, "replaced_tokens": 1, "model": "small", "created_at": 1.0}
    body = target.export + _json(summary) + b"\n"
    answer = check(target, Request("POST", "/v1/sessions/import?session_id=imported", _auth(), body))
    assert answer.status == 400, answer
    assert "'covers_hash' must be a chain hash" in answer.json()["error"]["message"], answer


# --- what aiohttp refuses before memproxy's handlers run ------------------------------------------

POST_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + PROXY_KEY.encode()
# (name, the request's bytes, code)
UNPARSEABLE: list[tuple[str, bytes, str]] = [
    ("header over 8190 bytes", b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Long: hostile" + b"a" * 9000 + b"\r\n\r\n",
     "request_too_large"),
    # aiohttp's C parser reports a bad header as a malformed message, whatever the fault.
    ("control character in a header name", b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Ho\x01stile: v\r\n\r\n",
     "invalid_http_request"),
    ("space in a header name", b"GET /v1/models HTTP/1.1\r\nHost: x\r\nhostile name: v\r\n\r\n",
     "invalid_http_request"),
    ("bad request line", b"hostile garbage\r\n\r\n", "invalid_request_line"),
    ("bad method", b"G\x01T /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", "invalid_request_line"),
    ("br body", POST_HEAD + b"\r\nContent-Encoding: br\r\nContent-Length: 7\r\n\r\nhostile", "unsupported_content_encoding"),
    ("zstd body", POST_HEAD + b"\r\nContent-Encoding: zstd\r\nContent-Length: 7\r\n\r\nhostile",
     "unsupported_content_encoding"),
    ("bad chunked encoding", POST_HEAD + b"\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhostile\r\n0\r\n\r\n",
     "invalid_http_request"),
]


def raw_exchange(target: Target, data: bytes) -> tuple[int, dict[str, str], bytes]:
    """`data` over a socket of its own; the status, headers and body of the answer (the server
    closes the connection after it)."""
    host, port = target.served.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(data)
        received = b""
        while chunk := conn.recv(65536):
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, body


def test_unparseable_requests_get_the_error_shape(target: Target) -> None:
    for name, data, code in UNPARSEABLE:
        before = target.snapshot()
        status, headers, body = raw_exchange(target, data)
        assert status == 400, (name, status, body)
        assert headers["content-type"].startswith("application/json"), (name, headers)
        error = json.loads(body)
        assert_error_shape(error)
        assert (error["error"]["type"], error["error"]["code"]) == ("invalid_request_error", code), (name, error)
        assert b"hostile" not in body, name  # the offending bytes are not echoed
        assert target.snapshot() == before, name
    # The server still answers after all that.
    assert target.send(Request("GET", "/v1/models", _auth(), None)).status == 200


def test_an_expectation_other_than_100_continue_is_a_417_in_the_error_shape(target: Target) -> None:
    """aiohttp answers an unknown `Expect` before any middleware: a plain-text 417 quoting it, or a
    500 where it is not ASCII (that text failed to encode), for a caller with a key or without."""
    for expect in (b"hostile", b"hostile\xff", b"100-continue, hostile"):
        for key in (PROXY_KEY, "not-a-key"):
            before = target.snapshot()
            status, headers, body = raw_exchange(target, POST_HEAD.replace(PROXY_KEY.encode(), key.encode())
                                                 + b"\r\nExpect: " + expect + b"\r\nContent-Type: application/json"
                                                 + b"\r\nContent-Length: " + str(len(_json(CHAT))).encode()
                                                 + b"\r\n\r\n" + _json(CHAT))
            assert status == 417, (expect, status, body)
            assert headers["content-type"].startswith("application/json"), headers
            assert headers["x-content-type-options"] == "nosniff" and headers["cache-control"] == "no-store"
            error = json.loads(body)
            assert_error_shape(error)
            assert (error["error"]["code"], error["error"]["param"]) == ("expectation_failed", "Expect"), error
            assert b"hostile" not in body
            assert target.snapshot() == before
    # The expectation HTTP/1.1 defines is met as before: a 100 Continue, then the answer.
    status, _, body = raw_exchange(target, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                                   + PROXY_KEY.encode() + b"\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n")
    assert status == 100 and b'"object": "list"' in body, body
