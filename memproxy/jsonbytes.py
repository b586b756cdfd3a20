"""JSON bodies as bytes, for the upstream and for the client.

orjson writes UTF-8 some thirty times faster than the standard library (a 1,000-message history,
260 KB: 0.04 ms against 1.2 ms), which matters once whole long conversations are sent on every
turn. A value orjson refuses, above all a lone surrogate (a provider's earlier answer, stored and
sent again, which no UTF-8 encoder takes), goes out as the standard library writes it with ASCII
escapes (`\\udXXX`, as the provider sent it), the whole value then escaped.
"""

from __future__ import annotations

import json
from typing import Any

import orjson


def dumps(value: Any) -> bytes:
    try:
        return orjson.dumps(value)
    except TypeError:  # orjson.JSONEncodeError is one
        return json.dumps(value, separators=(",", ":")).encode()
