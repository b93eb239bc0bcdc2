"""The smaller gaps found in review, each reproduced: SSRF guard
errors that echoed URL secrets, full-width and ideographic host spellings,
CR/LF in an email subject, ``enqueue_many`` given a non-list, ``outbox show``
of a row too deep to decode, malformed ``DATABASE_URL`` values, and ids
beyond bigint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

import outbox
from outbox import netguard, sender
from outbox.errors import ConfigError, ValidationError
from outbox.handoff import HandOff
from outbox.relay_settings import DatabaseSettings
from outbox_cli.cli import cli
from support import EMAIL, settings

SECRET = "hunter2-TOKEN"


def count_rows(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM outbox_message")).scalar_one())


@pytest.mark.parametrize(
    "url",
    [
        f"https://alice:{SECRET}@hooks.example.com/in",
        f"https://alice:{SECRET}/in",  # no @: the "port" is the password
        f"https://hooks.example.com:{SECRET}/in",
        f"https://alice:{SECRET}@hooks.example.com:99x/in",
        f"https://alice:{SECRET}@[::1/in",
        f"http://alice:{SECRET}@hooks.example.com/in",
        f"https://alice:{SECRET}@hooks.example.com/in#frag",
    ],
)
def test_ssrf_guard_errors_never_echo_the_url(engine: sa.Engine, url: str) -> None:
    for check in (netguard.check_url, netguard.resolve):
        with pytest.raises(netguard.ForbiddenDestination) as caught:
            check(url)
        assert SECRET not in str(caught.value) and "alice" not in str(caught.value)
    with engine.begin() as conn, pytest.raises(ValidationError) as refused:
        outbox.enqueue(conn, "webhook", {"url": url, "event_type": "t", "body": {}})
    assert refused.value.field == "payload.url"
    assert SECRET not in str(refused.value)
    assert count_rows(engine) == 0


def full_width(text: str) -> str:
    """ASCII as full-width forms: "127" -> U+FF11 U+FF12 U+FF17."""
    return "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in text)


IDEOGRAPHIC_STOP, FULL_WIDTH_STOP = "\u3002", "\uff0e"


@pytest.mark.parametrize(
    "host",
    [
        full_width("127.0.0.1"),  # full-width digits and full stops
        "127.0.0.1".replace(".", IDEOGRAPHIC_STOP),
        "127.0.0.1".replace(".", FULL_WIDTH_STOP),
        full_width("169.254.169.254"),  # the metadata address
        full_width("10.0.0.7"),
        full_width("0x7f.1"),  # a hex spelling
    ],
)
def test_full_width_and_ideographic_host_spellings_are_refused_at_enqueue(
    engine: sa.Engine, host: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WEBHOOK_ALLOW_INSECURE", raising=False)
    with engine.begin() as conn, pytest.raises(ValidationError) as caught:
        outbox.enqueue(
            conn, "webhook", {"url": f"https://{host}/in", "event_type": "t", "body": {}}
        )
    assert caught.value.field == "payload.url"
    assert count_rows(engine) == 0


def test_a_unicode_host_name_is_checked_and_connected_to_in_its_idna_form() -> None:
    target = netguard.resolve(
        f"https://{full_width('example')}.com/in", resolver=lambda host, port: ["93.184.215.14"]
    )
    assert target.hostname == "example.com"


@pytest.mark.parametrize("subject", ["Hi\r\nBcc: everyone@example.org", "Hi\nthere", "Hi\r"])
def test_an_email_subject_with_cr_or_lf_is_refused(engine: sa.Engine, subject: str) -> None:
    with engine.begin() as conn, pytest.raises(ValidationError) as caught:
        outbox.enqueue(conn, "email", {**EMAIL, "subject": subject})
    assert caught.value.field == "payload.subject"
    assert count_rows(engine) == 0


@pytest.mark.parametrize("messages", [5, None, "email", b"x", {"channel": "email"}])
def test_enqueue_many_of_something_that_is_not_a_list_is_a_field_error(
    engine: sa.Engine, messages: Any
) -> None:
    with engine.begin() as conn, pytest.raises(ValidationError) as caught:
        outbox.enqueue_many(conn, messages)
    assert caught.value.field == "messages"
    assert count_rows(engine) == 0


def test_outbox_show_of_a_row_too_deep_to_decode_prints_it_without_a_traceback(
    engine: sa.Engine, database_url: str
) -> None:
    deep = '{"n": ' + "[" * 5000 + "]" * 5000 + "}"
    with engine.begin() as conn:
        message_id = conn.execute(
            sa.text(
                "INSERT INTO outbox_message (channel, payload) VALUES ('email', CAST(:p AS jsonb)) "
                "RETURNING id"
            ),
            {"p": deep},
        ).scalar_one()
    runner = CliRunner()
    env = {"DATABASE_URL": database_url}
    table = runner.invoke(cli, ["show", str(message_id)], env=env)
    as_json = runner.invoke(cli, ["show", str(message_id), "--json"], env=env)
    for result in (table, as_json):
        assert result.exit_code == 0, result.output
        assert result.exception is None and "Traceback" not in result.output
    assert "[[[[" in table.stdout
    stored = json.loads(as_json.stdout)["message"]["payload"]
    assert stored.replace(" ", "") == deep.replace(" ", "")  # the stored text, as it is


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql://relay:{SECRET}@db.internal:notaport/outbox",
        f"postgresql://relay:{SECRET}@[::1/outbox",
        f"postgresql://relay:{SECRET}@db.internal:99999/outbox",
        "not a url",
        f"mysql://relay:{SECRET}@db.internal/outbox",
    ],
)
def test_a_malformed_database_url_is_one_error_line(url: str) -> None:
    with pytest.raises(ConfigError) as caught:
        DatabaseSettings.from_env({"DATABASE_URL": url})
    assert caught.value.setting == "DATABASE_URL" and SECRET not in str(caught.value)
    done = subprocess.run(
        [sys.executable, "-m", "outbox_cli", "status"],
        env={**os.environ, "DATABASE_URL": url},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode != 0
    assert len(lines) == 1 and lines[0].startswith("Error: configuration DATABASE_URL"), done.stderr
    assert SECRET not in done.stderr + done.stdout


@pytest.mark.parametrize("message_id", [2**63, 10**30])
def test_ids_beyond_bigint_are_field_errors(
    engine: sa.Engine, database_url: str, message_id: int
) -> None:
    event = {
        "version": 1,
        "channel": "email",
        "messages": [{"id": message_id, "claim_token": str(uuid.uuid4()), "attempt": 1}],
    }
    with pytest.raises(ValidationError) as caught:
        HandOff.from_event(event)
    assert caught.value.field == "event.messages[0].id"
    with pytest.raises(ValidationError):
        sender.run(engine, event, settings(), lambda: 30.0, channel_name="email")
    big_attempt = {**event, "messages": [{**event["messages"][0], "id": 1, "attempt": 2**31}]}
    with pytest.raises(ValidationError) as caught:
        HandOff.from_event(big_attempt)
    assert caught.value.field == "event.messages[0].attempt"
    result = CliRunner().invoke(cli, ["show", str(message_id)], env={"DATABASE_URL": database_url})
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert [line for line in result.stderr.splitlines() if line.strip()] == [
        f"Error: message ids are positive integers up to {2**63 - 1}, got {message_id}"
    ]
