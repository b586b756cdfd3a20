"""`POST /v1/chat/completions`: memory around one forwarded call.

HTTP only: parse, plan (`memory.plan`), forward, record (`memory.record`). Without `X-Session-Id`
the request goes upstream untouched and nothing is stored. With it, one request per session runs at
a time: the turn is planned (reconcile, budget, pre-flight check), forwarded, and recorded in one
transaction once the answer is complete, before the client is told it is done (the final `[DONE]`
of a stream, the body of a plain response). Recording runs as an owned task, so a client that
disconnects after the answer was complete still gets its turn stored; a failed or cut upstream call
stores nothing.

Failures (README, "Failure behaviour"). A store that fails while the turn is planned fails the request
with a 503 before anything is paid for upstream, or with `storage.on_failure: passthrough` the request
goes upstream without memory (`X-Memproxy-Memory: unavailable`) and nothing is stored. An answer the
provider gave is never thrown away for want of recording it: a plain response says whether it was
stored (`X-Memproxy-Stored`); a stream, whose headers left before, ends with an error event instead of
`[DONE]`. Once a stream's headers are out, whatever goes wrong ends it with exactly one OpenAI-shaped
error event: an exception never reaches the error middleware, which would write a second response
into the body.

The turn itself (`serve_turn`) is shared with the Responses API (`memproxy.responses`): only the
wire differs, the upstream call and what the client sees of it (`Wire`; chat's is `ChatWire`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import traceback
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

from .bodies import json_object, requested_model
from .calibration import observed_from
from .config import Config, ModelConfig
from .errors import (
    BadRequest,
    Forbidden,
    Conflict,
    ProxyError,
    UpstreamError,
    error_body,
    store_unavailable_body,
)
from .jsonbytes import dumps
from .memory.plan import PreparedTurn, prepare_turn
from .memory.reconcile import HISTORY_MODES, HistoryMode, Reconciled
from .memory.record import turn_record
from .memory.retention import cap_messages
from .messages import Message, validate_messages, within_cache_breakpoints
from .observe import CLIENT_GONE, notes
from .params import check_params
from .redact import session_digest
from .session_ids import SESSION_HEADER, SESSION_ID_RULE, end_user, is_session_id
from .store import StoreUnavailable, TurnRecord
from .store.errors import SessionDeleted, StoreConflict
from .streaming import StreamAssembler, hiding_usage
from .timing import BEFORE_UPSTREAM, Timings, measured
from .typedefs import CALLER, CONFIG, HISTORIES, LOCKS, METRICS, PROVIDER, STORE, SUMMARIZER, TASKS

if TYPE_CHECKING:
    from .provider import Provider

log = logging.getLogger("memproxy.chat")

HISTORY_HEADER = "X-Memproxy-History"
STORED_HEADER = "X-Memproxy-Stored"  # a plain response on a session: whether its turn was recorded
RECALLED_HEADER = "X-Memproxy-Recalled"  # stored messages recalled into the request
MEMORY_HEADER = "X-Memproxy-Memory"  # "unavailable": forwarded without memory (`storage.on_failure`)
_NOT_PARAMS = frozenset({"model", "messages"})


@dataclass(frozen=True)
class Answer:
    """A plain (not streamed) upstream answer: the assistant message and usage a turn records, and
    the body the client gets."""

    reply: Message
    usage: dict[str, Any] | None
    body: dict[str, Any]


class Wire(Protocol):
    """How one turn's answer travels: the upstream call, and what the client sees of it. Chat's is
    `ChatWire`; the Responses API has its own (`memproxy.responses`). The handler around it (the
    session, the plan, the record, headers, errors) is the same for both."""

    async def answer(self, provider: Provider, exchange: Exchange) -> Answer: ...

    async def open(self, provider: Provider, exchange: Exchange) -> AsyncGenerator[dict[str, Any], None]:
        """The upstream stream; its first chunk is awaited, so early errors raise before any header."""
        ...

    def relay(self, chunk: dict[str, Any]) -> bytes:
        """What the client sees of one upstream chunk (b"": nothing)."""
        ...

    def reply(self) -> tuple[Message, dict[str, Any] | None] | None:
        """Once the stream ended: the assistant message and usage to record; None if it was cut."""
        ...

    def attach(self, record: TurnRecord) -> TurnRecord:
        """The turn as the store writes it, with whatever this wire keeps beside it."""
        ...

    def unkept(self, body: dict[str, Any]) -> dict[str, Any]:
        """A plain answer's body where its turn could not be recorded (told by `X-Memproxy-Stored`)."""
        ...

    def without_memory(self) -> None:
        """The turn goes upstream without memory and will not be recorded (`storage.on_failure:
        passthrough`): nothing the client sees of it may say that it is kept."""
        ...

    def done(self) -> bytes:
        """The end of a stream whose answer is complete and recorded."""
        ...

    def error(self, body: dict[str, Any]) -> bytes:
        """The one event that ends a stream with an error (`body`: an OpenAI error body)."""
        ...


class ChatWire:
    """Chat completions: the provider's answer relayed as it came. A recorded turn's usage is asked
    for even where the client did not ask; the client's stream is then relayed as it would have
    been without it (no usage field, no usage chunk)."""

    def __init__(self) -> None:
        self._assembler = StreamAssembler()
        self._hide_usage = False

    async def answer(self, provider: Provider, exchange: Exchange) -> Answer:
        result = await provider.complete(exchange.model, exchange.messages, exchange.params)
        choices = result.get("choices")
        message = choices[0].get("message") if choices and isinstance(choices[0], dict) else None
        if not isinstance(message, dict):  # nothing to relay or remember: the provider's fault
            raise UpstreamError("upstream answered with no message (a chat completion without choices)")
        return Answer(message, result.get("usage"), result)

    async def open(self, provider: Provider, exchange: Exchange) -> AsyncGenerator[dict[str, Any], None]:
        asking = _with_usage(exchange.params) if exchange.turn is not None else None
        self._hide_usage = asking is not None
        return await provider.stream(exchange.model, exchange.messages, asking or exchange.params)

    def relay(self, chunk: dict[str, Any]) -> bytes:
        self._assembler.add(chunk)
        shown = hiding_usage(chunk) if self._hide_usage else chunk
        return b"" if shown is None else b"data: " + dumps(shown) + b"\n\n"

    def reply(self) -> tuple[Message, dict[str, Any] | None] | None:
        if not self._assembler.complete:
            return None
        return self._assembler.message(), self._assembler.usage

    def attach(self, record: TurnRecord) -> TurnRecord:
        return record

    def unkept(self, body: dict[str, Any]) -> dict[str, Any]:
        return body

    def without_memory(self) -> None:
        pass

    def done(self) -> bytes:
        return b"data: [DONE]\n\n"

    def error(self, body: dict[str, Any]) -> bytes:
        return b"data: " + dumps(body) + b"\n\n"


@dataclass
class Exchange:
    """What one request carries through the handler, and the headers that report on it."""

    model: ModelConfig
    messages: list[Message]
    params: dict[str, Any]
    timings: Timings
    headers: dict[str, str] = field(default_factory=dict)
    turn: PreparedTurn | None = None
    record: TurnRecord | None = None  # the turn, once it is recorded
    wire: Wire = field(default_factory=ChatWire)

    @property
    def recorded(self) -> bool:
        return self.record is not None

    @property
    def stream(self) -> bool:
        return bool(self.params.get("stream"))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    with measured() as timings:
        return await _chat(request, timings)


async def _chat(request: web.Request, timings: Timings) -> web.StreamResponse:
    config = request.app[CONFIG]
    body = await json_object(request)
    exchange = _parse(config, request.app[PROVIDER], body, timings, request.match_info.get("deployment"))
    timings.lap("parse")
    noted = notes(request)  # the request's log line and metrics (`memproxy.observe`)
    noted.model, noted.stream, noted.timings = exchange.model.name, exchange.stream, timings
    tenant = caller_tenant(request)
    return await serve_turn(request, exchange, tenant, session_id_header(request))


def caller_tenant(request: web.Request) -> str:
    tenant = request[CALLER].tenant
    if tenant is None:
        raise Forbidden("An admin key manages sessions; chat with a tenant's key.")
    return tenant


# What a turn reads inside its session's lock, where the messages to reconcile depend on the
# session as it is then (the Responses API's `previous_response_id`): the messages and how to read them.
Planning = Callable[[], Awaitable[tuple[list[Message], HistoryMode]]]


async def serve_turn(request: web.Request, exchange: Exchange, tenant: str, session_id: str | None,
                     planning: Planning | None = None) -> web.StreamResponse:
    """A parsed exchange's turn: without a session forwarded untouched, else planned, forwarded and
    recorded under the session's lock. `planning`: the messages and history mode, decided once the
    lock is held (default: the exchange's messages, read as `X-Memproxy-History` says)."""
    config = request.app[CONFIG]
    if session_id is None:
        return await _forward(request, exchange)
    exchange.headers[SESSION_HEADER] = session_id
    async with request.app[LOCKS].hold(tenant, session_id):
        mode: HistoryMode | None = None
        sent: list[Message] = exchange.messages
        try:
            if planning is not None:
                exchange.messages, mode = await planning()
            sent = exchange.messages
            await _prepare(request, exchange, tenant, session_id, mode)
        except StoreUnavailable as exc:
            if config.storage.on_failure != "passthrough":
                raise  # a 503, before anything is paid for upstream
            # The request as the client sent it, remembered nowhere: what "continue without memory"
            # asks for, said in a header so the client knows this turn will not be recalled.
            log.error("store unavailable, chat forwarded without memory: %s", type(exc.__cause__).__name__)
            request.app[METRICS].store_error("passthrough")
            exchange.turn = None
            exchange.wire.without_memory()
            exchange.headers.update({MEMORY_HEADER: "unavailable", STORED_HEADER: "false"})
        try:
            return await _forward(request, exchange)
        except UpstreamError as exc:
            if not _refused_for_length(request, exchange, exc):
                raise
        # The provider counts more than memproxy did: planned again for its count, and sent once more.
        # The client's request is reported as first read: a history the first plan stored
        # (`resent_history`) reads as stored to the second.
        exchange.timings.upstream_retried()
        read_as = exchange.turn.reading if exchange.turn is not None else None
        exchange.messages = sent
        await _prepare(request, exchange, tenant, session_id, mode, read_as)
        return await _forward(request, exchange)


def _refused_for_length(request: web.Request, exchange: Exchange, exc: UpstreamError) -> bool:
    """Whether the provider refused the planned request as too long where memory can make it
    shorter (it holds stored history, a summary or recalled turns); if so the model's calibration
    is raised by what the refusal says (`memproxy.calibration`)."""
    turn = exchange.turn
    app = request.app
    provider = app[PROVIDER]
    if exc.code != "context_length_exceeded" or turn is None or not provider.calibration.enabled:
        return False
    context = turn.context
    if not (context.included or context.summary is not None or context.recalled):
        return False  # the client's own messages alone: nothing of memory's to leave out
    model = exchange.model
    media = context.media  # counted by estimate: the refusal is this session's own
    session = (turn.tenant, turn.session_id)
    before = provider.calibration.factor(model.name, session)
    after = provider.calibration.refused(model.name, context.tokens, exc.message, provider.window(model),
                                         session if media else None)
    app[METRICS].refused_for_length(model.name)
    log.warning("the provider refused a planned request as too long: model=%s counted=%d calibration=%.3f->%.3f%s;"
                " planned again", model.name, context.tokens, before, after, " (this session's: media)" if media else "")
    return True


def _parse(config: Config, provider: Provider, body: dict[str, Any], timings: Timings,
           deployment: str | None = None) -> Exchange:
    """The request: its model is the one a path names (`deployment`, as Azure OpenAI's do), else its body's."""
    model = requested_model(config, deployment or body.get("model"))
    messages = validate_messages(body.get("messages"), provider.user_part_types(model))
    check_params(body, provider.through_litellm(model))
    params = {k: v for k, v in body.items() if k not in _NOT_PARAMS}
    return Exchange(model=model, messages=messages, params=params, timings=timings)


def session_id_header(request: web.Request) -> str | None:
    value = request.headers.get(SESSION_HEADER)
    if value is None:
        return None
    if not is_session_id(value):
        raise BadRequest(f"{SESSION_HEADER} must be {SESSION_ID_RULE}",
                         code="invalid_session_id", param=SESSION_HEADER)
    return value


def _history_mode(request: web.Request) -> HistoryMode:
    """The `X-Memproxy-History` header's mode (`auto` when absent), as a checked kind."""
    value = request.headers.get(HISTORY_HEADER, "auto").lower()
    for mode in HISTORY_MODES:
        if value == mode:
            return mode
    raise BadRequest(f"{HISTORY_HEADER} must be one of {', '.join(HISTORY_MODES)}", param=HISTORY_HEADER)


async def _prepare(request: web.Request, exchange: Exchange, tenant: str, session_id: str,
                   mode: HistoryMode | None = None, read_as: Reconciled | None = None) -> None:
    app = request.app
    config, provider = app[CONFIG], app[PROVIDER]
    mode = mode or _history_mode(request)
    turn = await prepare_turn(
        app[STORE], app[SUMMARIZER], exchange.model, provider.counter(exchange.model),
        provider.window(exchange.model), config.memory, tenant, session_id, exchange.messages,
        exchange.params, mode, idle_ttl=config.retention.idle_ttl_seconds,
        end_user=end_user(request.headers, exchange.params),
        calibration=provider.calibration.factor(exchange.model.name, (tenant, session_id)), tasks=app[TASKS],
        histories=app[HISTORIES],
    )
    if read_as is not None:
        turn = dataclasses.replace(turn, read_as=read_as)
    exchange.turn = notes(request).turn = turn
    exchange.messages = within_cache_breakpoints(turn.context.messages, len(turn.reconciled.new),
                                                 exchange.params.get("tools"))
    context, reconciled, budget = turn.context, turn.reading, turn.budget
    if reconciled.superseded and read_as is None:  # said once, by the first plan
        # Forgetting must never pass unseen: counts and positions, never content.
        log.info("supersede session=%s kind=%s superseded=%d positions=%d..%d (once the turn is recorded)",
                 session_digest(tenant, session_id), reconciled.kind, reconciled.superseded,
                 reconciled.base, reconciled.base + reconciled.superseded - 1)
    exchange.headers.update({
        "X-Memproxy-Reconcile": reconciled.kind,
        "X-Memproxy-Superseded": str(reconciled.superseded),
        "X-Memproxy-Context-Tokens": str(context.tokens),
        "X-Memproxy-Input-Budget": str(budget.input_tokens),
        "X-Memproxy-Token-Calibration": f"{budget.calibration:.3f}",
        "X-Memproxy-Stored-Included": str(context.included),
        "X-Memproxy-Stored-Omitted": str(context.omitted),
        "X-Memproxy-Summary-Version": str(context.summary.version if context.summary else 0),
        "X-Memproxy-Summarized": str(context.summary.covers if context.summary else 0),
        "X-Memproxy-Unsummarized-Omitted": str(context.unsummarised_omitted),
        "X-Memproxy-Tool-Outputs-Trimmed": str(context.trimmed),
        "X-Memproxy-Deduplicated": str(context.deduplicated),
        RECALLED_HEADER: str(len(context.recalled)),
    })
    exchange.timings.lap("budget")


async def _forward(request: web.Request, exchange: Exchange) -> web.StreamResponse:
    if exchange.stream:
        return await _forward_stream(request, exchange)
    provider = request.app[PROVIDER]
    upstream_started = time.perf_counter()
    try:
        answer = await exchange.wire.answer(provider, exchange)
    except UpstreamError:
        exchange.timings.upstream_failed(upstream_started)  # a refusal for length is planned again
        raise
    upstream_ms = exchange.timings.upstream_ended(upstream_started)
    if exchange.turn is not None:
        try:
            await _record(request, exchange, answer.reply, answer.usage, upstream_ms)
        except SessionDeleted:
            pass  # paid for, its session gone: the client gets the answer, told it is not remembered
        except (ProxyError, StoreConflict):
            raise  # a refusal (the session moved meanwhile: 409), not a failure
        except Exception as exc:
            # The answer is paid for: the client gets it, told that the turn is not remembered.
            _log_failure("recording a turn", exc)
            if isinstance(exc, StoreUnavailable):
                request.app[METRICS].store_error("record")
        exchange.headers[STORED_HEADER] = "true" if exchange.recorded else "false"
    body = answer.body if exchange.turn is None or exchange.recorded else exchange.wire.unkept(answer.body)
    exchange.headers["Server-Timing"] = exchange.timings.header()
    response = web.Response(body=dumps(body), headers=exchange.headers, content_type="application/json",
                            charset="utf-8")
    try:
        await response.prepare(request)
        await response.write_eof()
    finally:
        _after_response(request, exchange)
    return response


def _with_usage(params: dict[str, Any]) -> dict[str, Any] | None:
    """`params` asking the provider for the stream's usage, where the client did not ask (None
    where it did): a turn is recorded with what it cost, whatever the client wanted to see."""
    options = params.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        return None
    return {**params, "stream_options": {**(options if isinstance(options, dict) else {}), "include_usage": True}}


async def _forward_stream(request: web.Request, exchange: Exchange) -> web.StreamResponse:
    provider = request.app[PROVIDER]
    upstream_started = time.perf_counter()
    try:
        chunks = await exchange.wire.open(provider, exchange)
    except UpstreamError:
        exchange.timings.upstream_failed(upstream_started)
        raise
    exchange.timings.upstream_ended(upstream_started)
    # The headers leave now, before the answer is complete and recorded: the whole split, `record`
    # included, is in the request's log line.
    exchange.headers["Server-Timing"] = exchange.timings.header(BEFORE_UPSTREAM, "upstream-first-chunk")
    response = web.StreamResponse(headers={
        **exchange.headers,
        "Content-Type": "text/event-stream",
        "Cache-Control": "no-cache",
    })
    await response.prepare(request)
    relayed = False
    try:
        upstream_ms = await _relay(chunks, response, exchange.wire, exchange.timings, upstream_started)
        relayed = True
        reply = exchange.wire.reply()
        if reply is None:
            raise ProxyError("the upstream stream ended before the answer was complete",
                             status=502, code="upstream_incomplete")
        if exchange.turn is not None:
            try:
                await _record(request, exchange, *reply, upstream_ms)
            except SessionDeleted:  # paid for, its session gone: the answer ends as any other, not remembered
                exchange.wire.without_memory()
        await response.write(exchange.wire.done())
    except (ConnectionError, asyncio.CancelledError) as exc:  # the client went away (aiohttp cancels its handler)
        notes(request).status = CLIENT_GONE
        if not relayed:
            await _record_finished(request, exchange, upstream_started)
        else:  # recorded before the client went, or its write still under way (`BackgroundTasks.run`)
            _after_response(request, exchange)
        if isinstance(exc, asyncio.CancelledError):
            raise
        return response
    except Exception as exc:  # anything at all: the headers are out, so it can only end the stream
        await _end_stream(request, response, exc, exchange.wire)
        return response
    await _write_quietly_eof(response)
    _after_response(request, exchange)
    return response


async def _record_finished(request: web.Request, exchange: Exchange, upstream_started: float) -> None:
    """The client went away while its stream was relayed. An answer the provider had finished (its
    finish reason relayed; the usage chunk and `[DONE]` still to come) is the client's whole answer:
    a client may read up to the finish reason and hang up, and one that sends only its new messages
    next would find the answer forgotten. It is recorded, without the usage that never came. An
    answer cut before its finish reason is not: nobody saw it whole, and a retry asks it again."""
    reply = exchange.wire.reply() if exchange.turn is not None else None
    if reply is None:
        return
    try:
        await _record(request, exchange, reply[0], reply[1], (time.perf_counter() - upstream_started) * 1000)
    except SessionDeleted:
        return
    except Exception as exc:  # nobody to tell: logged, as any failed write
        _log_failure("recording a turn whose client went away", exc)
        if isinstance(exc, StoreUnavailable):
            request.app[METRICS].store_error("record")
        return
    _after_response(request, exchange)


async def _end_stream(request: web.Request, response: web.StreamResponse, exc: Exception, wire: Wire) -> None:
    """End a stream whose headers are out with one error event, and no `[DONE]`: the client's SDK
    raises it, and what came before it is not a finished answer. A `ProxyError` says what it is; a
    store failure says the answer was not stored; anything else is an internal error, whose text
    (it may quote content) goes nowhere."""
    noted = notes(request)  # the request ends with this error's status, not the headers' 200
    if isinstance(exc, StoreConflict):
        exc = Conflict.from_store(exc)
    if isinstance(exc, ProxyError):
        status, body = exc.status, exc.body()
        if isinstance(exc, UpstreamError):
            noted.upstream_status = exc.upstream_status
    elif isinstance(exc, StoreUnavailable):
        _log_failure("recording a streamed turn", exc)
        request.app[METRICS].store_error("record")
        status, body = 503, store_unavailable_body()
    else:
        _log_failure("a stream after its headers", exc)
        status, body = 500, error_body("internal error", "server_error", "internal_error")
    noted.status, noted.error = status, body["error"]["code"] or body["error"]["type"]
    await _write_quietly(response, wire.error(body))


def _log_failure(where: str, exc: BaseException) -> None:
    """The exception's class and where it was raised, at ERROR: never its message, nor its cause's,
    which may quote message content."""
    cause = f" (from {type(exc.__cause__).__name__})" if exc.__cause__ is not None else ""
    stack = "".join(traceback.format_tb(exc.__traceback__)).rstrip()
    log.error("%s failed: %s%s\n%s", where, type(exc).__name__, cause, stack)


async def _relay(chunks: AsyncGenerator[dict[str, Any], None], response: web.StreamResponse,
                 wire: Wire, timings: Timings, upstream_started: float) -> float:
    """Relay the stream to the client as `wire` shows it; returns how long the upstream took
    (relaying included), also when the stream or the client broke off."""
    try:
        async with aclosing(chunks):  # a client that went away releases the upstream connection now
            async for chunk in chunks:
                shown = wire.relay(chunk)
                if shown:
                    await response.write(shown)
    finally:
        upstream_ms = timings.upstream_ended(upstream_started)
    return upstream_ms


async def _record(request: web.Request, exchange: Exchange, reply: Message,
                  usage: dict[str, Any] | None, upstream_ms: float) -> None:
    turn = exchange.turn
    assert turn is not None
    app = request.app
    provider = app[PROVIDER]
    record = exchange.wire.attach(turn_record(turn, provider.counter(exchange.model), app[CONFIG].memory, reply,
                                              exchange.model.name, usage, upstream_ms,
                                              provider.cost(exchange.model, usage)))
    await app[TASKS].run(app[STORE].record_turn(record))
    exchange.record = notes(request).record = record
    window = provider.window(exchange.model)
    if usage and turn.context.tokens >= observed_from(window) and not turn.context.media:
        provider.calibration.observe(exchange.model.name, turn.context.tokens, usage.get("prompt_tokens"), window)
    exchange.timings.lap("record")


def _after_response(request: web.Request, exchange: Exchange) -> None:
    """Once the answer is out, a recorded turn may start a background summary and trim the
    session to its message cap."""
    turn, record = exchange.turn, exchange.record
    if record is None or turn is None:
        return
    app = request.app
    app[SUMMARIZER].after_turn(turn.tenant, turn.session_id, exchange.model,
                               turn.context.unfolded + sum(m.compacted_tokens for m in record.messages))
    cap = app[CONFIG].retention.max_messages_per_session
    if cap is not None:
        app[TASKS].spawn(cap_messages(app[STORE], turn.tenant, turn.session_id, cap), optional=True)


async def _write_quietly(response: web.StreamResponse, data: bytes) -> None:
    try:
        await response.write(data)
    except ConnectionError:
        pass


async def _write_quietly_eof(response: web.StreamResponse) -> None:
    try:
        await response.write_eof()
    except ConnectionError:
        pass
