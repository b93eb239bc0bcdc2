"""`store._sql.statement` strips comments and layout line by line; a statement
it would change the meaning of is refused when it is built, at import."""

from __future__ import annotations

import subprocess
import sys

import pytest

from outbox.store._sql import statement


def test_comments_and_indentation_are_removed() -> None:
    text = """
        SELECT a,  -- the first column
               b   -- the second
        FROM t
        -- a line of comment alone
        WHERE c = 'x'
    """
    assert str(statement(text)) == "SELECT a, b FROM t WHERE c = 'x'"


def test_a_comment_may_hold_quotes_and_a_literal_may_hold_a_doubled_quote() -> None:
    text = """
        SELECT 'it''s' AS said  -- the batch's size, a "quoted" word
        FROM t
    """
    assert str(statement(text)) == "SELECT 'it''s' AS said FROM t"


@pytest.mark.parametrize(
    "text",
    [
        # An interpolated prefix with two dashes: cutting at the first "--"
        # would end the statement inside the literal.
        "SELECT * FROM t WHERE name LIKE 'order--%' AND channel = :channel",
        'SELECT 1 AS "odd--name"',
        "SELECT 'it''s -- not a comment'",
    ],
)
def test_two_dashes_inside_a_quoted_literal_or_name_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="--"):
        statement(text)


def test_a_literal_across_lines_is_refused() -> None:
    # Joining the lines would change the literal's text (its newline, its indentation).
    with pytest.raises(ValueError, match="across lines"):
        statement("SELECT 'first line\n    second line' AS text")


def test_every_statement_of_the_store_is_built() -> None:
    # The store builds its statements at import; a fresh interpreter imports it
    # (this one may have done so before the rule was checked), so an import
    # error here names the statement that breaks the rule.
    result = subprocess.run(
        [sys.executable, "-c", "import outbox.store"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
