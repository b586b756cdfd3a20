"""The small endpoints: liveness, readiness and the model list. None of them touches litellm."""

from __future__ import annotations

import time

from aiohttp import web

from .errors import ProxyError
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
    data = [{"id": m.name, "object": "model", "created": created, "owned_by": "memproxy"}
            for m in request.app[CONFIG].models]
    return web.json_response({"object": "list", "data": data})
