"""Request bodies: one JSON object, or a clear 400 saying what is wrong with it.

Every JSON a client sends (a request body, each line of an import) goes through `parse_json`,
which refuses what `json.loads` accepts but nothing downstream can hold:

- a lone UTF-16 surrogate written as an escape (`"\\ud800"`): it parses into a Python string that no
  store, log or UTF-8 encoder accepts;
- nesting deeper than `MAX_DEPTH` levels (deep enough for any real request; much deeper would reach
  Python's recursion limit in the parser or in whatever walks the value later);
- `NaN`, `Infinity` and numbers too large for a double (`1e400` parses as infinity): not JSON, and
  PostgreSQL's `jsonb` refuses them.

The body must be UTF-8 (strictly: the UTF-8 form of a surrogate is refused as it is decoded), so a
surrogate can only come from an escape. Both checks are cheap: one walk of the parsed containers
(a step per member, not per byte: a chat body of 100 kB has a few hundred) checks the depth, and
looks at strings only when the raw bytes hold a surrogate escape that is not half of a pair (one
regex search, then a step per escape: an emoji sent as a pair of escapes costs nothing more).
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import hdrs, web

from .config import Config, ModelConfig, ServerConfig
from .errors import BadRequest, NotFound, ServerBusy
from .typedefs import CALLER

MAX_DEPTH = 64
_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF][0-9a-fA-F]{2}")


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


def parse_json(raw: bytes | str, what: str = "the request body", surrogates: bool = False) -> Any:
    """One JSON value that every part of memproxy can hold, or a 400 naming the field at fault.
    `surrogates`: lone surrogate escapes are let through (an export of what a provider answered)."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    try:
        # Strict UTF-8 (JSON's encoding on the wire): `json.loads` on bytes would let the UTF-8
        # form of a surrogate (ED A0 80) through, and guess UTF-16 or UTF-32 from the first bytes.
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"{what} is not UTF-8: invalid byte at position {exc.start}") from exc
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError as exc:
        raise BadRequest(f"{what} is nested more than {MAX_DEPTH} levels deep") from exc
    except ValueError as exc:
        raise BadRequest(f"{what} is not valid JSON: {exc}") from exc
    lone = not surrogates and _SURROGATE_ESCAPE.search(data) is not None and _lone_surrogate_escape(data)
    _check(value, lone, what)
    return value


def refuse_lone_surrogates(value: Any, what: str) -> None:
    """A 400 naming where `value` (parsed with `surrogates=True`) holds a lone surrogate."""
    _check(value, True, what)


def _lone_surrogate_escape(data: bytes) -> bool:
    """Whether `data` holds a surrogate escape (`\\ud800`-`\\udfff`, the only way a surrogate gets
    into valid UTF-8 JSON) that is not half of a pair: a pair, how JSON writes a character beyond
    U+FFFF such as an emoji, parses into that one character. Only the escapes are visited, so text
    full of emoji costs a step per emoji, not a walk of every string."""
    pending = False  # a high surrogate waiting for its low half, which must start at `low_at`
    low_at = -1
    for match in _SURROGATE_ESCAPE.finditer(data):
        start = match.start()
        high = data[start + 3] in b"89abAB"
        if pending:  # right after an escape, this is one too: only a low half completes the pair
            if start != low_at or high:
                return True
            pending = False
            continue
        backslashes = 0  # before this one: an odd run makes it a literal "\\ud800", not an escape
        while start - backslashes > 0 and data[start - backslashes - 1] == 0x5C:
            backslashes += 1
        if backslashes % 2:
            continue
        if not high:
            return True
        pending, low_at = True, match.end()
    return pending


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    number = float(text)
    if number in (float("inf"), float("-inf")):
        raise ValueError(f"the number {text[:40]} is too large")
    return number


# A container met on the walk: (value, depth, the parent's entry, its key or index in the parent).
_Entry = tuple[Any, int, Any, Any]


def _check(value: Any, surrogates: bool, what: str) -> None:
    """One walk of the containers: their depth, and (`surrogates`) every string and key in them.
    Only containers go on the stack, each with its parent, so a path is rebuilt for an error only."""
    if not isinstance(value, (dict, list)):
        if surrogates and isinstance(value, str) and _SURROGATE.search(value):
            raise _surrogate(what, None)
        return
    stack: list[_Entry] = [(value, 1, None, None)]
    while stack:
        entry = stack.pop()
        item, depth = entry[0], entry[1]
        if depth > MAX_DEPTH:
            raise BadRequest(f"{what} is nested more than {MAX_DEPTH} levels deep", param=_path(entry))
        members = item.items() if isinstance(item, dict) else enumerate(item)
        for key, child in members:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1, entry, key))
            elif surrogates and isinstance(child, str) and _SURROGATE.search(child):
                raise _surrogate(what, _path((child, depth + 1, entry, key)))
            if surrogates and isinstance(key, str) and _SURROGATE.search(key):
                raise _surrogate(what, _path(entry), "a key with ")


def _surrogate(what: str, param: str | None, holder: str = "") -> BadRequest:
    return BadRequest(f"{what} holds {holder}a lone UTF-16 surrogate (\\ud800-\\udfff), which is not valid "
                      "Unicode", param=param)


def _path(entry: _Entry) -> str | None:
    """`messages[0].content` for the entry reached by those keys; None for the body itself."""
    parts: list[str] = []
    while entry[2] is not None:
        key = entry[3]
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
        entry = entry[2]
    path = "".join(reversed(parts)).lstrip(".")
    return path or None
