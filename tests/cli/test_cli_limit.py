"""`outbox limit set / show / clear` against the real Postgres: limits shared
by every dispatcher and worker; bad input is refused with one clear error and
changes nothing."""

from __future__ import annotations

import json
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from outbox import store
from outbox.limits import RateLimit
from outbox_cli.cli import cli


def limits(engine: sa.Engine) -> list[tuple[str, str, float | None, float | None]]:
    with engine.connect() as conn:
        return [
            (d.channel, d.destination, d.limit_rate, d.limit_burst)
            for d in store.destination_figures(conn)
        ]


def test_set_show_clear(run: Any, engine: sa.Engine) -> None:
    result = run("limit", "set", "webhook", "--destination", "Hooks.Example.com", "--rate", "10")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "webhook hooks.example.com: at most 10/s, 10 at once"
    result = run("limit", "set", "email", "--rate", "14", "--burst", "20", "--json")
    assert json.loads(result.stdout) == {
        "channel": "email",
        "destination": "",
        "rate": 14.0,
        "burst": 20.0,
    }
    assert limits(engine) == [
        ("email", "", 14.0, 20.0),
        ("webhook", "hooks.example.com", 10.0, 10.0),
    ]
    shown = run("limit", "show")
    assert shown.exit_code == 0 and "hooks.example.com" in shown.stdout
    assert "(the account)" in shown.stdout
    data = json.loads(run("limit", "show", "--json").stdout)
    assert [(d["channel"], d["limit_per_second"]) for d in data["destinations"]] == [
        ("email", 14.0),
        ("webhook", 10.0),
    ]
    assert run("limit", "clear", "email").stdout.strip() == "limit cleared"
    assert run("limit", "clear", "email").stdout.strip() == "no limit was set"
    assert limits(engine) == [("webhook", "hooks.example.com", 10.0, 10.0)]


def test_limit_clear_learned_forgets_a_throttled_destination(run: Any, engine: sa.Engine) -> None:
    with engine.begin() as conn:
        store.record_throttling(conn, "webhook", {"hooks.example.com": store.Throttled(1, 1, 5)})
    args = ("limit", "clear", "webhook", "--destination", "hooks.example.com")
    # without --learned the row stays (it holds no limit)
    assert run(*args).stdout.strip() == "no limit was set"
    assert run(*args, "--learned").stdout.strip() == "no limit was set; learned rate forgotten"
    with engine.connect() as conn:
        assert store.destination_figures(conn) == []
    assert json.loads(run(*args, "--learned", "--json").stdout)["changed"] is False


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["webhook", "--destination", "a.example", "--rate", "0"], "rate must be above 0"),
        (["webhook", "--destination", "a.example", "--rate", "-3"], "rate must be above 0"),
        (["webhook", "--destination", "a.example", "--rate", "nan"], "finite number"),
        (["webhook", "--destination", "a.example", "--rate", "inf"], "finite number"),
        (["webhook", "--destination", "a.example", "--rate", "1e9"], "at most 100000"),
        (["webhook", "--destination", "a.example", "--rate", "5", "--burst", "0"], "burst"),
        (["webhook", "--destination", "https://a.example/x", "--rate", "5"], "host[:port]"),
        (["webhook", "--destination", "a.example:70000", "--rate", "5"], "host[:port]"),
        (["webhook", "--destination", "*.example", "--rate", "5"], "host[:port]"),
        (["email", "--destination", "*", "--rate", "5"], "the account"),
        (["email", "--destination", "example.com", "--rate", "5"], "the account"),
        (["fax", "--rate", "5"], "unknown channel 'fax'"),
        (["Email", "--rate", "5"], "not a channel name"),
        (["webhook", "--destination", "a.example", "--rate", "ten"], "not a valid float"),
    ],
)
def test_bad_input_is_refused_and_changes_nothing(
    run: Any, engine: sa.Engine, args: list[str], problem: str
) -> None:
    result = run("limit", "set", *args)
    assert result.exit_code == 2, result.output
    assert problem in result.output
    assert limits(engine) == []


def test_show_says_who_set_each_limit(run: Any, engine: sa.Engine) -> None:
    with engine.begin() as conn:
        store.apply_configured_limits(
            conn, [RateLimit("webhook", "a.example", 10, 10), RateLimit("email", "", 14, 14)]
        )
    assert run("limit", "set", "email", "--rate", "2").exit_code == 0  # overrides the config
    data = json.loads(run("limit", "show", "--json").stdout)
    assert [
        (d["channel"], d["limit_per_second"], d["limit_source"]) for d in data["destinations"]
    ] == [
        ("email", 2.0, "operator"),
        ("webhook", 10.0, "config"),
    ]
    shown = run("limit", "show").stdout
    assert "set by" in shown and "operator" in shown and "config" in shown


def test_a_worker_with_a_bad_rate_limit_does_not_start(
    database_url: str, engine: sa.Engine
) -> None:
    result = CliRunner().invoke(
        cli,
        ["worker", "--once"],
        env={"DATABASE_URL": database_url, "RATE_LIMITS": "email=14,fax=1"},
    )
    assert result.exit_code == 2, result.output
    assert "configuration RATE_LIMITS: unknown channel 'fax'" in result.output
    assert limits(engine) == []


def test_a_webhook_limit_without_a_destination_holds_the_whole_channel(
    run: Any, engine: sa.Engine
) -> None:
    result = run("limit", "set", "webhook", "--rate", "50")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "webhook the whole channel: at most 50/s, 50 at once"
    assert limits(engine) == [("webhook", "*", 50.0, 50.0)]
    assert "(the whole channel)" in run("limit", "show").stdout
    assert run("limit", "clear", "webhook").stdout.strip() == "limit cleared"
    assert limits(engine) == []
