"""`/v1/responses`: the Responses API, with memory, on the chat pipeline.

A request's input items become chat messages (litellm's bridge, `Provider.responses_messages`) and
its parameters a chat completion's (`Provider.responses_chat_params`, which the budget reads); the
turn is then served exactly as a chat turn (`memproxy.chat.serve_turn`: reconcile, budget, summary,
recall, record), so items and chat messages share one store and one session can be continued from
either API. Only the wire differs (`ResponsesWire`): the answer comes from a chat completion on the
model's transport (`responses_api: bridge`, any provider) or from the provider's own Responses API
through litellm (`native`), and goes back as a Response object or its stream of events.

The session is `X-Session-Id`, or the session of `previous_response_id`, or `conversation` (its id
is the session id); two of them naming different sessions is a 400. A request with none is a new
session named by its response id when the response is kept (`store` not false), so that a chain of
`previous_response_id`s has memory on any provider; with `store: false` and no session it is
forwarded without memory. A kept response is written with its turn, in one transaction
(`TurnRecord.response`), and is its tenant's alone.

`previous_response_id` continues after that response's answer: new items only, appended, when it is
still the session's newest message; otherwise the stored history up to it followed by the new items,
read as a full history, so the turn is an edit from there (the later messages are superseded: kept
and listed, never sent again). A response whose answer was itself superseded by such an edit goes
on from its own branch, which becomes the active one again; one whose history the message cap has
cut cannot be continued (409 `session_conflict`).
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from aiohttp import web

from .bodies import json_object, requested_model
from .chat import Answer, Exchange, caller_tenant, serve_turn, session_id_header
from .errors import BadRequest, Conflict, NotFound, UpstreamError
from .jsonbytes import dumps
from .memory.reconcile import HistoryMode
from .memory.retention import has_expired
from .messages import Message, split_system, validate_messages
from .observe import notes
from .params import check_params
from .provider import Provider
from .responses_wire import (ITEM_PREFIXES, ChatEvents, Item, ResponsesRequest, as_opened, chat_usage,
                             check_bridge_input, check_item, input_items, item_ids, item_page, new_id, output_items,
                             parse_request, response_object, response_of_item, responses_usage, sse, status_of)
from .session_ids import SESSION_HEADER, SESSION_ID_RULE, is_session_id
from .store import NewResponse, StoredMessage, StoredResponse, TurnRecord, TurnStore
from .streaming import StreamAssembler
from .timing import Timings, measured
from .typedefs import CONFIG, PROVIDER, STORE, AddRoute

_PREFIX = re.compile("[a-z]+")
_TERMINAL = frozenset({"response.completed", "response.incomplete"})
_FAILED = frozenset({"response.failed", "error"})


def add_routes(add: AddRoute) -> None:
    add("POST", "/v1/responses", create)
    add("GET", "/v1/responses/{response_id}", retrieve)
    add("DELETE", "/v1/responses/{response_id}", delete)
    add("GET", "/v1/responses/{response_id}/input_items", list_input_items)


# The Responses parameters that are chat's too, type-checked as chat's are (`memproxy.params`).
_CHAT_PARAMS = frozenset({"temperature", "top_p", "parallel_tool_calls", "user", "top_logprobs", "tool_choice",
                          "metadata", "service_tier"})


async def create(request: web.Request) -> web.StreamResponse:
    with measured() as timings:
        return await _create(request, timings)


async def _create(request: web.Request, timings: Timings) -> web.StreamResponse:
    app = request.app
    provider = app[PROVIDER]
    body = await json_object(request)
    tenant = caller_tenant(request)
    parsed = parse_request(body)
    if isinstance(parsed.input, list):
        parsed = dataclasses.replace(parsed, input=await referenced_items(app[STORE], tenant, parsed.input))
    model = requested_model(app[CONFIG], parsed.model)
    if model.responses_api != "native":
        check_bridge_input(parsed)
    check_params({k: v for k, v in body.items() if k in _CHAT_PARAMS})
    messages = items_as_messages(provider, parsed.input, parsed.instructions)
    try:
        params = provider.responses_chat_params(model, parsed.params)
    except Exception as exc:  # litellm's bridge could not read the tools or formats: the client's
        raise BadRequest(f"the request's parameters could not be read: {type(exc).__name__}",
                         param="tools" if parsed.params.get("tools") else None) from exc
    timings.lap("parse")
    noted = notes(request)
    noted.model, noted.stream, noted.timings = model.name, parsed.stream, timings
    response_id = new_id("resp")
    wire = ResponsesWire(provider, parsed, response_id, model.name, native=model.responses_api == "native")
    exchange = Exchange(model=model, messages=messages, params={**params, "stream": parsed.stream},
                        timings=timings, wire=wire)
    session_id = await _session(request, app[STORE], tenant, parsed)
    planning = None
    if parsed.previous_response_id is not None:
        previous_id = parsed.previous_response_id

        async def planning() -> tuple[list[Message], HistoryMode]:
            return await _continuing(app[STORE], tenant, previous_id, messages,
                                     app[CONFIG].retention.idle_ttl_seconds)
    if session_id is None and parsed.store:
        # A kept response always has a session: its chain has memory. Input that resends items of
        # a kept response (the Vercel AI SDK's references, the Agents SDK's `to_input_list`) goes on
        # in that response's session, rather than storing the history again in a new one each turn.
        session_id = await _resent_session(app[STORE], tenant, parsed) or response_id
    return await serve_turn(request, exchange, tenant, session_id, planning)


_RESENT_LOOKUPS = 4  # kept responses looked up at most, newest item first, for `_resent_session`


async def _resent_session(store: TurnStore, tenant: str, parsed: ResponsesRequest) -> str | None:
    """The session of the kept response whose items the input resends (an item id of memproxy's
    names its response, `response_of_item`), the newest such item first; None if none is kept."""
    if not isinstance(parsed.input, list):
        return None
    tried: set[str] = set()
    for item in reversed(parsed.input):
        item_id = item.get("id") if isinstance(item, dict) else None
        response_id = response_of_item(item_id) if isinstance(item_id, str) else None
        if response_id is None or response_id in tried:
            continue
        tried.add(response_id)
        kept = await _stored(store, tenant, response_id, with_input=False)
        if kept is not None:
            return kept.session_id
        if len(tried) >= _RESENT_LOOKUPS:
            break
    return None


async def referenced_items(store: TurnStore, tenant: str, given: list[Item], name: str = "input") -> list[Item]:
    """The items with each `item_reference` replaced by the item it names: an item of a kept
    response of the tenant's (its output, or its input), found by that response, whose id the
    item's names (`response_of_item`). What the Vercel AI SDK sends back for the answers of kept
    responses. A reference to no such item is a 404, as OpenAI answers one (`name`: the field that
    holds the items, as errors name it)."""
    if not any(item.get("type") == "item_reference" for item in given):
        return given
    outputs: dict[str, list[Any] | None] = {}  # each kept response's output items (None: none kept)
    items: list[Item] = []
    for i, item in enumerate(given):
        if item.get("type") != "item_reference":
            items.append(item)
            continue
        item_id, found = item["id"], None
        response_id = response_of_item(item_id)
        if response_id is not None:
            if response_id not in outputs:  # its output alone: one answer, not the history it was sent
                kept = await _stored(store, tenant, response_id, with_input=False)
                outputs[response_id] = None if kept is None else kept.body.get("output") or []
            output = outputs[response_id]
            found = None if output is None else _item_of(output, item_id)
            if found is None and output is not None:  # an input item it was given: read its history
                kept = await _stored(store, tenant, response_id)
                found = _item_of(kept.input_items if kept is not None else [], item_id)
        if found is None:
            raise NotFound(f"Item with id '{item_id}' not found.", param=f"{name}[{i}]")
        check_item(found, f"{name}[{i}]")  # a kind memory cannot keep (a native built-in tool's) is refused
        items.append(found)
    return items


def _item_of(items: list[Any], item_id: str) -> Item | None:
    return next((item for item in items if isinstance(item, dict) and item.get("id") == item_id), None)


def items_as_messages(provider: Provider, items: str | list[Item], instructions: str | None,
                      name: str = "input") -> list[Message]:
    """Input items as the chat messages memory stores, checked as chat messages are: what a
    request's input and a conversation's new items both become (`name`: the field that holds them)."""
    try:
        messages = provider.responses_messages(items, instructions)
    except Exception as exc:  # litellm's bridge refused the items: the client's input
        raise BadRequest(f"'{name}' could not be read: {type(exc).__name__}", param=name) from exc
    try:
        return validate_messages(_thinking_joined(messages))
    except BadRequest as exc:
        raise BadRequest(f"'{name}' does not make a valid conversation: {exc.message}", param=name) from exc


_THINK = re.compile(r"\s*<think>\n?(.*?)\n?</think>\s*", re.DOTALL)


def _thinking_joined(messages: list[Message]) -> list[Message]:
    """An answer's reasoning, resent as an assistant message of its own holding only a `<think>`
    block right before the answer (pydantic-ai's Responses model does so for a model it does not
    know to reason, where memproxy returned a `reasoning` item), joined back into that answer as
    its `reasoning_content`: the answer memproxy stored, not an edit of it with one message more."""
    joined: list[Message] = []
    for message in messages:
        before = joined[-1] if joined else None
        if (before is not None and before.get("role") == "assistant" and message.get("role") == "assistant"
                and set(before) == {"role", "content"} and isinstance(before["content"], str)
                and not message.get("reasoning_content") and (think := _THINK.fullmatch(before["content"]))):
            joined[-1] = {**message, "reasoning_content": think[1]}
            continue
        joined.append(message)
    return joined


async def _session(request: web.Request, store: TurnStore, tenant: str, parsed: ResponsesRequest) -> str | None:
    """The session the request names, by `X-Session-Id`, `previous_response_id` or `conversation`."""
    header = session_id_header(request)
    named: str | None = None
    source = ""
    if parsed.previous_response_id is not None:
        previous = await _stored(store, tenant, parsed.previous_response_id)
        if previous is None:
            raise _no_previous(parsed.previous_response_id)
        named, source = previous.session_id, "previous_response_id"
    elif parsed.conversation is not None:
        if not is_session_id(parsed.conversation):
            raise BadRequest(f"'conversation' must be {SESSION_ID_RULE}", param="conversation")
        named, source = parsed.conversation, "conversation"
    if named is not None and header is not None and header != named:
        raise BadRequest(f"{SESSION_HEADER} names another session than '{source}' does", param=source)
    return named or header


def _no_previous(response_id: str) -> BadRequest:
    # A 400, as OpenAI answers it (not a 404): clients that recover from a lost chain (resend the
    # whole history without the id) look for this status and code.
    return BadRequest(f"Previous response with id '{response_id}' not found.", code="previous_response_not_found",
                      param="previous_response_id")


async def _continuing(store: TurnStore, tenant: str, previous_id: str, messages: list[Message],
                      idle_ttl: float | None) -> tuple[list[Message], HistoryMode]:
    """What a request continuing `previous_id` reconciles, read under the session's lock: its new
    messages alone where that response is the session's newest answer; else the stored history up
    to that answer and then the new messages, as a full history (an edit from there). A response
    of a session that has expired (`idle_ttl`) is not found, as an expired response is at OpenAI:
    its session's past is gone, and continuing it would go on without it, or bring it back."""
    previous = await _stored(store, tenant, previous_id)
    if previous is None:  # deleted since the request began
        raise _no_previous(previous_id)
    session = None
    if idle_ttl is not None or not previous.head:
        session = await store.get_session(tenant, previous.session_id)
    if has_expired(session, idle_ttl):
        raise _no_previous(previous_id)
    if previous.head:
        return messages, "new"
    if session is None:  # deleted since the response was read
        raise _no_previous(previous_id)
    # Its history: the active one up to it (a range read), or, where an edit superseded its answer,
    # the branch it was on (a walk by parents), which this turn makes the active one again (OpenAI
    # continues either).
    if previous.active:
        stored: list[StoredMessage] | None = await store.active_range(session, 0, previous.seq + 1)
    else:
        stored = await store.branch(session, previous.seq, previous.chain_hash)
    if stored is None or [m.seq for m in stored] != list(range(previous.seq + 1)):
        raise Conflict(f"the history before response '{previous_id}' is no longer stored whole "
                       "(retention.max_messages_per_session); continue from the newest response")
    system, new = split_system(messages)
    instructions = None if system else await _instructions_of(store, tenant, previous)
    if instructions is not None:
        # The branch goes on under the instructions of the response it continues, not those a later
        # turn it supersedes left to the session (as litellm's bridge makes them: a system message).
        system = [{"role": "system", "content": instructions}]
    return [*system, *(m.body for m in stored), *new], "full"


_CHAIN_LOOKUPS = 16  # kept responses looked back through at most, for `_instructions_of`


async def _instructions_of(store: TurnStore, tenant: str, response: StoredResponse) -> str | None:
    """The instructions a kept response went on under: its request's, or, where it gave none (it
    went on under the session's, which the turn before it had set), those the response it
    continued went on under, and so back along its chain. None where the chain gives none."""
    for _ in range(_CHAIN_LOOKUPS):
        instructions = response.body.get("instructions")
        if isinstance(instructions, str) and instructions:
            return instructions
        before = response.body.get("previous_response_id")
        found = await _stored(store, tenant, before, with_input=False) if isinstance(before, str) else None
        if found is None or found.session_id != response.session_id:
            return None
        response = found
    return None


class ResponsesWire:
    """The Responses API's wire for one request (`memproxy.chat.Wire`): a chat completion answered
    as a Response (bridge), or the provider's own Response relayed (native); kept with its turn
    unless `store: false`. A stream's `response.completed` leaves once the turn is recorded, as
    chat's `[DONE]` does."""

    def __init__(self, provider: Provider, request: ResponsesRequest, response_id: str, model: str,
                 native: bool) -> None:
        self._provider = provider  # its bridge reads a native Response's output items
        self._request = request
        self.id = response_id
        self._model = model  # the client's name for it
        self._native = native
        self._final: dict[str, Any] | None = None
        self._created_at = time.time()  # one creation time, in every event and the kept object
        self._make_id = item_ids(response_id)  # an item_reference to any of them finds this response
        self._renamed: dict[str, str] = {}  # a native provider's item ids -> this response's
        self._events = self._chat_events()
        self._assembler = StreamAssembler()
        self._started = False
        self._closing: list[dict[str, Any]] = []
        self._held: dict[str, Any] | None = None  # a native stream's terminal event

    def _chat_events(self) -> ChatEvents:
        created = response_object(self.id, self._request, self._model, [], None, status="in_progress",
                                  created_at=self._created_at)
        return ChatEvents(created, self._make_id)

    def without_memory(self) -> None:
        """Not recorded, the response is not kept: it says `store: false` from its next event on
        (all of them, where no event has left yet), as one whose recording failed does (`unkept`),
        and cannot be retrieved or continued from."""
        self._request = dataclasses.replace(self._request, store=False)
        if not self._started:
            self._events = self._chat_events()
        if self._final is not None:
            self._final = {**self._final, "store": False}
        if self._held is not None:
            self._held = {**self._held, "response": {**self._held["response"], "store": False}}

    def _upstream_params(self, exchange: Exchange) -> dict[str, Any]:
        # The provider keeps nothing: memproxy is the store, and sends the whole context each time.
        # Nor works in the background: memproxy answers in the foreground (it has no queue), and a
        # provider's `queued` Response, empty, would be recorded and kept as the answer for good.
        return {**{k: v for k, v in self._request.params.items() if k != "background"}, "store": False}

    async def answer(self, provider: Provider, exchange: Exchange) -> Answer:
        if self._native:
            result = await provider.respond(exchange.model, input_items(exchange.messages),
                                            self._upstream_params(exchange))
            body = self._native_body(result)
            reply = _reply_from(provider, body)
            usage = chat_usage(body.get("usage"))
        else:
            completion = await provider.complete(exchange.model, exchange.messages, exchange.params)
            choice = (completion.get("choices") or [{}])[0]
            reply = choice.get("message") or {}
            usage = completion.get("usage")
            body = response_object(self.id, self._request, self._model,
                                   output_items(reply, self._make_id, choice.get("logprobs")),
                                   responses_usage(usage), status_of(choice.get("finish_reason")),
                                   created_at=self._created_at, finish_reason=choice.get("finish_reason"))
        self._final = body
        return Answer(reply, usage, body)

    def _native_body(self, result: dict[str, Any]) -> dict[str, Any]:
        """The provider's Response as memproxy's: its id, the client's model name, what the client
        asked about keeping it and continuing from which response, and the client's instructions
        (the provider got them as a system message among the input, as memory sends them)."""
        body = {**result, "id": self.id, "model": self._model, "store": self._request.store,
                "previous_response_id": self._request.previous_response_id,
                "instructions": self._request.instructions}
        if isinstance(body.get("output"), list):
            body["output"] = [self._item(item) for item in body["output"]]
        if self._request.conversation is not None:
            body["conversation"] = {"id": self._request.conversation}
        return body

    def _item(self, item: Any) -> Any:
        """A native provider's output item under this response's id for it (`item_ids`): the
        provider keeps nothing (`store: false`), memproxy keeps the response, and a later
        `item_reference` to the item finds it here."""
        return {**item, "id": self._item_id(item["id"])} if isinstance(item, dict) and isinstance(
            item.get("id"), str) and item["id"] else item  # an empty id names nothing: left so

    def _item_id(self, provider_id: str) -> str:
        ours = self._renamed.get(provider_id)
        if ours is None:
            prefix = provider_id.partition("_")[0]  # `msg`, `fc`, `rs`: the kind, as `response_of_item` reads it
            ours = self._renamed[provider_id] = self._make_id(prefix if _PREFIX.fullmatch(prefix) else "item")
        return ours

    async def open(self, provider: Provider, exchange: Exchange) -> AsyncGenerator[dict[str, Any], None]:
        if self._native:
            return await provider.respond_stream(exchange.model, input_items(exchange.messages),
                                                 self._upstream_params(exchange))
        # A Response reports its usage: asked for always, as chat asks for a recorded turn's.
        options = exchange.params.get("stream_options")
        params = {**exchange.params, "stream": True,
                  "stream_options": {**(options if isinstance(options, dict) else {}), "include_usage": True}}
        return await provider.stream(exchange.model, exchange.messages, params)

    def relay(self, chunk: dict[str, Any]) -> bytes:
        if self._native:
            return self._relay_native(chunk)
        events = [] if self._started else self._events.start()
        self._started = True
        self._assembler.add(chunk)
        return b"".join(sse(e) for e in [*events, *self._events.add(chunk)])

    def _relay_native(self, event: dict[str, Any]) -> bytes:
        kind = event.get("type")
        if kind in _FAILED:
            error = (event.get("response") or {}).get("error") or event.get("error") or event
            message = error.get("message") if isinstance(error, dict) else None
            raise UpstreamError(f"upstream response failed: {message or kind}", code="upstream_error")
        if isinstance(event.get("response"), dict):
            event = {**event, "response": self._native_body(event["response"])}
        if isinstance(event.get("item"), dict):
            event = {**event, "item": self._item(event["item"])}
        if isinstance(event.get("item_id"), str) and event["item_id"]:
            event = {**event, "item_id": self._item_id(event["item_id"])}
        event = self._events.numbered(as_opened(event))
        if kind in _TERMINAL:
            self._held = event  # sent once the turn is recorded (`done`)
            return b""
        return sse(event)

    def reply(self) -> tuple[Message, dict[str, Any] | None] | None:
        if self._native:
            if self._held is None:
                return None
            self._final = self._held["response"]
            return _reply_from(self._provider, self._final), chat_usage(self._final.get("usage"))
        if not self._assembler.complete:
            return None
        self._closing = self._events.finish()
        self._final = response_object(self.id, self._request, self._model, self._events.items,
                                      responses_usage(self._assembler.usage),
                                      status_of(self._assembler.finish_reason), created_at=self._created_at,
                                      finish_reason=self._assembler.finish_reason)
        return self._assembler.message(), self._assembler.usage

    def unkept(self, body: dict[str, Any]) -> dict[str, Any]:
        """Not recorded, the response is not kept either: `store: false` says it cannot be retrieved
        or continued from (`previous_response_id` would be a 400 `previous_response_not_found`)."""
        return {**body, "store": False}

    def attach(self, record: TurnRecord) -> TurnRecord:
        if self._request.previous_response_id is not None:  # what led to that response, and nothing else
            record = dataclasses.replace(record, pinned=True)
        if not self._request.store or self._final is None:
            return record
        kept = NewResponse(self.id, self._final, _with_ids(self._request.input_list, self._make_id))
        return dataclasses.replace(record, response=kept)

    def done(self) -> bytes:
        if self._native:
            assert self._held is not None
            return sse(self._held)
        assert self._final is not None
        return b"".join(sse(e) for e in [*self._closing, self._events.completed(self._final)])

    def error(self, body: dict[str, Any]) -> bytes:
        return sse(self._events.error(body["error"]))


def _reply_from(provider: Provider, response: dict[str, Any]) -> Message:
    """A native Response's output items as one assistant message, what the turn records: read by
    the same bridge as the input, so an answer is stored as its items read when a client sends
    them back (text joined, function calls as tool calls, reasoning as `reasoning_content`)."""
    reply: Message = {"role": "assistant", "content": None}
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    output = response.get("output") or []
    for message in provider.responses_messages(output, None):
        if message.get("role") != "assistant":
            continue
        text = message.get("content")
        if isinstance(text, list):
            text = "".join(str(p.get("text", "")) for p in text if isinstance(p, dict))
        if text:
            texts.append(text)
        calls += message.get("tool_calls") or []
        for key in ("reasoning_content", "thinking_blocks"):
            if message.get(key) and key not in reply:
                reply[key] = message[key]
    reply["content"] = "".join(texts) or None
    # The model declined: its refusal parts, which the bridge drops, kept as a chat answer says it.
    refusal = "".join(str(part.get("refusal") or "") for item in output if isinstance(item, dict)
                      and item.get("type") == "message" for part in item.get("content") or []
                      if isinstance(part, dict) and part.get("type") == "refusal")
    if refusal:
        reply["refusal"] = refusal
    if calls:
        reply["tool_calls"] = calls
    return reply


def _with_ids(items: list[Item], make_id: Callable[[str], str]) -> list[Item]:
    """Input items as `input_items` lists them: each with an id (the client's, else a new one)."""
    return [item if item.get("id") else {"id": make_id(ITEM_PREFIXES.get(item.get("type", "message"), "item")),
                                        **item} for item in items]


# --- the kept responses ----------------------------------------------------------------------------


def _may_exist(response_id: str) -> bool:
    """Whether a kept response could have this id: one with a character no store column holds (a
    NUL, which PostgreSQL refuses as an error, not a miss) or longer than any id is none."""
    return len(response_id) <= 256 and response_id.isprintable()


async def _stored(store: TurnStore, tenant: str, response_id: str, with_input: bool = True) -> StoredResponse | None:
    return await store.get_response(tenant, response_id, with_input) if _may_exist(response_id) else None


async def _kept(request: web.Request) -> tuple[str, Any]:
    tenant = caller_tenant(request)
    response_id = request.match_info["response_id"]
    stored = await _stored(request.app[STORE], tenant, response_id)
    if stored is None:
        raise NotFound(f"Response with id '{response_id}' not found.", param="response_id")
    return tenant, stored


async def retrieve(request: web.Request) -> web.StreamResponse:
    _, stored = await _kept(request)
    if request.query.get("stream", "false").lower() not in ("false", "0", ""):
        # OpenAI streams a background response's events again here; memproxy answers every response
        # in the foreground and keeps none of its events. Answered with the object, the SDK would
        # read a stream with no events in it, and say nothing.
        raise BadRequest("a kept response's events cannot be streamed again (memproxy answers every response "
                         "in the foreground and keeps no events); retrieve it without 'stream'", param="stream")
    return web.Response(body=dumps(stored.body), content_type="application/json", charset="utf-8")


async def delete(request: web.Request) -> web.StreamResponse:
    tenant = caller_tenant(request)
    response_id = request.match_info["response_id"]
    if not _may_exist(response_id) or not await request.app[STORE].delete_response(tenant, response_id):
        raise NotFound(f"Response with id '{response_id}' not found.", param="response_id")
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


async def list_input_items(request: web.Request) -> web.StreamResponse:
    """A kept response's input items, a page at a time (`limit` 1-100, default 20; `order` desc by
    default, as OpenAI lists them; `after` an item id)."""
    _, stored = await _kept(request)
    after = request.query.get("after")
    page = item_page(stored.input_items, request.query, f"no input item '{after}' in this response")
    return web.Response(body=dumps(page), content_type="application/json", charset="utf-8")
