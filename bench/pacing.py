"""Pacing (docs/how-to/pacing.md): what an idle stack costs, and how fast a
message goes out from idle and under load. ``python -m bench.pacing``.

Everything runs through the real handlers in process (``outbox.runtime``:
the dispatcher's ``Runtime.dispatch``, the reaper's ``Runtime.reap``, a channel
function's ``Runtime.send``) against a fresh database on the local Postgres,
with the template's defaults (``PACING_MODE=sleep``, a 2 s linger, the safety
net and the reaper every 10 minutes).

* **idle**: a backlog is enqueued, nudged and drained; then one simulated idle
  hour: the runs its schedules make (the safety net and the reaper at the
  same minutes), each a real invocation. Between runs nothing of the relay
  runs, so the hour's other 59 minutes are not waited for: the cell checks
  ``pg_stat_activity`` instead (connections the relay holds while it is
  "frozen") and counts every statement (a SQLAlchemy ``before_cursor_execute``
  hook on each function's engine) and connection (``connect`` hook). For
  comparison, one poll-mode dispatcher run of today's default budget (50 s)
  on the same idle database.
* **cost**: the monthly idle bill from those counts and the price table
  below (us-east-1 list prices, arm64), itemised, with the template's
  default alarms counted from ``template.yaml``.
* **from idle**: the dispatcher has stopped (pool empty); a message is
  committed and the dispatcher nudged (``Runtime.dispatch`` of the nudge
  event): ``settled_at - created_at`` from the database clock, the connection
  made again included, Lambda's own start not.
* **under load**: ``bench.latency`` (100 msg/s for 10 s) with the dispatcher
  run as sleep mode runs it (a linger) and as poll mode does, in the same run.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from . import common, latency

ROOT = Path(__file__).resolve().parents[1]
MONTH_HOURS = 730.0
MEMORY_GB = 0.5  # the template's MemorySize for every function
# The INIT phase is billed too (Lambda, from August 2025): an idle function's
# every run is likely a cold start. bench/results.json's cold-start cell:
# importing the dispatcher's or the reaper's handler takes about 0.18 s.
INIT_SECONDS = 0.2
# us-east-1 list prices, 2026.
PRICES = {
    "lambda_gb_second_arm64": 0.0000133334,
    "lambda_request": 0.20 / 1e6,
    "scheduler_invocation": 1.00 / 1e6,
    "secrets_manager_call": 0.05 / 1e4,  # GetSecretValue, once per connection (DatabaseAuth=secret)
    "alarm_metric_month": 0.10,  # a standard-resolution alarm, per metric it reads
    "custom_metric_month": 0.30,  # prorated by the hour: a metric with no data costs nothing
    "dashboard_month": 3.00,
    "xray_trace": 5.00 / 1e6,
    "logs_gb": 0.50,
}


@contextmanager
def counting(engine: sa.Engine) -> Iterator[Counter[str]]:
    counts: Counter[str] = Counter()

    def statement(*_: Any) -> None:
        counts["statements"] += 1

    def connect(*_: Any) -> None:
        counts["connections"] += 1

    sa.event.listen(engine, "before_cursor_execute", statement)
    sa.event.listen(engine, "connect", connect)
    try:
        yield counts
    finally:
        sa.event.remove(engine, "before_cursor_execute", statement)
        sa.event.remove(engine, "connect", connect)


class Stack:
    """The dispatcher, reaper and one channel function of a stack, in process."""

    def __init__(self, url: str, **env: str) -> None:
        from outbox.handoff import CallableInvoker
        from outbox.runtime import Runtime

        common.register_channel()
        base = {
            "DATABASE_URL": url,
            "CHANNEL_FUNCTIONS": json.dumps({common.CHANNEL: "channel"}),
            **env,
        }
        self.dispatcher = Runtime.for_dispatcher(base)
        self.reaper = Runtime(base)
        self.channel = Runtime(base)
        self.dispatcher._invoker = CallableInvoker({common.CHANNEL: self._send})
        self.invocations: Counter[str] = Counter()
        self.seconds: Counter[str] = Counter()
        self._one_at_a_time = threading.Lock()

    def _send(self, event: dict[str, Any]) -> None:
        # One invocation at a time, as one Lambda environment runs them (the
        # dispatcher hands off from several threads).
        wire = json.loads(json.dumps(event, separators=(",", ":")))
        with self._one_at_a_time:
            self._timed("channel", lambda: self.channel.send(common.CHANNEL, wire, _Context(30)))

    def _timed(self, name: str, call: Any) -> Any:
        started = time.monotonic()
        try:
            return call()
        finally:
            self.invocations[name] += 1
            self.seconds[name] += time.monotonic() - started

    def dispatch(self, event: dict[str, Any]) -> Any:
        return self._timed("dispatcher", lambda: self.dispatcher.dispatch(event, _Context(60)))

    def reap(self) -> Any:
        return self._timed("reaper", lambda: self.reaper.reap({}, _Context(60)))


class _Context:
    def __init__(self, seconds: float) -> None:
        self._deadline = time.monotonic() + seconds
        self.invoked_function_arn = "arn:aws:lambda:us-east-1:123456789012:function:bench"

    def get_remaining_time_in_millis(self) -> int:
        return max(0, int((self._deadline - time.monotonic()) * 1000))


def relay_connections(admin: sa.Engine, database: str) -> int:
    with admin.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = :db "
                    "AND application_name = 'outbox-relay'"
                ),
                {"db": database},
            ).scalar_one()
        )


def idle(url: str, *, backlog: int = 200, poll_budget: float = 50.0) -> dict[str, Any]:
    import outbox

    database = sa.engine.make_url(url).database or ""
    admin = sa.create_engine(url, poolclass=sa.NullPool, hide_parameters=True)
    stack = Stack(url)
    engines = {"dispatcher": stack.dispatcher.engine, "reaper": stack.reaper.engine}
    engines["channel"] = stack.channel.engine
    with admin.begin() as conn:
        outbox.enqueue_many(
            conn,
            [
                {"channel": common.CHANNEL, "payload": common.python_payload(i)}
                for i in range(backlog)
            ],
        )
    stack.dispatch({"version": 1, "source": "outbox.nudge"})  # drains the backlog
    stack.reap()
    drained = common.count_status(url)
    held_after_drain = relay_connections(admin, database)

    # The idle hour: the schedules' runs (the safety net and the reaper fall
    # on the same minutes), nothing in between.
    runs = 6
    per_window: list[dict[str, int]] = []
    held_between: list[int] = []
    invocations_before = Counter(stack.invocations)
    seconds_before = Counter(stack.seconds)
    for _ in range(runs):
        counts: Counter[str] = Counter()
        with (
            counting(engines["dispatcher"]) as d,
            counting(engines["reaper"]) as r,
            counting(engines["channel"]) as c,
        ):
            stack.dispatch({"execution_id": "safety-net"})
            stack.reap()
        counts.update(d)
        counts.update(r)
        counts.update(c)
        per_window.append(dict(counts))
        held_between.append(relay_connections(admin, database))
    hour_invocations = stack.invocations - invocations_before
    hour_seconds = {k: stack.seconds[k] - seconds_before[k] for k in stack.invocations}

    # Today's behaviour on the same idle database: one poll-mode run.
    poll = Stack(url, PACING_MODE="poll", DISPATCH_BUDGET_SECONDS=str(poll_budget))
    with counting(poll.dispatcher.engine) as polled:
        poll.dispatch({"execution_id": "every-minute"})
    poll_held = relay_connections(admin, database)
    admin.dispose()
    return {
        "backlog": backlog,
        "drained": drained,
        "connections_held_after_drain": held_after_drain,
        "idle_hour_runs": dict(hour_invocations),
        "idle_hour_seconds": {k: round(v, 3) for k, v in hour_seconds.items()},
        "statements_per_run_window": per_window,
        "statements_per_idle_hour": sum(w.get("statements", 0) for w in per_window),
        "connections_per_idle_hour": sum(w.get("connections", 0) for w in per_window),
        "connections_held_between_runs": held_between,
        "statements_between_runs": 0,  # nothing of the relay runs between invocations
        "poll_run_seconds": round(poll.seconds["dispatcher"], 3),
        "poll_run_statements": polled["statements"],
        "poll_connections_held_after_run": poll_held,
    }


def template_alarm_metrics() -> dict[str, int]:
    """Alarms of the template with its default parameters, and the metrics they read."""
    from cfnlint.decode import cfn_yaml

    template = cfn_yaml.load(str(ROOT / "template.yaml"))
    on_by_default = {None, "PublishOutcomeEvents"}
    alarms = {
        name: r["Properties"]
        for name, r in template["Resources"].items()
        if r["Type"] == "AWS::CloudWatch::Alarm" and r.get("Condition") in on_by_default
    }
    metrics = sum(
        len([m for m in a["Metrics"] if "MetricStat" in m]) if "Metrics" in a else 1
        for a in alarms.values()
    )
    optional = sum(
        1
        for r in template["Resources"].values()
        if r["Type"] == "AWS::CloudWatch::Alarm" and r.get("Condition") == "WithDetailedAlarms"
    )
    return {"alarms": len(alarms), "alarm_metrics": metrics, "optional_alarms": optional}


def monthly_cost(cell: dict[str, Any]) -> dict[str, Any]:
    """The idle bill, itemised, from the idle hour's counts."""
    p = PRICES
    runs = cell["idle_hour_runs"]
    seconds = cell["idle_hour_seconds"]
    invocations = sum(runs.values()) * MONTH_HOURS
    gb_seconds = (
        (sum(seconds.values()) + INIT_SECONDS * sum(runs.values())) * MEMORY_GB * MONTH_HOURS
    )
    alarms = template_alarm_metrics()
    items = {
        "lambda_compute": gb_seconds * p["lambda_gb_second_arm64"],
        "lambda_requests": invocations * p["lambda_request"],
        "scheduler": invocations * p["scheduler_invocation"],
        "secrets_manager": cell["connections_per_idle_hour"]
        * MONTH_HOURS
        * p["secrets_manager_call"],
        "alarms": alarms["alarm_metrics"] * p["alarm_metric_month"],
        "custom_metrics": 0.0,  # idle runs publish no level that is zero
        "xray": 0.0,  # PassThrough for the dispatcher and reaper; the others do not run
        "logs": sum(runs.values()) * MONTH_HOURS * 1500 / 1e9 * p["logs_gb"],
    }
    without_dashboard = sum(items.values())
    items["dashboard"] = p["dashboard_month"]
    # Today, idle: a poll-mode dispatcher run every minute for its budget, the
    # reaper every minute (its idle run measured above, per run).
    poll_runs = 60 * MONTH_HOURS
    reaper_per_run = seconds.get("reaper", 0.0) / max(1, runs.get("reaper", 1))
    today_gb_seconds = (cell["poll_run_seconds"] + reaper_per_run) * MEMORY_GB * poll_runs
    return {
        "items": {k: round(v, 3) for k, v in items.items()},
        "total": round(without_dashboard + p["dashboard_month"], 2),
        "total_without_dashboard": round(without_dashboard, 2),
        "idle_gb_seconds_month": round(gb_seconds),
        "today_idle_gb_seconds_month": round(today_gb_seconds),
        "compute_ratio_to_today": round(gb_seconds / today_gb_seconds, 5),
        "today_idle_dispatcher_statements_month": cell["poll_run_statements"] * poll_runs,
        **alarms,
        "prices": p,
        "init_seconds_per_run": INIT_SECONDS,
    }


def from_idle(url: str, trials: int = 10) -> dict[str, Any]:
    import outbox

    stack = Stack(url)
    admin = common.engine_for(url)
    latencies = []
    for _ in range(trials):
        with admin.begin() as conn:
            message_id = outbox.enqueue(conn, common.CHANNEL, common.python_payload(0))
        stack.dispatch({"version": 1, "source": "outbox.nudge"})
        with admin.connect() as conn:
            ms = conn.execute(
                sa.text(
                    "SELECT EXTRACT(EPOCH FROM settled_at - created_at) * 1000 "
                    "FROM outbox_message WHERE id = :id AND status = 'delivered'"
                ),
                {"id": message_id},
            ).scalar_one()
        latencies.append(float(ms))
    admin.dispose()
    return {
        "trials": trials,
        "p50_ms": round(common.percentile(latencies, 50), 1),
        "p99_ms": round(common.percentile(latencies, 99), 1),
        "max_ms": round(max(latencies), 1),
    }


def run(quick: bool = False) -> list[dict[str, Any]]:
    dbs = common.Databases(common.server_url())
    cells: list[dict[str, Any]] = []
    try:
        dbs.prepare_template()
        with dbs.fresh("pacing_idle") as url:
            cell = idle(url, backlog=20 if quick else 200, poll_budget=2.0 if quick else 50.0)
            cells.append({"name": "pacing idle", **cell, "cost": monthly_cost(cell)})
        with dbs.fresh("pacing_from_idle") as url:
            cells.append({"name": "pacing from idle", **from_idle(url, 2 if quick else 10)})
        seconds = 2.0 if quick else 10.0
        for linger in (2.0, None):
            with dbs.fresh("pacing_load") as url:
                cells.append(
                    {
                        "name": "pacing under load",
                        **latency.run(url, seconds=seconds, linger=linger),
                    }
                )
    finally:
        dbs.close()
    return cells


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pacing", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a seconds-long smoke run")
    parser.add_argument("--output", type=Path, default=None, help="write the cells as JSON here")
    args = parser.parse_args(argv)
    quiet = common.quiet_process()
    try:
        cells = run(args.quick)
    finally:
        quiet()
    text = json.dumps(cells, indent=2, default=str)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
