"""Recall end to end (issue 14): the proxy as a real server on both stores, the openai SDK as the
client, the fake provider recording what it was sent.

An old fact left out of a small window comes back when the question asks about it, in one block
after the kept turns and before the new message, and is never stored; the headers, the context
preview, each turn's `sent` record and the search endpoints say what was found; recall across an
end user's sessions stays within the tenant and the user; superseded messages are never recalled.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import aiohttp
import pytest

from admin_api import ADMIN_KEY, MakeStorage, StartProxy, age, api_for, assert_error, config_of, part, preview_of, start
from conftest import OTHER_KEY, Proxy, make_config
from fake_upstream import FakeUpstream, Reply
from helpers import Conversation, user
from memproxy.config import RetentionConfig
from memproxy.memory.recall import RECALL_PREFIX
from memproxy.tokens import TiktokenCounter, request_tokens

pytestmark = pytest.mark.both_stores

RECALL: dict[str, Any] = {"recall_tokens": None}  # the default room
FACT = "The combination of the blue locker in the boathouse is 7281."


def filler(i: int) -> str:
    """A turn about something else, about 60 tokens, sharing no word with the fact or the question."""
    return f"Turn {i}: " + " ".join(f"weather{i}x{j}" for j in range(40))


async def long_conversation(proxy: Proxy, upstream: FakeUpstream, session: str = "s1", turns: int = 30,
                            fact: str = FACT, **headers: str) -> Conversation:
    """A session whose first message states the fact, followed by enough turns that a 2,000-token
    window leaves it out."""
    talk = Conversation(proxy, upstream, session, **headers)
    for i in range(turns):
        new = [user(fact if i == 0 else filler(i))]
        reply = Reply(content="Noted." if i == 0 else f"Answer {i}: " + " ".join(f"sun{i}y{j}" for j in range(20)))
        await talk.exchange(new, reply)
        talk.remember(new, reply)
    return talk


def block_of(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for m in messages if isinstance(m.get("content"), str) and m["content"].startswith(RECALL_PREFIX)]


async def test_an_old_fact_left_out_comes_back_when_asked_about(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession,
) -> None:
    proxy = await start(start_proxy, make_storage, upstream, **RECALL)
    api = api_for(http, proxy)
    talk = await long_conversation(proxy, upstream)
    question = [user("What is the combination of the blue locker?")]

    preview = await preview_of(api, "s1", question[0]["content"], model="small")
    received, headers = await talk.exchange(question, Reply(content="7281"))
    sent = received.messages
    [block] = block_of(sent)
    assert "[#0 " in block["content"] and FACT in block["content"] and block["role"] == "user"
    assert sent[-2:] == [block, question[0]]  # after the kept turns, right before the new message
    assert not any("7281" in str(m.get("content")) for m in sent if m is not block)  # the fact was left out
    assert int(headers["x-memproxy-recalled"]) >= 1
    assert int(headers["x-memproxy-context-tokens"]) <= int(headers["x-memproxy-input-budget"])

    # The preview said exactly this, and why.
    assert preview["messages"] == sent
    recalled = part(preview, "recalled")
    assert recalled["messages"] == int(headers["x-memproxy-recalled"]) and recalled["tokens"] > 0
    assert {"combination", "blue", "locker"} <= set(recalled["query"])
    hit = next(e for e in recalled["excerpts"] if e["position"] == 0)
    assert hit["hit"] and hit["score"] > 0 and hit["session_id"] == "s1" and hit["role"] == "user"
    assert set(hit["matched"]) == {"combination", "blue", "locker"}
    assert sum(p.get("tokens", 0) for p in preview["parts"]) == preview["tokens"]

    # Never stored; the turn's `sent` record keeps what was recalled.
    shown = await api.get("/sessions/s1")
    assert not any(RECALL_PREFIX in str(m["message"].get("content")) for m in shown["messages"])
    last = shown["turns"][-1]["sent"]
    assert {"session_id": "s1", "position": 0} in last["recalled"]
    assert len(last["recalled"]) == recalled["messages"]

    # An export of a session that recalled imports back whole, what each turn recalled included.
    exported = await api.get("/sessions/s1/export")
    await api.post("/sessions/import?session_id=s1copy", data=exported.encode(), status=201)
    assert (await api.get("/sessions/s1copy"))["turns"][-1]["sent"]["recalled"] == last["recalled"]


async def test_a_fact_said_in_chinese_comes_back_when_asked_about_in_other_words(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession,
) -> None:
    # No spaces between words: the question shares words with the fact, not whole runs of text.
    proxy = await start(start_proxy, make_storage, upstream, **RECALL)
    fact = "我的蓝色储物柜在船屋里，密码是7281。"
    talk = await long_conversation(proxy, upstream, fact=fact)
    received, headers = await talk.exchange([user("储物柜的密码是多少？")], Reply(content="7281"))
    [block] = block_of(received.messages)
    assert fact in block["content"] and int(headers["x-memproxy-recalled"]) >= 1
    assert not any("7281" in str(m.get("content")) for m in received.messages if m is not block)
    found = await api_for(http, proxy).post("/sessions/s1/search", json={"query": "船屋"})
    assert [(h["position"], h["matched"]) for h in found["data"]] == [(0, ["船屋"])]


async def test_the_summary_a_request_folds_for_itself_goes_with_what_recall_finds(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream,
) -> None:
    """With `overflow: summarize` a request that leaves turns out folds them first; recall then
    plans it again, from the session as the fold left it: the summary just made (and paid for)
    goes with this very request."""
    proxy = await start(start_proxy, make_storage, upstream, **RECALL, summaries=True, overflow="summarize",
                        chunk_threshold_tokens=1_000_000)  # only the request's own fold
    upstream.summarizer = lambda _: Reply(content="Known facts: several.")
    talk = Conversation(proxy, upstream, "folded")
    for turn in range(30):
        text = " ".join(f"w{(i * 7 + turn) % 997}" for i in range(40))  # each shares words with some others
        received, headers = await talk.exchange([user(f"FACT-{turn} {text}")], Reply(content=f"noted {text[:60]}"))
        talk.remember([user(f"FACT-{turn} {text}")], Reply(content=f"noted {text[:60]}"))
        if upstream.summary_requests():
            break
    assert int(headers["x-memproxy-summary-version"]) > 0 and int(headers["x-memproxy-recalled"]) > 0
    assert any(str(m.get("content")).startswith("Summary of the earlier conversation") for m in received.messages)


async def test_the_preview_says_whether_a_request_folds_as_the_request_does(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession,
) -> None:
    """With `overflow: summarize` a request folds what its plan leaves out unsummarised, decided
    before recall holds back room from older kept turns (those give way to recall and are not
    folded for it: folding them too summarised on nearly every turn of a tight window). The
    preview says beforehand whether a request will fold, by the same plan, where it read the plan
    recall had cut and disagreed; and the request does not fold on every turn."""
    proxy = await start(start_proxy, make_storage, upstream, **RECALL, recall_min_tokens=600, summaries=True,
                        overflow="summarize", chunk_threshold_tokens=1_000_000)  # only the request's own fold
    upstream.summarizer = lambda _: Reply(content="Known facts: several.")
    api = api_for(http, proxy)
    talk = Conversation(proxy, upstream, "s1")
    gave_way = 0
    for i in range(40):
        text = filler(i) if i else FACT
        expected = (await preview_of(api, "s1", text, model="small")) if i else None
        folds = len(upstream.summary_requests())
        new, reply = [user(text)], Reply(content=f"Answer {i}: " + " ".join(f"sun{i}y{j}" for j in range(20)))
        _, headers = await talk.exchange(new, reply)
        talk.remember(new, reply)
        if expected is not None:
            assert expected["would_summarize"] == (len(upstream.summary_requests()) > folds), f"turn {i}"
        gave_way += headers["x-memproxy-unsummarized-omitted"] != "0"
    assert 2 <= len(upstream.summary_requests()) <= 10 and gave_way  # folds now and then, not every turn


async def test_kept_turns_stay_put_where_the_room_beside_them_holds_recall(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession,
) -> None:
    """The provider's prompt cache: where a request leaves recall the room it is sure of
    (`recall_min_tokens`) beside the kept turns, they are what they would be without recall, so
    each request opens with exactly what the one before sent ahead of its block, then the exchange
    that one added, however large each block is."""
    proxy = await start(start_proxy, make_storage, upstream, **RECALL, recall_min_tokens=300)
    talk = await long_conversation(proxy, upstream)
    upstream.summarizer = lambda _: Reply(content="Known facts: several.")
    assert (await api_for(http, proxy).post("/sessions/s1/compact"))["outcome"] == "applied"
    previous: list[dict[str, Any]] | None = None
    sizes = set()
    for text in ("What is the combination of the blue locker?", "Was it weather3x1, weather3x2 or sun7y4?",
                 "Tell me about weather9x5 and weather12x7 and weather20x1 again."):
        new, reply = [user(text)], Reply(content="I recall.")
        received, headers = await talk.exchange(new, reply)
        talk.remember(new, reply)
        [block] = block_of(received.messages)
        sizes.add(len(block["content"]))
        assert int(headers["x-memproxy-context-tokens"]) <= int(headers["x-memproxy-input-budget"])
        prefix = received.messages[: received.messages.index(block)]
        assert any(str(m.get("content")).startswith("Summary of the earlier conversation") for m in prefix)
        if previous is not None:
            assert prefix[: len(previous)] == previous
            assert [m["role"] for m in prefix[len(previous):]] == ["user", "assistant"]
        previous = prefix
    assert len(sizes) == 3  # blocks of different sizes moved nothing before them


async def test_recall_off_sends_the_plain_window(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream,
) -> None:
    proxy = await start(start_proxy, make_storage, upstream)  # the core config: recall_tokens 0
    talk = await long_conversation(proxy, upstream)
    received, headers = await talk.exchange([user("What is the combination of the blue locker?")], Reply("?"))
    assert not block_of(received.messages) and "7281" not in str(received.messages)
    assert headers["x-memproxy-recalled"] == "0"


async def test_nothing_is_recalled_while_everything_fits(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream,
) -> None:
    proxy = await start(start_proxy, make_storage, upstream, **RECALL)
    talk = await long_conversation(proxy, upstream, turns=3)
    received, headers = await talk.exchange([user("What is the combination of the blue locker?")], Reply("?"))
    assert not block_of(received.messages) and headers["x-memproxy-recalled"] == "0"
    assert received.messages[0]["content"] == FACT


async def test_an_edited_fact_is_recalled_as_edited_never_as_it_was(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream,
) -> None:
    proxy = await start(start_proxy, make_storage, upstream, **RECALL)
    talk = Conversation(proxy, upstream, "s1", style="full")
    hello = [user("Hello there.")]
    await talk.exchange(hello, Reply("Hi."))
    talk.remember(hello, Reply("Hi."))
    _, headers = await talk.exchange([user(FACT)], Reply("Noted."))
    # The client edits that message: the original and its answer are superseded.
    edited = [user("The combination of the blue locker in the boathouse is 5550.")]
    _, headers = await talk.exchange(edited, Reply("Noted again."))
    assert headers["x-memproxy-reconcile"] == "edit"
    talk.remember(edited, Reply("Noted again."))
    talk.style = "new"
    for i in range(1, 30):
        new = [user(filler(i))]
        await talk.exchange(new, Reply(f"Answer {i}"))
        talk.remember(new, Reply(f"Answer {i}"))
    received, _ = await talk.exchange([user("What is the combination of the blue locker?")], Reply("?"))
    [block] = block_of(received.messages)
    assert "5550" in block["content"] and "7281" not in str(received.messages)


async def test_recall_across_an_end_users_sessions_stays_with_that_user_and_tenant(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession,
) -> None:
    proxy = await start(start_proxy, make_storage, upstream, recall_scope="user", **RECALL)
    # Alice told the fact in one session; Bob and tenant b told other combinations in theirs.
    await long_conversation(proxy, upstream, "alice-1", turns=2, **{"X-Memproxy-User": "alice"})
    await long_conversation(proxy, upstream, "bob-1", turns=2, fact=FACT.replace("7281", "1111"),
                            **{"X-Memproxy-User": "bob"})
    b_client = proxy.client(session="b-1", key=OTHER_KEY, **{"X-Memproxy-User": "alice"})
    upstream.enqueue(Reply("ok"))
    await b_client.chat.completions.create(model="small", messages=[user(FACT.replace("7281", "2222"))])
    # A new session of Alice's, long enough that recall runs, asks about it.
    talk = await long_conversation(proxy, upstream, "alice-2", turns=30, fact="Let us plan the regatta.",
                                   **{"X-Memproxy-User": "alice"})
    received, headers = await talk.exchange([user("What is the combination of the blue locker?")], Reply("?"))
    [block] = block_of(received.messages)
    assert "session alice-1 #0" in block["content"] and "7281" in block["content"]
    assert "1111" not in block["content"] and "2222" not in block["content"]
    # The `user` field names the end user when the header does not.
    plain = proxy.client(session="alice-2")
    upstream.enqueue(Reply("?"))
    await plain.chat.completions.create(model="small", user="alice",
                                        messages=[user("And the combination of the blue locker again?")])
    assert "7281" in str(upstream.chat_requests()[-1].messages)
    # And so does `safety_identifier`, which OpenAI has supersede `user`.
    upstream.enqueue(Reply("?"))
    await plain.chat.completions.create(model="small", safety_identifier="alice",
                                        messages=[user("Once more, the combination of the blue locker?")])
    assert "7281" in str(upstream.chat_requests()[-1].messages)
    assert upstream.chat_requests()[-1].body["safety_identifier"] == "alice"
    # With the default scope, only the session itself is searched.
    scoped = await start(start_proxy, make_storage, upstream, db="scoped", **RECALL)
    await long_conversation(scoped, upstream, "alice-1", turns=2, **{"X-Memproxy-User": "alice"})
    talk = await long_conversation(scoped, upstream, "alice-2", turns=30, fact="Let us plan the regatta.",
                                   **{"X-Memproxy-User": "alice"})
    received, _ = await talk.exchange([user("What is the combination of the blue locker?")], Reply("?"))
    assert "7281" not in str(received.messages)


async def test_an_end_user_named_with_a_nul_is_recalled_across_sessions(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream,
) -> None:
    """The end user is the client's text: a name a database cannot hold as it is (a NUL) is stored
    escaped, and looked up the same way (before, every recalling turn failed: 500 on SQLite, a 503
    on PostgreSQL, which SDKs retry)."""
    proxy = await start(start_proxy, make_storage, upstream, recall_scope="user", **RECALL)
    name = "ali\u0000ce"
    for session, turns, fact in (("nul-1", 2, FACT), ("nul-2", 30, "Let us plan the regatta.")):
        talk = Conversation(proxy, upstream, session)
        for i in range(turns):
            new = [user(fact if i == 0 else filler(i))]
            reply = Reply(content="Noted." if i == 0 else f"Answer {i}: " + " ".join(f"sun{i}y{j}" for j in range(20)))
            await talk.exchange(new, reply, user=name)
            talk.remember(new, reply)
    received, _ = await talk.exchange([user("What is the combination of the blue locker?")], Reply("?"), user=name)
    [block] = block_of(received.messages)
    assert "session nul-1 #0" in block["content"] and "7281" in block["content"]


async def test_an_expired_session_is_neither_recalled_nor_found(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession,
) -> None:
    """A session idle past `retention.idle_ttl_seconds` is new to everything that uses it, before
    the sweep deletes it: its end user's other sessions recall nothing of it, and search finds
    nothing in it."""
    proxy = await start(start_proxy, make_storage, upstream, retention=RetentionConfig(idle_ttl_seconds=3600),
                        recall_scope="user", **RECALL)
    api = api_for(http, proxy)
    await long_conversation(proxy, upstream, "alice-1", turns=2, **{"X-Memproxy-User": "alice"})
    talk = await long_conversation(proxy, upstream, "alice-2", turns=30, fact="Let us plan the regatta.",
                                   **{"X-Memproxy-User": "alice"})
    question = [user("What is the combination of the blue locker?")]
    received, _ = await talk.exchange(question, Reply("?"))
    assert "7281" in str(received.messages)  # recalled from alice-1 while it lives
    assert (await api.post("/sessions/alice-1/search", json={"query": "blue locker"}))["data"]
    await age(config_of(proxy), "alice-1", 3601)
    received, _ = await talk.exchange(question, Reply("?"))
    assert "7281" not in str(received.messages)
    assert (await api.post("/sessions/alice-1/search", json={"query": "blue locker"}))["data"] == []
    assert not any(hit["session_id"] == "alice-1"
                   for hit in (await api.post("/search", json={"query": "blue locker"}))["data"])


async def test_the_opening_turns_stay_when_head_turns_is_set(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession,
) -> None:
    proxy = await start(start_proxy, make_storage, upstream, head_turns=1, **RECALL)
    talk = await long_conversation(proxy, upstream)
    received, _ = await talk.exchange([user("Shall we go on?")], Reply("Yes."))
    assert received.messages[:2] == [user(FACT), {"role": "assistant", "content": "Noted."}]
    preview = await preview_of(api_for(http, proxy), "s1", "Shall we go on?", model="small")
    head = part(preview, "head")
    assert (head["messages"], head["to_position"]) == (2, 2)
    assert all(e["position"] >= 2 for e in part(preview, "recalled")["excerpts"])
    # What is left out is what lies between the opening turns and the kept ones, as stored.
    stored = {m["position"]: m["tokens"] for m in (await api_for(http, proxy).get("/sessions/s1"))["messages"]}
    kept_from = part(preview, "kept")["from_position"]
    assert part(preview, "left_out")["tokens_stored"] == sum(stored[p] for p in range(2, kept_from))


async def test_search_a_session_and_every_session_the_key_may_see(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession,
) -> None:
    proxy = await start(start_proxy, make_storage, upstream, **RECALL)
    api = api_for(http, proxy)
    await long_conversation(proxy, upstream, "s1", turns=3)
    await long_conversation(proxy, upstream, "s2", turns=2, fact="The red locker stays open.")
    b_client = proxy.client(session="s1", key=OTHER_KEY)  # tenant b's session of the same name
    upstream.enqueue(Reply("ok"))
    await b_client.chat.completions.create(model="small", messages=[user("The blue locker is mine, tenant b.")])

    found = await api.post("/sessions/s1/search", json={"query": "blue locker"})
    assert found["object"] == "list" and found["query"] == ["blue", "locker"]
    [hit] = found["data"]
    assert (hit["tenant"], hit["session_id"], hit["position"], hit["role"]) == ("a", "s1", 0, "user")
    assert hit["message"] == user(FACT) and hit["matched"] == ["blue", "locker"] and hit["score"] > 0

    everywhere = await api.post("/search", json={"query": "locker", "limit": 10})
    assert {(h["tenant"], h["session_id"]) for h in everywhere["data"]} == {("a", "s1"), ("a", "s2")}  # never b's
    scores = [h["score"] for h in everywhere["data"]]
    assert scores == sorted(scores, reverse=True)
    theirs = await api.as_(OTHER_KEY).post("/search", json={"query": "locker"})
    assert [(h["tenant"], h["session_id"], h["message"]) for h in theirs["data"]] == [
        ("b", "s1", user("The blue locker is mine, tenant b."))]
    assert [h["message"] for h in (await api.as_(OTHER_KEY).post("/sessions/s1/search", json={"query": "blue"}))[
        "data"]] == [user("The blue locker is mine, tenant b.")]  # its own s1, not tenant a's
    # An admin's hits name their tenant: two tenants' sessions of one name are told apart.
    admin = await api.as_(ADMIN_KEY).post("/search", json={"query": "locker"})
    assert {(h["tenant"], h["session_id"]) for h in admin["data"]} == {("a", "s1"), ("a", "s2"), ("b", "s1")}
    only_b = await api.as_(ADMIN_KEY).post("/search?tenant=b", json={"query": "locker"})
    assert [(h["tenant"], h["session_id"]) for h in only_b["data"]] == [("b", "s1")]

    # Errors are OpenAI-shaped; a query never goes in a URL.
    assert_error(await api.post("/search?query=locker", 400, json={"query": "locker"}),
                 type="invalid_request_error", param="query")
    assert_error(await api.post("/search", 400, json={}), type="invalid_request_error", param="query")
    assert_error(await api.post("/search", 400, json={"query": "x", "limit": 0}), type="invalid_request_error",
                 param="limit")
    assert_error(await api.post("/sessions/s1/search", 400, data=b"[1]"), type="invalid_request_error")
    assert (await api.post("/search", json={"query": "the and of"}))["data"] == []  # only function words


async def test_another_sessions_lines_counted_by_another_models_counter_are_counted_again(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream,
) -> None:
    # Alice's other session talked to a model counted with cl100k_base; this one's counter is
    # o200k_base. The block's count is the sum of its lines' stored counts: the other session's
    # were another counter's, and Hindi text counts very differently in the two.
    config = make_config(make_storage("memproxy"), upstream.url, recall_scope="user", **RECALL)
    old = dataclasses.replace(config.models[1], name="old", tokenizer="cl100k_base")
    proxy = await start_proxy(dataclasses.replace(config, models=(*config.models, old)))
    fact = "The combination of the blue locker is " + " ".join("अनुच्छेद" for _ in range(40))
    other = Conversation(proxy, upstream, "alice-1", model="old", **{"X-Memproxy-User": "alice"})
    await other.exchange([user(fact)], Reply("Noted."))
    talk = await long_conversation(proxy, upstream, "alice-2", turns=30, fact="Let us plan the regatta.",
                                   **{"X-Memproxy-User": "alice"})
    received, headers = await talk.exchange([user("What is the combination of the blue locker?")], Reply("?"))
    [block] = block_of(received.messages)
    assert "session alice-1 #0" in block["content"]
    counted = request_tokens(TiktokenCounter("o200k_base"), received.messages, [])
    assert int(headers["x-memproxy-context-tokens"]) == counted
