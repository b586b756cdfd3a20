"""The application factory: routes, the error and auth middlewares, and one cleanup context per
resource (store, provider, background tasks, summarizer), which aiohttp unwinds in reverse order so
pending writes finish before the provider and the store close."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from .auth import authenticate
from .chat import chat_completions
from .concurrency import BackgroundTasks, SessionLocks
from .config import Config
from .deadlines import read_deadlines
from .errors import ProxyError, error_body, store_unavailable_body
from .provider import Provider
from .routes import healthz, models, readyz
from .sessions import add_routes as add_session_routes
from .store import Store, StoreUnavailable, open_store
from .summarize import Summarizer
from .typedefs import CALLER, CONFIG, LOCKS, PROVIDER, STORE, SUMMARIZER, TASKS

log = logging.getLogger("memproxy")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_HTTP_TYPES = {401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error",
               413: "invalid_request_error"}
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def create_app(config: Config) -> web.Application:
    app = web.Application(
        middlewares=[_errors, read_deadlines, _auth],
        client_max_size=config.server.max_body_bytes,
    )
    app[CONFIG] = config
    app[LOCKS] = SessionLocks()
    app.cleanup_ctx.extend([_store, _provider, _tasks, _summarizer, _retention])
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/chat/completions", chat_completions)
    add_session_routes(app)
    return app


async def _store(app: web.Application) -> AsyncIterator[None]:
    app[STORE] = await open_store(app[CONFIG].storage)
    yield
    await app[STORE].close()


async def _provider(app: web.Application) -> AsyncIterator[None]:
    app[PROVIDER] = Provider(app[CONFIG])
    yield
    await app[PROVIDER].close()


async def _tasks(app: web.Application) -> AsyncIterator[None]:
    app[TASKS] = BackgroundTasks()
    yield
    await app[TASKS].close()


async def _summarizer(app: web.Application) -> AsyncIterator[None]:
    app[SUMMARIZER] = Summarizer(app[CONFIG], app[STORE], app[PROVIDER], app[TASKS])
    yield


async def _retention(app: web.Application) -> AsyncIterator[None]:
    """With an idle TTL, a sweep deletes expired sessions every `sweep_interval_seconds`."""
    retention = app[CONFIG].retention
    if retention.idle_ttl_seconds is not None:
        app[TASKS].spawn(_sweep(app[STORE], retention.idle_ttl_seconds, retention.sweep_interval_seconds),
                         optional=True)
    yield


async def _sweep(store: Store, ttl: float, interval: float) -> None:
    while True:
        try:
            removed = await store.prune(time.time() - ttl)
            if removed:
                log.info("retention sweep removed=%d", removed)
        except Exception as exc:  # the next sweep tries again
            log.error("retention sweep failed: %s", type(exc).__name__)
        await asyncio.sleep(interval)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ProxyError as exc:
        return web.json_response(exc.body(), status=exc.status)
    except StoreUnavailable as exc:
        # The driver's error names only its class: its text may quote stored content.
        log.error("store unavailable on %s %s: %s", request.method, request.path, type(exc.__cause__).__name__)
        return web.json_response(store_unavailable_body(), status=503)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.reason
        if exc.status == 413:
            message = f"The request body is larger than server.max_body_bytes ({request.app[CONFIG].server.max_body_bytes} bytes)."
        body = error_body(message, _HTTP_TYPES.get(exc.status, "invalid_request_error"),
                          _HTTP_CODES.get(exc.status))
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None  # 405 must say
        return web.json_response(body, status=exc.status, headers=allow)
    except Exception as exc:
        # Never the message: it may quote request content.
        log.error("unhandled %s on %s %s", type(exc).__name__, request.method, request.path,
                  exc_info=log.isEnabledFor(logging.DEBUG))
        return web.json_response(error_body("internal error", "server_error", "internal_error"),
                                 status=500)


@web.middleware
async def _auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.path.startswith("/v1/") or request.path == "/chat/completions":
        request[CALLER] = authenticate(request.app[CONFIG].auth, request.headers.get("Authorization"))
    return await handler(request)
