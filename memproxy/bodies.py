"""Request bodies: one JSON object, or a clear 400 saying what is wrong with it."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from .errors import BadRequest


async def json_object(request: web.Request, optional: bool = False) -> dict[str, Any]:
    """The body as a JSON object; `optional`: an empty body is `{}`."""
    raw = await request.read()
    if optional and not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body
