"""Logs (issue 16, item 2): `memproxy serve` as a real process, its standard error read back.

One line per HTTP request whatever its answer (the error middleware's, an auth failure, a stream that
ends in an error event, a request aiohttp could not parse), with its fields; `logging.format: json`
writes one JSON object a line; the start-up line and its warnings; and no message content, metadata
value or key in any line.
"""

from __future__ import annotations

import json
import socket
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from conftest import PROXY_KEY
from fake_upstream import FakeUpstream, Reply
from processes import Served, serve_one

ADMIN_KEY = "test-admin-key-1"
UPSTREAM_KEY = "upstream-secret"
SECRET_CONTENT = "zebra-secret-content-42"
SECRET_METADATA = "okapi-secret-metadata-17"
SESSION = "log-session"


def config_text(upstream_url: str, db: Path, extra: str) -> str:
    return f"""\
server:
  host: 127.0.0.1
  port: 0
  max_body_bytes: 4096
storage:
  url: "sqlite:///{db}"
models:
  - name: small
    model: openai/small
    api_base: {upstream_url}
    api_key: {UPSTREAM_KEY}
    context_window: 2000
    max_output_tokens: 256
  - name: big
    model: openai/gpt-4o-mini
    api_base: {upstream_url}
    api_key: ""
    context_window: 100000
auth:
  keys:
    - {{key: "{PROXY_KEY}", tenant: a}}
  admin_keys: ["{ADMIN_KEY}"]
{extra}"""


def http(served: Served, method: str, path: str, key: str | None = PROXY_KEY, **kwargs: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(base_url=served.url, timeout=30) as client:
        return client.request(method, path, headers={**headers, **kwargs.pop("headers", {})}, **kwargs)


def raw(served: Served, data: bytes) -> int:
    """`data` over a socket of its own; the answer's status."""
    host, port = served.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(data)
        received = b""
        while chunk := conn.recv(65536):
            received += chunk
    return int(received.split(b" ", 2)[1])


@pytest.fixture
def json_logs(tmp_path: Path, upstream: FakeUpstream) -> tuple[list[dict[str, Any]], str]:
    """A JSON-logging proxy, driven through every kind of answer; its log lines, parsed, and its
    standard error as text."""
    config = tmp_path / "memproxy.yaml"
    config.write_text(config_text(upstream.url, tmp_path / "m.db", "logging:\n  format: json\n"))
    served = serve_one(config, tmp_path / "stderr.log")
    try:
        client = served.client(SESSION)
        chat = [{"role": "user", "content": f"remember {SECRET_CONTENT}"}]
        client.chat.completions.create(model="small", messages=chat)  # type: ignore[arg-type]
        for _ in client.chat.completions.create(model="small", messages=chat, stream=True):  # type: ignore[arg-type]
            pass
        assert http(served, "POST", "/v1/chat/completions", json={"model": "small"}).status_code == 400
        assert http(served, "GET", "/v1/models", key="not-the-proxy-key").status_code == 401
        assert http(served, "GET", "/v1/no-such-route").status_code == 404
        assert http(served, "GET", "/v1/chat/completions").status_code == 405
        big = {"model": "small", "messages": [{"role": "user", "content": SECRET_CONTENT * 400}]}
        assert http(served, "POST", "/v1/chat/completions", json=big).status_code == 413
        upstream.enqueue(Reply(status=502, error_message="bad gateway upstream"))
        with pytest.raises(openai.APIStatusError) as bad_gateway:
            client.chat.completions.create(model="small", messages=chat)  # type: ignore[arg-type]
        assert bad_gateway.value.status_code == 502
        upstream.enqueue(Reply(status=429, error_message="slow down"))
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model="small", messages=chat)  # type: ignore[arg-type]
        upstream.enqueue(Reply(content="cut short here", cut_stream=True))
        with pytest.raises(openai.APIError):
            for _ in client.chat.completions.create(model="small", messages=chat, stream=True):  # type: ignore[arg-type]
                pass
        # A transcription goes through the OpenAI SDK (litellm's client for it), which warns of a
        # response format it does not know as sent: a line of the client's own, a new line and all.
        audio = {"file": ("a.wav", b"RIFF0000WAVE", "audio/wav")}
        form = {"model": "small", "response_format": f"x\n{SECRET_CONTENT}"}
        assert http(served, "POST", "/v1/audio/transcriptions", files=audio, data=form).status_code == 200
        put = http(served, "PUT", f"/v1/sessions/{SESSION}/metadata", json={"note": SECRET_METADATA})
        assert put.status_code == 200, put.text
        assert http(served, "GET", "/metrics", key=ADMIN_KEY).status_code == 200
        assert http(served, "GET", "/healthz", key=None).status_code == 200
        assert raw(served, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nbad header: v\r\n\r\n") == 400
        # A body that is not the gzip it says, read (400) or left unread (401): no error logged
        # after the answer, whoever sends it.
        gzipped = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
        for key, status in ((PROXY_KEY, 400), (None, 401)):
            sent = http(served, "POST", "/v1/embeddings", key=key, content=b"not gzip", headers=gzipped)
            assert sent.status_code == status
    finally:
        assert served.stop() == 0, served.log.read_text()
    text = served.log.read_text()
    lines = [json.loads(line) for line in text.splitlines()]  # every line is one JSON object
    return lines, text


def test_one_json_line_per_request_whatever_its_status(json_logs: tuple[list[dict[str, Any]], str]) -> None:
    lines, _ = json_logs
    requests = [line for line in lines if line["logger"] == "memproxy.http"]
    assert all(line["message"] == "request" and line["level"] == "INFO" for line in requests)
    assert Counter((r["route"], r["status"]) for r in requests) == Counter({
        ("/v1/chat/completions", 200): 2, ("/v1/chat/completions", 400): 1, ("/v1/models", 401): 1,
        ("unmatched", 404): 1, ("unmatched", 405): 1, ("/v1/chat/completions", 413): 1,
        ("/v1/chat/completions", 502): 2, ("/v1/chat/completions", 429): 1,
        ("/v1/sessions/{session_id}/metadata", 200): 1, ("/metrics", 200): 1, ("/healthz", 200): 1,
        ("-", 400): 1, ("/v1/embeddings", 400): 1, ("/v1/embeddings", 401): 1,
        ("/v1/audio/transcriptions", 200): 1,
    })
    assert [line for line in lines if line["level"] in ("ERROR", "CRITICAL")] == []
    for line in requests:
        assert {"time", "method", "route", "status"} <= line.keys()
        assert line["time"].endswith("Z")
        if line["route"] != "-":  # aiohttp answered it before any timing began
            assert isinstance(line["duration_ms"], float) and line["duration_ms"] >= 0

    def one(**match: Any) -> dict[str, Any]:
        [found] = [r for r in requests if match.items() <= r.items()]
        return found

    plain = one(route="/v1/chat/completions", status=200, stream=False)
    assert (plain["method"], plain["tenant"], plain["session"], plain["model"]) == ("POST", "a", SESSION, "small")
    assert plain["reconcile"] == "new" and plain["context_tokens"] > 0 and plain["included"] == 0
    assert {"parse_ms", "reconcile_ms", "budget_ms", "recall_ms", "store_ms", "record_ms", "memory_ms",
            "upstream_ms"} <= plain.keys()
    assert "error" not in plain and "upstream_status" not in plain
    streamed = one(route="/v1/chat/completions", status=200, stream=True)
    assert streamed["reconcile"] == "append" and streamed["record_ms"] > 0  # the same question again
    assert one(status=400, route="/v1/chat/completions")["error"] == "invalid_request_error"  # no code: its type
    unauthorised = one(status=401, route="/v1/models")
    assert unauthorised["error"] == "invalid_api_key" and "tenant" not in unauthorised
    assert one(status=404)["error"] == "not_found"
    assert one(status=405)["error"] == "method_not_allowed"
    assert one(status=413)["error"] == "request_too_large"
    bad_gateway = one(status=502, stream=False)
    assert (bad_gateway["upstream_status"], bad_gateway["error"]) == (502, "upstream_error")
    assert bad_gateway["reconcile"] == "append" and bad_gateway["upstream_ms"] == 0  # no answer came
    cut = one(status=502, stream=True)  # a stream whose headers said 200: the error event's status
    assert cut["error"] == "upstream_incomplete" and "upstream_status" not in cut
    limited = one(status=429)
    assert (limited["upstream_status"], limited["error"]) == (429, "rate_limit_exceeded")
    assert one(route="/v1/sessions/{session_id}/metadata")["session"] == SESSION
    assert one(route="/metrics")["admin"] is True
    assert one(route="-")["error"] == "invalid_http_request"


def test_no_content_metadata_or_key_is_logged(json_logs: tuple[list[dict[str, Any]], str]) -> None:
    _, text = json_logs
    for secret in (SECRET_CONTENT, SECRET_METADATA, PROXY_KEY, ADMIN_KEY, UPSTREAM_KEY, "not-the-proxy-key"):
        assert secret not in text, secret


def test_json_start_up_line_and_the_empty_key_warning(json_logs: tuple[list[dict[str, Any]], str]) -> None:
    lines, _ = json_logs
    [start] = [line for line in lines if line["message"] == "memproxy starting"]
    assert start["logger"] == "memproxy" and start["version"] == "0.1.0"
    assert start["models"] == [
        {"name": "small", "provider": "openai", "window": 2000, "transport": "litellm"},
        {"name": "big", "provider": "openai", "window": 100000, "transport": "litellm"},
    ]
    assert (start["store"], start["auth"], start["tenant_keys"], start["admin_keys"]) == ("sqlite", "keys", 1, 1)
    [warning] = [line for line in lines if line["level"] == "WARNING"]
    assert "api_key is empty" in warning["message"]
    assert (warning["model"], warning["setting"]) == ("big", "models[1].api_key")


def test_text_lines_the_no_models_warning_and_the_level_flag(tmp_path: Path) -> None:
    config = tmp_path / "memproxy.yaml"
    config.write_text(f'storage:\n  url: "sqlite:///{tmp_path / "m.db"}"\nlogging:\n  level: WARNING\n')
    served = serve_one(config, tmp_path / "stderr.log", "--log-level", "INFO")  # the flag wins
    try:
        assert http(served, "GET", "/healthz", key=None).status_code == 200
        assert http(served, "GET", "/metrics", key=None).status_code == 200  # as the start line says
        chat = http(served, "POST", "/v1/chat/completions", json={"model": "small", "messages": [
            {"role": "user", "content": "hi"}]})
        assert chat.status_code == 404  # no models
    finally:
        assert served.stop() == 0, served.log.read_text()
    lines = served.log.read_text().splitlines()
    [start] = [line for line in lines if " INFO memproxy memproxy starting " in line]
    assert start.endswith(" memproxy starting version=0.1.0 models=[] store=sqlite auth=none tenant_keys=0"
                          " admin_keys=0 metrics=public")  # no key of any kind: anyone may read it
    assert any(" WARNING memproxy no models configured" in line for line in lines)
    requests = [line for line in lines if " INFO memproxy.http request " in line]
    assert len(requests) == 3
    assert " request method=GET route=/healthz status=200 duration_ms=" in requests[0]
    assert " request method=GET route=/metrics status=200 duration_ms=" in requests[1]
    assert (" request method=POST route=/v1/chat/completions status=404 duration_ms=" in requests[2]
            and " error=model_not_found tenant=default" in requests[2])
