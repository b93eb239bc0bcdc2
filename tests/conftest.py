"""Test fixtures: a throwaway Postgres database per run, moto for AWS, and a
guard that fails any test which tries to connect outside 127.0.0.0/8.

The database is ``DATABASE_URL`` when set, else the local Postgres on
127.0.0.1:5432 when one answers, else an embedded one (pgserver).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

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

LOCAL_POSTGRES = "postgresql://postgres@127.0.0.1:5432/test"
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


def _answers(url: str) -> bool:
    try:
        engine = sa.create_engine(_pg8000(url), connect_args={"timeout": 3})
        with engine.connect():
            pass
        engine.dispose()
        return True
    except Exception:
        return False


def _pg8000(url: str) -> str:
    u = make_url(url)
    if u.drivername in ("postgresql", "postgres"):
        u = u.set(drivername="postgresql+pg8000")
    return u.render_as_string(hide_password=False)


@pytest.fixture(scope="session")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Postgres server we may create databases on."""
    explicit = os.environ.get("DATABASE_URL")
    if explicit:
        yield _pg8000(explicit)
        return
    if _answers(LOCAL_POSTGRES):
        yield _pg8000(LOCAL_POSTGRES)
        return
    import pgserver  # embedded Postgres, for machines without one

    server = pgserver.get_server(tmp_path_factory.mktemp("pgdata"), cleanup_mode="stop")
    yield _pg8000(server.get_uri())
    server.cleanup()


@pytest.fixture(scope="session")
def database_url(server_url: str) -> Iterator[str]:
    """A throwaway database for this test run, dropped at the end."""
    name = f"outbox_test_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = make_url(server_url).set(database=name).render_as_string(hide_password=False)
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(scope="session")
def migrated_engine(database_url: str) -> Iterator[sa.Engine]:
    from outbox import migrate
    from outbox.config import DatabaseSettings
    from outbox.db import create_engine

    engine = create_engine(DatabaseSettings(url=database_url, sslmode="disable"), pool_size=12)
    migrate.upgrade(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def engine(migrated_engine: sa.Engine) -> sa.Engine:
    """The migrated engine over empty tables."""
    with migrated_engine.begin() as conn:
        conn.execute(sa.text("TRUNCATE outbox_attempt, outbox_message RESTART IDENTITY"))
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
def _fresh_channel_registry() -> Iterator[None]:
    from outbox import channels

    saved = dict(channels._registry)
    yield
    channels._registry.clear()
    channels._registry.update(saved)
    channels._instances.clear()
