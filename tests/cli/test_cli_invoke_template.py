"""`outbox invoke` against the real template.yaml and the shipped env.local.json,
as a newcomer runs it: a local Postgres over loopback, AWS through a moto
server on 127.0.0.1. Every function of the template must run without a
warning; a channel function must deliver a live claim; overrides and the env
file must take precedence the way `sam local invoke` gives it."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result

import outbox
from outbox import store
from outbox.cli import cli
from support import EMAIL, statuses

REPO = Path(__file__).resolve().parents[2]
SENDER = "relay@example.com"  # EMAIL's sender: a verified identity in moto


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def newcomer(
    database_url: str, moto_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[dict[str, str]]:
    """The repository as the current directory and the shell a newcomer has:
    DATABASE_URL (plain postgresql://, loopback, no TLS) and the moto endpoint.
    The process environment and sys.path are restored afterwards (invoke runs
    the handler in this process)."""
    monkeypatch.chdir(REPO)
    saved_env, saved_path = dict(os.environ), list(sys.path)
    shell = {
        "DATABASE_URL": database_url.replace("postgresql+pg8000://", "postgresql://"),
        "AWS_ENDPOINT_URL": moto_endpoint,
    }
    os.environ.update(shell)
    for name in ("CHANNEL_FUNCTIONS", "DISPATCH_BUDGET_SECONDS", "LEASE_SECONDS"):
        os.environ.pop(name, None)
    yield shell
    os.environ.clear()
    os.environ.update(saved_env)
    sys.path[:] = saved_path


def run(*args: str, stdin: str | None = None) -> Result:
    return CliRunner().invoke(cli, ["invoke", *args], input=stdin)


def verified_sender(endpoint: str) -> None:
    import boto3

    boto3.client("sesv2", endpoint_url=endpoint).create_email_identity(EmailIdentity=SENDER)


def test_a_live_claim_is_delivered_with_the_templates_sender_timeout(
    newcomer: dict[str, str], engine: sa.Engine, tmp_path: Path
) -> None:
    """The channel functions' `Timeout: !Ref SenderTimeoutSeconds` must resolve
    (30 s): with Lambda's 3 s default and the 3 s settle margin every row of a
    live claim was deferred "deadline near: not started"."""
    verified_sender(newcomer["AWS_ENDPOINT_URL"])
    with engine.begin() as conn:
        ids = outbox.enqueue_many(conn, [{"channel": "email", "payload": EMAIL}] * 2)
        claims = store.claim(conn, 10, 120, ["email"])
    event = {
        "version": 1,
        "channel": "email",
        "messages": [
            {"id": c.id, "claim_token": str(c.claim_token), "attempt": c.attempt} for c in claims
        ],
    }
    (tmp_path / "live.json").write_text(json.dumps(event))
    result = run("EmailFunction", str(tmp_path / "live.json"), "--env-vars", "env.local.json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["statuses"] == {"delivered": 2}
    assert statuses(engine) == {"delivered": len(ids)}
