"""Test fixtures: a throwaway Postgres database per run, moto for AWS, and a
guard that fails any test which tries to connect outside 127.0.0.0/8.

The database is ``DATABASE_URL`` when set, else the local Postgres on
127.0.0.1:5432 when one answers, else an embedded one (pgserver).
"""

from __future__ import annotations

import gc
import ipaddress
import os
import shutil
import socket
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

# Fake credentials and a fixed region before anything imports boto3.
os.environ.update(
    {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_REGION": "us-east-1",
        "POWERTOOLS_METRICS_NAMESPACE": "OutboxRelay",
        "POWERTOOLS_TRACE_DISABLED": "true",
    }
)
for _name in ("AWS_PROFILE", "AWS_ENDPOINT_URL"):
    os.environ.pop(_name, None)

LOCAL_POSTGRES = "postgresql://postgres@127.0.0.1:5432/test"  # = outbox_cli.devdb.LOCAL_POSTGRES
pytest_plugins = ["logscan"]

# --- network guard ----------------------------------------------------------

_real_connect = socket.socket.connect
_real_connect_ex = socket.socket.connect_ex


def _check_target(sock: socket.socket, address: Any) -> None:
    if sock.family == getattr(socket, "AF_UNIX", None):
        return
    host = address[0] if isinstance(address, tuple) else address
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise AssertionError(f"test tried to connect to unresolved host {host!r}") from None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    if not ip.is_loopback:
        raise AssertionError(f"test tried to connect outside loopback: {host}")


def _guarded_connect(self: socket.socket, address: Any) -> Any:
    _check_target(self, address)
    return _real_connect(self, address)


def _guarded_connect_ex(self: socket.socket, address: Any) -> Any:
    _check_target(self, address)
    return _real_connect_ex(self, address)


socket.socket.connect = _guarded_connect  # type: ignore[method-assign]
socket.socket.connect_ex = _guarded_connect_ex  # type: ignore[method-assign]


# --- database -----------------------------------------------------------------


@pytest.fixture(scope="session")
def server_url() -> Iterator[str]:
    """A Postgres server we may create databases on: DATABASE_URL's, else the
    local one, else an embedded one (``OUTBOX_DEV_DB=embedded``, ``local`` or
    ``url`` forces one; the same switch as `make run`'s)."""
    from outbox_cli import devdb

    forced = devdb.dev_db_choice()
    explicit = os.environ.get("DATABASE_URL")
    if forced == "url" and not explicit:
        pytest.fail(f"{devdb.DEV_DB_VARIABLE}=url but DATABASE_URL is not set")
    if explicit and forced in ("", "url"):
        yield devdb.pg8000_url(explicit)
    elif forced == "local" or (forced == "" and devdb.answers(LOCAL_POSTGRES)):
        yield devdb.pg8000_url(LOCAL_POSTGRES)
    else:
        # Not under pytest's temporary root (/tmp/pytest-of-<user>): another
        # pytest run on this machine prunes the older runs' folders there and
        # resets the root's permissions, under a live server.
        root = Path(tempfile.mkdtemp(prefix="outbox-test-pgdata-"))
        try:
            with devdb.embedded(root / "pgdata") as url:
                yield url
        finally:
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def database_url(server_url: str) -> Iterator[str]:
    """A throwaway database for this test run, dropped at the end."""
    from outbox_cli import devdb

    name = f"outbox_test_{uuid.uuid4().hex[:10]}"
    url = devdb.recreate_database(server_url, name)
    try:
        yield url
    finally:
        devdb.drop_database(server_url, name)


@pytest.fixture(scope="session")
def migrated_engine(database_url: str) -> Iterator[sa.Engine]:
    from outbox import migrate
    from outbox.db import create_engine
    from outbox.relay_settings import DatabaseSettings

    engine = create_engine(DatabaseSettings(url=database_url, sslmode="disable"), pool_size=12)
    migrate.upgrade(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def empty_database(server_url: str) -> Iterator[tuple[str, sa.Engine]]:
    """A database of its own with nothing of the relay's in it (to migrate
    from nothing): its URL and an engine, dropped after the test."""
    from outbox.db import create_engine
    from outbox.relay_settings import DatabaseSettings
    from outbox_cli import devdb

    name = f"outbox_empty_{uuid.uuid4().hex[:8]}"
    url = devdb.recreate_database(server_url, name)
    engine = create_engine(DatabaseSettings(url=url, sslmode="disable"))
    try:
        yield url, engine
    finally:
        engine.dispose()
        devdb.drop_database(server_url, name)


@pytest.fixture
def engine(migrated_engine: sa.Engine) -> sa.Engine:
    """The migrated engine over empty tables."""
    with migrated_engine.begin() as conn:
        conn.execute(
            sa.text(
                "TRUNCATE outbox_attempt, outbox_message, outbox_outcome_event, outbox_dedupe, "
                "outbox_channel_pause, outbox_destination, outbox_cooldown, outbox_tenant, "
                "outbox_tenant_role, outbox_tenant_secret, outbox_tenant_channel RESTART IDENTITY"
            )
        )
    return migrated_engine


@pytest.fixture
def relay_env(database_url: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Environment for the Lambda handlers, pointed at the test database."""
    env = {
        "DATABASE_URL": database_url,
        "BATCH_SIZE": "50",
        "LEASE_SECONDS": "120",
        "MAX_ATTEMPTS": "3",
        "BACKOFF_BASE_SECONDS": "1",
        "BACKOFF_CAP_SECONDS": "60",
        "DISPATCH_BUDGET_SECONDS": "1",
        "POLL_INTERVAL_SECONDS": "0.05",
        "CHANNEL_FUNCTIONS": '{"email": "outbox-email"}',
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


@pytest.fixture
def aws() -> Iterator[None]:
    from moto import mock_aws

    with mock_aws():
        yield


@pytest.fixture(autouse=True)
def _collectable_heap() -> Iterator[None]:
    """A handler built by a test froze the heap at its "cold start"
    (runtime.cold_start_done): give what the test made back to the collector,
    at the collector's thresholds from before."""
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


@pytest.fixture(autouse=True)
def _fresh_channel_registry() -> Iterator[None]:
    from outbox import channels

    saved = dict(channels._registry)
    yield
    channels._registry.clear()
    channels._registry.update(saved)
    channels._instances.clear()
