"""The database URL as users write it: any SQLAlchemy Postgres spelling (the
CLI connects with its own driver, pg8000), libpq's sslmode and sslrootcert,
and --database-url before or after the command."""

from __future__ import annotations

import json
import ssl
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result
from sqlalchemy.engine import make_url

import outbox
from outbox.db import create_engine, parse_database_url
from outbox.errors import ConfigError
from outbox.relay_settings import DatabaseSettings
from outbox_cli.cli import cli
from support import EMAIL

SPELLINGS = [
    "postgresql",
    "postgres",
    "postgresql+psycopg",
    "postgresql+psycopg2",
    "postgresql+pg8000",
]


def spelled(database_url: str, drivername: str, **query: str) -> str:
    url = make_url(database_url).set(drivername="postgresql").update_query_dict(query)
    text = url.render_as_string(hide_password=False)
    return text.replace("postgresql://", f"{drivername}://", 1)


def run(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(cli, list(args), env={"DATABASE_URL": "", **(env or {})})


@pytest.mark.parametrize("drivername", SPELLINGS)
def test_every_spelling_connects_with_pg8000(
    engine: sa.Engine, database_url: str, drivername: str
) -> None:
    """psycopg and psycopg2 are not installed here: a URL naming them works
    only because the CLI rewrites the driver."""
    with engine.begin() as conn:
        outbox.enqueue(conn, "email", EMAIL)
    url = spelled(database_url, drivername, sslmode="disable")
    result = run("status", "--json", env={"DATABASE_URL": url})
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["pending"] == 1


def test_database_url_is_accepted_after_the_command(engine: sa.Engine, database_url: str) -> None:
    after = run("status", "--database-url", database_url, "--json")
    before = run("--database-url", database_url, "status", "--json")
    assert after.exit_code == before.exit_code == 0, after.output
    assert json.loads(after.stdout) == json.loads(before.stdout)
    # After the command it wins over one given before it.
    both = run(
        "--database-url",
        "postgresql://nobody@127.0.0.1:9/x",
        "status",
        "--database-url",
        database_url,
        "--json",
    )
    assert both.exit_code == 0, both.output
    assert "--database-url URL" in run("status", "--help").output


@pytest.mark.parametrize("mode", ["prefer", "allow", "bogus"])
def test_an_sslmode_that_cannot_be_honoured_is_one_line(database_url: str, mode: str) -> None:
    url = spelled(database_url, "postgresql", sslmode=mode)
    result = run("status", "--json", env={"DATABASE_URL": url})
    assert result.exit_code == 2
    error = json.loads(result.stdout)["error"]
    assert error["kind"] == "config"
    assert f"sslmode={mode} cannot be honoured" in error["message"]
    assert "password" not in error["message"] and "127.0.0.1" not in error["message"]


def test_an_unknown_query_argument_is_refused(database_url: str) -> None:
    result = run(
        "status", env={"DATABASE_URL": spelled(database_url, "postgresql", gssencmode="x")}
    )
    assert result.exit_code == 2
    assert "'gssencmode'" in result.output and "Traceback" not in result.output


def test_parsing_keeps_everything_but_the_driver_and_the_tls_arguments() -> None:
    parsed = parse_database_url(
        "postgresql+psycopg://app:s3cret@db.internal:6432/orders"
        "?sslmode=verify-ca&sslrootcert=/etc/rds.pem"
    )
    assert parsed.url.render_as_string(hide_password=False) == (
        "postgresql+pg8000://app:s3cret@db.internal:6432/orders"
    )
    assert (parsed.sslmode, parsed.sslrootcert) == ("verify-ca", "/etc/rds.pem")
    # pg8000's own socket path (the embedded Postgres's URL) passes through.
    socket = parse_database_url("postgresql://postgres@/db?unix_sock=/tmp/pg/.s.PGSQL.5432")
    assert socket.url.query == {"unix_sock": "/tmp/pg/.s.PGSQL.5432"}
    with pytest.raises(ConfigError, match="DATABASE_URL: must be a postgresql"):
        parse_database_url("mysql://app@db/orders")


def ssl_context_for(url: str) -> Any:
    """The TLS pg8000 is handed for ``url``: the engine's real connect path,
    stopped just before it opens a socket."""
    engine = create_engine(DatabaseSettings.from_env({"DATABASE_URL": url}))
    seen: dict[str, Any] = {}

    @sa.event.listens_for(engine, "do_connect")
    def _capture(dialect: Any, conn_rec: Any, cargs: Any, cparams: dict[str, Any]) -> None:
        seen.update(cparams)
        raise ConnectionAbortedError("captured")

    with pytest.raises(ConnectionAbortedError), engine.connect():
        pass
    engine.dispose()
    assert "sslmode" not in seen and "sslrootcert" not in seen
    return seen.get("ssl_context")


def test_sslmode_maps_to_pg8000s_tls(tmp_path: Any) -> None:
    from support import make_ca

    ca = make_ca(tmp_path, names=("db.internal",))
    base = "postgresql://app@db.internal:5432/orders"
    # a remote URL without sslmode: verified TLS (it used to be none)
    default = ssl_context_for(base)
    assert default is not None and default.verify_mode == ssl.CERT_REQUIRED
    assert ssl_context_for("postgresql://app@127.0.0.1:5432/orders") is None  # local: none
    assert ssl_context_for(f"{base}?sslmode=disable") is None
    require = ssl_context_for(f"{base}?sslmode=require")
    assert (require.verify_mode, require.check_hostname) == (ssl.CERT_NONE, False)
    verify_ca = ssl_context_for(f"{base}?sslmode=verify-ca&sslrootcert={ca.ca_file}")
    assert (verify_ca.verify_mode, verify_ca.check_hostname) == (ssl.CERT_REQUIRED, False)
    assert verify_ca.get_ca_certs() != []  # the sslrootcert's CA is loaded
    full = ssl_context_for(f"{base}?sslmode=verify-full&sslrootcert={ca.ca_file}")
    assert (full.verify_mode, full.check_hostname) == (ssl.CERT_REQUIRED, True)


def test_tls_asked_of_a_server_without_it_says_so(database_url: str, engine: sa.Engine) -> None:
    """sslmode=require really asks pg8000 for TLS: a server without it (the
    local one here has ssl off) refuses, and the error says what to change."""
    with engine.connect() as conn:
        if conn.exec_driver_sql("SHOW ssl").scalar() != "off":
            pytest.skip("this Postgres offers TLS")
    url = spelled(database_url, "postgresql", sslmode="require")
    result = run("status", "--json", env={"DATABASE_URL": url})
    assert result.exit_code == 1
    error = json.loads(result.stdout)["error"]
    assert error["kind"] == "database_tls_refused"
    assert "sslmode=disable" in error["message"]
