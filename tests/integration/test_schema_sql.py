"""store/schema.sql is the schema the migration chain creates: the file is
what `make schema` renders from the chain today, and loaded into an empty
database it gives the same schema as the migrations do (pg_dump of both)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from outbox_cli import schema

pytestmark = pytest.mark.skipif(
    shutil.which("pg_dump") is None or shutil.which("psql") is None,
    reason="needs pg_dump and psql (the PostgreSQL client) on PATH",
)


@pytest.fixture(scope="module")
def from_the_chain(server_url: str) -> str:
    """The normalised schema of a database migrated to the head."""
    if (schema.pg_dump_major() or 0) < schema.server_major(server_url):
        pytest.skip("pg_dump is older than the server: it cannot dump it")
    return schema.migrated_schema(server_url)


def load(database_url: str, sql: str) -> None:
    result = subprocess.run(
        ["psql", "--quiet", "--no-psqlrc", "-v", "ON_ERROR_STOP=1", "-f", "-"],
        input=sql,
        env={**os.environ, **schema.libpq_environment(database_url)},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


def test_schema_sql_is_what_make_schema_renders_from_the_chain(from_the_chain: str) -> None:
    committed = schema.SCHEMA_SQL.read_text()
    if schema.rendered_major(committed) != schema.pg_dump_major():
        pytest.skip(
            f"schema.sql was rendered by pg_dump {schema.rendered_major(committed)}, "
            f"this one is {schema.pg_dump_major()}: their layouts differ"
        )
    assert committed == schema.with_header(from_the_chain), (
        f"{schema.SCHEMA_SQL} is not the migration chain's head schema: run make schema"
    )


def test_loading_schema_sql_gives_the_schema_the_migrations_give(
    server_url: str, from_the_chain: str
) -> None:
    with schema.throwaway_database(server_url, "outbox_schema_sql") as url:
        # The grants name the relay's group role; a migration to the head
        # created it on this server (it is cluster-wide).
        load(url, schema.SCHEMA_SQL.read_text())
        loaded = schema.normalise(schema.dump(url), {})
    assert loaded == from_the_chain, "run make schema"
