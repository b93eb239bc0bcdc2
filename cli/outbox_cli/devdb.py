"""Finding a Postgres for local runs and the tests (development only).

``DATABASE_URL`` when set; else the Postgres on 127.0.0.1:5432 when it
answers; else an embedded one (the ``pgserver`` package, the ``local`` extra)
in a folder of its own. ``OUTBOX_DEV_DB`` (``local``, ``embedded`` or ``url``)
forces one. Shared by ``make run`` (outbox_cli.local) and tests/conftest.py.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path

import sqlalchemy as sa

LOCAL_POSTGRES = "postgresql://postgres@127.0.0.1:5432/test"

# One switch for `make run` and `make test`. The two names it replaces still
# work, with a line saying so.
DEV_DB_VARIABLE = "OUTBOX_DEV_DB"
DEPRECATED_DEV_DB_VARIABLES = ("OUTBOX_LOCAL_DB", "OUTBOX_TEST_DB")
DEV_DB_CHOICES = ("local", "embedded", "url")

# The comment `make run` puts on the databases it makes: it drops a database
# only when it carries this, so a database of the same name that someone else
# made is never touched.
OWN_DATABASE_MARKER = "made by outbox-relay make run; the next run drops and recreates it"
OBJECT_IN_USE = "55006"


def dev_db_choice(env: Mapping[str, str] | None = None) -> str:
    """``OUTBOX_DEV_DB``: ``local``, ``embedded`` or ``url``; "" lets the caller pick.

    Raises ValueError for any other value."""
    env = os.environ if env is None else env
    value = env.get(DEV_DB_VARIABLE)
    if value is None:
        for old in DEPRECATED_DEV_DB_VARIABLES:
            if env.get(old):
                value = env[old]
                sys.stderr.write(
                    f"note: {old} is deprecated: use {DEV_DB_VARIABLE}={value.strip()}\n"
                )
                break
    choice = (value or "").strip().lower()
    if choice not in ("", *DEV_DB_CHOICES):
        raise ValueError(f"{DEV_DB_VARIABLE} must be local, embedded or url, not {choice!r}")
    return choice


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


class NotOwnDatabase(Exception):
    """A database of the wanted name exists and was not made by us: left alone."""


class DatabaseInUse(Exception):
    """Our database of the wanted name has sessions (another run?): left alone."""


def recreate_own_database(server_url: str, name: str) -> str:
    """Make database ``name`` afresh, marked as ours; returns its URL.

    A database of that name is dropped first only when it carries the marker
    (an earlier run made it), and without FORCE, so that nobody's session is
    cut: NotOwnDatabase or DatabaseInUse otherwise, and it stays as it was."""
    admin = _admin(server_url)
    try:
        with admin.connect() as conn:
            found = conn.execute(
                sa.text(
                    "SELECT shobj_description(oid, 'pg_database') FROM pg_database "
                    "WHERE datname = :name"
                ),
                {"name": name},
            ).first()
            if found is not None:
                if found[0] != OWN_DATABASE_MARKER:
                    raise NotOwnDatabase(name)
                try:
                    conn.execute(sa.text(f"DROP DATABASE {_quoted(name)}"))
                except sa.exc.DBAPIError as exc:
                    if _sqlstate(exc) == OBJECT_IN_USE:
                        raise DatabaseInUse(name) from None
                    raise
            conn.execute(sa.text(f"CREATE DATABASE {_quoted(name)}"))
            # A utility statement takes no parameters; the marker is a constant.
            conn.execute(sa.text(f"COMMENT ON DATABASE {_quoted(name)} IS '{OWN_DATABASE_MARKER}'"))
    finally:
        admin.dispose()
    return _database_url(server_url, name)


def _sqlstate(exc: sa.exc.DBAPIError) -> str:
    fields = exc.orig.args[0] if exc.orig is not None and exc.orig.args else None
    return str(fields.get("C", "")) if isinstance(fields, dict) else ""


def _database_url(server_url: str, name: str) -> str:
    url = sa.engine.make_url(pg8000_url(server_url)).set(database=name)
    return url.render_as_string(hide_password=False)


def recreate_database(server_url: str, name: str) -> str:
    """Drop (if there) and create database ``name``; returns its URL. For the
    tests' throwaway databases, whose names are random."""
    admin = _admin(server_url)
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS {_quoted(name)} WITH (FORCE)"))
            conn.execute(sa.text(f"CREATE DATABASE {_quoted(name)}"))
    finally:
        admin.dispose()
    return _database_url(server_url, name)


def drop_database(server_url: str, name: str) -> None:
    admin = _admin(server_url)
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS {_quoted(name)} WITH (FORCE)"))
    finally:
        admin.dispose()
