"""The small endpoints: liveness, readiness, the model list and each model. None of them touches litellm."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from .errors import NotFound, ProxyError
from .typedefs import CONFIG, STORE


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


async def model(request: web.Request) -> web.Response:
    """`GET /v1/models/{model}`: a configured model, as the list shows it."""
    name = request.match_info["model"]
    if request.app[CONFIG].model(name) is None:
        raise NotFound(f"The model '{name}' does not exist on this proxy; GET /v1/models lists them.",
                       code="model_not_found", param="model")
    return web.json_response(_model(name, int(time.time())))


def _model(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "memproxy"}
