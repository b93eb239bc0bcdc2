"""A producer or an operator on a database the relay was never migrated into
is told to run `outbox migrate`, in one sentence without SQL."""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

import outbox
from outbox import migrate
from outbox_cli.cli import cli
from support import EMAIL


@pytest.mark.parametrize("api", ["enqueue", "enqueue_many"])
def test_enqueue_without_the_schema_raises_schema_missing(
    empty_database: tuple[str, sa.Engine], api: str
) -> None:
    _, engine = empty_database
    with pytest.raises(outbox.SchemaMissing) as raised, engine.begin() as conn:
        if api == "enqueue":
            outbox.enqueue(conn, "email", EMAIL)
        else:
            outbox.enqueue_many(conn, [{"channel": "email", "payload": EMAIL}])
    assert isinstance(raised.value, outbox.OutboxError)
    message = str(raised.value)
    assert "outbox migrate" in message
    assert "INSERT" not in message.upper() and "SELECT" not in message.upper()
    # Nothing of the statement rides along in a chained exception either.
    assert raised.value.__cause__ is None and raised.value.__suppress_context__


def test_enqueue_on_a_schema_older_than_the_release_raises_schema_missing(
    empty_database: tuple[str, sa.Engine],
) -> None:
    _, engine = empty_database
    migrate.upgrade(engine, "0001")
    with pytest.raises(outbox.SchemaMissing), engine.begin() as conn:
        outbox.enqueue(conn, "email", EMAIL, dedupe_key="order-1")


def test_other_database_errors_keep_their_type(empty_database: tuple[str, sa.Engine]) -> None:
    """Only an undefined table or function is a missing schema: a read-only
    transaction's refusal stays the driver's error, for the caller's handling."""
    _, engine = empty_database
    migrate.upgrade(engine)
    with pytest.raises(sa.exc.DBAPIError) as raised, engine.begin() as conn:
        conn.execute(sa.text("SET TRANSACTION READ ONLY"))
        outbox.enqueue(conn, "email", EMAIL)
    assert not isinstance(raised.value, outbox.SchemaMissing)


@pytest.mark.parametrize(
    "args",
    [
        ["status"],
        ["enqueue", "--channel", "email", "--payload", json.dumps(EMAIL)],
    ],
)
def test_the_cli_says_run_migrate_first(
    empty_database: tuple[str, sa.Engine], args: list[str]
) -> None:
    url, _ = empty_database
    result = CliRunner().invoke(cli, [*args, "--json"], env={"DATABASE_URL": url})
    assert result.exit_code == 1, result.output
    assert '"kind": "schema_missing"' in result.output
    assert "outbox migrate" in result.output
