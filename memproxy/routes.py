"""The small endpoints: liveness, readiness, metrics, the model list and each model. None of them
touches litellm."""

from __future__ import annotations

import logging
import time
from typing import Any

from aiohttp import web

from .auth import authenticate
from .bodies import requested_model
from .errors import Forbidden, ProxyError
from .store import StoreUnavailable
from .typedefs import CALLER, CONFIG, METRICS, STORE

log = logging.getLogger("memproxy")


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    try:
        await request.app[STORE].ping()
    except Exception as exc:
        raise ProxyError(f"store unreachable: {type(exc).__name__}", status=503,
                         code="store_unavailable") from exc
    return web.json_response({"status": "ready"})


async def models(request: web.Request) -> web.Response:
    created = int(time.time())
    data = [_model(m.name, created) for m in request.app[CONFIG].models]
    return web.json_response({"object": "list", "data": data})


async def metrics(request: web.Request) -> web.Response:
    """`GET /metrics` (`memproxy.metrics`): for an admin key, as the admin API across tenants is,
    unless `metrics.public`; with no keys configured at all, for anyone, as every endpoint is."""
    config = request.app[CONFIG]
    if not config.metrics.public:
        caller = request[CALLER] = authenticate(config.auth, request.headers.get("Authorization"),
                                                request.headers.get("api-key"))
        if not caller.admin and (config.auth.keys or config.auth.admin_keys):
            raise Forbidden("Metrics are read with an admin key (auth.admin_keys), unless metrics.public is true.")
    app_metrics = request.app[METRICS]
    try:
        counts = await request.app[STORE].stored_counts()
        stored: tuple[int, int] | None = (counts.sessions, counts.messages)
    except StoreUnavailable as exc:  # the rest still tells what is going on: it matters most now
        log.error("store unavailable for the metrics' counts: %s", type(exc.__cause__).__name__)
        app_metrics.store_error("metrics")
        stored = None
    body, content_type = app_metrics.exposition(stored, request.headers.get("Accept"))
    return web.Response(body=body, headers={"Content-Type": content_type})


async def model(request: web.Request) -> web.Response:
    """`GET /v1/models/{model}`: a configured model, as the list shows it."""
    found = requested_model(request.app[CONFIG], request.match_info["model"])
    return web.json_response(_model(found.name, int(time.time())))


def _model(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "memproxy"}
