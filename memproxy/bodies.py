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
surrogate can only come from an escape. Both checks cost next to nothing on ordinary bodies: the
surrogate check runs only when the raw bytes hold `\\ud` or `\\uD` (two substring searches), the
depth check only when the body holds more brackets than the limit (two `bytes.count`), and then one
walk of the parsed containers does both.
"""

from __future__ import annotations

import json
import re
from typing import Any

from aiohttp import web

from .errors import BadRequest

MAX_DEPTH = 64
_SURROGATE = re.compile("[\ud800-\udfff]")
_CONSTANTS = {"NaN", "Infinity", "-Infinity"}


async def json_object(request: web.Request, optional: bool = False) -> dict[str, Any]:
    """The body as a JSON object; `optional`: an empty body is `{}`."""
    raw = await body_bytes(request)
    if optional and not raw.strip():
        return {}
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


async def body_bytes(request: web.Request) -> bytes:
    """The raw body; one that fails to decode (a `Content-Encoding: gzip` body that is not gzip, a
    broken chunked encoding) is the client's fault, so a 400, not the 500 of an unknown error."""
    try:
        return await request.read()
    except web.RequestPayloadError as exc:  # what the parser found wrong with the payload
        raise BadRequest("the request body could not be decoded: its bytes do not match its "
                         "Content-Encoding or Transfer-Encoding", code="invalid_body_encoding") from exc


def parse_json(raw: bytes | str, what: str = "the request body") -> Any:
    """One JSON value that every part of memproxy can hold, or a 400 naming the field at fault."""
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
    # Only an escape can now make a surrogate: `\\ud800`..`\\udfff` (or `\\uD800`...).
    surrogates = b"\\ud" in data or b"\\uD" in data
    if surrogates or data.count(b"[") + data.count(b"{") > MAX_DEPTH:
        _check(value, surrogates, what)
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    number = float(text)
    if number in (float("inf"), float("-inf")):
        raise ValueError(f"the number {text[:40]} is too large")
    return number


def _check(value: Any, surrogates: bool, what: str) -> None:
    """One walk of the containers: their depth, and (`surrogates`) every string and key."""
    # (value, depth, parent entry, key or index): the path is rebuilt only for an error.
    stack: list[tuple[Any, int, Any, Any]] = [(value, 1, None, None)]
    while stack:
        entry = stack.pop()
        item, depth, _, _ = entry
        if isinstance(item, dict):
            if depth > MAX_DEPTH:
                raise BadRequest(f"{what} is nested more than {MAX_DEPTH} levels deep", param=_path(entry))
            for key, child in item.items():
                if surrogates and _SURROGATE.search(key):
                    raise BadRequest(f"{what} holds a key with a lone UTF-16 surrogate (\\ud800-\\udfff), "
                                     "which is not valid Unicode", param=_path(entry))
                stack.append((child, depth + 1, entry, key))
        elif isinstance(item, list):
            if depth > MAX_DEPTH:
                raise BadRequest(f"{what} is nested more than {MAX_DEPTH} levels deep", param=_path(entry))
            stack.extend((child, depth + 1, entry, i) for i, child in enumerate(item))
        elif surrogates and isinstance(item, str) and _SURROGATE.search(item):
            raise BadRequest(f"{what} holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not valid "
                             "Unicode", param=_path(entry))


def _path(entry: tuple[Any, int, Any, Any]) -> str | None:
    """`messages[0].content` for the entry reached by those keys; None for the body itself."""
    parts: list[str] = []
    while entry[2] is not None:
        key = entry[3]
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
        entry = entry[2]
    path = "".join(reversed(parts)).lstrip(".")
    return path or None
