"""Bodies as bytes (`memproxy.jsonbytes`): UTF-8 whatever the text, lone surrogates as escapes."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from memproxy.jsonbytes import dumps

JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.text(),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
                    max_leaves=20)


@given(JSON)
def test_any_value_reads_back_as_itself(value: Any) -> None:
    assert json.loads(dumps(value)) == value


def test_text_goes_as_utf8_and_a_lone_surrogate_as_the_escape_a_provider_sent() -> None:
    assert dumps({"content": "héllo ✓"}) == '{"content":"héllo ✓"}'.encode()
    assert dumps({"content": "a\ud800b", "other": "é"}) == b'{"content":"a\\ud800b","other":"\\u00e9"}'
