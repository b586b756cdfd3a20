"""Broken streams, exact round trips and failed recordings (issue 12, items 1 and 2).

- Once a stream's headers are out, any failure (a provider's malformed chunk, a store refusing the
  turn) ends it with exactly one OpenAI-shaped error event and no `[DONE]`, never a second HTTP
  response written into the body, and never the exception's text.
- Every valid JSON string is stored and returned exactly on both stores: a NUL anywhere (message,
  system prompt, title, metadata, summary text), a lone surrogate in a provider's answer (relayed as
  the escape the provider sent).
- A turn whose recording fails after the provider answered: a plain response still carries the
  answer, with `X-Memproxy-Stored: false`; a stream ends with the store's error event after the
  content. Nothing of the turn is stored, and the next turn, once the store is well, stores it all.

The store is made to fail for real: a trigger that refuses every new message (on both databases),
or on SQLite the file's write lock held by another connection past the busy timeout.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import aiohttp
import openai
import pytest

from conftest import PROXY_KEY, Proxy
from db import execute, rows, table_rows, write_lock_held
from fake_upstream import FakeUpstream, Reply
from memproxy.config import Config
from memproxy.messages import chain_hash
from memproxy.store import Summary, open_store
from memproxy.typedefs import STORE

pytestmark = [pytest.mark.both_stores, pytest.mark.both_transports]

NUL = "\u0000"
TABLES = ("sessions", "turns", "messages")


def auth(session: str = "s1") -> dict[str, str]:
    return {"Authorization": f"Bearer {PROXY_KEY}", "X-Session-Id": session}


async def post_chat(proxy: Proxy, body: dict[str, Any], session: str = "s1") -> tuple[int, dict[str, str], bytes]:
    # A deadline: a second response written into a chunked body leaves a client waiting for its end.
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        async with http.post(proxy.server.make_url("/v1/chat/completions"), json=body,
                             headers=auth(session)) as response:
            return response.status, dict(response.headers), await response.read()


def events_of(raw: bytes) -> list[str]:
    """The SSE events of a stream's body; every one must be a `data:` line."""
    text = raw.decode()
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), text
    return [e[len("data: "):] for e in events]


def assert_error_event(event: str, code: str) -> None:
    body = json.loads(event)
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "code", "param"}
    assert (body["error"]["type"], body["error"]["code"]) == ("server_error", code)


def stored_bodies(config: Config, session: str = "s1") -> list[dict[str, Any]]:
    found = rows(config, "SELECT m.body FROM messages m JOIN sessions s ON s.pk = m.session_pk"
                         " WHERE s.session_id = ? AND m.active = 1 ORDER BY m.seq", session)
    return [json.loads(body) for (body,) in found]


def refuse_messages(config: Config) -> None:
    """From now on the database refuses every new message: a store failing at record time."""
    if config.storage.is_postgres:
        execute(config, "CREATE FUNCTION refuse_messages() RETURNS trigger AS $$"
                        " BEGIN RAISE EXCEPTION 'refused'; END $$ LANGUAGE plpgsql")
        execute(config, "CREATE TRIGGER refuse BEFORE INSERT ON messages FOR EACH ROW"
                        " EXECUTE FUNCTION refuse_messages()")
    else:
        execute(config, "CREATE TRIGGER refuse BEFORE INSERT ON messages BEGIN SELECT RAISE(ABORT, 'refused'); END")


def accept_messages(config: Config) -> None:
    execute(config, "DROP TRIGGER refuse ON messages" if config.storage.is_postgres else "DROP TRIGGER refuse")


# --- item 1: a stream never carries a second response ------------------------------------------


async def test_a_malformed_chunk_ends_the_stream_with_one_internal_error_event(
    proxy: Proxy, upstream: FakeUpstream, config: Config, caplog: pytest.LogCaptureFixture, transport: str,
) -> None:
    if transport == "litellm":
        pytest.skip("litellm rebuilds every chunk from its own model: the malformed content never reaches memproxy")
    # A provider whose delta content is not a string: assembling the answer to record it fails (a
    # bug's stand-in: neither a provider error nor a lost client) after the headers went out.
    upstream.enqueue(Reply(raw_content='["secret-part"]'))
    body = {"model": "small", "stream": True, "messages": [{"role": "user", "content": "private words"}]}
    with caplog.at_level(logging.INFO, logger="memproxy"):
        status, _, raw = await post_chat(proxy, body)
    assert status == 200
    assert b"HTTP/1.1" not in raw
    events = events_of(raw)
    assert "[DONE]" not in events
    assert_error_event(events[-1], "internal_error")
    assert [e for e in events if '"error"' in e] == [events[-1]]
    assert json.loads(events[-1])["error"]["message"] == "internal error"
    assert table_rows(config, *TABLES) == {t: [] for t in TABLES}
    failures = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(failures) == 1 and "TypeError" in failures[0] and "Traceback" not in failures[0]
    assert all("private words" not in r.getMessage() and "secret" not in r.getMessage() for r in caplog.records)


async def test_a_store_failing_at_record_time_ends_the_stream_after_the_content(
    proxy: Proxy, upstream: FakeUpstream, config: Config, caplog: pytest.LogCaptureFixture,
) -> None:
    refuse_messages(config)
    upstream.enqueue(Reply(content="the whole answer"))
    body = {"model": "small", "stream": True, "messages": [{"role": "user", "content": "tell me"}]}
    with caplog.at_level(logging.INFO, logger="memproxy"):
        status, _, raw = await post_chat(proxy, body)
    assert status == 200
    assert b"HTTP/1.1" not in raw
    events = events_of(raw)
    assert "[DONE]" not in events
    content = "".join(json.loads(e)["choices"][0]["delta"].get("content") or ""
                      for e in events[:-1] if json.loads(e).get("choices"))
    assert content == "the whole answer"  # all of it reached the client before the error
    assert_error_event(events[-1], "store_unavailable")
    assert rows(config, "SELECT count(*) FROM messages") == [(0,)]
    assert rows(config, "SELECT count(*) FROM turns") == [(0,)]
    assert "refused" not in raw.decode()  # the database's own words stay in the server
    assert all("tell me" not in r.getMessage() for r in caplog.records)
    # The SDK sees the stream as failed, not as a short answer.
    upstream.enqueue(Reply(content="the whole answer"))
    stream = await proxy.client().chat.completions.create(
        model="small", stream=True, messages=[{"role": "user", "content": "tell me"}])
    with pytest.raises(openai.APIError):
        async for _ in stream:
            pass


# --- item 2: a failed recording does not cost the client its answer -----------------------------


async def test_a_plain_turn_whose_recording_fails_returns_the_answer_marked_unstored(
    proxy: Proxy, upstream: FakeUpstream, config: Config,
) -> None:
    client = proxy.client()
    first = await client.chat.completions.with_raw_response.create(
        model="small", messages=[{"role": "user", "content": "one"}])
    assert first.headers["X-Memproxy-Stored"] == "true"
    refuse_messages(config)
    upstream.enqueue(Reply(content="paid for"))
    first_answer = first.parse().choices[0].message.content
    history: Any = [{"role": "user", "content": "one"}, {"role": "assistant", "content": first_answer},
                    {"role": "user", "content": "two"}]
    raw = await client.chat.completions.with_raw_response.create(model="small", messages=history)
    assert raw.http_response.status_code == 200
    assert raw.parse().choices[0].message.content == "paid for"
    assert raw.headers["X-Memproxy-Stored"] == "false"
    assert len(upstream.chat_requests()) == 2  # the provider was asked once for it, and only once
    assert len(stored_bodies(config)) == 2  # the first turn only
    # Once the store is well, the client's next turn (the unstored exchange in its history) stores all.
    accept_messages(config)
    history += [{"role": "assistant", "content": "paid for"}, {"role": "user", "content": "three"}]
    after = await client.chat.completions.with_raw_response.create(model="small", messages=history)
    assert after.headers["X-Memproxy-Stored"] == "true"
    assert [m["content"] for m in stored_bodies(config)] == [
        "one", first.parse().choices[0].message.content, "two", "paid for", "three",
        after.parse().choices[0].message.content]


async def test_a_response_whose_recording_fails_says_it_is_not_kept(
    proxy: Proxy, upstream: FakeUpstream, config: Config,
) -> None:
    """The Responses API's plain answer: paid for, so the client gets it, with `store: false` (it
    cannot be retrieved or continued from), not an id that then turns out not to exist."""
    client = proxy.client()
    refuse_messages(config)
    upstream.enqueue(Reply(content="paid for"))
    raw = await client.responses.with_raw_response.create(model="small", input="hello")
    response = raw.parse()
    assert raw.headers["X-Memproxy-Stored"] == "false"
    assert response.output_text == "paid for" and response.store is False
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(response.id)
    accept_messages(config)
    upstream.enqueue(Reply(content="kept"))
    kept = await client.responses.create(model="small", input="again")
    assert kept.store is True and (await client.responses.retrieve(kept.id)).output_text == "kept"


async def test_sqlite_locked_past_its_busy_timeout_at_record_time(
    start_proxy: Callable[[Config], Any], upstream: FakeUpstream, config: Config,
) -> None:
    if config.storage.is_postgres:
        pytest.skip("SQLite's busy timeout")
    proxy: Proxy = await start_proxy(replace(config, storage=replace(config.storage, busy_timeout_ms=100)))
    client = proxy.client()
    with write_lock_held(config):  # another process holds the file's write lock longer than 100 ms
        raw = await client.chat.completions.with_raw_response.create(
            model="small", messages=[{"role": "user", "content": "one"}])
        assert raw.headers["X-Memproxy-Stored"] == "false"
        answer = raw.parse().choices[0].message.content
    assert stored_bodies(config) == []
    after = await client.chat.completions.with_raw_response.create(
        model="small", messages=[{"role": "user", "content": "one"}, {"role": "assistant", "content": answer},
                                 {"role": "user", "content": "two"}])
    assert after.headers["X-Memproxy-Stored"] == "true"
    assert [m["content"] for m in stored_bodies(config)][:3] == ["one", answer, "two"]


# --- item 2: every valid JSON string round-trips ----------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_a_nul_in_every_stored_text_round_trips(
    proxy: Proxy, upstream: FakeUpstream, config: Config, stream: bool,
) -> None:
    system = f"be{NUL}brief"
    user = f"hello{NUL}world"
    upstream.enqueue(Reply(content=f"an{NUL}swer"))
    client = proxy.client()
    async with aiohttp.ClientSession() as http:
        url = f"{proxy.url}/sessions/s1/metadata"
        async with http.put(url, json={"note": f"a{NUL}b", f"k{NUL}": [NUL]}, headers=auth()) as response:
            assert response.status == 200, await response.text()
    messages: Any = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    if stream:
        chunks = await client.chat.completions.create(model="small", messages=messages, stream=True)
        answer = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
    else:
        reply = await client.chat.completions.create(model="small", messages=messages)
        answer = reply.choices[0].message.content or ""
    assert answer == f"an{NUL}swer"
    assert upstream.last().messages == messages
    assert stored_bodies(config) == [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    # The next turn recognises the stored history (the hashes match) and sends it back exactly.
    raw = await client.chat.completions.with_raw_response.create(
        model="small", messages=[*messages, {"role": "assistant", "content": answer},
                                 {"role": "user", "content": f"again{NUL}"}])
    assert raw.headers["X-Memproxy-Reconcile"] == "continue"
    assert upstream.last().messages[:3] == [*messages, {"role": "assistant", "content": answer}]
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{proxy.url}/sessions/s1", headers=auth()) as response:
            shown = await response.json()
            assert response.status == 200, shown
        async with http.get(f"{proxy.url}/sessions/s1/metadata", headers=auth()) as response:
            assert await response.json() == {"note": f"a{NUL}b", f"k{NUL}": [NUL]}
    assert shown["title"] == user
    assert rows(config, "SELECT system_prompt FROM sessions") == [(json.dumps([messages[0]], separators=(",", ":")),)]


async def test_summary_and_title_texts_with_nul_and_surrogates_round_trip(
    proxy: Proxy, upstream: FakeUpstream, config: Config,
) -> None:
    client = proxy.client()
    first = await client.chat.completions.create(model="small", messages=[{"role": "user", "content": "one"}])
    history = [{"role": "user", "content": "one"}, {"role": "assistant", "content": first.choices[0].message.content}]
    store = await open_store(config.storage)
    try:
        session = await store.get_session("a", "s1")
        assert session is not None
        covers_hash = chain_hash(chain_hash("", history[0]), history[1])
        text = f"\x1bmemproxy-json:\"not json{NUL} \ud800 é"
        await store.save_summary(session, 0, Summary(version=1, text=text, covers=2, covers_hash=covers_hash,
                                                     tokens=10, replaced_tokens=20, model=f"m{NUL}"))
        [saved] = await store.summary_history(session)
        assert (saved.text, saved.model) == (text, f"m{NUL}")
        current = await store.current_summary(session, 2)
        assert current is not None and current.text == text
        # An export carries them exactly, and an import stores them again.
        records = await store.export_session(session)
        [head] = [r for r in records if r["type"] == "session"]
        head["title"] = f"\x1bmemproxy-json:{NUL}title"
        await store.import_session("a", "copy", records)
        copy = await store.get_session("a", "copy")
        assert copy is not None
        assert (await store.session_info(copy)).title == f"\x1bmemproxy-json:{NUL}title"
        assert [s.text for s in await store.summary_history(copy)] == [text]
    finally:
        await store.close()


async def test_a_streamed_chunk_of_a_megabyte_is_relayed_and_stored(
    proxy: Proxy, upstream: FakeUpstream, config: Config, transport: str,
) -> None:
    """A provider may send a whole answer, an image or a clip of audio as one event: a line of SSE far
    over aiohttp's 128 KiB line limit, which memproxy's own client read as a 500 (or an error event
    later in a stream)."""
    answer = "long answer " * 100_000  # 1.2 MB in one chunk
    upstream.enqueue(Reply(raw_content=json.dumps(answer)))
    body = {"model": "small", "stream": True, "messages": [{"role": "user", "content": "all at once"}]}
    status, _, raw = await post_chat(proxy, body)
    assert status == 200
    events = events_of(raw)
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["delta"].get("content") or ""
                   for e in events[:-1] if json.loads(e).get("choices")) == answer
    assert stored_bodies(config)[-1] == {"role": "assistant", "content": answer}


@pytest.mark.parametrize("stream", [False, True])
async def test_a_lone_surrogate_in_a_providers_answer_is_relayed_and_stored(
    proxy: Proxy, upstream: FakeUpstream, config: Config, stream: bool, transport: str,
) -> None:
    upstream.enqueue(Reply(raw_content='"half \\ud800 of a pair, \\u00e9"'))
    body = {"model": "small", "stream": stream, "messages": [{"role": "user", "content": "odd"}]}
    status, headers, raw = await post_chat(proxy, body)
    assert status == 200, raw
    expected = "half \ud800 of a pair, é"
    if stream:
        events = events_of(raw)
        assert events[-1] == "[DONE]"
        content = "".join(json.loads(e)["choices"][0]["delta"].get("content") or ""
                          for e in events[:-1] if json.loads(e).get("choices"))
        assert "\\ud800" in raw.decode()
    else:
        assert headers["X-Memproxy-Stored"] == "true"
        content = json.loads(raw)["choices"][0]["message"]["content"]
    assert content == expected
    assert stored_bodies(config)[-1] == {"role": "assistant", "content": expected}
    # The stored answer goes upstream again with the next turn as the same escape, on either transport
    # (litellm's own HTTP client writes JSON escapes; the OpenAI SDK's, which memproxy does not use
    # for chat, cannot encode it, and would get U+FFFD).
    await proxy.client(**{"X-Memproxy-History": "new"}).chat.completions.create(
        model="small", messages=[{"role": "user", "content": "and then?"}])
    assert upstream.last().messages[-2:] == [{"role": "assistant", "content": expected},
                                             {"role": "user", "content": "and then?"}]
    # An export holds it as JSON's escape (UTF-8 cannot encode it), and an import restores it.
    async with aiohttp.ClientSession() as http:
        async with http.get(proxy.server.make_url("/v1/sessions/s1/export"), headers=auth()) as response:
            assert response.status == 200
            exported = await response.read()
        assert b"\\ud800" in exported
        async with http.post(proxy.server.make_url("/v1/sessions/import?session_id=copy"), data=exported,
                             headers=auth()) as response:
            assert response.status == 201, await response.text()
        async with http.get(proxy.server.make_url("/v1/sessions/copy/export"), headers=auth()) as response:
            copied = [json.loads(line) for line in (await response.read()).splitlines()]
    original = [json.loads(line) for line in exported.splitlines()]
    assert [r["body"] for r in copied if r["type"] == "message"] == \
        [r["body"] for r in original if r["type"] == "message"]
    assert {"role": "assistant", "content": expected} in [r["body"] for r in copied if r["type"] == "message"]
    # The client's SDK takes it as the provider's answer too.
    upstream.enqueue(Reply(raw_content='"again \\udfff"'))
    reply = await proxy.client("s2").chat.completions.create(model="small", messages=[{"role": "user", "content": "x"}])
    assert reply.choices[0].message.content == "again \udfff"


async def test_an_answer_of_nothing_is_stored_as_empty_text_and_resent_so(
    proxy: Proxy, upstream: FakeUpstream, config: Config,
) -> None:
    """No content, calls or refusal (a reasoning model that spent its output thinking): relayed as it
    came, stored with empty content; resent with null content and no calls, OpenAI would refuse
    every later request of the session."""
    upstream.enqueue(Reply(content=None, finish_reason="length"))
    status, headers, raw = await post_chat(proxy, {"model": "small", "messages": [{"role": "user", "content": "think"}]})
    assert status == 200 and headers["X-Memproxy-Stored"] == "true", raw
    assert json.loads(raw)["choices"][0]["message"]["content"] is None
    assert stored_bodies(config)[-1] == {"role": "assistant", "content": ""}
    second = await proxy.client(**{"X-Memproxy-History": "new"}).chat.completions.create(
        model="small", messages=[{"role": "user", "content": "and now?"}])
    assert upstream.last().messages[-2:] == [{"role": "assistant", "content": ""},
                                             {"role": "user", "content": "and now?"}]
    # The client resending the answer as it got it (null content) goes on from it: nothing twice.
    upstream.enqueue(Reply(content="Done."))
    status, headers, raw = await post_chat(proxy, {"model": "small", "messages": [
        {"role": "user", "content": "think"}, {"role": "assistant", "content": None},
        {"role": "user", "content": "and now?"}, {"role": "assistant", "content": second.choices[0].message.content},
        {"role": "user", "content": "last"}]})
    assert status == 200 and headers["X-Memproxy-Reconcile"] == "continue", raw


async def test_a_completion_without_choices_is_a_502_that_stores_nothing(
    proxy: Proxy, upstream: FakeUpstream, config: Config, transport: str,
) -> None:
    upstream.enqueue(Reply(no_choices=True))
    status, headers, raw = await post_chat(proxy, {"model": "small", "messages": [{"role": "user", "content": "hi"}]})
    assert status >= 500, raw
    body = json.loads(raw)
    assert set(body["error"]) == {"message", "type", "code", "param"}
    if transport == "openai":  # litellm refuses the answer itself, with its own status
        assert (status, body["error"]["code"]) == (502, "upstream_error")
    assert stored_bodies(config) == []


# --- item 7 on both stores: a store that fails when the turn is planned ----------------------------


@pytest.mark.parametrize("on_failure", ["error", "passthrough"])
async def test_a_store_failing_at_plan_time_costs_no_upstream_call(
    start_proxy: Callable[[Config], Any], upstream: FakeUpstream, config: Config, on_failure: str,
) -> None:
    config = replace(config, storage=replace(config.storage, on_failure=on_failure))
    proxy: Proxy = await start_proxy(config)
    await proxy.app[STORE].close()  # every read and write now fails in the driver (a closed pool, a closed file)
    body = {"model": "small", "messages": [{"role": "user", "content": "hi"}]}
    for stream in (False, True):
        status, headers, raw = await post_chat(proxy, {**body, "stream": stream})
        if on_failure == "error":
            assert status == 503
            assert json.loads(raw) == {"error": {"message": json.loads(raw)["error"]["message"],
                                                 "type": "server_error", "code": "store_unavailable", "param": None}}
            assert upstream.chat_requests() == []
        else:
            assert status == 200
            assert (headers["X-Memproxy-Memory"], headers["X-Memproxy-Stored"]) == ("unavailable", "false")
            assert upstream.last().messages == body["messages"]
            if stream:
                assert events_of(raw)[-1] == "[DONE]"
            else:
                assert json.loads(raw)["choices"][0]["message"]["content"]
    assert table_rows(config, *TABLES) == {t: [] for t in TABLES}


async def test_titles_written_before_the_escape_read_back_unchanged(
    proxy: Proxy, upstream: FakeUpstream, config: Config,
) -> None:
    await proxy.client().chat.completions.create(model="small", messages=[{"role": "user", "content": "hi"}])
    async with aiohttp.ClientSession() as http:
        for title in ("plain", "\x1bplain", '\x1b"[1]"', '\x1bmemproxy-json:"not closed', '\x1bmemproxy-json:[1]'):
            execute(config, "UPDATE sessions SET title = ?", title)
            async with http.get(f"{proxy.url}/sessions/s1", headers=auth()) as response:
                assert (await response.json())["title"] == title


@pytest.mark.parametrize("stream", [False, True])
async def test_an_answer_nested_past_the_parsers_depth_is_a_502_and_nothing_is_stored(
    proxy: Proxy, upstream: FakeUpstream, config: Config, stream: bool, transport: str,
) -> None:
    """A provider's JSON nested deeper than Python's parser goes (`json.loads` raises RecursionError,
    not ValueError) is a bad answer from upstream, as any other invalid JSON: a 502 or an error
    event, never a 500, and the turn is not half-written."""
    upstream.enqueue(Reply(raw_content="[" * 100_000 + "]" * 100_000))
    body = {"model": "small", "stream": stream, "messages": [{"role": "user", "content": "deep"}]}
    status, _, raw = await post_chat(proxy, body)
    if stream and status == 200:
        events = events_of(raw)
        assert "[DONE]" not in events
        assert json.loads(events[-1])["error"]["type"] != "internal_error", events[-1]
    else:
        assert status == 502, raw
        error = json.loads(raw)["error"]
        assert set(error) >= {"message", "type", "code", "param"}
    assert table_rows(config, *TABLES) == {t: [] for t in TABLES}
