"""The session admin API (issue 4): usage, the upstream tokens and cost a tenant spent.

The proxy runs in process on a real port, driven by the `openai` SDK for chats and a plain aiohttp
client for `/v1/sessions` (helpers in `tests/admin_api.py`); what the API reports is checked against
what the fake upstream received and against the store, read from a second connection.
"""

from __future__ import annotations


import aiohttp
import litellm
import pytest

from admin_api import (
    MakeStorage,
    NOTHING_DELETED,
    StartProxy,
    api_for,
    config_of,
    start,
    stored_bodies,
    words,
)
from conftest import OTHER_KEY
from db import rows
from fake_upstream import FakeUpstream, Reply
from helpers import send_turn, user
from memproxy.tokens import TiktokenCounter, encoding_name_for, request_tokens

pytestmark = pytest.mark.both_stores


# --- usage --------------------------------------------------------------------------------------


async def test_usage_counts_upstream_tokens_cost_and_tokens_kept_out(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    proxy = await start(start_proxy, make_storage, upstream, overflow="drop")
    api, config = api_for(http, proxy), config_of(proxy)
    usages = [{"prompt_tokens": 100 * (i + 1), "completion_tokens": 10 + i} for i in range(6)]
    upstream.enqueue(*[Reply(content=f"answer {i}", usage=u) for i, u in enumerate(usages)])
    omitted = []
    for i in range(5):  # ~300 tokens a turn in a 1724-token budget: older turns get left out
        headers = await send_turn(proxy, "long", [user(f"turn {i}: " + words(300, f"w{i}"))])
        omitted.append(int(headers["X-Memproxy-Stored-Omitted"]))
    await send_turn(proxy, "priced", [user("what does this cost?")], model="big")
    assert omitted[0] == 0 and omitted[-1] > 0

    turns = rows(config, "SELECT s.session_id, t.context_tokens, t.full_tokens, t.cost FROM turns t"
                         " JOIN sessions s ON s.pk = t.session_pk ORDER BY t.id")
    saved = {sid: sum(full - context for s, context, full, _ in turns if s == sid) for sid in ("long", "priced")}
    assert saved["long"] > 0 and saved["priced"] == 0
    # What resending everything would have cost: never less than what was sent, growing turn by
    # turn, and for the last turn the whole stored conversation recounted apart from memproxy.
    assert all(full >= context for _, context, full, _ in turns)
    assert [full for s, _, full, _ in turns if s == "long"] == sorted(full for s, _, full, _ in turns if s == "long")
    counter = TiktokenCounter(encoding_name_for("openai/small"))
    last_full = [full for s, _, full, _ in turns if s == "long"][-1]
    assert last_full == request_tokens(counter, stored_bodies(config, "long")[:-1], [])

    by_id = {s["id"]: s for s in (await api.get("/sessions"))["data"]}
    assert by_id["long"]["usage"] == {"turns": 5, "prompt_tokens": sum(u["prompt_tokens"] for u in usages[:5]),
                                      "completion_tokens": sum(u["completion_tokens"] for u in usages[:5]),
                                      "cost": None, "tokens_saved": saved["long"]}
    priced_cost = sum(litellm.cost_per_token(model="openai/gpt-4o-mini", prompt_tokens=600, completion_tokens=15))
    assert by_id["priced"]["usage"]["cost"] == pytest.approx(priced_cost) and priced_cost > 0
    assert (await api.get("/sessions/long"))["usage"] == by_id["long"]["usage"]

    usage = await api.get("/usage")
    assert usage == {
        "object": "usage", "tenant": "a", "sessions": 2, "turns": 6, "summary_calls": 0,
        "prompt_tokens": sum(u["prompt_tokens"] for u in usages),
        "completion_tokens": sum(u["completion_tokens"] for u in usages),
        "cost": pytest.approx(priced_cost),
        "context_tokens": sum(context for _, context, _, _ in turns),
        "full_history_tokens": sum(full for _, _, full, _ in turns),
        "tokens_saved": saved["long"],
        "deleted_sessions": NOTHING_DELETED,
        "endpoints": {},
    }
    assert (await api.as_(OTHER_KEY).get("/usage"))["turns"] == 0


async def test_summariser_calls_are_spending_too(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """A summariser call's tokens and cost count in its session's usage, and what it sent counts
    against the tokens memory saved; it is not a chat turn. Discarded summaries were paid for too."""
    proxy = await start(start_proxy, make_storage, upstream, summaries=True, overflow="summarize", tail_turns=1)
    api, config = api_for(http, proxy), config_of(proxy)
    for i in range(3):
        upstream.enqueue(Reply(content=f"answer {i}", usage={"prompt_tokens": 100, "completion_tokens": 10}))
        await send_turn(proxy, "s1", [user(f"question number {i}, with some words to summarise")])
    before = await api.get("/usage")
    bloated = Reply(content=words(2000, "bloat"), usage={"prompt_tokens": 400, "completion_tokens": 300})
    upstream.summarizer = lambda received: bloated
    assert (await api.post("/sessions/s1/compact"))["outcome"] == "discarded"  # not smaller: thrown away
    upstream.summarizer = lambda received: Reply(content="The user asked three questions.",
                                                 usage={"prompt_tokens": 300, "completion_tokens": 7})
    assert (await api.post("/sessions/s1/compact"))["outcome"] == "applied"

    [first, second] = rows(config, "SELECT model, context_tokens, prompt_tokens, completion_tokens, full_tokens"
                                   " FROM turns WHERE kind = 'summary' ORDER BY id")
    assert first[0] == "small" and first[2:] == (400, 300, 0) and second[2:] == (300, 7, 0)
    summariser_sent = first[1] + second[1]
    assert first[1] > 0 and first[1] == second[1]  # the same request, counted as the summariser sends it
    after = await api.get("/usage")
    assert after == {**before, "summary_calls": 2, "prompt_tokens": before["prompt_tokens"] + 700,
                     "completion_tokens": before["completion_tokens"] + 307,
                     "context_tokens": before["context_tokens"] + summariser_sent,
                     "tokens_saved": before["tokens_saved"] - summariser_sent}
    listed = (await api.get("/sessions"))["data"][0]["usage"]
    assert listed["turns"] == 3 and listed["prompt_tokens"] == 300 + 700
    assert listed["tokens_saved"] == after["tokens_saved"]
