"""memproxy/store/postgres.py numbers `?` placeholders for asyncpg with a scanner, so a `?` inside a
quoted literal, a quoted name or a comment is left as it is."""

from __future__ import annotations

import pytest

from memproxy.store.postgres import numbered


@pytest.mark.parametrize(("sql", "expected"), [
    ("SELECT ? , ?", "SELECT $1 , $2"),
    ("SELECT '?', ? WHERE x = 'it''s ?' AND y = ?", "SELECT '?', $1 WHERE x = 'it''s ?' AND y = $2"),
    ('SELECT "odd?name", ? FROM t', 'SELECT "odd?name", $1 FROM t'),
    ("SELECT ? -- why?\n, ?", "SELECT $1 -- why?\n, $2"),
    ("SELECT /* ? */ ? - ? / ?", "SELECT /* ? */ $1 - $2 / $3"),
    ("SELECT '' || ?", "SELECT '' || $1"),
    ("SELECT 'no end ?", "SELECT 'no end ?"),
])
def test_postgres_numbers_placeholders_but_not_a_question_mark_in_a_literal(sql: str, expected: str) -> None:
    assert numbered(sql) == expected
