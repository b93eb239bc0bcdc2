"""Sleep mode (docs/how-to/pacing.md) against the real Postgres and moto's
EventBridge Scheduler: the next-wake statement, the wake schedule moved only
earlier, a run that ends after its linger with no connection left open, its
successor when work is left, and poll mode as it was."""

from __future__ import annotations

import datetime as dt
import json
import struct
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
import sqlalchemy as sa

from outbox import pacing, store
from outbox.handoff import Invoker
from outbox.runtime import Runtime, wake_source
from support import LambdaContext, enqueue

WAKE = "outbox-relay-dispatcher-wake"
FAR = "at(2099-12-31T23:59:59)"


def set_row(conn: sa.Connection, message_id: int, assignments: str) -> None:
    conn.execute(
        sa.text(f"UPDATE outbox_message SET {assignments} WHERE id = :id"), {"id": message_id}
    )


# --- the next-wake statement -----------------------------------------------------


def test_an_empty_outbox_has_nothing_to_wake_for(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        wake = store.next_wake(conn)
    assert (wake.next_due, wake.next_lease_expiry, wake.next_deadline) == (None, None, None)
    assert wake.earliest is None and not wake.outcome_events_due


def test_the_next_wake_is_the_earliest_future_event_of_any_priority(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        (due_now,) = enqueue(conn)  # due already: the run claims it, no wake-up needed
        (later_low,) = enqueue(conn, delay=600, priority=-5)
        (soon_high,) = enqueue(conn, delay=300, priority=9)
        (soonest_mid,) = enqueue(conn, delay=120, priority=0)
        (deadline,) = enqueue(conn, delay=900)
        set_row(conn, deadline, "expires_at = now() + interval '200 seconds'")
        times = dict(
            conn.execute(
                sa.text("SELECT id, available_at FROM outbox_message WHERE id = ANY(:ids)"),
                {"ids": [later_low, soon_high, soonest_mid]},
            ).all()
        )
        wake = store.next_wake(conn)
    assert due_now
    assert wake.next_due == times[soonest_mid]
    assert wake.next_lease_expiry is None
    assert wake.next_deadline is not None
    assert 150 < (wake.next_deadline - wake.now).total_seconds() <= 200
    assert wake.earliest == wake.next_due


def test_a_lease_expiry_and_waiting_outcome_events_wake_too(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        enqueue(conn, delay=3600)
        enqueue(conn)
        claims = store.claim(conn, 10, 60)
        (dead,) = enqueue(conn)
        set_row(conn, dead, "status = 'dead', settled_at = now()")  # the trigger writes an event
        wake = store.next_wake(conn)
    assert len(claims) == 1
    assert wake.next_lease_expiry is not None
    assert 0 < (wake.next_lease_expiry - wake.now).total_seconds() <= 60
    assert wake.earliest == wake.next_lease_expiry
    assert wake.outcome_events_due


def test_rows_due_but_not_claimable_do_not_wake_the_dispatcher_in_a_loop(
    engine: sa.Engine,
) -> None:
    """A paused channel's due rows and a held ordering key's rows are due and
    unclaimable: only future times count, so they cause no wake-up at all."""
    with engine.begin() as conn:
        (first,) = enqueue(conn, ordering_key="k")
        enqueue(conn, ordering_key="k")
        set_row(conn, first, "status = 'failed', settled_at = now()")
        store.pause_channel(conn, "email", "test")
        enqueue(conn)
        conn.execute(sa.text("DELETE FROM outbox_outcome_event"))
        wake = store.next_wake(conn)
    assert wake.earliest is None


def _paused(conn: sa.Connection, seconds: float) -> None:
    """Every destination of the email rows paused ``seconds`` from now."""
    conn.execute(
        sa.text(
            "INSERT INTO outbox_destination (channel, destination, paused_until) "
            "SELECT DISTINCT channel, destination, now() + make_interval(secs => :s) "
            "FROM outbox_message"
        ),
        {"s": seconds},
    )


def test_a_pause_ending_before_its_rows_come_due_is_no_wake_up(engine: sa.Engine) -> None:
    """A paused destination whose only row backs off past the pause's end: at
    the pause's end nothing can be claimed, so the wake-up is the row's time."""
    with engine.begin() as conn:
        (row,) = enqueue(conn, delay=900)
        _paused(conn, 300)
        conn.execute(sa.text("DELETE FROM outbox_outcome_event"))
        wake = store.next_wake(conn)
        available_at = conn.execute(
            sa.text("SELECT available_at FROM outbox_message WHERE id = :id"), {"id": row}
        ).scalar_one()
    assert wake.earliest == available_at


def test_a_row_retried_while_its_destination_is_paused_waits_for_the_pause(
    engine: sa.Engine,
) -> None:
    """A retry's backoff ending inside its destination's pause would wake the
    dispatcher for nothing: the row's wake-up is when the pause ends."""
    with engine.begin() as conn:
        enqueue(conn)
        (claim,) = store.claim(conn, 10, 60)
        _paused(conn, 600)
        store.settle(
            conn,
            [store.Settlement(claim.id, claim.claim_token, "retry", "HTTP 503", None, None, 1)],
            store.Backoff(base_seconds=5, cap_seconds=60, default_max_attempts=8),
        )
        conn.execute(sa.text("DELETE FROM outbox_outcome_event"))
        wake = store.next_wake(conn)
        paused_until, available_at = conn.execute(
            sa.text(
                "SELECT d.paused_until, m.available_at FROM outbox_message AS m "
                "JOIN outbox_destination AS d USING (channel, destination)"
            )
        ).one()
    assert available_at < paused_until  # (an operator's resume makes it due at once)
    assert wake.earliest == paused_until


def test_rows_behind_a_pause_never_make_the_wake_up_late(engine: sa.Engine) -> None:
    """A row of a destination not paused, coming due after rows that wait for
    a pause: it wakes the dispatcher at its own time; past the rows the
    statement looks at (store.pacing.LOOKAHEAD), a row's own time is the
    bound (early, never late)."""
    with engine.begin() as conn:
        behind = enqueue(conn, store.pacing.LOOKAHEAD + 1, delay=100)
        _paused(conn, 600)
        conn.execute(
            sa.text(
                "UPDATE outbox_message SET available_at = available_at + make_interval(secs => id)"
            )
        )
        (free,) = outbox_webhook(conn, delay=300)
        conn.execute(sa.text("DELETE FROM outbox_outcome_event"))
        times = dict(conn.execute(sa.text("SELECT id, available_at FROM outbox_message")).all())
        wake = store.next_wake(conn)
        # the last of them is past the lookahead: its own time, though paused
        assert wake.earliest == times[behind[-1]] < times[free]
        conn.execute(sa.text("DELETE FROM outbox_message WHERE id = :id"), {"id": behind[-1]})
        wake = store.next_wake(conn)
    assert wake.earliest == times[free]


def outbox_webhook(conn: sa.Connection, delay: float) -> list[int]:
    import outbox

    hook = {"url": "https://free.example/h", "event_type": "t", "body": {}}
    return [outbox.enqueue(conn, "webhook", hook, delay=delay)]


def test_the_next_wake_reads_indexes_not_the_table(engine: sa.Engine) -> None:
    """A large delayed backlog (50,000 rows due tomorrow) must not be read
    whole at the end of every run: the plan walks the indexes."""
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO outbox_message (channel, payload, available_at, priority) "
                "SELECT 'email', '{}', now() + interval '1 day' + g * interval '1 second', g % 3 "
                "FROM generate_series(1, 50000) AS g"
            )
        )
        conn.execute(sa.text("ANALYZE outbox_message"))
        plan = conn.execute(
            sa.text("EXPLAIN (FORMAT JSON) " + store.pacing._NEXT_WAKE.text)
        ).scalar_one()
        analyzed = conn.execute(
            sa.text("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + store.pacing._NEXT_WAKE.text)
        ).scalar_one()
    text = json.dumps(plan)
    assert not [
        n
        for n in _nodes(plan[0]["Plan"])
        if n["Node Type"] == "Seq Scan" and n["Relation Name"] == "outbox_message"
    ], text
    for index in ("outbox_message_due", "outbox_message_lease", "outbox_message_expiry"):
        assert f'"Index Name": "{index}"' in text, (index, text)
    # Buffers, not time: a handful of index pages, not the 50,000 rows' pages.
    top = analyzed[0]["Plan"]
    assert top["Shared Hit Blocks"] + top.get("Shared Read Blocks", 0) < 200, top


def _nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from _nodes(child)


# --- the wake schedule (moto's EventBridge Scheduler) -----------------------------


@pytest.fixture
def scheduler(aws: None) -> Iterator[Any]:
    client = boto3.client("scheduler", region_name="us-east-1")
    client.create_schedule(
        Name=WAKE,
        ScheduleExpression=FAR,
        ScheduleExpressionTimezone="UTC",
        FlexibleTimeWindow={"Mode": "OFF"},
        Target={
            "Arn": "arn:aws:lambda:us-east-1:123456789012:function:dispatcher",
            "RoleArn": "arn:aws:iam::123456789012:role/wake",
            "Input": '{"version": 1, "source": "outbox.wake"}',
            "RetryPolicy": {"MaximumRetryAttempts": 0, "MaximumEventAgeInSeconds": 60},
        },
    )
    yield client


def held(client: Any) -> str:
    return str(client.get_schedule(Name=WAKE)["ScheduleExpression"])


NOW = dt.datetime(2026, 12, 2, 4, 0, 0, tzinfo=dt.UTC)


def test_the_wake_schedule_moves_only_earlier(scheduler: Any) -> None:
    wake = pacing.WakeSchedule(WAKE, scheduler)
    assert wake.arrange(NOW + dt.timedelta(seconds=90.2), NOW)
    # Rounded up to the minute: Scheduler fires within the minute, never early.
    assert held(scheduler) == "at(2026-12-02T04:02:00)"
    # A later time leaves the earlier one; a fresh process reads it first.
    assert not pacing.WakeSchedule(WAKE, scheduler).arrange(NOW + dt.timedelta(hours=1), NOW)
    assert held(scheduler) == "at(2026-12-02T04:02:00)"
    assert wake.arrange(NOW + dt.timedelta(seconds=30), NOW)
    assert held(scheduler) == "at(2026-12-02T04:01:00)"
    got = scheduler.get_schedule(Name=WAKE)
    assert got["Target"]["Input"] == '{"version": 1, "source": "outbox.wake"}'  # target kept
    assert got["ScheduleExpressionTimezone"] == "UTC" and got["State"] == "ENABLED"


def test_a_wake_time_that_has_passed_is_replaced_by_a_later_one(scheduler: Any) -> None:
    wake = pacing.WakeSchedule(WAKE, scheduler)
    assert wake.arrange(NOW + dt.timedelta(seconds=10), NOW)
    # The schedule fired; the next run knows of an event further on.
    later = NOW + dt.timedelta(minutes=5)
    assert wake.arrange(later + dt.timedelta(minutes=1), later)
    assert held(scheduler) == "at(2026-12-02T04:06:00)"  # 04:06 exactly: not rounded


def test_the_wake_up_that_started_the_run_counts_as_fired(scheduler: Any) -> None:
    """Woken at T by a Scheduler whose clock runs a little ahead of the
    database's: T still looks future, but it has fired, and a later time
    must replace it (or nothing would wake the next event)."""
    wake = pacing.WakeSchedule(WAKE, scheduler)
    fired = NOW + dt.timedelta(seconds=60)
    wake.arrange(fired, NOW)
    event = {"version": 1, "source": "outbox.wake", "scheduled_time": "2026-12-02T04:01:00Z"}
    consumed = pacing.scheduled_time(event)
    assert consumed == fired
    almost = fired - dt.timedelta(seconds=0.5)  # the database's clock
    assert not wake.arrange(fired + dt.timedelta(minutes=3), almost)  # without it: kept
    assert wake.arrange(fired + dt.timedelta(minutes=3), almost, consumed)
    assert held(scheduler) == "at(2026-12-02T04:04:00)"


def test_a_warm_dispatcher_does_not_ask_scheduler_for_a_later_time(scheduler: Any) -> None:
    calls: list[str] = []

    class Counting:
        def __getattr__(self, name: str) -> Any:
            calls.append(name)
            return getattr(scheduler, name)

    wake = pacing.WakeSchedule(WAKE, Counting())
    wake.arrange(NOW + dt.timedelta(seconds=60), NOW)
    calls.clear()
    for minutes in (2, 3, 4):
        assert not wake.arrange(NOW + dt.timedelta(minutes=minutes), NOW)
    assert calls == []


def test_a_missing_schedule_is_a_warning_not_a_failure(
    aws: None, caplog: pytest.LogCaptureFixture
) -> None:
    client = boto3.client("scheduler", region_name="us-east-1")
    wake = pacing.WakeSchedule("no-such-schedule", client)
    assert not wake.arrange(NOW + dt.timedelta(seconds=60), NOW)
    [record] = [r for r in caplog.records if r.name == "outbox.pacing"]
    assert "could not move the wake schedule" in record.getMessage()
    assert "ResourceNotFoundException" in record.error  # type: ignore[attr-defined]


# --- a dispatcher run in sleep mode ---------------------------------------------


class RecordingLambda:
    """Records the dispatcher's own asynchronous invokes (its successor, the
    reaper) as Lambda would accept them."""

    def __init__(self) -> None:
        self.invokes: list[tuple[str, dict[str, Any]]] = []

    def invoke(self, FunctionName: str, InvocationType: str, Payload: bytes) -> dict[str, Any]:
        assert InvocationType == "Event"
        self.invokes.append((FunctionName, json.loads(Payload)))
        return {"StatusCode": 202}


class Handed(Invoker):
    """The channel functions: every hand-off accepted."""

    def __init__(self) -> None:
        self.events: list[Any] = []
        self.client = RecordingLambda()

    def can_route(self, channel: str) -> bool:
        return True

    def hand_off(self, handoff: Any) -> None:
        self.events.append(handoff)


def backend_pids(runtime: Runtime) -> list[int]:
    """The server pids of every connection ``runtime``'s engine makes from now
    on (pg8000 keeps the BackendKeyData message: the pid, then a secret)."""
    pids: list[int] = []

    def connected(dbapi_connection: Any, _: Any) -> None:
        pids.append(struct.unpack("!i", dbapi_connection._backend_key_data[:4])[0])

    sa.event.listen(runtime.engine, "connect", connected)
    return pids


def still_open(engine: sa.Engine, pids: list[int]) -> int:
    """How many of these server connections are still open (pg_stat_activity)."""
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(:pids)"),
                {"pids": pids},
            ).scalar_one()
        )


def sleep_runtime(relay_env: dict[str, str], **env: str) -> tuple[Runtime, Handed]:
    runtime = Runtime.for_dispatcher(
        {
            **relay_env,
            "PACING_MODE": "sleep",
            "IDLE_LINGER_SECONDS": "0.3",
            "DISPATCH_BUDGET_SECONDS": "20",
            **env,
        }
    )
    handed = Handed()
    runtime._invoker = handed
    runtime._lambda_client = handed.client
    return runtime, handed


def test_a_sleep_run_ends_after_its_linger_and_holds_no_connection(
    engine: sa.Engine, relay_env: dict[str, str], scheduler: Any
) -> None:
    runtime, _ = sleep_runtime(relay_env, WAKE_SCHEDULE_NAME=WAKE)
    pids = backend_pids(runtime)
    with engine.begin() as conn:
        for _ in range(3):
            enqueue(conn)
        (delayed,) = enqueue(conn, delay=3600)
        delayed_at = conn.execute(
            sa.text("SELECT available_at FROM outbox_message WHERE id = :id"), {"id": delayed}
        ).scalar_one()
    result = runtime.dispatch({"version": 1, "source": "outbox.nudge"}, LambdaContext(60))
    assert result["handed_off"] == 3
    assert result["ended"] == "idle"  # long before the 20 s budget
    assert not result["successor"]
    # Woken next for the delayed row (and the three leases, which end sooner).
    assert result["wake_at"] == pacing.at_expression(min(delayed_at, *_lease_ends(engine)))
    assert held(scheduler) == result["wake_at"]
    # The pool holds nothing while the environment is frozen: the server has
    # closed every connection the run made.
    assert runtime.engine.pool.checkedin() == 0
    assert len(pids) >= 1 and still_open(engine, pids) == 0


def _lease_ends(engine: sa.Engine) -> list[dt.datetime]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.text("SELECT lease_expires_at FROM outbox_message WHERE status = 'claimed'")
            ).scalars()
        )


def test_a_row_enqueued_during_the_linger_is_claimed_by_the_same_run(
    engine: sa.Engine, relay_env: dict[str, str]
) -> None:
    """A nudge that arrives before its producer's row is visible: the linger
    finds the row when it commits."""
    runtime, _ = sleep_runtime(relay_env, IDLE_LINGER_SECONDS="2")
    import threading

    def late_commit() -> None:
        with engine.begin() as conn:
            enqueue(conn)

    timer = threading.Timer(0.3, late_commit)
    timer.start()
    result = runtime.dispatch({"version": 1, "source": "outbox.nudge"}, LambdaContext(60))
    timer.join()
    assert result["handed_off"] == 1
    assert result["ended"] == "idle"


def test_a_run_out_of_budget_with_work_left_starts_its_successor(
    engine: sa.Engine, relay_env: dict[str, str]
) -> None:
    runtime, handed = sleep_runtime(relay_env, DISPATCH_BUDGET_SECONDS="0", BATCH_SIZE="2")
    with engine.begin() as conn:
        for _ in range(5):
            enqueue(conn)
    context = LambdaContext(60, name="outbox-dispatcher")
    result = runtime.dispatch({"version": 1, "source": "outbox.nudge"}, context)
    assert result["claimed"] == 2 and result["ended"] == "budget"
    assert result["successor"]
    assert handed.client.invokes == [(context.invoked_function_arn, pacing.SUCCESSOR_EVENT)]
    # The successor's own run: the same, until the work is done; the last
    # one finds nothing left and starts nobody.
    runs = 1
    while handed.client.invokes and runs < 10:
        handed.client.invokes.clear()
        runtime.dispatch(pacing.SUCCESSOR_EVENT, context)
        runs += 1
    assert len(handed.events) == 3  # chunks of 2, 2, 1
    assert runs == 4


def test_a_run_that_found_nothing_starts_no_successor_even_with_no_budget(
    engine: sa.Engine, relay_env: dict[str, str]
) -> None:
    runtime, handed = sleep_runtime(relay_env, DISPATCH_BUDGET_SECONDS="0")
    result = runtime.dispatch({}, LambdaContext(60))
    assert not result["successor"] and handed.client.invokes == []


def test_waiting_outcome_events_wake_the_reaper(
    engine: sa.Engine, relay_env: dict[str, str]
) -> None:
    runtime, handed = sleep_runtime(
        relay_env, OUTCOME_EVENT_BUS="default", REAPER_FUNCTION="outbox-reaper"
    )
    with engine.begin() as conn:
        (dead,) = enqueue(conn, delay=60)
        set_row(conn, dead, "status = 'dead', settled_at = now()")
    result = runtime.dispatch({}, LambdaContext(60))
    assert result["reaper_woken"]
    assert handed.client.invokes == [("outbox-reaper", pacing.REAPER_WAKE_EVENT)]


def test_a_sleep_run_releases_expired_leases_first(
    engine: sa.Engine, relay_env: dict[str, str]
) -> None:
    """Woken at a lease's end, the run releases it and hands the row off again
    (even with a claiming budget of one pass)."""
    runtime, _ = sleep_runtime(relay_env, DISPATCH_BUDGET_SECONDS="0")
    with engine.begin() as conn:
        enqueue(conn)
        store.claim(conn, 10, 60)
        conn.execute(sa.text("UPDATE outbox_message SET lease_expires_at = now() - interval '1 s'"))
    result = runtime.dispatch({"version": 1, "source": "outbox.wake"}, LambdaContext(60))
    assert result["released_leases"] == 1
    assert result["handed_off"] == 1


def test_a_sleep_run_woken_at_a_deliver_by_time_expires_the_row(
    engine: sa.Engine, relay_env: dict[str, str]
) -> None:
    runtime, handed = sleep_runtime(relay_env)
    with engine.begin() as conn:
        (late,) = enqueue(conn)
        store.pause_channel(conn, "email", "test")  # so it waits past its deadline
        set_row(conn, late, "expires_at = now() - interval '1 second'")
    result = runtime.dispatch({"version": 1, "source": "outbox.wake"}, LambdaContext(60))
    assert result["expired"] == 1 and handed.events == []
    with engine.connect() as conn:
        assert (
            conn.execute(
                sa.text("SELECT status FROM outbox_message WHERE id = :id"), {"id": late}
            ).scalar_one()
            == "expired"
        )


def test_poll_mode_keeps_claiming_for_its_budget_and_keeps_its_connection(
    engine: sa.Engine, relay_env: dict[str, str]
) -> None:
    runtime = Runtime.for_dispatcher(
        {**relay_env, "PACING_MODE": "poll", "DISPATCH_BUDGET_SECONDS": "1"}
    )
    handed = Handed()
    runtime._invoker = handed
    result = runtime.dispatch({}, LambdaContext(60))
    # The whole budget, polled (the pass count is not timed: at least two).
    assert result["ended"] == "budget" and result["batches"] >= 2
    assert "successor" not in result and handed.client.invokes == []
    assert runtime.engine.pool.checkedin() == 1  # kept for the next minute's run


@pytest.mark.parametrize(
    ("event", "source"),
    [
        ({"version": 1, "source": "outbox.nudge"}, "outbox.nudge"),
        ({"version": 1, "source": "outbox.wake", "execution_id": "x"}, "outbox.wake"),
        ({"execution_id": "x", "scheduled_time": "2026-11-29T12:00:00Z"}, "schedule"),
        ({"version": 1, "source": "outbox.nudge", "extra": {"anything": 1}}, "outbox.nudge"),
        ({"version": 7, "source": "something.else"}, "schedule"),
    ],
)
def test_every_wake_up_event_is_accepted(event: dict[str, Any], source: str) -> None:
    assert wake_source(event) == source


def test_the_sample_events_are_accepted(engine: sa.Engine, relay_env: dict[str, str]) -> None:
    from pathlib import Path

    runtime, _ = sleep_runtime(relay_env, IDLE_LINGER_SECONDS="0")
    root = Path(__file__).resolve().parents[2] / "events"
    for name in ("dispatcher", "dispatcher-nudge", "dispatcher-wake", "dispatcher-successor"):
        result = runtime.dispatch(
            json.loads((root / f"{name}.json").read_text()), LambdaContext(60)
        )
        assert result["ended"] == "idle", name


def test_the_reaper_and_a_channel_function_hold_no_connection_between_invocations(
    engine: sa.Engine, relay_env: dict[str, str]
) -> None:
    from outbox.channels.email import EmailChannel
    from outbox.handoff import chunk
    from support import ScriptedChannel, install_channel

    with engine.begin() as conn:
        enqueue(conn)
        claims = store.claim(conn, 10, 120)

    class FakeEmail(ScriptedChannel):
        schema = EmailChannel.schema

    install_channel(FakeEmail(name="email"))
    env = {**relay_env, "PACING_MODE": "sleep"}
    channel = Runtime(env)
    pids = backend_pids(channel)
    result = channel.send("email", chunk(claims, 32)[0].to_event(), LambdaContext(30))
    assert result["statuses"] == {"delivered": 1}
    reaper = Runtime(env)
    reaper_pids = backend_pids(reaper)
    reaped = reaper.reap({}, LambdaContext(60))
    assert reaped["backlog"]["pending"] == 0
    for runtime in (channel, reaper):
        assert runtime.engine.pool.checkedin() == 0
    assert len(pids) == len(reaper_pids) == 1
    assert still_open(engine, pids + reaper_pids) == 0
    # Polling, the pool keeps its connection for the next invocation.
    polling = Runtime({**relay_env, "PACING_MODE": "poll"})
    kept = backend_pids(polling)
    polling.reap({}, LambdaContext(60))
    assert polling.engine.pool.checkedin() == 1
    assert still_open(engine, kept) == 1  # the check can see an open one
    polling.engine.dispose()


def test_a_failed_reaping_step_is_logged_and_the_claim_still_runs(
    engine: sa.Engine,
    relay_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A fault in the reaping steps (a statement timeout, a lock timeout, a
    # bug) used to fail the whole invocation: nothing was claimed.
    from outbox import reaper as reaper_module

    runtime, _ = sleep_runtime(relay_env)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise sa.exc.OperationalError(
            "SELECT ...", {}, Exception("canceling statement due to statement timeout")
        )

    monkeypatch.setattr(reaper_module.store, "reap_expired", broken)
    with engine.begin() as conn:
        enqueue(conn)
    result = runtime.dispatch({"version": 1, "source": "outbox.nudge"}, LambdaContext(60))
    assert result["handed_off"] == 1
    assert result["reaping_failed"] is True
    assert any(
        r.levelname == "ERROR" and "reaping steps failed" in r.getMessage() for r in caplog.records
    )
