"""`outbox migrate --sql` and `--check` against real databases: the printed
script is the migration (run by Postgres, it makes the schema), and the
check's exit status follows the database's revision."""

from __future__ import annotations

import json
import uuid

import sqlalchemy as sa
from click.testing import CliRunner, Result

from outbox import migrate
from outbox_cli.cli import cli

HEAD = migrate.head()


def outbox_cmd(url: str, *args: str) -> Result:
    return CliRunner().invoke(cli, list(args), env={"DATABASE_URL": url})


def run_script(engine: sa.Engine, script: str) -> None:
    """The printed script, run as psql -f would: one simple query."""
    with engine.connect() as conn:
        raw = conn.connection.dbapi_connection
        assert raw is not None
        raw.execute_simple(script)  # type: ignore[attr-defined]
        raw.commit()


def test_check_fails_on_an_empty_database_and_sql_prints_a_script_that_makes_the_schema(
    empty_database: tuple[str, sa.Engine],
) -> None:
    url, engine = empty_database
    check = outbox_cmd(url, "migrate", "--check")
    assert check.exit_code == 1
    assert f"{len(migrate.pending(None))} revision(s) behind {HEAD}" in check.output

    printed = outbox_cmd(url, "migrate", "--sql")
    assert printed.exit_code == 0, printed.output
    assert "CREATE TABLE outbox_message" in printed.output
    assert migrate.current(engine) is None  # printing ran nothing

    run_script(engine, printed.output)
    assert migrate.current(engine) == HEAD
    with engine.connect() as conn:
        key = conn.execute(sa.text("SELECT length(key) FROM outbox_fingerprint_key")).scalar()
    assert key == 32
    made = set(sa.inspect(engine).get_table_names())
    assert {t for t in made if not migrate.HISTORY_PARTITION.fullmatch(t)} == migrate.RELAY_TABLES
    assert all(migrate.is_relay_table(t) for t in made)
    current = outbox_cmd(url, "migrate", "--check")
    assert current.exit_code == 0, current.output
    assert f"schema at revision {HEAD}: current" in current.output


def test_sql_starts_from_the_databases_revision(empty_database: tuple[str, sa.Engine]) -> None:
    url, engine = empty_database
    migrate.upgrade(engine, "0003")
    check = outbox_cmd(url, "migrate", "--check", "--json")
    assert check.exit_code == 1
    assert json.loads(check.output) == {
        "revision": "0003",
        "head": HEAD,
        "behind": len(migrate.pending("0003")),
    }
    printed = outbox_cmd(url, "migrate", "--sql")
    assert printed.exit_code == 0, printed.output
    assert "CREATE TABLE outbox_message (\n" not in printed.output  # 0001 to 0003 are applied
    assert "CREATE TABLE outbox_dedupe" in printed.output  # 0006, which comes next, is not
    # The installation's fingerprint key is drawn by the database, never printed.
    assert "INSERT INTO outbox_fingerprint_key (key) VALUES (decode(" in printed.output
    assert migrate.current(engine) == "0003"
    run_script(engine, printed.output)
    assert outbox_cmd(url, "migrate", "--check").exit_code == 0


def test_sql_on_a_current_schema_has_nothing_to_run(
    empty_database: tuple[str, sa.Engine],
) -> None:
    url, engine = empty_database
    migrate.upgrade(engine)
    printed = outbox_cmd(url, "migrate", "--sql")
    assert printed.exit_code == 0
    assert printed.output.strip() == f"-- the schema is at revision {HEAD}: nothing to run"


def test_sql_and_check_together_are_refused(empty_database: tuple[str, sa.Engine]) -> None:
    url, _ = empty_database
    result = outbox_cmd(url, "migrate", "--sql", "--check")
    assert result.exit_code == 2


def test_a_revision_this_release_does_not_know_is_one_line(
    empty_database: tuple[str, sa.Engine],
) -> None:
    url, engine = empty_database
    migrate.upgrade(engine)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE outbox_alembic_version SET version_num = '9999'"))
    for flag in ("--check", "--sql"):
        result = outbox_cmd(url, "migrate", flag, "--json")
        assert result.exit_code == 1
        error = json.loads(result.stdout)["error"]
        assert error["kind"] == "schema_unknown" and "9999" in error["message"]


def test_a_schema_others_may_create_in_is_refused_then_fixed_with_fix(
    empty_database: tuple[str, sa.Engine],
) -> None:
    """PostgreSQL 14's default (PUBLIC has CREATE on public), reproduced with a
    grant: migrate refuses, changes nothing, and says how to mend it; --fix
    revokes it from PUBLIC and from any other role, then migrates."""
    url, engine = empty_database
    role = f"neighbour_{uuid.uuid4().hex[:8]}"
    with engine.begin() as conn:
        conn.execute(sa.text("GRANT CREATE ON SCHEMA public TO PUBLIC"))
        conn.execute(sa.text(f"CREATE ROLE {role}"))
        conn.execute(sa.text(f"GRANT CREATE ON SCHEMA public TO {role}"))
    try:
        refused = outbox_cmd(url, "migrate")
        assert refused.exit_code == 2
        assert "lets PUBLIC, " + role + " create objects in it" in refused.output
        assert "outbox migrate --fix" in refused.output
        assert len(refused.output.strip().splitlines()) == 1
        as_json = outbox_cmd(url, "migrate", "--json")
        assert as_json.exit_code == 2
        assert json.loads(as_json.output)["error"]["kind"] == "schema_unsafe"
        assert migrate.current(engine) is None  # nothing was made

        fixed = outbox_cmd(url, "migrate", "--fix")
        assert fixed.exit_code == 0, fixed.output
        assert f"revoked CREATE on the schema from PUBLIC, {role}" in fixed.output
        assert migrate.current(engine) == HEAD
        with engine.connect() as conn:
            for who in ("public", role):
                assert not conn.execute(
                    sa.text("SELECT has_schema_privilege(:r, 'public', 'CREATE')"), {"r": who}
                ).scalar_one()
        again = outbox_cmd(url, "migrate")  # and it stays fixed
        assert again.exit_code == 0, again.output
    finally:
        with engine.begin() as conn:
            conn.execute(sa.text(f"REVOKE ALL ON SCHEMA public FROM {role}"))
            conn.execute(sa.text(f"DROP ROLE {role}"))
