"""Import records checked on their own, without a server: the pydantic models of `memproxy.exports`
refuse what the store never writes, and each refusal names the line, the record type and the field.
The HTTP and CLI paths of an import are tested in test_admin_api.py and test_sessions_cli.py."""

from __future__ import annotations

import json
from typing import Any, get_args

import pytest

from memproxy.errors import BadRequest
from memproxy.exports import RECORDS, Role, from_jsonl
from memproxy.messages import ROLES, ROOT_HASH, chain_hash

BODY = {"role": "user", "content": "hi"}
HASH = chain_hash(ROOT_HASH, BODY)

SESSION: dict[str, Any] = {"type": "session", "session_id": "x", "created_at": 1.0, "updated_at": 2,
                           "length": 1, "head_hash": HASH, "head_cum": 1, "head_compact_cum": 1}
TURN: dict[str, Any] = {"type": "turn", "id": 1, "created_at": 1, "model": "m", "kind": "new",
                        "context_tokens": 3, "latency_ms": 1.5}
MESSAGE: dict[str, Any] = {"type": "message", "id": 1, "turn": 1, "seq": 0, "active": 1, "role": "user",
                           "body": BODY, "tokens": 1, "cum_before": 0,
                           "unit_start": 1, "chain_hash": HASH, "created_at": 1, "compact_tokens": 1,
                           "compact_cum_before": 0}


def lines(*records: dict[str, Any]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def refusal(*records: dict[str, Any]) -> str:
    with pytest.raises(BadRequest) as caught:
        from_jsonl(lines(*records))
    assert caught.value.status == 400
    return caught.value.message


def test_a_good_export_reads_back_as_written() -> None:
    assert from_jsonl(lines(SESSION, TURN, MESSAGE)) == [SESSION, TURN, MESSAGE]


def test_a_turn_that_recalled_reads_back_as_written() -> None:
    # What a turn sent, recalled messages included: as the store exports it, JSON arrays.
    sent = {"summary_version": 0, "first_sent": 0, "included": 1, "omitted": 0, "unsummarised_omitted": 0,
            "trimmed": 0, "deduplicated": 0, "marker": 0, "recalled": [["x", 0], ["other", 12]]}
    assert from_jsonl(lines(SESSION, {**TURN, **sent}, MESSAGE)) == [SESSION, {**TURN, **sent}, MESSAGE]
    assert refusal(SESSION, {**TURN, **sent, "recalled": [["x", "0"]]}, MESSAGE).startswith(
        "line 2: turn field 'recalled'")


@pytest.mark.parametrize(("line", "record", "expected"), [
    (1, {**SESSION, "length": "1"}, "line 1: session field 'length' must be an integer"),
    (1, {**SESSION, "length": 1.0}, "line 1: session field 'length' must be an integer"),
    (1, {**SESSION, "format": 3}, "line 1: session field 'format' must be from 1 to 1"),
    (1, {**SESSION, "metadata": ["a"]}, "line 1: session field 'metadata' must be an object or null"),
    (1, {**SESSION, "history_mode": "auto"}, "line 1: session field 'history_mode' must be one of full, new"),
    (1, {**SESSION, "colour": "blue"}, "line 1: session field 'colour' is not a field of this record"),
    (2, {**TURN, "context_tokens": True}, "line 2: turn field 'context_tokens' must be an integer"),
    (2, {**TURN, "prompt_tokens": "lots"}, "line 2: turn field 'prompt_tokens' must be an integer or null"),
    (2, {**TURN, "full_tokens": 2**63}, "line 2: turn field 'full_tokens' must be from 0 to 9223372036854775807"),
    (2, {**TURN, "latency_ms": False}, "line 2: turn field 'latency_ms' must be a number"),
    (2, {**TURN, "kind": "chat"}, "line 2: turn field 'kind' must be one of new, continue, window, append, edit,"
                                  " regenerate, summary, fork"),
    (2, {**TURN, "included": 1}, "line 2: turn fields summary_version, first_sent, included, omitted, "
                                 "unsummarised_omitted, trimmed, deduplicated, marker are all null or all set"),
    (3, {**MESSAGE, "active": True}, "line 3: message field 'active' must be an integer"),
    (3, {**MESSAGE, "unit_start": 2}, "line 3: message field 'unit_start' must be 0 or 1"),
    (3, {**MESSAGE, "role": "assistant"}, "line 3: message field 'role' is not the role of its 'body'"),
    (3, {k: v for k, v in MESSAGE.items() if k != "chain_hash"}, "line 3: message field 'chain_hash' is missing"),
    (3, {**MESSAGE, "body": {"role": "user"}}, "line 3: message field 'body' is not a chat message: "),
])
def test_a_bad_field_is_named_with_its_line(line: int, record: dict[str, Any], expected: str) -> None:
    records = [SESSION, TURN, MESSAGE]
    records[line - 1] = record
    assert refusal(*records).startswith(expected)


def test_fields_an_older_export_lacks_read_as_absent() -> None:
    old = {k: v for k, v in TURN.items()}
    session = {k: v for k, v in SESSION.items() if k not in ("session_id", "format")}
    assert from_jsonl(lines(session, old, MESSAGE)) == [session, old, MESSAGE]


def test_a_body_edited_under_its_old_hash_is_refused() -> None:
    # Reconciling matches a client's messages by their hashes: an edited body kept under the old
    # one would be taken for what the client sent, and sent upstream in its place.
    edited = {**MESSAGE, "body": {"role": "user", "content": "hi there"}}
    assert refusal(SESSION, TURN, edited).startswith("line 3: message field 'chain_hash' does not match its body")
    answer = {"role": "assistant", "content": "hello"}
    second = {**MESSAGE, "id": 2, "seq": 1, "role": "assistant", "body": answer, "cum_before": 1,
              "compact_cum_before": 1, "chain_hash": chain_hash(HASH, answer)}
    session = {**SESSION, "length": 2, "head_hash": second["chain_hash"], "head_cum": 2, "head_compact_cum": 2}
    assert from_jsonl(lines(session, TURN, MESSAGE, second)) == [session, TURN, MESSAGE, second]
    # The hash names the chain before it too: a message moved to another chain is refused.
    moved = {**second, "chain_hash": chain_hash(ROOT_HASH, answer)}
    assert refusal({**session, "head_hash": moved["chain_hash"]}, TURN, MESSAGE, moved).startswith(
        "line 4: message field 'chain_hash' does not match")


def test_the_role_literal_is_every_chat_role() -> None:
    assert set(get_args(Role)) == ROLES
    assert set(RECORDS) == {"session", "turn", "message", "summary"}
