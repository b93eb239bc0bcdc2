"""`outbox limit set / show / clear` against the real Postgres: limits shared
by every dispatcher and worker; bad input is refused with one clear error and
changes nothing."""

from __future__ import annotations

import json
from typing import Any

import pytest
import sqlalchemy as sa

from outbox import store


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
        (["webhook", "--rate", "5"], "host[:port]"),
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
