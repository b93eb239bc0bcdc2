"""The relay's head schema as one readable file (development only).

``layers/outbox/outbox/store/schema.sql`` is what the migration chain
creates, for a reader: ``make schema`` migrates a throwaway database to the
head, dumps its schema with ``pg_dump``, removes what only a restore needs
and writes the file. tests/integration/test_schema_sql.py holds the file to
the chain. The Postgres is found as for the tests (outbox_cli.devdb):
``DATABASE_URL``, else 127.0.0.1:5432, else an embedded one.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

import sqlalchemy as sa

import outbox.store
from outbox import settings

from . import devdb

SCHEMA_SQL = Path(outbox.store.__file__).with_name("schema.sql")

# The migrations' own bookkeeping, not part of the relay's schema.
_EXCLUDED_TABLE = "outbox_alembic_version"

_HEADER = """\
-- The relay's schema at the head of its migration chain, as `outbox migrate`
-- creates it (tables, indexes, constraints, triggers, functions, grants).
-- Generated from the migrations, never edited by hand: after adding a
-- migration, run `make schema`. The reasons behind each object are in the
-- migrations (layers/outbox/outbox/migrations/versions/), in chain order.
-- For reading (it loads into an empty database, but deployments are
-- created and upgraded by `outbox migrate`).
-- Roles are shown with their default names (the settings OUTBOX_*_ROLE),
-- the objects in the schema public (the migrator's first on its search_path).
-- The history's day partitions (outbox_message_resolved_pYYYYMMDD, one a
-- UTC day) are left out: the relay makes them as days pass.
-- Rendered by pg_dump {major}.
"""

# pg_dump's lines that only a restore needs: its session settings (named, so
# that a function body's own SET is never taken for one), its banner, and
# psql's \restrict guard (a random key on every dump since 15.14).
_RESTORE_ONLY = re.compile(
    r"^(SET (statement_timeout|lock_timeout|idle_in_transaction_session_timeout|"
    r"client_encoding|standard_conforming_strings|xmloption|"
    r"client_min_messages|row_security|default_tablespace|default_table_access_method) = "
    r"|SELECT pg_catalog\.set_config\('search_path', '', false\);$"
    r"|\\(un)?restrict |-- Dumped (from|by) |-- PostgreSQL database dump|--$)"
)
# The one setting kept, so that the file loads as it is.
_UNCHECKED_BODIES = "SET check_function_bodies = false;"
_UNCHECKED_BODIES_WHY = (
    "-- The functions come in name order, some before the ones they call: their\n"
    "-- bodies are checked when first called rather than when created.\n"
)
# The header pg_dump writes above each object, three lines; kept as one.
_OBJECT_HEADER = re.compile(
    r"^--\n-- (?P<what>Name: [^\n]*?)(; Schema: [^;\n]*)?(; Owner: [^\n]*)?\n--$", re.MULTILINE
)


def pg_dump_major() -> int | None:
    """The major version of the pg_dump on PATH; None when there is none."""
    pg_dump = shutil.which("pg_dump")
    if pg_dump is None:
        return None
    version = subprocess.run([pg_dump, "--version"], capture_output=True, text=True, check=True)
    match = re.search(r"\b(\d+)(\.\d+)*\b", version.stdout)
    return int(match.group(1)) if match else None


def server_major(database_url: str) -> int:
    engine = sa.create_engine(devdb.pg8000_url(database_url))
    try:
        with engine.connect() as conn:
            return int(conn.execute(sa.text("SHOW server_version_num")).scalar_one()) // 10000
    finally:
        engine.dispose()


def libpq_environment(database_url: str) -> dict[str, str]:
    """The PG* variables that point pg_dump and psql at ``database_url``."""
    url = sa.engine.make_url(database_url)
    env = {"PGDATABASE": url.database or "postgres", "PGUSER": url.username or "postgres"}
    if url.password is not None:
        env["PGPASSWORD"] = str(url.password)
    socket_file = url.query.get("unix_sock")
    if isinstance(socket_file, str):  # pg8000 takes the socket file; libpq its folder and port
        folder, name = os.path.split(socket_file)
        env.update(PGHOST=folder, PGPORT=name.rsplit(".", 1)[-1])
    else:
        env.update(PGHOST=url.host or "127.0.0.1", PGPORT=str(url.port or 5432))
    return env


def dump(database_url: str) -> str:
    """The database's schema as pg_dump writes it: no owners, no data."""
    result = subprocess.run(
        [
            "pg_dump",
            "--schema-only",
            "--no-owner",
            f"--exclude-table={_EXCLUDED_TABLE}",
            # the history's day partitions: made by the relay as days pass
            "--exclude-table=outbox_message_resolved_p*",
        ],
        env={**os.environ, **libpq_environment(database_url)},
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise RuntimeError(f"pg_dump failed: {result.stderr.strip()}")
    return result.stdout


def normalise(dumped: str, roles: Mapping[str, str]) -> str:
    """The dump for a reader: without what only a restore needs, and each role
    renamed as ``roles`` maps it (:func:`role_defaults`). Names stay qualified
    as pg_dump writes them: a function may name its schema on purpose."""
    text = _OBJECT_HEADER.sub(r"-- \g<what>", dumped)
    lines = [line for line in text.splitlines() if not _RESTORE_ONLY.match(line)]
    text = "\n".join(lines)
    text = text.replace(_UNCHECKED_BODIES, _UNCHECKED_BODIES_WHY + _UNCHECKED_BODIES, 1)
    for name, default in roles.items():
        text = re.sub(rf"\b{name}\b", default, text)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def role_defaults(env: Mapping[str, str]) -> dict[str, str]:
    """The roles the migrations create or grant to, as ``env`` names them,
    each mapped to its default name, where the two differ."""
    roles = (s for s in settings.SETTINGS if s.name.endswith("_ROLE"))
    return {s.read(env): s.default for s in roles if s.read(env) != s.default}


@contextlib.contextmanager
def throwaway_database(server_url: str, prefix: str) -> Iterator[str]:
    """A new empty database on the server; its URL. Dropped afterwards."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    url = devdb.recreate_database(server_url, name)
    try:
        yield url
    finally:
        devdb.drop_database(server_url, name)


def migrated_schema(server_url: str) -> str:
    """The normalised schema of a database migrated to the head, with the
    production defaults (no ``delivered`` outcome event)."""
    from outbox import migrate
    from outbox.db import create_engine
    from outbox.relay_settings import DatabaseSettings

    with throwaway_database(server_url, "outbox_schema") as url:
        engine = create_engine(DatabaseSettings(url=url, sslmode="disable"))
        try:
            migrate.upgrade(
                engine,
                delivered_events=settings.OUTCOME_EVENTS_DELIVERED.default,
                retrying_events=settings.OUTCOME_EVENTS_RETRYING.default,
            )
        finally:
            engine.dispose()
        return normalise(dump(url), role_defaults(os.environ))


def with_header(migrated: str) -> str:
    """The text of schema.sql: its header, then the migrated schema."""
    return _HEADER.format(major=pg_dump_major()) + "\n" + migrated


def render(server_url: str) -> str:
    return with_header(migrated_schema(server_url))


def rendered_major(text: str) -> int | None:
    """The pg_dump major version a schema.sql was rendered by."""
    match = re.search(r"^-- Rendered by pg_dump (\d+)\.$", text, re.MULTILINE)
    return int(match.group(1)) if match else None


def main() -> None:
    if pg_dump_major() is None:
        sys.exit("make schema needs pg_dump (the PostgreSQL client) on PATH")
    explicit = os.environ.get("DATABASE_URL")
    if explicit:
        SCHEMA_SQL.write_text(render(devdb.pg8000_url(explicit)))
    elif devdb.answers(devdb.LOCAL_POSTGRES):
        SCHEMA_SQL.write_text(render(devdb.pg8000_url(devdb.LOCAL_POSTGRES)))
    else:
        with tempfile.TemporaryDirectory() as pgdata, devdb.embedded(Path(pgdata)) as url:
            SCHEMA_SQL.write_text(render(url))
    print(f"wrote {SCHEMA_SQL}")


if __name__ == "__main__":
    main()
