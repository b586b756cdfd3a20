"""One log line and one count per HTTP request, whatever its answer: a middleware, the outermost.

`observe` times the request, lets the error middleware inside it turn any failure into its answer,
and once the answer is out (a stream: once it ended) writes one line to the `memproxy.http` logger
and counts the request in the app's metrics (`memproxy.metrics`). What only the handlers learn (the
model, how the turn was reconciled, the error's code, the provider's status, the timings, the turn
recorded) they note on the request's `Notes` as they learn it (`notes(request)`).

The line says who and what, never content: method, route pattern, status, duration, the error's
code, the provider's status, tenant, session id (an identifier the client chose, logged only when it
is a valid one), and for a chat request the model, the reconcile kind, the context's counts and the
`Server-Timing` split.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from .metrics import ADMIN_TENANT, NO_TENANT, Metrics
from .session_ids import SESSION_HEADER, is_session_id
from .typedefs import CALLER, METRICS, NOTES

if TYPE_CHECKING:
    from .memory.plan import PreparedTurn
    from .store import TurnRecord
    from .timing import Timings

log = logging.getLogger("memproxy.http")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
CLIENT_GONE = 499  # nginx's status for a request whose client went away before its answer was complete
_UNMATCHED = "unmatched"  # the route of a request no route matched (404, 405): its path is not a label
_SESSIONLESS_PARTS = ("parse", "memory")  # a chat request without a session does no other memory work


@dataclass
class Notes:
    """What the handlers learnt about one request, for its log line and metrics."""

    model: str | None = None
    stream: bool | None = None
    timings: Timings | None = None
    turn: PreparedTurn | None = None  # planned on a session
    record: TurnRecord | None = None  # recorded
    status: int | None = None  # where the response's is not the outcome: a stream's error event, 499
    error: str | None = None  # the error's code
    upstream_status: int | None = None  # the provider's own status, where it answered with an error


def notes(request: web.Request) -> Notes:
    """The request's notes (a request that did not pass `observe`, as in a unit test: thrown away)."""
    return request.get(NOTES) or Notes()


@web.middleware
async def observe(request: web.Request, handler: Handler) -> web.StreamResponse:
    started = time.perf_counter()
    noted = request[NOTES] = Notes()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except asyncio.CancelledError:
        status = CLIENT_GONE  # aiohttp cancels the handler of a client that went away
        raise
    except web.HTTPException as exc:  # what the error middleware lets through (a redirect)
        status = exc.status
        raise
    finally:
        try:
            _finish(request, noted, noted.status or status, time.perf_counter() - started)
        except Exception as exc:  # a failure to observe must never fail the answer
            log.error("observing a request failed: %s", type(exc).__name__)


def _finish(request: web.Request, noted: Notes, status: int, seconds: float) -> None:
    route = _route(request)
    caller = request.get(CALLER)
    tenant = caller.tenant if caller is not None else None
    metrics: Metrics = request.app[METRICS]
    metrics.request(route, request.method, status, seconds, noted.model or "", _reconcile(noted),
                    tenant or (ADMIN_TENANT if caller is not None and caller.admin else NO_TENANT))
    record = noted.record
    split = noted.timings.split() if noted.timings is not None else None
    if split is not None and split["upstream"] > 0 and noted.model is not None:
        parts = {part: ms for part, ms in split.items() if part != "upstream"}
        if noted.turn is None:
            parts = {part: parts[part] for part in _SESSIONLESS_PARTS}
        metrics.chat_timings(noted.model, parts, split["upstream"])
    if record is not None:
        metrics.turn(record.model, tenant or NO_TENANT, record.context_tokens, record.full_tokens,
                     record.usage.prompt_tokens, record.usage.completion_tokens)
    if not log.isEnabledFor(logging.INFO):
        return
    fields: dict[str, Any] = {"method": request.method, "route": route, "status": status,
                              "duration_ms": seconds * 1000}
    if noted.error is not None:
        fields["error"] = noted.error
    if noted.upstream_status is not None:
        fields["upstream_status"] = noted.upstream_status
    if tenant is not None:
        fields["tenant"] = tenant
    elif caller is not None and caller.admin:
        fields["admin"] = True
    session = _session_id(request)
    if session is not None:
        fields["session"] = session
    if noted.model is not None:
        fields["model"] = noted.model
        fields["stream"] = bool(noted.stream)
    turn = noted.turn
    if turn is not None:
        context = turn.context
        fields.update(reconcile=turn.reading.kind, context_tokens=context.tokens, included=context.included,
                      omitted=context.omitted, recalled=len(context.recalled))
    if split is not None:
        fields.update((f"{part}_ms", ms) for part, ms in split.items())
    log.info("request", extra=fields)


def _route(request: web.Request) -> str:
    """The route's pattern (`/v1/sessions/{session_id}`), never the path: a label must not take
    a value per session."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else _UNMATCHED


def _reconcile(noted: Notes) -> str:
    if noted.turn is not None:
        return noted.turn.reading.kind
    return "none" if noted.model is not None else ""  # a chat request without a session


def _session_id(request: web.Request) -> str | None:
    value = request.match_info.get("session_id") or request.headers.get(SESSION_HEADER)
    return value if value is not None and is_session_id(value) else None
