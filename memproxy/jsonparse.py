"""JSON from clients: one value every part of memproxy can hold, or a clear 400 saying what is wrong.

Every JSON a client sends (a request body, each line of an import, a CLI option) goes through
`parse_json`, which refuses what `json.loads` accepts but nothing downstream can hold:

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
from typing import Any

from .errors import BadRequest

MAX_DEPTH = 64
_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF][0-9a-fA-F]{2}")


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
