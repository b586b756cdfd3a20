"""Request bodies: one JSON object (`memproxy.jsonparse`), read within the body budget, or a clear 400
saying what is wrong with it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import hdrs, web

from .config import Config, ModelConfig, ServerConfig
from .errors import BadRequest, NotFound, ServerBusy
from .jsonparse import parse_json
from .typedefs import CALLER


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class BodyBudget:
    """The request bodies a process holds at once, at most `server.max_body_bytes_in_flight` bytes
    (0: no limit). `server.max_body_bytes` bounds one request; this bounds them all, so many large
    requests at once (the clients of many sessions, or many requests queued on one session's lock,
    each holding its body and what was parsed from it: a few times its size) get 503
    `server_busy` with `Retry-After` instead of exhausting the process's memory. An authenticated
    request is charged from before its body is read until its answer is done (a stream: until it
    ends): its `Content-Length`, or where the body's size is not known before it is read (chunked,
    or compressed: aiohttp inflates it, up to `max_body_bytes`) the most it may be, lowered to its
    size once read (`body_bytes`). A middleware after authentication: a caller without a valid
    key, or a request to a route that takes none (whose body nothing reads), is charged nothing.
    Per process: `serve --workers N` holds N times as much."""

    def __init__(self, server: ServerConfig) -> None:
        self._limit = server.max_body_bytes_in_flight
        self._largest = server.max_body_bytes
        self.held = 0

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if not self._limit or not request.body_exists or CALLER not in request:
            return await handler(request)
        length = request.content_length
        encoding = request.headers.get(hdrs.CONTENT_ENCODING, "identity").strip().lower()
        size = self._largest if length is None or encoding not in ("", "identity") else min(length, self._largest)
        if self.held + size > self._limit:
            raise ServerBusy("This server is handling as many request bytes as server.max_body_bytes_in_flight "
                             "allows; retry shortly.")
        charge = request[BODY_CHARGE] = _Charge(self, size)
        self.held += size
        try:
            return await handler(request)
        finally:
            self.held -= charge.size


class _Charge:
    """What a request is charged (`BodyBudget`), lowered to its body's size once that is read."""

    def __init__(self, budget: BodyBudget, size: int) -> None:
        self._budget = budget
        self.size = size

    def settle(self, read: int) -> None:
        if read < self.size:
            self._budget.held -= self.size - read
            self.size = read


BODY_CHARGE: web.RequestKey[_Charge] = web.RequestKey("body_charge")


async def json_object(request: web.Request, optional: bool = False) -> dict[str, Any]:
    """The body as a JSON object; `optional`: an empty body is `{}`."""
    raw = await body_bytes(request)
    if optional and not raw.strip():
        return {}
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def requested_model(config: Config, name: Any) -> ModelConfig:
    """The configured model a request names (`model` in its body or its URL): a 400 without one, a
    404 `model_not_found` for a name no `models[].name` has, as OpenAI answers both."""
    if not isinstance(name, str) or not name:
        raise BadRequest("'model' is required", param="model")
    model = config.model(name)
    if model is None:
        raise NotFound(f"The model '{name}' does not exist on this proxy; GET /v1/models lists them.",
                       code="model_not_found", param="model")
    return model


# What aiohttp decodes: br and zstd where Brotli and backports.zstd are installed (where they are
# not, it refuses them itself, before any handler: `app._LOW_LEVEL`).
_DECODED = frozenset({"", "identity", "gzip", "deflate", "br", "zstd"})


async def body_bytes(request: web.Request) -> bytes:
    """The raw body; one that fails to decode (a `Content-Encoding: gzip` body that is not gzip, a
    broken chunked encoding) is the client's fault, so a 400, not the 500 of an unknown error. So is
    a `Content-Encoding` that nothing here decodes (`x-gzip`, two codings, a made-up one), which
    aiohttp would hand over as it came: read as plain bytes, it was refused as "not UTF-8", or worse,
    stored as what the client meant to send compressed."""
    encoding = request.headers.get(hdrs.CONTENT_ENCODING, "").strip().lower()
    if encoding not in _DECODED:
        raise BadRequest("The request body's Content-Encoding cannot be decoded here: send it as gzip, deflate "
                         "or identity, as one coding.", code="unsupported_content_encoding")
    try:
        raw = await request.read()
    except web.RequestPayloadError as exc:  # what the parser found wrong with the payload
        raise BadRequest("the request body could not be decoded: its bytes do not match its "
                         "Content-Encoding or Transfer-Encoding", code="invalid_body_encoding") from exc
    charge = request.get(BODY_CHARGE)
    if charge is not None:
        charge.settle(len(raw))
    return raw
