"""Finding a Postgres for local runs and the tests (development only).

``DATABASE_URL`` when set; else the Postgres on 127.0.0.1:5432 when it
answers; else an embedded one (the ``pgserver`` package, a dev extra) in a
folder of its own. Shared by ``make run`` (outbox.local) and tests/conftest.py.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path

import sqlalchemy as sa

LOCAL_POSTGRES = "postgresql://postgres@127.0.0.1:5432/test"


def pg8000_url(url: str) -> str:
    """The URL with the pg8000 driver named (``postgresql://`` means psycopg2)."""
    parsed = sa.engine.make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+pg8000")
    return parsed.render_as_string(hide_password=False)


def answers(url: str, timeout: float = 2.0) -> bool:
    """Whether a Postgres accepts a connection at ``url``."""
    engine = sa.create_engine(
        pg8000_url(url), connect_args={"timeout": timeout}, hide_parameters=True
    )
    try:
        with engine.connect():
            return True
    except Exception:
        return False
    finally:
        engine.dispose()


@contextlib.contextmanager
def embedded(pgdata: Path) -> Iterator[str]:
    """Start an embedded Postgres in ``pgdata``; yields its server URL (unix socket)."""
    pgdata.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs: XDG_RUNTIME_DIR unset in containers
        import pgserver

        server = pgserver.get_server(pgdata, cleanup_mode="stop")
    try:
        info = server.get_postmaster_info()
        if info.socket_dir is not None:
            # pg8000 takes the socket file itself, not libpq's ?host=<dir>.
            sock = Path(info.socket_dir) / f".s.PGSQL.{info.port}"
            yield f"postgresql+pg8000://postgres@/postgres?unix_sock={sock}"
        else:
            yield pg8000_url(server.get_uri())
    finally:
        server.cleanup()


def _admin(server_url: str) -> sa.Engine:
    return sa.create_engine(
        pg8000_url(server_url), isolation_level="AUTOCOMMIT", hide_parameters=True
    )


def _quoted(name: str) -> str:
    if not name.replace("_", "").isalnum():
        raise ValueError(f"database name {name!r}: letters, digits and _ only")
    return f'"{name}"'


def recreate_database(server_url: str, name: str) -> str:
    """Drop (if there) and create database ``name``; returns its URL."""
    admin = _admin(server_url)
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS {_quoted(name)} WITH (FORCE)"))
            conn.execute(sa.text(f"CREATE DATABASE {_quoted(name)}"))
    finally:
        admin.dispose()
    url = sa.engine.make_url(pg8000_url(server_url)).set(database=name)
    return url.render_as_string(hide_password=False)


def drop_database(server_url: str, name: str) -> None:
    admin = _admin(server_url)
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS {_quoted(name)} WITH (FORCE)"))
    finally:
        admin.dispose()
