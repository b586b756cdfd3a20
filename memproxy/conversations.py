"""OpenAI's Conversations API (`/v1/conversations`) on memproxy's sessions.

A conversation is a session, named by its id: one made here is `conv_` and 48 hex digits, and any
session of the tenant's (started by `X-Session-Id`, `previous_response_id` or `conversation`) can be
read and written as a conversation. Its items are the session's active messages read as Responses
items (`memproxy.conversation_items`, which also says how they are named); its `metadata` is the
session's metadata (`/v1/sessions/{id}/metadata`), written here under OpenAI's limits.

New items become chat messages by the same code as a Responses request's input
(`responses.items_as_messages`) and are written as a turn of their own that calls no model (kind
`items`), under the session's lock, as a turn is. Deleting an item is an edit of the history: the
messages from the first one it changes on are superseded (kept, and listed by `GET
/v1/sessions/{id}`) and written again without it, in one turn. Either write is planned on the
session as it stands and refused (409 `session_conflict`) if another replica's write moved it
meanwhile, never rebased: the ids it returns are those of the history it wrote.

Scoped as the session admin API is (`memproxy.sessions`): a tenant key sees its own
conversations, another tenant's is a 404; an admin key names the tenant with `?tenant=`.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from . import admin
from .bodies import json_object
from .config import Config, ModelConfig
from .conversation_items import (ListedItem, checked_items, checked_metadata, conversation_items,
                                 new_conversation_id, without_item)
from .errors import BadRequest, Conflict, NotFound
from .jsonbytes import dumps
from .memory.retention import cap_messages, expired_before, has_expired
from .memory.shrink import new_message, title_of
from .messages import Message, chain_hashes, unanswered_result
from .responses import items_as_messages, referenced_items
from .responses_wire import check_bridge_items, check_item, item_page
from .session_ids import is_session_id
from .sessions import addressed_tenant
from .store import SessionState, Store, Totals, TurnRecord
from .typedefs import CONFIG, LOCKS, PROVIDER, STORE, TASKS, AddRoute

_CONVERSATION = "/v1/conversations/{conversation_id}"


def add_routes(add: AddRoute) -> None:
    add("POST", "/v1/conversations", create)
    add("GET", _CONVERSATION, retrieve)
    add("POST", _CONVERSATION, update)
    add("DELETE", _CONVERSATION, delete)
    add("POST", _CONVERSATION + "/items", create_items)
    add("GET", _CONVERSATION + "/items", list_items)
    add("GET", _CONVERSATION + "/items/{item_id}", retrieve_item)
    add("DELETE", _CONVERSATION + "/items/{item_id}", delete_item)


def _json(body: Any) -> web.Response:
    return web.Response(body=dumps(body), content_type="application/json", charset="utf-8")


def _tenant(request: web.Request) -> str:
    tenant = addressed_tenant(request)
    assert tenant is not None
    return tenant


async def _conversation(request: web.Request, tenant: str) -> SessionState:
    conversation_id = request.match_info["conversation_id"]
    session = await request.app[STORE].get_session(tenant, conversation_id) \
        if is_session_id(conversation_id) else None
    if session is None:
        raise NotFound(f"Conversation with id '{conversation_id}' not found.", param="conversation_id")
    return session


def _expired(request: web.Request, session: SessionState | None) -> bool:
    """Idle past `retention.idle_ttl_seconds`: it holds nothing any more, for every purpose."""
    return has_expired(session, request.app[CONFIG].retention.idle_ttl_seconds)


async def _conversation_object(request: web.Request, session: SessionState) -> dict[str, Any]:
    metadata = {} if _expired(request, session) else await request.app[STORE].get_metadata(session)
    return {"id": session.session_id, "object": "conversation", "created_at": int(session.created_at),
            "metadata": metadata if metadata is not None else {}}


async def _new_messages(request: web.Request, tenant: str, body: dict[str, Any], required: bool) -> list[Message]:
    """The body's `items` as the chat messages they are stored as, read as a Responses request's
    input is; a 400 (or a 404 for an unknown `item_reference`) before anything is written."""
    items = checked_items(body.get("items"), required)
    for i, item in enumerate(items):
        check_item(item, f"items[{i}]")
    items = await referenced_items(request.app[STORE], tenant, items, "items")
    check_bridge_items(items, "items")
    return items_as_messages(request.app[PROVIDER], items, None, "items") if items else []


# --- conversations ---------------------------------------------------------------------------------


async def create(request: web.Request) -> web.Response:
    tenant = _tenant(request)
    body = await json_object(request, optional=True)
    metadata = checked_metadata(body.get("metadata"))
    messages = await _new_messages(request, tenant, body, required=False)
    app = request.app
    store = app[STORE]
    await _check_answered(store, None, messages)
    conversation_id = new_conversation_id()
    while await store.get_session(tenant, conversation_id) is not None:
        conversation_id = new_conversation_id()
    async with app[LOCKS].hold(tenant, conversation_id):
        if messages:  # its items and metadata in one write: a conversation is made whole or not at all
            await _write(request, tenant, conversation_id, None, messages, metadata=metadata or None)
        else:  # a conversation without items is a session without messages
            await app[TASKS].run(store.set_metadata(tenant, conversation_id, metadata))
        session = await store.get_session(tenant, conversation_id)
    if session is None:  # deleted as soon as it was made
        raise Conflict("the conversation was deleted while it was being created; create it again")
    return _json(await _conversation_object(request, session))


async def retrieve(request: web.Request) -> web.Response:
    session = await _conversation(request, _tenant(request))
    return _json(await _conversation_object(request, session))


async def update(request: web.Request) -> web.Response:
    """`metadata` replaces the conversation's (its session's) metadata whole, as OpenAI's update
    and `PUT /v1/sessions/{id}/metadata` do."""
    tenant = _tenant(request)
    body = await json_object(request)
    if "metadata" not in body:
        raise BadRequest("'metadata' is required", param="metadata")
    metadata = checked_metadata(body["metadata"])
    session = await _conversation(request, tenant)
    app = request.app
    async with app[LOCKS].hold(tenant, session.session_id):
        await app[TASKS].run(app[STORE].set_metadata(tenant, session.session_id, metadata,
                                                     expired_before(app[CONFIG].retention.idle_ttl_seconds)))
        session = await _conversation(request, tenant)
    return _json(await _conversation_object(request, session))


async def delete(request: web.Request) -> web.Response:
    session = await _conversation(request, _tenant(request))
    await request.app[TASKS].run(request.app[STORE].delete_session(session))
    return _json({"id": session.session_id, "object": "conversation.deleted", "deleted": True})


# --- items -----------------------------------------------------------------------------------------


async def _items(request: web.Request, session: SessionState) -> list[ListedItem]:
    if _expired(request, session) or session.length == 0:
        return []
    store = request.app[STORE]
    messages = await store.active_range(session, 0, session.length)
    return conversation_items(session.tenant, session.session_id, messages, await store.kept_answers(session))


def _check_include(request: web.Request) -> None:
    """`include` (extra fields OpenAI can add to items: logprobs, encrypted reasoning, tool
    outputs) is taken and adds nothing: memproxy keeps none of them with the conversation."""
    for value in request.query.getall("include", []) + request.query.getall("include[]", []):
        if not value:
            raise BadRequest("'include' values must be non-empty strings", param="include")


async def create_items(request: web.Request) -> web.Response:
    tenant = _tenant(request)
    _check_include(request)
    body = await json_object(request)
    messages = await _new_messages(request, tenant, body, required=True)
    session = await _conversation(request, tenant)
    async with request.app[LOCKS].hold(tenant, session.session_id):
        session = await _conversation(request, tenant)  # as it stands once the lock is held
        expired = _expired(request, session)
        first = 0 if expired else session.length
        await _check_answered(request.app[STORE], None if expired else session, messages)
        await _write(request, tenant, session.session_id, session, messages)
        session = await _conversation(request, tenant)
        created = [listed.item for listed in await _items(request, session) if listed.seq >= first]
    return _json({"object": "list", "data": created, "first_id": created[0]["id"] if created else None,
                  "last_id": created[-1]["id"] if created else None, "has_more": False})


async def list_items(request: web.Request) -> web.Response:
    _check_include(request)
    session = await _conversation(request, _tenant(request))
    after = request.query.get("after")
    items = [listed.item for listed in await _items(request, session)]
    return _json(item_page(items, request.query, f"no item '{after}' in this conversation"))


async def _item(request: web.Request, session: SessionState) -> tuple[ListedItem, list[ListedItem]]:
    item_id = request.match_info["item_id"]
    items = await _items(request, session)
    for listed in items:
        if listed.item["id"] == item_id:
            return listed, items
    raise NotFound(f"Item with id '{item_id}' not found.", param="item_id")


async def retrieve_item(request: web.Request) -> web.Response:
    _check_include(request)
    session = await _conversation(request, _tenant(request))
    listed, _ = await _item(request, session)
    return _json(listed.item)


async def delete_item(request: web.Request) -> web.Response:
    """The item taken out of the history (`without_item`: a call goes with its output), as an
    edit from the first message that changes: that message and those after it are superseded and
    the rest written again after the cut. Returns the conversation, as OpenAI does."""
    tenant = _tenant(request)
    session = await _conversation(request, tenant)
    store = request.app[STORE]
    async with request.app[LOCKS].hold(tenant, session.session_id):
        session = await _conversation(request, tenant)
        listed, _ = await _item(request, session)
        stored = await store.active_range(session, 0, session.length)
        at = next(i for i, m in enumerate(stored) if m.seq == listed.seq)
        first, rest = without_item([m.body for m in stored], at, listed.place)
        base = stored[first].seq
        if first == 0 and base > 0:
            raise Conflict("the history before this item is no longer stored whole "
                           "(retention.max_messages_per_session): it cannot be deleted")
        base_hash = stored[first - 1].chain_hash if first else ""
        totals = await store.totals_at(session, base)
        await _write(request, tenant, session.session_id, session, rest, base, base_hash, totals)
        session = await _conversation(request, tenant)
    return _json(await _conversation_object(request, session))


_TAIL = 64  # a conversation's last messages read for the call that new results answer


async def _check_answered(store: Store, session: SessionState | None, messages: list[Message]) -> None:
    """Refuse items holding a `function_call_output` that follows no `function_call` of its own, in
    the items or as the last of the conversation (`session`, None: none stored): stored, it would be
    sent with every later turn, and providers refuse them all."""
    if not any(m.get("role") == "tool" for m in messages):
        return
    tail: list[Message] = []
    start = session.length if session else 0
    while session and start > 0 and all(m.get("role") == "tool" for m in tail):  # back to the call they answer
        start = max(start - _TAIL, 0)
        tail = [m.body for m in await store.active_range(session, start, session.length)]
    index = unanswered_result(tail, messages)
    if index is not None:
        raise BadRequest(
            f"A function_call_output answers call '{messages[index].get('tool_call_id')}', but it does not follow "
            "the function_call it answers (in these items, or as the conversation's last items): stored so, every "
            "later response of the conversation would be refused by the provider. Add the call and its output "
            "together.", param="items")


async def _write(request: web.Request, tenant: str, session_id: str, session: SessionState | None,
                 messages: list[Message], base: int | None = None, base_hash: str | None = None,
                 base_totals: Totals | None = None, metadata: dict[str, Any] | None = None) -> None:
    """Write `messages` after the first `base` of the session's (default: after all of them), as
    a turn that called no model (with `metadata`, the session's, replaced in the same write):
    counted by the counter of the model the session last talked to.
    Pinned: if the session moved since it was read, a 409 and nothing written. A session idle past
    its TTL is started afresh first, as a turn would start it."""
    app = request.app
    config, store = app[CONFIG], app[STORE]
    cutoff = expired_before(config.retention.idle_ttl_seconds) if _expired(request, session) else None
    current = None if cutoff is not None else session
    if base is None or base_hash is None or base_totals is None:
        base = current.length if current else 0
        base_hash = current.head_hash if current else ""
        base_totals = Totals(current.head_cum, current.head_compact_cum) if current else Totals(0, 0)
    model = await _counting_model(store, config, current)
    counter = app[PROVIDER].counter(model)
    new = [new_message(m, h, counter, config.memory) for m, h in zip(messages, chain_hashes(base_hash, messages))]
    record = TurnRecord(
        tenant=tenant, session_id=session_id,
        expected_length=current.length if current else 0, expected_head_hash=current.head_hash if current else "",
        base=base, base_totals=base_totals, base_hash=base_hash, messages=new, system=None, model="-",
        kind="items", context_tokens=0, latency_ms=0.0, title=title_of(messages), expired_before=cutoff,
        tokenizer=counter.name, pinned=True, metadata=metadata)
    await app[TASKS].run(store.record_turn(record))
    cap = config.retention.max_messages_per_session
    if cap is not None:
        app[TASKS].spawn(cap_messages(store, tenant, session_id, cap), optional=True)


async def _counting_model(store: Store, config: Config, session: SessionState | None) -> ModelConfig:
    """The model whose counter counts new items: the session's last, else the summariser's, else
    the first configured (`admin.session_model`)."""
    if session is not None:
        return await admin.session_model(store, config, session, None)
    name = config.memory.summarizer_model or (config.models[0].name if config.models else None)
    model = config.model(name) if name else None
    if model is None:
        raise NotFound("no model is configured to count the conversation's items", code="model_not_found")
    return model
