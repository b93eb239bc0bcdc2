"""Schema migration: Alembic upgrade, and the migrate function as a CloudFormation
custom resource answering a real (local, TLS) response URL."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import outbox
from outbox import migrate, store
from outbox.db import create_engine
from outbox.migrate import check_response_url
from outbox.migrate import handle as migrate_handler
from outbox.relay_settings import DatabaseSettings
from support import LambdaContext, make_ca

SQS_URL = "https://sqs.us-east-1.amazonaws.com/123456789012/orders"


@pytest.fixture
def fresh_database(empty_database: tuple[str, sa.Engine]) -> sa.Engine:
    """An empty database of its own, to migrate from nothing."""
    return empty_database[1]


def tables(engine: sa.Engine) -> set[str]:
    return set(sa.inspect(engine).get_table_names())


APP_MIGRATION = """
from alembic import op

revision = "a1b2c3d4e5f6"
down_revision = None


def upgrade():
    op.execute("CREATE TABLE orders (id bigint PRIMARY KEY, state text NOT NULL)")


def downgrade():
    op.execute("DROP TABLE orders")
"""


def app_alembic(engine: sa.Engine, tmp_path: Path, command: str, revision: str = "head") -> None:
    """An application's own Alembic project (its own env.py and revision), run
    against the same database the way the application runs it."""
    from alembic import command as alembic_command
    from alembic.config import Config

    versions = tmp_path / "app_migrations" / "versions"
    if not versions.is_dir():
        versions.mkdir(parents=True)
        (versions / "a1b2c3d4e5f6_orders.py").write_text(APP_MIGRATION)
        (versions.parent / "script.py.mako").write_text("")
        (versions.parent / "env.py").write_text(
            "from alembic import context\n"
            "context.configure(connection=context.config.attributes['connection'])\n"
            "with context.begin_transaction():\n"
            "    context.run_migrations()\n"
        )
    config = Config()
    config.set_main_option("script_location", str(versions.parent))
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        getattr(alembic_command, command)(config, revision)


def app_revision(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalars())


def test_the_relay_and_an_application_alembic_share_a_database(
    fresh_database: sa.Engine, tmp_path: Path
) -> None:
    """The application migrated first (its alembic_version holds a revision the
    relay does not know); `outbox migrate` then works, and so do the
    application's later upgrades and downgrades."""
    from click.testing import CliRunner

    from outbox_cli.cli import cli

    app_alembic(fresh_database, tmp_path, "upgrade")
    url = fresh_database.url.render_as_string(hide_password=False)
    result = CliRunner().invoke(cli, ["migrate", "--json"], env={"DATABASE_URL": url})
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["revision"] == migrate.head()
    assert app_revision(fresh_database) == ["a1b2c3d4e5f6"]
    assert migrate.current(fresh_database) == migrate.head()
    with fresh_database.begin() as conn:
        conn.execute(sa.text("INSERT INTO orders VALUES (42, 'shipped')"))
        outbox.enqueue(conn, "sqs", {"queue_url": SQS_URL, "body": "order 42"})
    # The application's Alembic still works on its own table, and never sees ours.
    app_alembic(fresh_database, tmp_path, "downgrade", "base")
    assert app_revision(fresh_database) == []
    assert "orders" not in tables(fresh_database)
    app_alembic(fresh_database, tmp_path, "upgrade")
    assert app_revision(fresh_database) == ["a1b2c3d4e5f6"]
    assert migrate.upgrade(fresh_database) == migrate.head()
    with fresh_database.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM outbox_message")).scalar_one() == 1


def test_a_deployment_that_kept_its_revision_in_alembic_version_upgrades_in_place(
    fresh_database: sa.Engine,
) -> None:
    """Releases before 0.1.0 wrote the relay's revision into alembic_version:
    the next migrate moves it to outbox_alembic_version and carries on from it."""
    migrate.upgrade(fresh_database, "0001")
    with fresh_database.begin() as conn:
        conn.execute(sa.text("ALTER TABLE outbox_alembic_version RENAME TO alembic_version"))
        conn.execute(
            sa.text(
                "ALTER TABLE alembic_version RENAME CONSTRAINT outbox_alembic_version_pkc "
                "TO alembic_version_pkc"
            )
        )
    assert migrate.upgrade(fresh_database) == migrate.head()
    assert "alembic_version" not in tables(fresh_database)  # it held only the relay's row
    assert migrate.current(fresh_database) == migrate.head()


def test_the_legacy_move_leaves_an_applications_rows_in_alembic_version(
    fresh_database: sa.Engine, tmp_path: Path
) -> None:
    migrate.upgrade(fresh_database, "0001")
    app_alembic(fresh_database, tmp_path, "upgrade")  # alembic_version: the app's row
    with fresh_database.begin() as conn:  # ... and the relay's, as an old release left it
        conn.execute(sa.text("DROP TABLE outbox_alembic_version"))
        conn.execute(sa.text("INSERT INTO alembic_version VALUES ('0001')"))
    assert migrate.upgrade(fresh_database) == migrate.head()
    assert app_revision(fresh_database) == ["a1b2c3d4e5f6"]


def test_an_applications_autogenerate_ignores_the_relays_tables(
    fresh_database: sa.Engine,
) -> None:
    """With outbox.migrate.include_object in its env.py, an application's
    autogenerate proposes neither dropping the relay's objects nor adding them."""
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    migrate.upgrade(fresh_database)
    app_metadata = sa.MetaData()
    sa.Table("orders", app_metadata, sa.Column("id", sa.BigInteger, primary_key=True))
    with fresh_database.begin() as conn:
        conn.execute(sa.text("CREATE TABLE orders (id bigint PRIMARY KEY)"))
        plain = compare_metadata(MigrationContext.configure(conn), app_metadata)
        filtered = compare_metadata(
            MigrationContext.configure(conn, opts={"include_object": migrate.include_object}),
            app_metadata,
        )
    assert {d[1].name for d in plain if d[0] == "remove_table"} >= {
        "outbox_message",
        "outbox_attempt",
    }
    assert filtered == []


def test_an_applications_own_outbox_named_table_is_not_skipped(
    fresh_database: sa.Engine,
) -> None:
    """include_object names the relay's tables exactly: an application table
    that merely starts with ``outbox_`` is the application's, and its
    autogenerate creates it."""
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    migrate.upgrade(fresh_database)
    app_metadata = sa.MetaData()
    sa.Table("outbox_preferences", app_metadata, sa.Column("id", sa.BigInteger, primary_key=True))
    with fresh_database.begin() as conn:
        context = MigrationContext.configure(conn, opts={"include_object": migrate.include_object})
        diff = compare_metadata(context, app_metadata)
    assert [(d[0], d[1].name) for d in diff] == [("add_table", "outbox_preferences")]


def test_relay_tables_are_exactly_the_tables_the_migrations_create(
    fresh_database: sa.Engine,
) -> None:
    migrate.upgrade(fresh_database)
    made = tables(fresh_database)
    days = {t for t in made if migrate.HISTORY_PARTITION.fullmatch(t)}
    # today's history partition and the days ahead, named by their UTC day
    assert len(days) == 1 + store.HISTORY_DAYS_AHEAD, days
    assert made - days == migrate.RELAY_TABLES


HEAD = migrate.head()


def test_upgrade_creates_the_schema_and_is_idempotent(fresh_database: sa.Engine) -> None:
    assert migrate.current(fresh_database) is None
    assert migrate.upgrade(fresh_database) == HEAD
    assert migrate.upgrade(fresh_database) == HEAD
    assert {"outbox_message", "outbox_attempt", "outbox_outcome_event"} <= tables(fresh_database)
    migrate.downgrade(fresh_database, "base")
    assert not {"outbox_message", "outbox_attempt", "outbox_outcome_event"} & tables(fresh_database)


@pytest.fixture
def response_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict[str, Any]]]:
    """A local HTTPS endpoint standing in for CloudFormation's pre-signed S3 URL
    (the one substitution: its host, 127.0.0.1, is let through the host check)."""
    ca = make_ca(tmp_path, names=("127.0.0.1",))
    monkeypatch.setenv("SSL_CERT_FILE", str(ca.ca_file))
    monkeypatch.setattr(migrate, "RESPONSE_URL_HOST", re.compile(r"^127\.0\.0\.1$"))
    received: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_PUT(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append({"path": self.path, **json.loads(body)})
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    server.socket = ca.server_context().wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    received.append({"url": f"https://127.0.0.1:{server.server_port}/stack-response?sig=x"})
    yield received
    server.shutdown()


def custom_resource_event(url: str, request_type: str) -> dict[str, Any]:
    return {
        "RequestType": request_type,
        "ResponseURL": url,
        "StackId": "arn:aws:cloudformation:us-east-1:123456789012:stack/outbox/1",
        "RequestId": "req-1",
        "LogicalResourceId": "OutboxSchema",
        "ResourceType": "Custom::OutboxSchema",
        "ResourceProperties": {"ServiceToken": "arn:aws:lambda:us-east-1:123456789012:function:m"},
    }


def test_custom_resource_create_migrates_and_answers_success(
    fresh_database: sa.Engine, response_url: list[dict[str, Any]]
) -> None:
    url = response_url.pop(0)["url"]
    result = migrate_handler(
        custom_resource_event(url, "Create"), LambdaContext(), lambda: fresh_database
    )
    assert result == {"status": "SUCCESS", "Revision": HEAD}
    (answer,) = response_url
    assert answer["Status"] == "SUCCESS" and answer["Data"] == {"Revision": HEAD}
    assert (answer["RequestId"], answer["LogicalResourceId"]) == ("req-1", "OutboxSchema")
    assert answer["path"] == "/stack-response?sig=x"
    assert {"outbox_message", "outbox_attempt", "outbox_outcome_event"} <= tables(fresh_database)


def test_custom_resource_delete_keeps_the_data(
    fresh_database: sa.Engine, response_url: list[dict[str, Any]]
) -> None:
    url = response_url.pop(0)["url"]
    migrate.upgrade(fresh_database)
    event = {**custom_resource_event(url, "Delete"), "PhysicalResourceId": "outbox-schema"}
    migrate_handler(event, LambdaContext(), lambda: fresh_database)
    assert response_url[0]["Status"] == "SUCCESS"
    assert {"outbox_message", "outbox_attempt", "outbox_outcome_event"} <= tables(fresh_database)


def test_custom_resource_reports_a_failed_migration(response_url: list[dict[str, Any]]) -> None:
    url = response_url.pop(0)["url"]
    broken = create_engine(
        DatabaseSettings(url="postgresql://nobody@127.0.0.1:9/none", sslmode="disable")
    )
    result = migrate_handler(custom_resource_event(url, "Create"), LambdaContext(), lambda: broken)
    assert result == {"status": "FAILED"}
    assert response_url[0]["Status"] == "FAILED" and "migration failed" in response_url[0]["Reason"]


def test_a_migration_whose_answer_fails_is_not_logged_as_a_failed_migration(
    fresh_database: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The schema is migrated; then CloudFormation's URL does not answer (here
    a loopback port nobody listens on). That is one error about the answer,
    without a chain of tracebacks, and the log says the migration succeeded."""
    import socket

    monkeypatch.setattr(migrate, "RESPONSE_URL_HOST", re.compile(r"^127\.0\.0\.1$"))
    with socket.socket() as closed:  # bound, never listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        url = f"https://127.0.0.1:{closed.getsockname()[1]}/stack-response"
        with (
            caplog.at_level("INFO", logger="outbox"),
            pytest.raises(migrate.CustomResourceAnswerFailed) as raised,
        ):
            migrate_handler(
                custom_resource_event(url, "Create"), LambdaContext(), lambda: fresh_database
            )
    assert migrate.current(fresh_database) == HEAD
    assert "SUCCESS answer" in str(raised.value) and "stack-response" not in str(raised.value)
    assert raised.value.__cause__ is None and raised.value.__suppress_context__
    messages = [r.getMessage() for r in caplog.records]
    assert "schema migrated" in messages
    assert "schema migration failed" not in messages


def test_plain_invoke_returns_the_revision(fresh_database: sa.Engine) -> None:
    assert migrate_handler({}, LambdaContext(), lambda: fresh_database) == {"revision": HEAD}


VALID_RESPONSE_URLS = [
    "https://cloudformation-custom-resource-response-useast1.s3.amazonaws.com/arn%3A?X-Amz-Signature=a",
    "https://cloudformation-custom-resource-response-euwest1.s3-eu-west-1.amazonaws.com/k?sig=x",
    "https://cloudformation-custom-resource-response-apsoutheast2.s3.ap-southeast-2.amazonaws.com/k",
    "https://cloudformation-custom-resource-response-cnnorth1.s3.cn-north-1.amazonaws.com.cn/k",
    "https://cloudformation-custom-resource-response-usgovwest1.s3-us-gov-west-1.amazonaws.com/k",
]
FORGED_RESPONSE_URLS = [
    "http://cloudformation-custom-resource-response-useast1.s3.amazonaws.com/x",
    "https://169.254.169.254/latest/meta-data/",
    "https://127.0.0.1/",
    "https://attacker.example.com/cloudformation-custom-resource-response",
    "https://cloudformation-custom-resource-response-useast1.s3.amazonaws.com.evil.com/x",
    "https://user:pw@cloudformation-custom-resource-response-useast1.s3.amazonaws.com/x",
    "https://bucket.s3.amazonaws.com/x",
    "https://[::1/",
    42,
]


def test_response_urls_must_be_cloudformations_s3_bucket_over_https() -> None:
    for url in VALID_RESPONSE_URLS:
        assert check_response_url(url) == url
    for bad in FORGED_RESPONSE_URLS:
        with pytest.raises(ValueError, match="ResponseURL") as caught:
            check_response_url(bad)
        assert "pw" not in str(caught.value)


def test_a_forged_response_url_migrates_nothing_and_sends_nothing(
    fresh_database: sa.Engine, response_url: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The migrate function holds the migrator's credentials: a forged
    custom-resource event must not make it PUT anywhere but CloudFormation."""
    monkeypatch.undo()  # the real host check: the local receiver is not CloudFormation's
    url = response_url.pop(0)["url"]
    with pytest.raises(ValueError, match="ResponseURL"):
        migrate_handler(
            custom_resource_event(url, "Create"), LambdaContext(), lambda: fresh_database
        )
    assert response_url == []
    assert migrate.current(fresh_database) is None


def test_0006_moves_existing_rows_to_the_recipient_scope_and_the_send_log(
    fresh_database: sa.Engine,
) -> None:
    import outbox
    from support import EMAIL

    migrate.upgrade(fresh_database, "0001")
    with fresh_database.begin() as conn:
        keyed, plain = conn.execute(
            sa.text(
                "INSERT INTO outbox_message (channel, payload, dedupe_key, status, settled_at) "
                "VALUES ('email', CAST(:email AS jsonb), 'order-1', 'delivered', now()), "
                "('sms', CAST(:sms AS jsonb), NULL, 'pending', NULL) RETURNING id"
            ),
            {"email": json.dumps(EMAIL), "sms": json.dumps({"to": "+15555550100", "message": "m"})},
        ).scalars()
        conn.execute(
            sa.text(
                "INSERT INTO outbox_attempt (message_id, attempt, outcome) "
                "VALUES (:id, 1, 'delivered')"
            ),
            {"id": keyed},
        )
    assert migrate.upgrade(fresh_database) == HEAD

    with fresh_database.begin() as conn:
        moved = conn.execute(
            sa.text(
                "SELECT d.message_id, d.recipient_fingerprint "
                "= outbox_recipient_fingerprint(m.channel, m.payload) AS fingerprint_ok "
                "FROM outbox_dedupe d JOIN outbox_message m ON m.id = d.message_id"
            )
        ).all()
        assert [tuple(r) for r in moved] == [(keyed, True)]
        attempt = conn.execute(
            sa.text(
                "SELECT channel, recipient_fingerprints = ARRAY[outbox_fingerprint(:to)] AS ok "
                "FROM outbox_attempt"
            ),
            {"to": EMAIL["to"][0]},
        ).one()
        assert tuple(attempt) == ("email", True)
        fingerprinted = conn.execute(
            sa.text(
                "SELECT count(*) FROM outbox_message WHERE cardinality(recipient_fingerprints) = 1"
            )
        ).scalar_one()
        assert fingerprinted == 2
        # the old key holds for its recipient; another recipient is a new message
        assert outbox.enqueue(conn, "email", EMAIL, dedupe_key="order-1", return_created=True) == (
            keyed,
            False,
        )
        other = {**EMAIL, "to": ["other@example.net"]}
        assert outbox.enqueue(conn, "email", other, dedupe_key="order-1") not in (keyed, plain)
        # attempts no longer go with their message
        conn.execute(sa.text("DELETE FROM outbox_message WHERE id = :id"), {"id": keyed})
        assert conn.execute(sa.text("SELECT count(*) FROM outbox_attempt")).scalar_one() == 1

    migrate.downgrade(fresh_database, "0001")
    assert "outbox_dedupe" not in tables(fresh_database)
    migrate.downgrade(fresh_database, "base")


def test_an_interrupted_upgrade_keeps_the_revisions_it_finished_and_resumes(
    fresh_database: sa.Engine,
) -> None:
    """Each revision is a transaction of its own: a failure in one (here an
    object already there under the name 0024 makes) leaves every revision
    before it applied, holds no lock, and the next `outbox migrate` goes on
    from there."""
    migrate.upgrade(fresh_database, "0022")
    with fresh_database.begin() as conn:
        conn.execute(sa.text("CREATE TABLE outbox_tenant_channel (x int)"))
    with pytest.raises(sa.exc.DBAPIError, match="already exists"):
        migrate.upgrade(fresh_database)
    assert migrate.current(fresh_database) == "0023"
    with fresh_database.connect() as conn:  # the migration lock went with the failure
        assert conn.execute(
            sa.text("SELECT pg_try_advisory_lock(:id)"), {"id": migrate._MIGRATION_LOCK_ID}
        ).scalar_one()
        conn.execute(sa.text("SELECT pg_advisory_unlock_all()"))
        conn.execute(sa.text("DROP TABLE outbox_tenant_channel"))
        conn.commit()
    assert migrate.upgrade(fresh_database) == migrate.head()
