"""`memproxy.jsonparse.parse_json` against the reference it must agree with: `json.loads`, minus what
nothing downstream can hold (lone surrogates, deep nesting, NaN and infinities)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memproxy.jsonparse import MAX_DEPTH, parse_json
from memproxy.errors import BadRequest

# Pieces of a JSON string's inside: surrogate escapes in both cases, pairs, escaped backslashes
# (so a "\\ud800" can be literal text), other escapes and plain text.
PIECES = [b"\\ud800", b"\\uDBFF", b"\\udc00", b"\\uDFFF", b"\\ud83d", b"\\ude00", b"\\\\", b"x", b"\\u0041",
          b"ud800", b"\\n", b"\\uD7FF", b"\\uE000", "\u00e9".encode()]


def has_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        return any(0xD800 <= ord(c) <= 0xDFFF for c in value)
    if isinstance(value, dict):
        return any(has_surrogate(k) or has_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(has_surrogate(v) for v in value)
    return False


@settings(max_examples=3000, deadline=None)
@given(st.lists(st.lists(st.sampled_from(PIECES), max_size=6).map(b"".join), min_size=1, max_size=4),
       st.booleans())
def test_refuses_exactly_the_strings_holding_a_lone_surrogate(strings: list[bytes], as_keys: bool) -> None:
    items = [b'"' + s + b'"' for s in strings]
    raw = (b"{" + b",".join(item + b":" + str(i).encode() for i, item in enumerate(items)) + b"}" if as_keys
           else b"[" + b",".join(items) + b"]")
    reference = json.loads(raw)
    if has_surrogate(reference):
        with pytest.raises(BadRequest) as refused:
            parse_json(raw)
        assert "surrogate" in refused.value.message
    else:
        assert parse_json(raw) == reference


def test_names_the_field_holding_a_surrogate() -> None:
    with pytest.raises(BadRequest) as refused:
        parse_json(b'{"messages":[{"role":"user","content":"ok"},{"role":"user","content":["\\udc00"]}]}')
    assert refused.value.param == "messages[1].content[0]"
    with pytest.raises(BadRequest) as refused:
        parse_json(b'{"metadata":{"\\ud800":1}}')
    assert refused.value.param == "metadata"
    with pytest.raises(BadRequest) as refused:
        parse_json(b'"\\ud800"')
    assert refused.value.param is None


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 128, 990, 100_000])
def test_refuses_nesting_beyond_the_limit(depth: int) -> None:
    for raw in (b"[" * depth + b"]" * depth, b'{"a":' * depth + b"1" + b"}" * depth):
        with pytest.raises(BadRequest) as refused:
            parse_json(raw)
        assert f"more than {MAX_DEPTH} levels" in refused.value.message


def test_takes_nesting_up_to_the_limit() -> None:
    raw = b"[" * MAX_DEPTH + b"]" * MAX_DEPTH
    assert parse_json(raw) == json.loads(raw)


@pytest.mark.parametrize("raw", [b'{"a":NaN}', b'{"a":Infinity}', b"[-Infinity]", b'{"a":1e400}', b"-1e999",
                                 b'"\xed\xa0\x80"', b"\xff", b'\xef\xbb\xbf{}', b'\xff\xfe{\x00}\x00'])
def test_refuses_what_is_not_json_in_utf_8(raw: bytes) -> None:
    with pytest.raises(BadRequest):
        parse_json(raw)


def test_takes_what_json_takes() -> None:
    raw = json.dumps({"a": [1, 2.5, -0.0, 1e300, None, True, "\x00\u2028\U0001f600"], "b": {}}).encode()
    assert parse_json(raw) == json.loads(raw)
    assert parse_json(raw.decode()) == json.loads(raw)
