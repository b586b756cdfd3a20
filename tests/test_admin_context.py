"""The session admin API (issue 4): the context preview, exactly what the next request sends.

The proxy runs in process on a real port, driven by the `openai` SDK for chats and a plain aiohttp
client for `/v1/sessions` (helpers in `tests/admin_api.py`); what the API reports is checked against
what the fake upstream received and against the store, read from a second connection.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import aiohttp
import pytest

from admin_api import (
    MakeStorage,
    SYSTEM,
    StartProxy,
    api_for,
    assert_error,
    part,
    preview_of,
    short_summary,
    start,
    tool_call,
    words,
)
from conftest import Proxy
from fake_upstream import FakeUpstream, Reply
from helpers import assistant, send_turn, user
from memproxy.memory.fit import SUMMARY_PREFIX
from memproxy.tokens import TiktokenCounter, encoding_name_for, request_tokens
from memproxy.typedefs import SUMMARIZER

pytestmark = pytest.mark.both_stores


# --- the context the next request sends ---------------------------------------------------------


async def converse(proxy: Proxy, upstream: FakeUpstream, scenario: str) -> None:
    """Session s1 of tenant a, as a client that sends only its new messages."""
    if scenario == "tool-output-trimmed":
        upstream.enqueue(Reply(tool_calls=[tool_call("call_1", "search")]))
        await send_turn(proxy, "s1", [SYSTEM, user("look it up")])
        await send_turn(proxy, "s1", [{"role": "tool", "tool_call_id": "call_1", "content": words(600, "row")}])
        return
    size = {"plain": 5, "summary": 150}.get(scenario, 300)
    for i in range(6):
        await send_turn(proxy, "s1", ([SYSTEM] if i == 0 else []) + [user(f"turn {i}: " + words(size, f"w{i}"))])
    if scenario == "summary":
        await proxy.app[SUMMARIZER].wait_idle()


SCENARIOS: dict[str, dict[str, Any]] = {
    "plain": {},
    "history-dropped": {"overflow": "drop"},
    "history-marked": {"overflow": "marker"},
    "summary": {"summaries": True, "overflow": "summarize", "chunk_threshold_tokens": 400, "tail_turns": 1},
    "tool-output-trimmed": {"tool_output_max_tokens": 64},
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
async def test_context_is_exactly_what_the_next_request_sends(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession, scenario: str
) -> None:
    proxy = await start(start_proxy, make_storage, upstream, **SCENARIOS[scenario])
    api = api_for(http, proxy)
    upstream.summarizer = short_summary
    await converse(proxy, upstream, scenario)
    stored = (await api.get("/sessions/s1"))["message_count"]

    preview = await preview_of(api, "s1", "what next?", model="small")
    without = await api.post("/sessions/s1/context", json={"model": "small"})
    assert await api.get("/sessions/s1/context?model=small") == without
    assert preview["object"] == "session.context" and preview["model"] == "small"
    assert preview["expired"] is False and preview["would_summarize"] is False
    budget = preview["budget"]
    assert budget == {"window": 2000, "output_reserve": 256, "safety_margin": 20, "input_tokens": 1724,
                      "calibration": 1.0, "planned_tokens": 1724}
    assert preview["tokens"] <= budget["input_tokens"]

    parts = {p["part"]: p for p in preview["parts"]}
    assert sum(p.get("tokens", 0) for p in preview["parts"]) == preview["tokens"]
    assert parts["system"]["messages"] == 1 and parts["new"]["messages"] == 1
    assert parts["kept"]["messages"] + parts["left_out"]["messages"] == stored
    assert len(preview["messages"]) == (1 + ("summary" in parts) + ("marker" in parts)
                                        + parts["kept"]["messages"] + 1)
    assert preview["messages"][0] == SYSTEM and preview["messages"][-1] == user("what next?")
    if scenario in ("plain", "tool-output-trimmed"):
        assert parts["left_out"]["messages"] == 0 and "summary" not in parts and "marker" not in parts
    if scenario in ("history-dropped", "history-marked"):
        left_out = parts["left_out"]
        assert left_out["messages"] > 0 and left_out["unsummarised"] == left_out["messages"]
        assert ("marker" in parts) == (scenario == "history-marked")
    if scenario == "summary":
        assert parts["summary"]["version"] >= 1 and parts["summary"]["covers_messages"] > 0
        assert parts["left_out"]["summarised"] == parts["summary"]["covers_messages"]
        assert parts["left_out"]["unsummarised"] == 0
        assert preview["messages"][1]["content"].startswith(SUMMARY_PREFIX)
    assert parts["kept"]["tool_outputs_trimmed"] == (1 if scenario == "tool-output-trimmed" else 0)
    # What was left out is counted too, as stored: what the summary or marker stand in for.
    stored_tokens = [m["tokens"] for m in (await api.get("/sessions/s1"))["messages"]]
    assert parts["left_out"]["tokens_stored"] == sum(stored_tokens[: parts["kept"]["from_position"]])
    assert (parts["left_out"]["tokens_stored"] > 0) == (parts["left_out"]["messages"] > 0)

    # Now the client sends that message: upstream gets exactly the preview, byte for byte.
    headers = await send_turn(proxy, "s1", [user("what next?")])
    assert headers["X-Memproxy-Reconcile"] == "append"
    assert json.dumps(upstream.last().messages) == json.dumps(preview["messages"])
    assert int(headers["X-Memproxy-Context-Tokens"]) == preview["tokens"]
    assert int(headers["X-Memproxy-Stored-Omitted"]) == parts["left_out"]["messages"]
    counter = TiktokenCounter(encoding_name_for("openai/small"))  # recounted apart from memproxy
    assert request_tokens(counter, upstream.last().messages, []) == preview["tokens"]
    await proxy.app[SUMMARIZER].wait_idle()


async def test_context_of_an_agent_loop_past_the_window_shows_its_question_sent_first(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """One question, then calls and large results until the exchange alone outgrows the window: the
    preview (the next tool result as the new message) lists the question as a part of its own,
    sent verbatim before the kept turns and not recalled again, and upstream gets exactly that."""
    proxy = await start(start_proxy, make_storage, upstream, overflow="marker", recall_tokens=None)
    api = api_for(http, proxy)
    task = user("TASK-7781: find the mildest of the cities, checking each one's weather")
    upstream.enqueue(Reply(tool_calls=[tool_call("call_0", "weather")]))
    await send_turn(proxy, "s1", [SYSTEM, task])
    for k in range(1, 7):
        upstream.enqueue(Reply(tool_calls=[tool_call(f"call_{k}", "weather")]))
        await send_turn(proxy, "s1", [{"role": "tool", "tool_call_id": f"call_{k - 1}",
                                       "content": f"TASK-7781 city {k}: " + words(300, f"c{k}")}])
    result = {"role": "tool", "tool_call_id": "call_6", "content": "city 7: mild"}
    preview = await api.post("/sessions/s1/context", json={"model": "small", "messages": [result]})
    parts = {p["part"]: p for p in preview["parts"]}
    assert parts["question"] == {"part": "question", "messages": 1, "position": 0,
                                 "tokens": request_tokens(TiktokenCounter(encoding_name_for("openai/small")),
                                                          [task], []) - request_tokens(
                                     TiktokenCounter(encoding_name_for("openai/small")), [], [])}
    assert preview["messages"][1 + ("marker" in parts)] == task  # after the system prompt and the marker
    assert preview["messages"].count(task) == 1
    assert parts["kept"]["from_position"] > 1 and parts["left_out"]["messages"] > 0
    assert all(e["position"] != 0 for e in parts["recalled"]["excerpts"])
    assert parts["recalled"]["messages"] > 0  # the question's words are in what was left out
    assert sum(p.get("tokens", 0) for p in preview["parts"]) == preview["tokens"]
    stored_tokens = [m["tokens"] for m in (await api.get("/sessions/s1"))["messages"]]
    assert parts["left_out"]["tokens_stored"] == sum(stored_tokens[1: parts["kept"]["from_position"]])

    upstream.enqueue(Reply(content="Paris is the mildest."))
    headers = await send_turn(proxy, "s1", [result])
    assert json.dumps(upstream.last().messages) == json.dumps(preview["messages"])
    assert int(headers["X-Memproxy-Stored-Included"]) == parts["kept"]["messages"] + 1


async def test_context_says_when_the_next_request_will_summarise_first(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """The one case a preview cannot show: history that no longer fits and no summary covers is
    folded by the request itself. The preview says so (and shows the marker meanwhile)."""
    proxy = await start(start_proxy, make_storage, upstream, summaries=True, overflow="summarize",
                        chunk_threshold_tokens=100_000, tail_turns=1)
    api = api_for(http, proxy)
    upstream.summarizer = short_summary
    for i in range(6):  # on the large model everything fits
        await send_turn(proxy, "s1", [user(f"turn {i}: " + words(300, f"w{i}"))], model="big")
    preview = await preview_of(api, "s1", "next", model="small")
    assert preview["would_summarize"] is True and "marker" in {p["part"] for p in preview["parts"]}
    assert upstream.summary_requests() == []  # previewing folds nothing
    await send_turn(proxy, "s1", [user("next")])
    sent = upstream.last().messages
    assert upstream.summary_requests()  # folded first, then sent
    assert sent[0]["content"].startswith(SUMMARY_PREFIX) and sent != preview["messages"]
    assert (await preview_of(api, "s1", "next", model="small"))["would_summarize"] is False


async def test_no_content_in_a_url_and_none_in_the_access_log(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A URL is logged by access logs and proxies: the preview of a new message takes it in a body."""
    caplog.set_level(logging.DEBUG, logger="aiohttp.access")
    proxy = await start(start_proxy, make_storage, upstream)
    api = api_for(http, proxy)
    await send_turn(proxy, "s1", [user("hello")])
    for query in ("message=hi", "messages=hi", "model=small&message="):
        body = await api.get(f"/sessions/s1/context?{query}", status=400)
        assert_error(body, type="invalid_request_error", param="message")
    secret = "my passport number is X1234567"
    preview = await preview_of(api, "s1", secret)
    assert preview["messages"][-1] == user(secret)
    access = [r for r in caplog.records if r.name == "aiohttp.access"]
    assert any("/sessions/s1/context" in r.getMessage() for r in access), "no access log: proves nothing"
    assert not any(secret.split()[-1] in r.getMessage() for r in caplog.records)


async def test_context_counts_a_response_format_schema_as_the_chat_does(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    proxy = await start(start_proxy, make_storage, upstream)
    api = api_for(http, proxy)
    await send_turn(proxy, "s1", [user("hello")])
    schema = {"name": "answer", "schema": {"type": "object", "properties": {
        "city": {"type": "string", "description": "the city the user lives in, as they wrote it"},
        "country": {"type": "string"}}}}
    response_format = {"type": "json_schema", "json_schema": schema}
    plain = await preview_of(api, "s1", "where do I live?")
    shaped = await preview_of(api, "s1", "where do I live?", response_format=response_format)
    schema_tokens = part(shaped, "tools_and_priming")["tokens"] - part(plain, "tools_and_priming")["tokens"]
    assert schema_tokens > 10 and shaped["tokens"] == plain["tokens"] + schema_tokens

    client = proxy.client(session="s1")
    raw = await client.chat.completions.with_raw_response.create(
        model="small", messages=[user("where do I live?")], response_format=response_format)
    raw.parse()
    assert int(raw.headers["X-Memproxy-Context-Tokens"]) == shaped["tokens"]
    assert upstream.last().messages == shaped["messages"]


async def test_context_of_a_session_without_a_new_message_and_for_another_model(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    proxy = await start(start_proxy, make_storage, upstream)
    api = api_for(http, proxy)
    await send_turn(proxy, "s1", [user("hello")])
    preview = await api.get("/sessions/s1/context")  # the model the session chatted with by default
    assert preview["model"] == "small"
    assert preview["messages"] == [user("hello"), assistant("reply 1")]
    parts = {p["part"]: p for p in preview["parts"]}
    assert parts["new"] == {"part": "new", "messages": 0, "tokens": 0}
    big = await api.post("/sessions/s1/context", json={"model": "big", "max_tokens": 500})
    assert big["budget"]["window"] == 100_000 and big["budget"]["output_reserve"] == 500
    body = await api.get("/sessions/s1/context?model=nope", status=404)
    assert_error(body, type="invalid_request_error", code="model_not_found", param="model")
    body = await api.post("/sessions/s1/context", json={"max_tokens": 5000}, status=400)
    assert_error(body, type="invalid_request_error", param="max_tokens")
    body = await api.post("/sessions/s1/context", data=b"[1, 2]", status=400)
    assert_error(body, type="invalid_request_error", param=None)
