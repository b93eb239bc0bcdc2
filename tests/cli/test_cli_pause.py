"""`outbox pause` / `outbox resume` against the real Postgres, and the pause
shown by `outbox status`."""

from __future__ import annotations

import json
from typing import Any

import pytest
import sqlalchemy as sa

import outbox
from outbox import store
from support import EMAIL


def paused(engine: sa.Engine) -> dict[str, str | None]:
    with engine.connect() as conn:
        return {p.channel: p.reason for p in store.paused_channels(conn)}


def test_pause_then_resume(run: Any, engine: sa.Engine) -> None:
    result = run("pause", "email", "--reason", "SES account under review")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "channel email paused"
    assert paused(engine) == {"email": "SES account under review"}

    again = run("pause", "email", "--json")
    assert json.loads(again.stdout) == {"channel": "email", "paused": True, "changed": False}
    assert paused(engine) == {"email": "SES account under review"}

    resumed = run("resume", "email")
    assert resumed.exit_code == 0 and resumed.stdout.strip() == "channel email resumed"
    assert paused(engine) == {}
    not_paused = run("resume", "email", "--json")
    assert not_paused.exit_code == 0
    assert json.loads(not_paused.stdout) == {"channel": "email", "paused": False, "changed": False}


def test_status_shows_paused_channels(run: Any, engine: sa.Engine) -> None:
    with engine.begin() as conn:
        outbox.enqueue(conn, "email", EMAIL)
    assert run("pause", "email", "--reason", "provider incident").exit_code == 0
    text = run("status")
    assert text.exit_code == 0, text.output
    assert "channel email is PAUSED since" in text.stdout
    assert "provider incident" in text.stdout
    data = json.loads(run("status", "--json").stdout)
    [entry] = data["paused_channels"]
    assert (entry["channel"], entry["reason"]) == ("email", "provider incident")
    assert data["pending"] == 1
    run("resume", "email")
    assert json.loads(run("status", "--json").stdout)["paused_channels"] == []
    assert "PAUSED" not in run("status").stdout


def test_a_custom_channel_present_in_the_database_can_be_paused(
    run: Any, engine: sa.Engine
) -> None:
    with engine.begin() as conn:  # a channel this process has not registered
        conn.execute(
            sa.text("INSERT INTO outbox_message (channel, payload) VALUES ('slack', '{}')")
        )
    result = run("pause", "slack")
    assert result.exit_code == 0, result.output
    assert paused(engine) == {"slack": None}


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("pause", "emial"), "unknown channel 'emial'"),
        (("pause", "Email"), "not a channel name"),
        (("pause", "x;DROP TABLE outbox_message"), "not a channel name"),
        (("resume", "BAD NAME"), "not a channel name"),
        (("pause",), "Missing argument"),
    ],
)
def test_bad_channels_are_refused_and_change_nothing(
    run: Any, engine: sa.Engine, args: tuple[str, ...], fragment: str
) -> None:
    result = run(*args)
    assert result.exit_code == 2, result.output
    assert fragment in result.stderr
    assert result.stderr.startswith("Error: ")
    assert paused(engine) == {}


def test_status_shows_a_quota_pause_and_the_destinations_that_throttled(
    run: Any, engine: sa.Engine
) -> None:
    with engine.begin() as conn:
        store.record_throttling(conn, "email", {}, ("quota: daily quota exceeded", 3600))
        store.record_throttling(
            conn, "webhook", {"hooks.example.com\x1b[2J": store.Throttled(30, 2, 10)}
        )
    text = run("status")
    assert text.exit_code == 0, text.output
    assert "channel email is PAUSED since" in text.stdout
    assert "quota: daily quota exceeded until" in text.stdout
    assert "(or outbox resume email)" in text.stdout
    assert "hooks.example.com" in text.stdout and "\x1b" not in text.stdout  # inert
    data = json.loads(run("status", "--json").stdout)
    [pause] = data["paused_channels"]
    assert pause["reason"] == "quota: daily quota exceeded" and pause["paused_until"]
    [destination] = data["destinations"]
    assert destination["destination"] == "hooks.example.com\x1b[2J"  # --json: exact
    assert (destination["throttled_last_minute"], destination["throttled_total"]) == (2, 2)
    assert destination["rate_per_second"] == pytest.approx(8.0, rel=0.2)
    assert destination["paused_until"]
