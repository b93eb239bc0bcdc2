"""Schema migration: Alembic upgrade, and the migrate function as a CloudFormation
custom resource answering a real (local, TLS) response URL."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from outbox import migrate
from outbox.config import DatabaseSettings
from outbox.db import create_engine
from outbox.runtime import migrate as migrate_handler
from support import LambdaContext, head_revision, make_ca


@pytest.fixture
def fresh_database(server_url: str) -> Iterator[sa.Engine]:
    """An empty database of its own, to migrate from nothing."""
    import uuid

    from sqlalchemy.engine import make_url

    name = f"outbox_migrate_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = make_url(server_url).set(database=name).render_as_string(hide_password=False)
    engine = create_engine(DatabaseSettings(url=url, sslmode="disable"))
    yield engine
    engine.dispose()
    with admin.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE "{name}" WITH (FORCE)'))
    admin.dispose()


def tables(engine: sa.Engine) -> set[str]:
    return set(sa.inspect(engine).get_table_names())


def test_upgrade_creates_the_schema_and_is_idempotent(fresh_database: sa.Engine) -> None:
    assert migrate.current(fresh_database) is None
    assert migrate.upgrade(fresh_database) == head_revision()
    assert migrate.upgrade(fresh_database) == head_revision()
    assert {"outbox_message", "outbox_attempt"} <= tables(fresh_database)
    migrate.downgrade(fresh_database, "base")
    assert not {"outbox_message", "outbox_attempt"} & tables(fresh_database)


@pytest.fixture
def response_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict[str, Any]]]:
    """A local HTTPS endpoint standing in for CloudFormation's pre-signed S3 URL."""
    ca = make_ca(tmp_path, names=("127.0.0.1",))
    monkeypatch.setenv("SSL_CERT_FILE", str(ca.ca_file))
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
    assert result == {"status": "SUCCESS", "Revision": head_revision()}
    (answer,) = response_url
    assert answer["Status"] == "SUCCESS" and answer["Data"] == {"Revision": head_revision()}
    assert (answer["RequestId"], answer["LogicalResourceId"]) == ("req-1", "OutboxSchema")
    assert answer["path"] == "/stack-response?sig=x"
    assert {"outbox_message", "outbox_attempt"} <= tables(fresh_database)


def test_custom_resource_delete_keeps_the_data(
    fresh_database: sa.Engine, response_url: list[dict[str, Any]]
) -> None:
    url = response_url.pop(0)["url"]
    migrate.upgrade(fresh_database)
    event = {**custom_resource_event(url, "Delete"), "PhysicalResourceId": "outbox-schema"}
    migrate_handler(event, LambdaContext(), lambda: fresh_database)
    assert response_url[0]["Status"] == "SUCCESS"
    assert {"outbox_message", "outbox_attempt"} <= tables(fresh_database)


def test_custom_resource_reports_a_failed_migration(response_url: list[dict[str, Any]]) -> None:
    url = response_url.pop(0)["url"]
    broken = create_engine(
        DatabaseSettings(url="postgresql://nobody@127.0.0.1:9/none", sslmode="disable")
    )
    result = migrate_handler(custom_resource_event(url, "Create"), LambdaContext(), lambda: broken)
    assert result == {"status": "FAILED"}
    assert response_url[0]["Status"] == "FAILED" and "migration failed" in response_url[0]["Reason"]


def test_plain_invoke_returns_the_revision(fresh_database: sa.Engine) -> None:
    assert migrate_handler({}, LambdaContext(), lambda: fresh_database) == {
        "revision": head_revision()
    }
