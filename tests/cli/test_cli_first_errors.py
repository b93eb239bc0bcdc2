"""The errors a new user meets first, each one line, no driver internals:
a URL without the password against a server that asks for one (and
PGPASSWORD, read as libpq reads it), a wrong password, nothing listening, a
server that accepts the connection and never answers; and what `outbox
migrate` did (created, already current, upgraded).

The password cases run against a Postgres cluster of their own with
scram-sha-256 (initdb from the system's Postgres or pgserver's), started on a
free loopback port and stopped at the end."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result
from pgcluster import Cluster, cluster, free_port

from outbox import migrate
from outbox_cli.cli import cli

PASSWORD = "first-error-pw"
NO_PASSWORD = (
    "Error: the server asks for a password and DATABASE_URL has none "
    "(set it in the URL or PGPASSWORD)"
)


@pytest.fixture(scope="module")
def password_server() -> Iterator[Cluster]:
    with cluster(PASSWORD) as server:
        yield server


def run_outbox(*args: str, **env: str) -> Result:
    env.setdefault("PGPASSWORD", "")  # never the caller's own
    return CliRunner().invoke(cli, list(args), env={"DB_SECRET_ARN": "", **env})


def one_line(result: Result, line: str, exit_code: int) -> None:
    assert result.exit_code == exit_code, result.output
    assert result.stderr.strip().splitlines() == [line], result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize("command", [["list"], ["migrate"], ["status"]])
def test_a_url_without_the_password_says_so_in_one_line(
    password_server: Cluster, command: list[str]
) -> None:
    result = run_outbox(*command, DATABASE_URL=password_server.url())
    one_line(result, NO_PASSWORD, 2)
    as_json = run_outbox(*command, "--json", DATABASE_URL=password_server.url())
    assert as_json.exit_code == 2
    assert json.loads(as_json.stdout)["error"] == {
        "kind": "database_password_missing",
        "message": NO_PASSWORD.removeprefix("Error: "),
    }


def test_pgpassword_is_read_when_the_url_has_no_password(password_server: Cluster) -> None:
    result = run_outbox(
        "migrate", "--check", DATABASE_URL=password_server.url(), PGPASSWORD=PASSWORD
    )
    # connected: the check's own answer (the cluster's database has no schema)
    assert result.exit_code == 1, result.output
    assert "revision(s) behind" in result.output
    # The URL's own password wins over PGPASSWORD, as in libpq.
    url = password_server.url(password=PASSWORD)
    assert run_outbox("migrate", "--check", DATABASE_URL=url, PGPASSWORD="wrong").exit_code == 1


def test_a_wrong_password_is_a_refused_login(password_server: Cluster) -> None:
    for env in (
        {"DATABASE_URL": password_server.url(password="wrong-pw")},
        {"DATABASE_URL": password_server.url(), "PGPASSWORD": "wrong-pw"},
    ):
        result = run_outbox("list", **env)
        one_line(
            result,
            'Error: the database refused the login: password authentication failed for user "postgres"',
            1,
        )
        assert "wrong-pw" not in result.output


def test_nothing_listening_is_said_with_its_address() -> None:
    port = free_port()
    url = f"postgresql://postgres@127.0.0.1:{port}/postgres"
    one_line(
        run_outbox("list", DATABASE_URL=url),
        f"Error: cannot reach the database: nothing is listening at 127.0.0.1:{port}",
        1,
    )


def test_a_server_that_never_answers_is_a_timeout() -> None:
    with socket.socket() as silent:  # accepts connections (the kernel does) and says nothing
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        url = f"postgresql://postgres@127.0.0.1:{port}/postgres"
        result = run_outbox("list", DATABASE_URL=url, DB_CONNECT_TIMEOUT="1")
    one_line(
        result,
        f"Error: cannot reach the database: no answer from 127.0.0.1:{port} within 1 s "
        "(DB_CONNECT_TIMEOUT)",
        1,
    )


def test_migrate_says_what_it_did(empty_database: tuple[str, sa.Engine]) -> None:
    url, engine = empty_database
    head = migrate.head()
    steps = migrate.pending(None)
    created = run_outbox("migrate", DATABASE_URL=url)
    assert created.exit_code == 0, created.output
    assert created.stdout == f"schema created at revision {head}\n"
    again = run_outbox("migrate", DATABASE_URL=url)
    assert again.stdout == f"already at revision {head}\n"
    assert json.loads(run_outbox("migrate", "--json", DATABASE_URL=url).stdout) == {
        "revision": head,
        "previous": head,
    }
    migrate.downgrade(engine, steps[-3])
    upgraded = run_outbox("migrate", DATABASE_URL=url)
    assert upgraded.stdout == f"upgraded from {steps[-3]} to {head}\n"
