"""OpenAI's Conversations API on memproxy's sessions: `/v1/conversations` and its items, driven by
the official SDK (`client.conversations.*`, `client.conversations.items.*`) and the OpenAI Agents
SDK's `OpenAIConversationsSession`, through a real proxy on each store to the fake chat provider.
What the provider received proves the memory; the session admin view proves what was stored."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import openai
import pytest

from conftest import OTHER_KEY, PROXY_KEY, Proxy
from db import execute, table_rows
from fake_upstream import FakeUpstream, Reply
from memproxy.config import Config
from memproxy.conversation_items import without_item
from test_endpoints import assert_error
from test_responses import call, session_messages

pytestmark = [pytest.mark.both_stores]

ADMIN_KEY = "test-admin-key-conv"
TABLES = ("sessions", "turns", "messages")


@pytest.fixture
def config(config: Config) -> Config:
    return replace(config, auth=replace(config.auth, admin_keys=(ADMIN_KEY,)))


def texts(items: Any) -> list[tuple[str, str]]:
    """Each item as (kind, what it says): a message's role and text, a call's name and arguments,
    an output's text, a reasoning's summary."""
    pairs = []
    for item in items:
        item = item if isinstance(item, dict) else item.model_dump()
        if item["type"] == "message":
            pairs.append((item["role"], "".join(p.get("text") or p.get("refusal") or "" for p in item["content"])))
        elif item["type"] == "function_call":
            pairs.append(("call", f"{item['name']} {item['arguments']}"))
        elif item["type"] == "function_call_output":
            pairs.append(("output", item["output"]))
        else:
            pairs.append((item["type"], "".join(s["text"] for s in item.get("summary") or [])))
    return pairs


async def all_items(client: openai.AsyncOpenAI, conversation_id: str) -> list[Any]:
    return [item async for item in client.conversations.items.list(conversation_id, order="asc")]


async def active(proxy: Proxy, session: str, key: str = PROXY_KEY) -> list[dict[str, Any]]:
    return [m["message"] for m in (await session_messages(proxy, session))["messages"]]


CALL = {"id": "call_w1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Lima"}'}}
RAINY = [{"type": "text", "text": "Rainy in Lima."}]  # content parts, as litellm's bridge reads them
TOOL_ITEMS: list[Any] = [
    {"type": "message", "role": "user", "content": "Weather in Lima?"},
    {"type": "function_call", "call_id": "call_w1", "name": "get_weather", "arguments": '{"city":"Lima"}'},
    {"type": "function_call_output", "call_id": "call_w1", "output": "rainy"},
    {"type": "reasoning", "summary": [{"type": "summary_text", "text": "It said rainy."}]},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Rainy in Lima."}]},
]


OUTPUT = TOOL_ITEMS[2]


# --- conversations ---------------------------------------------------------------------------------


async def test_a_conversation_is_created_read_updated_and_deleted(proxy: Proxy, upstream: FakeUpstream) -> None:
    client = proxy.client(None)
    made = await client.conversations.create(
        items=[{"type": "message", "role": "user", "content": "My name is Ada."},
               {"type": "message", "role": "assistant", "content": "Hello Ada."}],
        metadata={"topic": "names"})
    assert re.fullmatch(r"conv_[0-9a-f]{48}", made.id) and made.object == "conversation"
    assert made.metadata == {"topic": "names"} and made.created_at > 0
    assert upstream.received == []  # items are stored, never sent to a model
    # It is a session: its items are the session's messages, its metadata the session's.
    assert await active(proxy, made.id) == [{"role": "user", "content": "My name is Ada."},
                                            {"role": "assistant", "content": "Hello Ada."}]
    assert (await call(proxy, "GET", f"/sessions/{made.id}/metadata")) == (200, {"topic": "names"})
    read = await client.conversations.retrieve(made.id)
    assert (read.id, read.created_at, read.metadata) == (made.id, made.created_at, {"topic": "names"})
    updated = await client.conversations.update(made.id, metadata={"topic": "ada", "step": "2"})
    assert updated.metadata == {"topic": "ada", "step": "2"}  # replaced whole, as OpenAI's update does
    assert (await client.conversations.retrieve(made.id)).metadata == {"topic": "ada", "step": "2"}
    # Two creates never share an id; one without items is an empty session.
    empty = await client.conversations.create()
    assert empty.id != made.id and empty.metadata == {}
    assert await all_items(client, empty.id) == [] and await active(proxy, empty.id) == []
    deleted = await client.conversations.delete(made.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (made.id, "conversation.deleted", True)
    with pytest.raises(openai.NotFoundError):
        await client.conversations.retrieve(made.id)
    assert (await call(proxy, "GET", f"/sessions/{made.id}"))[0] == 404


async def test_any_session_of_the_tenant_reads_as_a_conversation(proxy: Proxy, upstream: FakeUpstream) -> None:
    upstream.enqueue(Reply(content="Hi Bob."))
    await proxy.client("chat-1").chat.completions.create(model="small", messages=[{"role": "user", "content": "I am Bob."}])
    client = proxy.client(None)
    assert (await client.conversations.retrieve("chat-1")).id == "chat-1"
    assert texts(await all_items(client, "chat-1")) == [("user", "I am Bob."), ("assistant", "Hi Bob.")]


# --- items -----------------------------------------------------------------------------------------


async def test_items_round_trip_as_responses_items(proxy: Proxy, upstream: FakeUpstream) -> None:
    client = proxy.client(None)
    conversation = await client.conversations.create(items=TOOL_ITEMS[:1])
    created = await client.conversations.items.create(conversation.id, items=TOOL_ITEMS[1:])
    # The call, its output, and the answer with its reasoning: stored as chat messages are.
    assert await active(proxy, conversation.id) == [
        {"role": "user", "content": "Weather in Lima?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_w1", "content": "rainy"},
        {"role": "assistant", "content": RAINY, "reasoning_content": "It said rainy."}]
    assert texts(created.data) == [("call", 'get_weather {"city":"Lima"}'), ("output", "rainy"),
                                   ("reasoning", "It said rainy."), ("assistant", "Rainy in Lima.")]
    listed = await all_items(client, conversation.id)
    assert [i.id for i in listed[1:]] == [i.id for i in created.data]  # ids are stable
    assert [i.type for i in listed] == ["message", "function_call", "function_call_output", "reasoning", "message"]
    user, call_item, output, reasoning, answer = [i.model_dump(exclude_none=True) for i in listed]
    assert user["content"] == [{"type": "input_text", "text": "Weather in Lima?"}] and user["role"] == "user"
    assert (call_item["call_id"], output["call_id"]) == ("call_w1", "call_w1")
    assert answer["content"][0]["type"] == "output_text" and answer["role"] == "assistant"
    assert [i.id.split("_")[0] for i in listed] == ["msg", "fc", "fco", "rs", "msg"]
    assert len({i.id for i in listed}) == 5
    for item in listed:  # each found by its id, within its conversation
        assert (await client.conversations.items.retrieve(item.id, conversation_id=conversation.id)) == item
    other = await client.conversations.create(items=TOOL_ITEMS[:1])  # the same message, another conversation
    [other_user] = await all_items(client, other.id)
    assert other_user.id != listed[0].id
    with pytest.raises(openai.NotFoundError):
        await client.conversations.items.retrieve(listed[0].id, conversation_id=other.id)
    # A conversation's items go on with memory: the provider sees them all.
    upstream.enqueue(Reply(content="Still rainy."))
    await proxy.client(conversation.id).chat.completions.create(
        model="small", messages=[{"role": "user", "content": "And now?"}])
    assert [m["role"] for m in upstream.last().messages] == ["user", "assistant", "tool", "assistant", "user"]


async def test_items_page_in_either_order(proxy: Proxy) -> None:
    client = proxy.client(None)
    words = [f"word {n}" for n in range(7)]
    conversation = await client.conversations.create(
        items=[{"role": "user" if n % 2 == 0 else "assistant", "content": w} for n, w in enumerate(words)])
    first = await client.conversations.items.list(conversation.id, limit=3, order="asc")
    assert [t for _, t in texts(first.data)] == words[:3] and first.has_more
    second = await client.conversations.items.list(conversation.id, limit=3, order="asc", after=first.data[-1].id)
    assert [t for _, t in texts(second.data)] == words[3:6] and second.has_more
    newest = await client.conversations.items.list(conversation.id, limit=2)  # desc by default, as OpenAI's
    assert [t for _, t in texts(newest.data)] == [words[6], words[5]]
    assert (newest.first_id, newest.last_id) == (newest.data[0].id, newest.data[1].id)
    everything = [item async for item in client.conversations.items.list(conversation.id, limit=2)]
    assert [t for _, t in texts(everything)] == words[::-1]  # the SDK pages on with `after`
    last = await client.conversations.items.list(conversation.id, order="asc", after=second.data[-1].id,
                                                 include=["message.output_text.logprobs"])
    assert [t for _, t in texts(last.data)] == words[6:] and not last.has_more
    for query, param in [("limit=0", "limit"), ("limit=101", "limit"), ("order=up", "order"),
                         ("after=msg_nowhere", "after")]:
        status, body = await call(proxy, "GET", f"/conversations/{conversation.id}/items?{query}")
        assert status == 400, query
        assert_error(body, type="invalid_request_error", code=None, param=param)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_response_in_a_conversation_has_its_memory_and_joins_its_items(
        proxy: Proxy, upstream: FakeUpstream, stream: bool) -> None:
    client = proxy.client(None)
    conversation = await client.conversations.create(
        items=[{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": "Hello Ada."}])
    upstream.enqueue(Reply(content="You are Ada."), Reply(content="Ada, still."))
    if stream:
        events = [e async for e in await client.responses.create(
            model="small", input="What is my name?", conversation=conversation.id, stream=True)]
        response = events[-1].response  # type: ignore[union-attr]
    else:
        response = await client.responses.create(model="small", input="What is my name?",
                                                 conversation=conversation.id)
    assert response.output_text == "You are Ada."
    assert [(m["role"], m["content"]) for m in upstream.last().messages] == [
        ("user", "My name is Ada."), ("assistant", "Hello Ada."), ("user", "What is my name?")]
    listed = await all_items(client, conversation.id)
    assert texts(listed) == [("user", "My name is Ada."), ("assistant", "Hello Ada."),
                             ("user", "What is my name?"), ("assistant", "You are Ada.")]
    # The answer is the kept response's output item: one id for it in both places.
    assert listed[-1].id == response.output[0].id
    assert await client.conversations.items.retrieve(response.output[0].id, conversation_id=conversation.id) \
        == listed[-1]
    # Chat completions on the conversation's id go on with the same memory.
    await proxy.client(conversation.id).chat.completions.create(
        model="small", messages=[{"role": "user", "content": "Sure?"}])
    assert [m["content"] for m in upstream.last().messages] == [
        "My name is Ada.", "Hello Ada.", "What is my name?", "You are Ada.", "Sure?"]
    assert texts(await all_items(client, conversation.id))[-2:] == [("user", "Sure?"), ("assistant", "Ada, still.")]


async def test_deleting_an_item_keeps_everything_else(proxy: Proxy, upstream: FakeUpstream) -> None:
    client = proxy.client(None)
    conversation = await client.conversations.create(items=[
        {"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
        {"role": "user", "content": "three"}, {"role": "assistant", "content": "four"}])
    one, two, three, four = await all_items(client, conversation.id)
    returned = await client.conversations.items.delete(two.id, conversation_id=conversation.id)
    assert (returned.id, returned.object) == (conversation.id, "conversation")
    after = await all_items(client, conversation.id)
    assert texts(after) == [("user", "one"), ("user", "three"), ("assistant", "four")]
    assert after[0].id == one.id  # before the cut: the same ids; after it, ids of their own
    with pytest.raises(openai.NotFoundError):
        await client.conversations.items.retrieve(two.id, conversation_id=conversation.id)
    # Kept as superseded, never sent again; the provider sees the rest.
    shown = await session_messages(proxy, conversation.id)
    assert [m["message"]["content"] for m in shown["messages"]] == ["one", "three", "four"]
    assert [m["message"]["content"] for b in shown["superseded"] for m in b["messages"]] == ["two", "three", "four"]
    upstream.enqueue(Reply(content="five"))
    await proxy.client(conversation.id).chat.completions.create(
        model="small", messages=[{"role": "user", "content": "next"}])
    assert [m["content"] for m in upstream.last().messages] == ["one", "three", "four", "next"]
    # Deleted newest first, the items before each keep their ids: deleting them all empties it.
    for item in reversed(await all_items(client, conversation.id)):
        await client.conversations.items.delete(item.id, conversation_id=conversation.id)
    assert await all_items(client, conversation.id) == [] and await active(proxy, conversation.id) == []
    assert (await client.conversations.retrieve(conversation.id)).id == conversation.id


async def test_a_call_and_its_output_are_deleted_together(proxy: Proxy) -> None:
    client = proxy.client(None)
    conversation = await client.conversations.create(items=[
        TOOL_ITEMS[0], {"type": "message", "role": "assistant", "content": "Let me look."}, *TOOL_ITEMS[1:]])
    listed = await all_items(client, conversation.id)
    assert [i.type for i in listed] == ["message", "message", "function_call", "function_call_output",
                                        "reasoning", "message"]
    await client.conversations.items.delete(listed[3].id, conversation_id=conversation.id)  # the output
    assert texts(await all_items(client, conversation.id)) == [
        ("user", "Weather in Lima?"), ("assistant", "Let me look."), ("reasoning", "It said rainy."),
        ("assistant", "Rainy in Lima.")]
    assert await active(proxy, conversation.id) == [
        {"role": "user", "content": "Weather in Lima?"}, {"role": "assistant", "content": "Let me look."},
        {"role": "assistant", "content": RAINY, "reasoning_content": "It said rainy."}]
    # A call deleted takes its output with it; an answer's reasoning goes alone.
    again = await client.conversations.create(items=TOOL_ITEMS)
    call_item = (await all_items(client, again.id))[1]
    await client.conversations.items.delete(call_item.id, conversation_id=again.id)
    reasoning = (await all_items(client, again.id))[1]
    await client.conversations.items.delete(reasoning.id, conversation_id=again.id)
    assert await active(proxy, again.id) == [{"role": "user", "content": "Weather in Lima?"},
                                             {"role": "assistant", "content": RAINY}]


async def test_a_calls_output_may_come_in_the_next_items(proxy: Proxy, upstream: FakeUpstream) -> None:
    """The Agents SDK's way: the call stored (here as items, as a response's output would be), its
    output added after it; the provider then gets the call and its result in order."""
    client = proxy.client(None)
    conversation = await client.conversations.create(items=TOOL_ITEMS[:2])
    await client.conversations.items.create(conversation.id, items=[OUTPUT])
    await client.responses.create(model="small", input="And tomorrow?", conversation=conversation.id)
    sent = upstream.last().messages
    assert [m["role"] for m in sent] == ["user", "assistant", "tool", "user"]
    assert sent[1]["tool_calls"][0]["id"] == sent[2]["tool_call_id"] == "call_w1"


def test_without_item_takes_a_call_out_of_a_message_with_others() -> None:
    calls = [{**CALL, "id": "c1"}, {**CALL, "id": "c2"}]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Two calls.", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "c1", "content": "r1"},
                {"role": "tool", "tool_call_id": "c2", "content": "r2"}]
    # Items of the answer: its text, then its calls: place 2 is the second call.
    assert without_item(messages, 1, 2) == (1, [
        {"role": "assistant", "content": "Two calls.", "tool_calls": calls[:1]},
        {"role": "tool", "tool_call_id": "c1", "content": "r1"}])
    assert without_item(messages, 2, 0) == (1, [
        {"role": "assistant", "content": "Two calls.", "tool_calls": calls[1:]},
        {"role": "tool", "tool_call_id": "c2", "content": "r2"}])
    assert without_item(messages, 1, 0) == (1, [{"role": "assistant", "content": None, "tool_calls": calls},
                                                *messages[2:]])
    assert without_item(messages, 0, 0) == (0, messages[1:])
    assert messages[1]["tool_calls"] == calls  # the messages given are left as they were


# --- tenants, errors -------------------------------------------------------------------------------


async def test_another_tenants_conversation_is_not_found_anywhere(proxy: Proxy, upstream: FakeUpstream) -> None:
    mine = proxy.client(None)
    conversation = await mine.conversations.create(items=[{"role": "user", "content": "secret"}],
                                                   metadata={"k": "v"})
    [item] = await all_items(mine, conversation.id)
    base, item_path = f"/conversations/{conversation.id}", f"/conversations/{conversation.id}/items/{item.id}"
    for method, path, body in [("GET", base, None), ("POST", base, {"metadata": {"k": "theirs"}}),
                               ("DELETE", base, None), ("GET", base + "/items", None),
                               ("POST", base + "/items", {"items": [{"role": "user", "content": "x"}]}),
                               ("GET", item_path, None), ("DELETE", item_path, None)]:
        status, error = await call(proxy, method, path, key=OTHER_KEY, json=body)
        assert status == 404, (method, path)
        assert_error(error, type="invalid_request_error", code="not_found", param="conversation_id")
    # An item id resolves only in its own conversation, even of the same tenant.
    theirs = await proxy.client(None, key=OTHER_KEY).conversations.create(items=[{"role": "user", "content": "x"}])
    status, _ = await call(proxy, "GET", f"/conversations/{theirs.id}/items/{item.id}", key=OTHER_KEY)
    assert status == 404
    assert texts(await all_items(mine, conversation.id)) == [("user", "secret")]
    assert (await mine.conversations.retrieve(conversation.id)).metadata == {"k": "v"}
    # An admin key names the tenant, as on the session API.
    status, error = await call(proxy, "GET", base, key=ADMIN_KEY)
    assert status == 400 and error["error"]["param"] == "tenant"
    assert (await call(proxy, "GET", base + "?tenant=a", key=ADMIN_KEY))[1]["id"] == conversation.id
    assert (await call(proxy, "GET", base + "?tenant=b", key=ADMIN_KEY))[0] == 404


async def test_bad_requests_are_refused_in_openais_shape_and_store_nothing(proxy: Proxy) -> None:
    client = proxy.client(None)
    conversation = await client.conversations.create(items=[{"role": "user", "content": "kept"}],
                                                     metadata={"k": "v"})
    base = f"/conversations/{conversation.id}"
    many = [{"role": "user", "content": str(n)} for n in range(21)]
    cases: list[tuple[str, str, Any, int, str | None, str | None]] = [
        ("POST", "/conversations", {"items": [{"type": "web_search_call", "id": "ws_1"}]}, 400, None, "items[0].type"),
        ("POST", "/conversations", {"items": many}, 400, None, "items"),
        ("POST", "/conversations", {"metadata": {str(n): "v" for n in range(17)}}, 400, None, "metadata"),
        ("POST", "/conversations", {"metadata": {"k": 1}}, 400, None, "metadata.k"),
        ("POST", "/conversations", {"metadata": {"k" * 65: "v"}}, 400, None, "metadata"),
        ("POST", "/conversations", {"items": [{"type": "item_reference", "id": "msg_nowhere"}]}, 404, "not_found",
         "items[0]"),
        ("POST", base + "/items", {"items": many}, 400, None, "items"),
        ("POST", base + "/items", {"items": []}, 400, None, "items"),
        ("POST", base + "/items", {"items": [{"role": "robot", "content": "x"}]}, 400, None, "items[0].role"),
        ("POST", base + "/items", {"items": [{"type": "function_call", "call_id": "c"}]}, 400, None,
         "items[0].name"),
        # A call's output with no call before it (here, or as the conversation's last item) would be
        # sent with every later turn, and refused by the provider each time.
        ("POST", "/conversations", {"items": [OUTPUT]}, 400, None, "items"),
        ("POST", base + "/items", {"items": [OUTPUT]}, 400, None, "items"),
        ("POST", base + "/items", {"items": [{**TOOL_ITEMS[1], "call_id": "call_other"}, OUTPUT]}, 400, None,
         "items"),
        ("POST", base, {"metadata": {"k": ["v"]}}, 400, None, "metadata.k"),
        ("POST", base, {}, 400, None, "metadata"),
        ("GET", "/conversations/conv_nowhere", None, 404, "not_found", "conversation_id"),
        ("POST", "/conversations/conv_nowhere/items", {"items": [{"role": "user", "content": "x"}]}, 404,
         "not_found", "conversation_id"),
        ("GET", base + "/items/msg_nowhere", None, 404, "not_found", "item_id"),
        ("DELETE", base + "/items/msg_nowhere", None, 404, "not_found", "item_id"),
    ]
    for method, path, body, status, code, param in cases:
        got, error = await call(proxy, method, path, json=body)
        assert got == status, (method, path, body, error)
        assert_error(error, type="invalid_request_error", code=code, param=param)
    # A method a path does not take is a 405 that lists what memproxy serves, conversations among it.
    got, error = await call(proxy, "PUT", base)
    assert got == 405
    assert_error(error, type="invalid_request_error", code="method_not_allowed")
    assert "POST /v1/conversations" in error["error"]["message"]
    assert "GET/POST/DELETE /v1/conversations/{conversation_id}" in error["error"]["message"] or \
        "DELETE/GET/POST /v1/conversations/{conversation_id}" in error["error"]["message"]
    # Nothing of the refused requests was stored.
    status, listed = await call(proxy, "GET", "/sessions")
    assert [s["id"] for s in listed["data"]] == [conversation.id]
    assert texts(await all_items(client, conversation.id)) == [("user", "kept")]
    assert (await client.conversations.retrieve(conversation.id)).metadata == {"k": "v"}


# --- the OpenAI Agents SDK ------------------------------------------------------------------------


async def test_the_agents_sdks_conversations_session_holds_two_runs(proxy: Proxy, upstream: FakeUpstream) -> None:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    client = proxy.client(None)
    session = agents.OpenAIConversationsSession(openai_client=client)
    agent = agents.Agent(name="assistant", instructions="Be brief.",
                         model=agents.OpenAIResponsesModel(model="small", openai_client=client))
    upstream.enqueue(Reply(content="Hello Ada."), Reply(content="You are Ada."))
    first = await agents.Runner.run(agent, "My name is Ada.", session=session)
    assert first.final_output == "Hello Ada."
    second = await agents.Runner.run(agent, "What is my name?", session=session)
    assert second.final_output == "You are Ada."
    # The second run's request carried the first run's exchange, read back from the conversation.
    assert [(m["role"], m["content"] if isinstance(m["content"], str) else m["content"][0]["text"])
            for m in upstream.last().messages] == [
        ("system", "Be brief."), ("user", "My name is Ada."), ("assistant", "Hello Ada."),
        ("user", "What is my name?")]
    conversation_id = session.session_id
    assert conversation_id.startswith("conv_")
    assert texts(await all_items(client, conversation_id)) == [
        ("user", "My name is Ada."), ("assistant", "Hello Ada."), ("user", "What is my name?"),
        ("assistant", "You are Ada.")]
    # `pop_item` deletes the newest item; `clear_session` the conversation.
    popped = await session.pop_item()
    assert popped is not None and popped["role"] == "assistant"
    assert len(await session.get_items()) == 3
    await session.clear_session()
    with pytest.raises(openai.NotFoundError):
        await client.conversations.retrieve(conversation_id)


def refuse_metadata(config: Config) -> None:
    """From now on the database refuses every write of a session's metadata: a store failing
    halfway through what a request writes."""
    if config.storage.is_postgres:
        execute(config, "CREATE FUNCTION refuse_metadata() RETURNS trigger AS $$"
                        " BEGIN RAISE EXCEPTION 'refused'; END $$ LANGUAGE plpgsql")
        execute(config, "CREATE TRIGGER refuse BEFORE UPDATE OF metadata ON sessions FOR EACH ROW"
                        " EXECUTE FUNCTION refuse_metadata()")
    else:
        execute(config, "CREATE TRIGGER refuse BEFORE UPDATE OF metadata ON sessions"
                        " BEGIN SELECT RAISE(ABORT, 'refused'); END")


async def test_a_conversation_made_with_items_and_metadata_is_stored_whole_or_not_at_all(
    proxy: Proxy, config: Config
) -> None:
    """Its items and its metadata are one write: a store that fails on either stores neither, and
    the client's retry (the SDK's own, on a 503) makes one conversation, not a second beside an
    orphan holding the items without the metadata."""
    client = proxy.client(None)
    refuse_metadata(config)
    with pytest.raises(openai.InternalServerError) as caught:
        await client.conversations.create(items=[{"role": "user", "content": "hello"}], metadata={"topic": "x"})
    assert caught.value.status_code == 503
    assert table_rows(config, *TABLES) == {table: [] for table in TABLES}
    execute(config, "DROP TRIGGER refuse ON sessions" if config.storage.is_postgres else "DROP TRIGGER refuse")
    conversation = await client.conversations.create(items=[{"role": "user", "content": "hello"}],
                                                     metadata={"topic": "x"})
    assert conversation.metadata == {"topic": "x"}
    assert texts(await all_items(client, conversation.id)) == [("user", "hello")]
    status, listed = await call(proxy, "GET", "/sessions")
    assert [s["id"] for s in listed["data"]] == [conversation.id]
