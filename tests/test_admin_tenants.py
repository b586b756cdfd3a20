"""The session admin API (issue 4): tenant isolation, and the admin key across tenants.

The proxy runs in process on a real port, driven by the `openai` SDK for chats and a plain aiohttp
client for `/v1/sessions` (helpers in `tests/admin_api.py`); what the API reports is checked against
what the fake upstream received and against the store, read from a second connection.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import openai
import pytest

from admin_api import (
    ADMIN_KEY,
    MakeStorage,
    StartProxy,
    api_for,
    assert_error,
    short_summary,
    snapshot,
    start,
)
from conftest import OTHER_KEY
from fake_upstream import FakeUpstream, Reply
from helpers import assistant, send_turn, user

pytestmark = pytest.mark.both_stores


# --- tenants ------------------------------------------------------------------------------------

# Every endpoint that addresses one session, with a body it accepts.
SESSION_ENDPOINTS: list[tuple[str, str, Any]] = [
    ("GET", "/sessions/{id}", None),
    ("DELETE", "/sessions/{id}", None),
    ("POST", "/sessions/{id}/clear", None),
    ("POST", "/sessions/{id}/fork", {"new_id": "stolen"}),
    ("GET", "/sessions/{id}/export", None),
    ("GET", "/sessions/{id}/context?model=small", None),
    ("POST", "/sessions/{id}/context", {"messages": [user("hi")]}),
    ("POST", "/sessions/{id}/compact", {}),
    ("GET", "/sessions/{id}/metadata", None),
    ("PATCH", "/sessions/{id}/metadata", {"owner": "mallory"}),
]
ENDPOINT_IDS = [f"{method} {path.split('{id}')[1] or '/'}" for method, path, _ in SESSION_ENDPOINTS]


@pytest.mark.parametrize("method, path, body", SESSION_ENDPOINTS, ids=ENDPOINT_IDS)
async def test_another_tenants_session_is_a_404_like_one_that_does_not_exist(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession,
    method: str, path: str, body: Any,
) -> None:
    proxy = await start(start_proxy, make_storage, upstream, summaries=True, overflow="summarize", tail_turns=1)
    api = api_for(http, proxy)
    upstream.summarizer = short_summary
    for i in range(3):
        await send_turn(proxy, "private", [user(f"a secret plan, part {i}, in enough words to fold")])
    await api.call("PUT", "/sessions/private/metadata", json={"owner": "alice"})
    await send_turn(proxy, "mine", [user("hello")], key=OTHER_KEY)
    before = await snapshot(api, "private")
    received = len(upstream.received)

    kwargs = {} if body is None else {"json": body}
    other = api.as_(OTHER_KEY)
    hidden = await other.call(method, path.format(id="private"), status=404, **kwargs)
    absent = await other.call(method, path.format(id="nobody"), status=404, **kwargs)
    assert hidden == {"error": {"message": "No session 'private'.", "type": "invalid_request_error",
                                "code": "session_not_found", "param": None}}
    assert json.loads(json.dumps(absent).replace("nobody", "private")) == hidden

    assert await snapshot(api, "private") == before
    assert len(upstream.received) == received  # nothing was summarised or sent
    assert [s["id"] for s in (await other.get("/sessions"))["data"]] == ["mine"]
    assert [s["id"] for s in (await api.get("/sessions"))["data"]] == ["private"]


async def test_list_usage_and_metadata_are_per_tenant(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    proxy = await start(start_proxy, make_storage, upstream)
    api = api_for(http, proxy)
    other = api.as_(OTHER_KEY)
    upstream.enqueue(Reply(content="a1", usage={"prompt_tokens": 7, "completion_tokens": 3}),
                     Reply(content="b1", usage={"prompt_tokens": 50, "completion_tokens": 20}))
    await send_turn(proxy, "same-id", [user("from a")])
    await send_turn(proxy, "same-id", [user("from b")], key=OTHER_KEY)  # the same id, another tenant
    await api.call("PUT", "/sessions/same-id/metadata", json={"owner": "alice"})
    await other.call("PUT", "/sessions/same-id/metadata", json={"owner": "bob"})  # its own, not a's

    assert await api.get("/sessions/same-id/metadata") == {"owner": "alice"}
    assert await other.get("/sessions/same-id/metadata") == {"owner": "bob"}
    assert [m["message"] for m in (await other.get("/sessions/same-id"))["messages"]] == [
        user("from b"), assistant("b1")]
    [mine] = (await api.get("/sessions"))["data"]
    assert (mine["tenant"], mine["title"], mine["usage"]["prompt_tokens"]) == ("a", "from a", 7)
    usage_a, usage_b = await api.get("/usage"), await other.get("/usage")
    assert (usage_a["tenant"], usage_a["sessions"], usage_a["prompt_tokens"], usage_a["completion_tokens"]) == (
        "a", 1, 7, 3)
    assert (usage_b["tenant"], usage_b["sessions"], usage_b["prompt_tokens"], usage_b["completion_tokens"]) == (
        "b", 1, 50, 20)
    # A tenant key cannot widen its view with ?tenant=: naming another tenant is a 403, naming its
    # own changes nothing.
    for path in ("/sessions?tenant=b", "/usage?tenant=b", "/sessions/same-id/metadata?tenant=b"):
        assert_error(await api.get(path, status=403), type="permission_error", param="tenant")
    assert [s["tenant"] for s in (await api.get("/sessions?tenant=a"))["data"]] == ["a"]
    assert (await api.get("/usage?tenant=a"))["prompt_tokens"] == 7
    assert await api.get("/sessions/same-id/metadata?tenant=a") == {"owner": "alice"}


async def test_admin_key_sees_every_tenant_and_names_one_per_session(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    proxy = await start(start_proxy, make_storage, upstream)
    api = api_for(http, proxy)
    admin = api.as_(ADMIN_KEY)
    upstream.enqueue(Reply(content="a1", usage={"prompt_tokens": 7, "completion_tokens": 3}),
                     Reply(content="b1", usage={"prompt_tokens": 50, "completion_tokens": 20}))
    await send_turn(proxy, "alpha", [user("from a")])
    await send_turn(proxy, "beta", [user("from b")], key=OTHER_KEY)

    listed = (await admin.get("/sessions"))["data"]
    assert [(s["tenant"], s["id"]) for s in listed] == [("b", "beta"), ("a", "alpha")]
    assert [s["id"] for s in (await admin.get("/sessions?tenant=a"))["data"]] == ["alpha"]
    assert (await admin.get("/usage"))["prompt_tokens"] == 57
    assert (await admin.get("/usage"))["tenant"] is None
    assert (await admin.get("/usage?tenant=b"))["prompt_tokens"] == 50

    detail = await admin.get("/sessions/alpha?tenant=a")
    assert [m["message"] for m in detail["messages"]] == [user("from a"), assistant("a1")]
    assert_error(await admin.get("/sessions/alpha?tenant=b", status=404), type="invalid_request_error",
                 code="session_not_found")
    await admin.call("PUT", "/sessions/alpha/metadata?tenant=a", json={"reviewed": True})
    assert await api.get("/sessions/alpha/metadata") == {"reviewed": True}
    export = await admin.get("/sessions/beta/export?tenant=b")
    await admin.post("/sessions/import?tenant=a&session_id=beta-copy", data=export.encode(), status=201)
    assert [m["message"] for m in (await api.get("/sessions/beta-copy"))["messages"]] == [
        user("from b"), assistant("b1")]
    await admin.call("DELETE", "/sessions/beta?tenant=b")
    assert (await api.as_(OTHER_KEY).get("/sessions"))["data"] == []

    # An admin key manages sessions; it does not chat.
    received = len(upstream.received)
    with pytest.raises(openai.PermissionDeniedError) as caught:
        await send_turn(proxy, "alpha", [user("let me in")], key=ADMIN_KEY)
    assert_error(caught.value.response.json(), type="permission_error", code="forbidden")
    with pytest.raises(openai.PermissionDeniedError):
        await proxy.client(session=None, key=ADMIN_KEY).chat.completions.create(
            model="small", messages=[{"role": "user", "content": "no session either"}])
    assert len(upstream.received) == received


@pytest.mark.parametrize("method, path, body", [
    *SESSION_ENDPOINTS, ("PUT", "/sessions/{id}/metadata", {"k": 1}), ("POST", "/sessions/import", None),
], ids=[*ENDPOINT_IDS, "PUT /metadata", "POST import"])
async def test_admin_key_without_a_tenant_on_a_session_endpoint_is_400(
    start_proxy: StartProxy, make_storage: MakeStorage, upstream: FakeUpstream, http: aiohttp.ClientSession,
    method: str, path: str, body: Any,
) -> None:
    proxy = await start(start_proxy, make_storage, upstream)
    api = api_for(http, proxy)
    await send_turn(proxy, "alpha", [user("from a")])
    export = await api.get("/sessions/alpha/export")
    before = await snapshot(api, "alpha")
    kwargs: dict[str, Any] = {"json": body} if body is not None else {}
    if path.endswith("import"):
        kwargs = {"data": export.encode()}
    result = await api.as_(ADMIN_KEY).call(method, path.format(id="alpha"), status=400, **kwargs)
    assert_error(result, type="invalid_request_error", param="tenant")
    assert await snapshot(api, "alpha") == before
    assert [s["id"] for s in (await api.get("/sessions"))["data"]] == ["alpha"]
