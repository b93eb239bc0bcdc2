"""The cached placeholder rewrite gives exactly what pg8000's own scan gives."""

from __future__ import annotations

import pg8000.dbapi
import pg8000.legacy
import pytest

from outbox import db

STATEMENTS = [
    "SELECT %s, %s",
    "SELECT '%s' AS literal, %s -- a comment with %s\n, %s",
    "SELECT E'it''s %s', $$ %s $$, \"col%s\", CAST(%s AS bigint[]), %s::text",
    "UPDATE t SET a = %s WHERE b = ANY(CAST(%s AS uuid[])) RETURNING 100%%",
]


@pytest.fixture(scope="module")
def original() -> object:
    db._convert_each_statement_once()
    return pg8000.dbapi.convert_paramstyle.__wrapped_original__  # type: ignore[attr-defined]


@pytest.mark.parametrize("statement", STATEMENTS)
def test_the_rewrite_matches_pg8000s_for_every_call(statement: str, original) -> None:
    args = tuple(range(statement.count("%s")))
    expected = original("format", statement, args)
    for _ in range(3):  # the first call fills the cache, the later ones read it
        assert pg8000.dbapi.convert_paramstyle("format", statement, args) == expected
        assert pg8000.legacy.convert_paramstyle("format", statement, args) == expected


def test_named_styles_are_converted_per_call(original) -> None:
    statement = "SELECT :a, :b, :a"
    assert pg8000.dbapi.convert_paramstyle("named", statement, {"a": 1, "b": 2}) == original(
        "named", statement, {"a": 1, "b": 2}
    )
    assert pg8000.dbapi.convert_paramstyle("named", statement, {"a": 3, "b": 4})[1] == (3, 4)


def test_installing_twice_keeps_one_wrapper() -> None:
    db._convert_each_statement_once()
    first = pg8000.dbapi.convert_paramstyle
    db._convert_each_statement_once()
    assert pg8000.dbapi.convert_paramstyle is first
