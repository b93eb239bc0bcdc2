"""Metrics: namespace and service from the Powertools variables (one set per
stack), and a ``channel`` dimension on every figure about one channel."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import sqlalchemy as sa

import outbox
from outbox import observability, reaper, store
from support import EMAIL, settings


@pytest.fixture(autouse=True)
def _no_earlier_metrics(capsys: pytest.CaptureFixture[str]) -> None:
    """Publish (and drop) what earlier tests recorded in this process."""
    observability.flush_metrics()
    capsys.readouterr()


def emf_records(text: str) -> list[dict[str, Any]]:
    records = []
    for line in text.splitlines():
        if line.startswith("{") and '"_aws"' in line:
            records.append(json.loads(line))
    return records


def metric_names(record: dict[str, Any]) -> set[str]:
    return {m["Name"] for d in record["_aws"]["CloudWatchMetrics"] for m in d["Metrics"]}


def dimensions(record: dict[str, Any]) -> list[list[str]]:
    return [sorted(ds) for d in record["_aws"]["CloudWatchMetrics"] for ds in d["Dimensions"]]


def test_namespace_and_service_come_from_the_powertools_variables() -> None:
    """Two stacks set different values and so never share a metric or an alarm."""
    script = textwrap.dedent(
        """
        from outbox import observability as o

        @o.log_metrics
        def handler(event, context):
            o.count("Claimed", 2, channel="email")
            o.gauge("PausedChannels", 0)
            return "ok"

        handler({}, None)
        """
    )
    env = {
        "PATH": "/usr/bin:/bin",
        "POWERTOOLS_METRICS_NAMESPACE": "OutboxRelay",
        "POWERTOOLS_SERVICE_NAME": "stack-a",
    }
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    ).stdout
    records = emf_records(out)
    assert {r["_aws"]["CloudWatchMetrics"][0]["Namespace"] for r in records} == {"OutboxRelay"}
    assert {r["service"] for r in records} == {"stack-a"}
    by_name = {name: r for r in records for name in metric_names(r)}
    assert by_name["Claimed"]["channel"] == "email"
    assert dimensions(by_name["Claimed"]) == [["channel", "service"]]
    assert "channel" not in by_name["PausedChannels"]
    assert dimensions(by_name["PausedChannels"]) == [["service"]]


def test_each_channel_gets_its_own_record(capsys: pytest.CaptureFixture[str]) -> None:
    @observability.log_metrics
    def handler(event: Any, context: Any) -> None:
        observability.count("Delivered", 3, channel="email")
        observability.count("Delivered", 1, channel="sms")
        observability.count("Retried", 0, channel="sms")  # a zero count is not published

    handler({}, None)
    records = [r for r in emf_records(capsys.readouterr().out) if "channel" in r]
    assert {(r["channel"], *r["Delivered"]) for r in records} == {("email", 3.0), ("sms", 1.0)}
    assert all("Retried" not in r for r in records)
    handler({}, None)  # flushed means cleared: the next invocation starts from zero
    again = [r for r in emf_records(capsys.readouterr().out) if "channel" in r]
    assert {(r["channel"], *r["Delivered"]) for r in again} == {("email", 3.0), ("sms", 1.0)}


def test_the_reaper_publishes_backlog_gauges_per_channel(
    engine: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    with engine.begin() as conn:
        outbox.enqueue_many(conn, [{"channel": "email", "payload": EMAIL}] * 2)
        store.pause_channel(conn, "sms")
    observability.log_metrics(lambda e, c: reaper.run(engine, settings(), lambda: 30.0))({}, None)
    records = emf_records(capsys.readouterr().out)
    per_channel = {r["channel"]: r for r in records if "channel" in r}
    assert per_channel["email"]["PendingMessages"] == [2.0]
    assert per_channel["email"]["Paused"] == [0.0]
    assert per_channel["sms"]["Paused"] == [1.0]
    assert per_channel["sms"]["PendingMessages"] == [0.0]
    assert {"OldestPendingAgeSeconds", "ExpiredClaims", "DeadMessages"} <= metric_names(
        per_channel["email"]
    )
    [relay_wide] = [r for r in records if "channel" not in r]
    assert relay_wide["PausedChannels"] == [1.0]
    assert relay_wide["PendingMessages"] == [2.0]


def test_a_sender_publishes_outcomes_and_call_durations_per_channel(
    engine: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    from outbox import sender
    from outbox.handoff import HandOff
    from support import ScriptedChannel, install_channel

    install_channel(ScriptedChannel())
    with engine.begin() as conn:
        outbox.enqueue_many(conn, [{"channel": "scripted", "payload": {"n": 1}}] * 3)
        claims = store.claim(conn, 10, 60)
    [first, *rest] = claims
    send = observability.log_metrics(
        lambda event, seconds_left: sender.run(engine, event, settings(), lambda: seconds_left)
    )
    send(HandOff("scripted", tuple(rest)).to_event(), 30.0)
    send(HandOff("scripted", (first,)).to_event(), 0.0)  # no time left: not started
    records = [r for r in emf_records(capsys.readouterr().out) if r.get("channel") == "scripted"]
    assert [r.get("Delivered") for r in records] == [[2.0], None]
    assert [r.get("NotStarted") for r in records] == [None, [1.0]]
    assert len(records[0]["SendMilliseconds"]) == 2  # one sample per provider call
    assert "SendMilliseconds" not in records[1]


def test_the_worker_command_records_no_metrics_so_its_stdout_stays_its_own(
    engine: sa.Engine, database_url: str
) -> None:
    """Powertools prints a metric set once a metric holds 100 values; the worker
    publishes no metrics, so 150 sends must not put EMF into its --json output."""
    from click.testing import CliRunner

    from outbox_cli.cli import cli
    from support import ScriptedChannel, install_channel

    install_channel(ScriptedChannel())
    with engine.begin() as conn:
        outbox.enqueue_many(conn, [{"channel": "scripted", "payload": {"n": 1}}] * 150)
    result = CliRunner().invoke(
        cli,
        ["worker", "--until-empty", "--channels", "scripted", "--json"],
        env={"DATABASE_URL": database_url},
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["statuses"] == {"delivered": 150}
    observability.count("Delivered", 1, channel="scripted")  # recording works again after it
    assert observability._target("scripted").metric_set


def test_nothing_is_recorded_when_metrics_are_disabled(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("POWERTOOLS_METRICS_DISABLED", "true")
    for _ in range(150):  # past Powertools' 100-value flush
        observability.timing("SendMilliseconds", 1.0, channel="email")
    observability.flush_metrics()
    assert emf_records(capsys.readouterr().out) == []


def test_the_dispatcher_counts_claims_and_hand_offs_per_channel(
    engine: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    from outbox.dispatcher import dispatch_once
    from outbox.handoff import CallableInvoker

    def broken(event: dict[str, Any]) -> None:
        raise RuntimeError("the sms function is unreachable")

    with engine.begin() as conn:
        outbox.enqueue_many(
            conn,
            [{"channel": "email", "payload": EMAIL}] * 3
            + [{"channel": "sms", "payload": {"to": "+15555550100", "message": "hi"}}] * 2
            + [
                {
                    "channel": "push",
                    "payload": {
                        "endpoint_arn": "arn:aws:sns:us-east-1:123456789012:endpoint/APNS/app/1",
                        "body": "hi",
                    },
                }
            ],
        )
    invoker = CallableInvoker({"email": lambda event: None, "sms": broken})
    observability.log_metrics(lambda: dispatch_once(engine, invoker, settings()))()
    by_channel = {r["channel"]: r for r in emf_records(capsys.readouterr().out) if "channel" in r}
    assert by_channel["email"]["Claimed"] == [3.0] and by_channel["email"]["HandedOff"] == [3.0]
    assert by_channel["sms"]["Claimed"] == [2.0] and by_channel["sms"]["HandOffFailed"] == [2.0]
    assert "HandedOff" not in by_channel["sms"]
    assert by_channel["push"]["Failed"] == [1.0]  # no function for it: failed at once


@pytest.mark.parametrize("channel", [None, "email"])
def test_a_batch_of_timings_is_recorded_as_one_add_metric_per_value_would(
    capsys: pytest.CaptureFixture[str], channel: str | None
) -> None:
    """``timings`` appends most samples to the metric's value list itself (one
    ``add_metric`` per sample formats the whole list each time): the values,
    their order, and Powertools' publishing of a metric that reaches 100 values
    are as they were."""
    observability.timing("SendMilliseconds", 7, channel=channel)  # an earlier sample
    observability.timings("SendMilliseconds", range(250), channel=channel)
    observability.timings("SendMilliseconds", [], channel=channel)
    observability.flush_metrics()
    records = [
        r
        for r in emf_records(capsys.readouterr().out)
        if "SendMilliseconds" in r and r.get("channel") == channel
    ]
    series = [r["SendMilliseconds"] for r in records]
    assert [len(s) for s in series] == [100, 100, 51]
    assert [v for s in series for v in s] == [7.0, *map(float, range(250))]
    [unit] = {
        m["Unit"]
        for r in records
        for d in r["_aws"]["CloudWatchMetrics"]
        for m in d["Metrics"]
        if m["Name"] == "SendMilliseconds"
    }
    assert unit == "Milliseconds"


def test_a_sleeping_reaper_publishes_only_levels_that_are_not_zero(
    engine: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/how-to/pacing.md: an idle stack publishes no metric (a custom
    metric is billed by the hours it has data), a real backlog still does."""

    def reap(e: Any, c: Any) -> None:
        reaper.run(engine, settings(), lambda: 30.0, quiet_when_idle=True)

    observability.log_metrics(reap)({}, None)
    assert emf_records(capsys.readouterr().out) == []  # idle: nothing at all
    with engine.begin() as conn:
        outbox.enqueue_many(conn, [{"channel": "email", "payload": EMAIL}] * 2)
        conn.execute(sa.text("UPDATE outbox_message SET available_at = now() - interval '9 s'"))
    observability.log_metrics(reap)({}, None)
    records = emf_records(capsys.readouterr().out)
    [relay_wide] = [r for r in records if "channel" not in r]
    assert relay_wide["PendingMessages"] == [2.0]
    assert relay_wide["OldestPendingAgeSeconds"][0] >= 9
    assert "DeadMessages" not in relay_wide and "PausedChannels" not in relay_wide
    [email] = [r for r in records if r.get("channel") == "email"]
    assert "Paused" not in email and email["PendingMessages"] == [2.0]
