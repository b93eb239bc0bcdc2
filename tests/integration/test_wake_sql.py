"""Wake on enqueue for SQL producers: layers/outbox/outbox/sql/wake_on_enqueue.sql
against the real Postgres.

The aws_lambda extension exists only on RDS and Aurora, so the test database
gets a stand-in with the same names and signature: ``aws_lambda.invoke``
counts its calls in a sequence (not transactional, like the real HTTP call:
a call made by a transaction that then rolls back still counts) and records
what it was given; ``raises`` makes it fail as the real one does without a
role or a network path. The script runs in a database of its own, so its
trigger never meets the other tests.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import outbox
from support import EMAIL

SCRIPT = Path(outbox.__file__).parent / "sql" / "wake_on_enqueue.sql"
EMAIL_JSON = json.dumps(EMAIL)
ARN = "arn:aws:lambda:eu-west-1:123456789012:function:stack-DispatcherFunction-AbC"

STAND_IN = """
CREATE SCHEMA aws_commons;
CREATE TYPE aws_commons._lambda_function_arn_1 AS (function_name text, region text);
CREATE FUNCTION aws_commons.create_lambda_function_arn(function_name text, region text DEFAULT NULL)
RETURNS aws_commons._lambda_function_arn_1 LANGUAGE sql
AS $$ SELECT ROW(function_name, region)::aws_commons._lambda_function_arn_1 $$;

CREATE SCHEMA aws_lambda;
CREATE SEQUENCE aws_lambda.calls;
CREATE TABLE aws_lambda.behaviour (raises boolean NOT NULL);
INSERT INTO aws_lambda.behaviour VALUES (false);
CREATE FUNCTION aws_lambda.invoke(
    IN function_name aws_commons._lambda_function_arn_1,
    IN payload json,
    IN invocation_type text DEFAULT 'RequestResponse',
    IN log_type text DEFAULT 'None',
    IN context json DEFAULT NULL,
    IN qualifier varchar(128) DEFAULT NULL,
    -- (the real one names its OUT payload "payload" too; plpgsql cannot)
    OUT status_code int, OUT response json, OUT executed_version text, OUT log_result text)
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM nextval('aws_lambda.calls');
    IF (SELECT raises FROM aws_lambda.behaviour) THEN
        RAISE EXCEPTION 'Lambda API returned error: 403 AccessDeniedException' USING ERRCODE = 'XX000';
    END IF;
    -- The real Invoke is not transactional: say what was sent at once (a
    -- notice), where a rollback of the caller's block cannot take it back.
    RAISE NOTICE 'aws_lambda.invoke %', json_build_object(
        'function_name', (function_name).function_name, 'region', (function_name).region,
        'payload', invoke.payload, 'invocation_type', invocation_type,
        'request_timeout_ms', current_setting('aws_lambda.request_timeout_ms', true),
        'connect_timeout_ms', current_setting('aws_lambda.connect_timeout_ms', true));
    status_code := 202;
END
$$;
"""


@pytest.fixture(scope="module")
def wake_db(server_url: str) -> Iterator[sa.Engine]:
    from outbox import migrate
    from outbox.db import create_engine
    from outbox.relay_settings import DatabaseSettings
    from outbox_cli import devdb

    name = f"outbox_wake_{uuid.uuid4().hex[:10]}"
    url = devdb.recreate_database(server_url, name)
    engine = create_engine(DatabaseSettings(url=url, sslmode="disable"), pool_size=4)
    try:
        migrate.upgrade(engine)
        with engine.begin() as conn:
            conn.exec_driver_sql(STAND_IN)
            conn.exec_driver_sql(SCRIPT.read_text())
            conn.exec_driver_sql(SCRIPT.read_text())  # running it again is harmless
        yield engine
    finally:
        engine.dispose()
        devdb.drop_database(server_url, name)


@pytest.fixture
def db(wake_db: sa.Engine) -> sa.Engine:
    """The wake database, configured with a long interval, no call counted yet."""
    with wake_db.begin() as conn:
        conn.execute(sa.text("TRUNCATE outbox_message, outbox_dedupe CASCADE"))
        conn.execute(sa.text("UPDATE aws_lambda.behaviour SET raises = false"))
        conn.execute(sa.text("SELECT setval('aws_lambda.calls', 1, false)"))
        conn.execute(sa.text("SELECT setval('outbox_wake_last_nudge_ms', 0)"))
        conn.execute(sa.text("SELECT outbox_wake_configure(:arn, interval '1 hour')"), {"arn": ARN})
    return wake_db


def calls(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM aws_lambda.calls"
                )
            ).scalar_one()
        )


def enqueue_sql(conn: sa.Connection, n: int = 1) -> None:
    for _ in range(n):
        conn.execute(
            sa.text("SELECT outbox_enqueue('email', CAST(:p AS jsonb))"), {"p": EMAIL_JSON}
        )


def invoked(conn: sa.Connection) -> list[dict[str, Any]]:
    """What the stand-in was asked to send on this connection (its notices)."""
    dbapi = conn.connection.dbapi_connection
    assert dbapi is not None
    notices = [n[b"M"].decode() for n in dbapi.notices]  # type: ignore[attr-defined]
    prefix = "aws_lambda.invoke "
    return [json.loads(n[len(prefix) :]) for n in notices if n.startswith(prefix)]


def test_it_invokes_the_dispatcher_once_after_a_committed_batch(db: sa.Engine) -> None:
    with db.connect() as conn:
        enqueue_sql(conn, 50)
        conn.execute(
            sa.text("INSERT INTO outbox_message (channel, payload) VALUES ('email', :p)"),
            {"p": EMAIL_JSON},
        )
        assert calls(db) == 0  # deferred to the commit
        conn.commit()
        (sent,) = invoked(conn)
    assert calls(db) == 1
    assert sent["function_name"] == ARN and sent["region"] == "eu-west-1"
    assert sent["invocation_type"] == "Event"
    assert sent["payload"] == {"version": 1, "source": "outbox.nudge"}
    # a hung Lambda endpoint holds the producer's COMMIT for seconds, not for ever
    assert (sent["connect_timeout_ms"], sent["request_timeout_ms"]) == ("1000", "2000")


def test_a_long_transaction_that_nudged_early_stops_no_other_producer(db: sa.Engine) -> None:
    """A transaction that fires the trigger at once (SET CONSTRAINTS ALL
    IMMEDIATE) and stays open holds nothing the next producer's nudge needs."""
    with db.begin() as conn:
        conn.execute(sa.text("SELECT outbox_wake_configure(:arn, interval '0')"), {"arn": ARN})
    with db.connect() as long_one:
        long_one.execute(sa.text("SET CONSTRAINTS ALL IMMEDIATE"))
        enqueue_sql(long_one)
        assert calls(db) == 1  # fired at the insert
        for _ in range(3):
            with db.begin() as conn:
                conn.execute(sa.text("SET LOCAL lock_timeout = '1ms'"))
                enqueue_sql(conn)
        assert calls(db) == 4
        long_one.rollback()


def test_a_role_without_grants_cannot_hold_the_decision(db: sa.Engine, database_url: str) -> None:
    """The coalescing lock is outbox_wake's row: a role with no grant on it
    cannot lock it (an advisory lock anyone could take)."""
    from sqlalchemy.engine import make_url

    role = f"stranger_{uuid.uuid4().hex[:8]}"
    with db.begin() as conn:
        conn.execute(sa.text(f"CREATE ROLE {role} LOGIN"))
    stranger = sa.create_engine(make_url(str(db.url)).set(username=role, password="x"))
    try:
        with pytest.raises(sa.exc.DBAPIError, match="permission denied"), stranger.connect() as c:
            c.execute(sa.text("SELECT * FROM outbox_wake FOR UPDATE"))
    finally:
        stranger.dispose()
        with db.begin() as conn:
            conn.execute(sa.text(f"DROP ROLE {role}"))


def test_a_rolled_back_transaction_invokes_nothing(db: sa.Engine) -> None:
    with pytest.raises(RuntimeError), db.begin() as conn:
        enqueue_sql(conn, 3)
        raise RuntimeError("the business change failed")
    with db.begin() as conn:  # a savepoint rolled back: its rows' triggers go with it
        savepoint = conn.begin_nested()
        enqueue_sql(conn)
        savepoint.rollback()
        conn.execute(sa.text("SELECT 1"))
    assert calls(db) == 0


def test_commits_within_the_interval_share_one_invoke(db: sa.Engine) -> None:
    for _ in range(20):
        with db.begin() as conn:
            enqueue_sql(conn)
    assert calls(db) == 1
    with db.begin() as conn:  # with no interval, every committing transaction pays
        conn.execute(sa.text("SELECT outbox_wake_configure(:arn, interval '0')"), {"arn": ARN})
    for _ in range(5):
        with db.begin() as conn:
            enqueue_sql(conn)
    assert calls(db) == 6


def test_a_producer_never_waits_for_another_that_is_nudging(db: sa.Engine) -> None:
    """While one transaction holds the decision (its COMMIT is invoking), the
    others commit at once and leave the nudge to it."""
    with db.connect() as holder:
        holder.execute(sa.text("SELECT * FROM outbox_wake FOR UPDATE"))
        with db.begin() as conn:
            conn.execute(sa.text("SET LOCAL lock_timeout = '1ms'"))  # a wait would error
            enqueue_sql(conn)
        holder.rollback()
    assert calls(db) == 0
    with db.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM outbox_message")).scalar() == 1


def test_an_invoke_error_warns_and_the_insert_commits(db: sa.Engine) -> None:
    with db.begin() as conn:
        conn.execute(sa.text("UPDATE aws_lambda.behaviour SET raises = true"))
    with db.connect() as conn:
        dbapi = conn.connection.dbapi_connection
        assert dbapi is not None
        dbapi.notices.clear()  # type: ignore[attr-defined]
        enqueue_sql(conn, 2)
        conn.commit()
        warnings = [n[b"M"].decode() for n in dbapi.notices]  # type: ignore[attr-defined]
    assert calls(db) == 1
    assert any("outbox wake: the dispatcher was not nudged" in w for w in warnings), warnings
    assert any("AccessDeniedException" in w for w in warnings)
    with db.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM outbox_message")).scalar() == 2


def test_without_configuration_nothing_is_invoked(db: sa.Engine) -> None:
    with db.begin() as conn:
        conn.execute(sa.text("DELETE FROM outbox_wake"))
    with db.begin() as conn:
        enqueue_sql(conn)
    assert calls(db) == 0


def test_configure_refuses_what_is_not_a_function(db: sa.Engine) -> None:
    with (
        pytest.raises(sa.exc.DBAPIError, match="not a Lambda function name or ARN"),
        db.begin() as conn,
    ):
        conn.execute(sa.text("SELECT outbox_wake_configure('x; DROP TABLE outbox_message')"))


def test_every_function_pins_its_search_path(db: sa.Engine) -> None:
    with db.connect() as conn:
        configs = dict(
            conn.execute(
                sa.text(
                    "SELECT proname, array_to_string(proconfig, ',') FROM pg_proc "
                    "WHERE proname IN ('outbox_wake_nudge', 'outbox_wake_configure')"
                )
            ).all()
        )
    assert configs == {
        "outbox_wake_nudge": "search_path=public, pg_temp",
        "outbox_wake_configure": "search_path=public, pg_temp",
    }


def test_the_script_refuses_a_database_without_the_extension(server_url: str) -> None:
    from outbox_cli import devdb

    name = f"outbox_wake_{uuid.uuid4().hex[:10]}"
    url = devdb.recreate_database(server_url, name)
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("CREATE TABLE outbox_message (id bigint)")
        with (
            pytest.raises(sa.exc.DBAPIError, match="CREATE EXTENSION aws_lambda CASCADE"),
            engine.begin() as conn,
        ):
            conn.exec_driver_sql(SCRIPT.read_text())
    finally:
        engine.dispose()
        devdb.drop_database(server_url, name)
