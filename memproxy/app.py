"""The application factory: routes, the middlewares (one log line and one count per request, errors,
auth), and one cleanup context per resource (store, provider, background tasks, summarizer), which aiohttp unwinds in reverse order so
pending writes finish before the provider and the store close."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import hdrs, http_exceptions, web

from . import inline_setup
from .auth import authenticate
from .bodies import BodyBudget
from .chat import chat_completions
from .concurrency import BackgroundTasks, SessionLocks
from .config import Config
from .conversations import add_routes as add_conversation_routes
from .deadlines import body_deadline, header_deadline, send_deadline
from .endpoints import add_routes as add_endpoint_routes, not_found_message, wrong_method_message
from .errors import Conflict, ProxyError, UpstreamError, error_body, error_type, store_unavailable_body
from .inspector import add_routes as add_inspector_routes
from .memory.retention import sweep
from .memory.sent import MAX_ENTRIES, SentHistories
from .memory.summaries import Summarizer
from .metrics import Metrics
from .observe import log as request_log, notes, observe
from .origins import add_cors, guard, is_preflight
from .provider import Provider
from .responses import add_routes as add_responses_routes
from .routes import healthz, metrics, model, models, readyz
from .sessions import add_routes as add_session_routes
from .store import StoreUnavailable, open_store
from .store.errors import StoreConflict
from .typedefs import (CALLER, CONFIG, HISTORIES, LOCKS, METRICS, PROVIDER, STORE, SUMMARIZER, TASKS, ALIASES,
                       AddRoute, Handler)

log = logging.getLogger("memproxy")

_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def create_app(config: Config) -> web.Application:
    app = web.Application(
        middlewares=[observe, _errors, guard(config), header_deadline, _auth, BodyBudget(config.server).middleware,
                     body_deadline],
        client_max_size=config.server.max_body_bytes,
    )
    app[CONFIG] = config
    app[LOCKS] = SessionLocks()
    app[METRICS] = Metrics(config.metrics)
    # Kept beside the history cache, whose stored messages it is made from: off with it.
    app[HISTORIES] = SentHistories(MAX_ENTRIES if config.storage.history_cache_mb else 0)
    app.cleanup_ctx.extend([_store, _provider, _tasks, _summarizer, _retention, _frozen_heap])
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    aliases: list[str] = []
    add = _openai_routes(app, aliases)
    add("GET", "/v1/models", models)
    add("GET", "/v1/models/{model:.+}", model)  # a name may hold a slash
    add("POST", "/v1/chat/completions", chat_completions)
    add_endpoint_routes(add)
    add_responses_routes(add)
    add_conversation_routes(add)
    app[ALIASES] = frozenset(aliases)
    add_session_routes(app)
    add_inspector_routes(app)
    add_cors(app, config)
    app.on_response_prepare.extend([_private, send_deadline])
    return app


# What Azure OpenAI's clients call with the deployment, their name for the model, in the path
# (`openai.lib.azure`), of what memproxy serves.
_DEPLOYMENT_PATHS = frozenset({"/chat/completions", "/completions", "/embeddings", "/audio/transcriptions",
                               "/audio/speech", "/images/generations", "/images/edits"})


def _openai_routes(app: web.Application, aliases: list[str]) -> AddRoute:
    """What registers an OpenAI endpoint: at its path under `/v1`, and at the same path without
    `/v1`, for a client whose `base_url` lacks it (as LiteLLM's proxy serves both), and where Azure
    OpenAI's clients call it: under `/openai`, and with `/openai/deployments/{deployment}` where
    Azure names the model in the path. The routes besides `/v1`'s are noted in `aliases` (as
    declared): the key is asked for there as under `/v1`. memproxy's own API (sessions, search,
    usage) is under `/v1` alone."""

    def add(method: str, path: str, handler: Handler) -> None:
        bare = path.removeprefix("/v1")
        at = [path, bare, "/openai" + bare]
        if bare in _DEPLOYMENT_PATHS:
            at.append("/openai/deployments/{deployment}" + bare)
        for where in at:
            # A GET route answers HEAD too, as aiohttp's `add_get` makes it.
            if method == "GET":
                route = app.router.add_get(where, handler)
            else:
                route = app.router.add_route(method, where, handler)
            if where != path:
                assert route.resource is not None
                aliases.append(route.resource.canonical)

    return add


async def _private(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer is the caller's own (conversations, sessions, usage): no cache may keep it
    unless a handler said otherwise (the inspector's pages, an event stream), and no browser may
    read it as anything but the type it is sent as."""
    headers = response.headers
    headers.setdefault("Cache-Control", "no-store")
    headers.setdefault("X-Content-Type-Options", "nosniff")


async def _store(app: web.Application) -> AsyncIterator[None]:
    app[STORE] = await open_store(app[CONFIG].storage)
    yield
    await app[STORE].close()


async def _provider(app: web.Application) -> AsyncIterator[None]:
    inline_setup.install(asyncio.get_running_loop())  # litellm's call set-up on the loop, not a thread
    app[PROVIDER] = Provider(app[CONFIG])
    yield
    await app[PROVIDER].close()


async def _tasks(app: web.Application) -> AsyncIterator[None]:
    app[TASKS] = BackgroundTasks()
    yield
    await app[TASKS].close()


async def _summarizer(app: web.Application) -> AsyncIterator[None]:
    app[SUMMARIZER] = Summarizer(app[CONFIG], app[STORE], app[PROVIDER], app[TASKS], app[METRICS])
    yield


async def _retention(app: web.Application) -> AsyncIterator[None]:
    """With an idle TTL, a sweep deletes expired sessions every `sweep_interval_seconds`: those idle
    for the TTL and as long again as a turn may take (the longest model timeout and the wait for a
    summary), so that a turn planned just before its session expired is never answered and then
    refused because the sweep deleted the session meanwhile. An expired session behaves as new
    from the TTL on whether or not it is deleted yet."""
    config = app[CONFIG]
    retention = config.retention
    if retention.idle_ttl_seconds is not None:
        turn = max((m.timeout_seconds for m in config.models), default=0.0) \
            + config.memory.sync_summary_timeout_seconds
        app[TASKS].spawn(sweep(app[STORE], retention.idle_ttl_seconds + turn, retention.sweep_interval_seconds,
                               app[METRICS]), optional=True)
    yield


async def _frozen_heap(app: web.Application) -> AsyncIterator[None]:
    """Once everything is loaded, what start-up allocated (litellm's import alone is some 300,000
    objects) is moved out of the garbage collector's sight: it lives as long as the process, and a
    full collection that walks it pauses every request for a few hundred milliseconds (measured
    here: one such collection took 225 ms with litellm loaded, 12 ms with its objects frozen)."""
    gc.freeze()
    yield
    gc.unfreeze()


def _route(request: web.Request) -> str:
    """The route a request matched, as declared (`/v1/sessions/{session_id}`): never its path, whose
    ids are the client's text (a `%0A` in one would start a log line of the client's choosing)."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "(no route)"


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ProxyError as exc:
        noted = notes(request)
        noted.error = exc.code or exc.type  # a 400 without a code of its own: its type
        if isinstance(exc, UpstreamError):
            noted.upstream_status = exc.upstream_status
        response = web.json_response(exc.body(), status=exc.status, headers=exc.headers or None)
        if isinstance(exc.__cause__, web.RequestPayloadError):
            response.force_close()  # the rest of a body that failed to decode cannot be skipped
        return response
    except StoreConflict as exc:  # the store refused: the session moved meanwhile, or the id exists
        notes(request).error = Conflict.code
        return web.json_response(Conflict.from_store(exc).body(), status=Conflict.status)
    except StoreUnavailable as exc:
        # The driver's error names only its class: its text may quote stored content.
        log.error("store unavailable on %s %s: %s", request.method, _route(request), type(exc.__cause__).__name__)
        notes(request).error = "store_unavailable"
        request.app[METRICS].store_error("request")
        return web.json_response(store_unavailable_body(), status=503)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.reason
        if exc.status == 404 and request.match_info.http_exception is not None:  # no such route
            message = not_found_message(request)
        if exc.status == 405 and "Allow" in exc.headers:
            message = wrong_method_message(request, ", ".join(sorted(exc.headers["Allow"].split(","))))
        if exc.status == 413:
            message = f"The request body is larger than server.max_body_bytes ({request.app[CONFIG].server.max_body_bytes} bytes)."
        code = _HTTP_CODES.get(exc.status)
        notes(request).error = code
        body = error_body(message, error_type(exc.status), code)
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None  # 405 must say
        return web.json_response(body, status=exc.status, headers=allow)
    except Exception as exc:
        # Never the message: it may quote request content.
        log.error("unhandled %s on %s %s", type(exc).__name__, request.method, _route(request),
                  exc_info=log.isEnabledFor(logging.DEBUG))
        notes(request).error = "internal_error"
        return web.json_response(error_body("internal error", "server_error", "internal_error"),
                                 status=500)


@web.middleware
async def _auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    if (request.path.startswith("/v1/") or _route(request) in request.app[ALIASES]) and not is_preflight(request):
        request[CALLER] = authenticate(request.app[CONFIG].auth, request.headers.get("Authorization"),
                                       request.headers.get("api-key"))
    return await handler(request)


# --- errors aiohttp answers before any handler or middleware runs --------------------------------
# A request aiohttp cannot parse (a header over 8,190 bytes, a bad header character or request line,
# a body in an encoding it cannot decode) never reaches the middlewares: aiohttp's RequestHandler
# answers it with a plain-text 400 from `handle_error`. `runner` gives every such answer the OpenAI
# shape instead. aiohttp offers no public hook for this: the handler class is swapped in through
# `web.Server.__call__`, its protocol factory, and the test of it (tests/test_hostile_input.py) fails
# if an aiohttp release changes that. What still cannot be shaped: a request whose bytes never
# form a request at all (the connection is closed), and a server-wide failure after a response began.

_LOW_LEVEL: list[tuple[type[Exception], str, str]] = [
    (http_exceptions.LineTooLong, "request_too_large",
     "A request line or header field is longer than the server accepts (8,190 bytes)."),
    (http_exceptions.InvalidHeader, "invalid_header", "A request header is not valid HTTP."),
    (http_exceptions.BadStatusLine, "invalid_request_line", "The request line is not valid HTTP."),
    (http_exceptions.ContentEncodingError, "unsupported_content_encoding",
     "The request body's Content-Encoding cannot be decoded here: send it as gzip, deflate or identity."),
    (http_exceptions.PayloadEncodingError, "invalid_body_encoding",
     "The request body does not match its Content-Length or Transfer-Encoding."),
    (http_exceptions.InvalidURLError, "invalid_url", "The request URL is not valid."),
]


class _JsonErrorHandler(web.RequestHandler):
    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:  # as aiohttp does: too late for a response of its own
            raise ConnectionError("an error after the response began")
        code, text = "invalid_http_request", "The request is not valid HTTP."
        for kind, kind_code, kind_text in _LOW_LEVEL:
            if isinstance(exc, kind):
                code, text = kind_code, kind_text
                break
        # aiohttp's own log line would quote the offending bytes (a header, perhaps a key): the
        # exception's kind only. No route, method or caller is known: the request line says so.
        if status >= 500:
            log.error("unhandled %s before the application", type(exc).__name__)
            code = "internal_error"
            body = error_body("internal error", "server_error", code)
        else:
            body = error_body(text, error_type(status), code)
        request_log.info("request", extra={"method": "-", "route": "-", "status": status, "error": code,
                                           "cause": type(exc).__name__ if exc is not None else None})
        response = web.json_response(body, status=status)
        response.force_close()
        return response

    def log_exception(self, *args: Any, **kw: Any) -> None:
        # A body left unread by its answer (a 401, a 404) or that failed to decode (a 400 said so)
        # is read and dropped after the answer; one that does not decode then raises there, and
        # aiohttp would log it as an unhandled error with its traceback, for any client to repeat.
        if isinstance(kw.get("exc_info"), web.RequestPayloadError):
            log.debug("a request body that did not decode was dropped after its answer")
            return
        super().log_exception(*args, **kw)


class _JsonErrorServer(web.Server):
    def __call__(self) -> web.RequestHandler:
        return _JsonErrorHandler(self, loop=self._loop, **self._kwargs)


class _Runner(web.AppRunner):
    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JsonErrorServer  # the same server, building the handler above
        server.request_handler = _refusing_unknown_expectations(server.request_handler)
        return server


def _refusing_unknown_expectations(
    handle: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]],
) -> Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]:
    """aiohttp answers an `Expect` other than `100-continue` itself, before the middlewares: a
    plain-text 417 quoting the header, logged by nobody, or, where the header is not ASCII, a 500
    as that text fails to encode, for any caller. Such a request gets the 417 in the OpenAI shape
    here, without the header's text, and its log line."""

    async def handle_request(request: web.BaseRequest) -> web.StreamResponse:
        expect = request.headers.get(hdrs.EXPECT)
        if expect is None or expect.lower() == "100-continue" or request.version < (1, 1):
            return await handle(request)
        code = "expectation_failed"
        request_log.info("request", extra={"method": "-", "route": "-", "status": 417, "error": code})
        body = error_body("The only expectation this server meets is Expect: 100-continue.", error_type(417), code,
                          "Expect")
        # Answered before routing: the app's own headers (`_private`) are not added by the app.
        response = web.json_response(body, status=417, headers={"Cache-Control": "no-store",
                                                                "X-Content-Type-Options": "nosniff"})
        response.force_close()
        return response

    return handle_request


def runner(config: Config, **kwargs: Any) -> web.AppRunner:
    """The runner `memproxy serve` uses: the app of `create_app`, with aiohttp's own error answers
    in the OpenAI shape; `kwargs` go to aiohttp's request handler (access log, timeouts)."""
    return _Runner(create_app(config), **kwargs)
