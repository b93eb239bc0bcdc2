"""The relay under Lambda's real asynchronous delivery (lambda_sim.py): the real
dispatcher, senders and reaper on the real Postgres, through a simulated
invoke with reserved concurrency, an event-age limit, throttling, duplicated,
delayed and reordered events, and invocations killed at random.

Durations are scaled (lambda_sim.SCALE): lease 4 s, sender timeout 1 s,
maximum event age 2 s, reaper every 0.5 s, retry window and outage / 75.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from outbox import sender
from outbox.db import create_engine
from outbox.relay_settings import DatabaseSettings, RelaySettings
from reliability import lambda_sim
from reliability.lambda_sim import Faults, LambdaSim


@pytest.fixture
def sim_engine(engine: sa.Engine, database_url: str) -> Iterator[sa.Engine]:
    """An autocommit engine, as the functions use, over the emptied tables."""
    relay = create_engine(
        DatabaseSettings(url=database_url, sslmode="disable"), pool_size=16, autocommit=True
    )
    yield relay
    relay.dispose()


def show(report: lambda_sim.SimReport) -> None:
    print("\n" + report.line(), file=sys.stderr)


class InFlightSampler:
    """Samples the claimed rows of the sim channel while a run goes on."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.highest = 0
        self._thread: threading.Thread | None = None

    def start(self, sim: LambdaSim) -> None:
        def sample() -> None:
            while not sim.stopping.wait(0.02):
                with self.engine.connect() as conn:
                    n = conn.execute(
                        sa.text("SELECT count(*) FROM outbox_message WHERE status = 'claimed'")
                    ).scalar_one()
                self.highest = max(self.highest, n)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()


def test_quick_run_with_every_fault_loses_nothing_and_explains_every_duplicate(
    sim_engine: sa.Engine,
) -> None:
    # Rates high enough that a run of about 100 events meets every fault.
    faults = Faults(
        throttle=0.08,
        duplicate=0.15,
        delay=0.15,
        max_delay_seconds=0.5,
        kill_before_receipt=0.06,
        kill_before_send=0.015,
        kill_after_send=0.015,
    )
    report = lambda_sim.run(
        sim_engine,
        lambda_sim.sim_settings(handoff_chunk_size=5),
        faults,
        messages=300,
        concurrency=4,
        seed=9,
        latency_seconds=0.002,
        timeout_seconds=90,
    )
    show(report)
    assert not report.violations, report.violations
    assert report.statuses == {"delivered": 300}
    record = report.record
    # Every fault happened in this run (the seed makes it so), and was survived.
    assert record.throttled and record.duplicated and record.delayed
    assert {"before_receipt", "before_send", "after_send"} <= set(record.kills)
    assert report.duplicates > 0  # kills between send and settle re-send, explained above
    assert report.max_attempts_seen <= report.max_attempts_allowed
    assert not record.dropped_for_age


def _backlog(sim_engine: sa.Engine, messages: int, latency: float) -> None:
    settings = lambda_sim.sim_settings()
    budget = settings.in_flight_budgets()[lambda_sim.CHANNEL]
    # min(C * K * (1 + floor(min(age, lease - T) / T)), (C + ceil(C / 2)) * K)
    assert budget == min(10 * 20 * 3, 15 * 20)
    sampler = InFlightSampler(sim_engine)
    report = lambda_sim.run(
        sim_engine,
        settings,
        Faults(),
        messages=messages,
        concurrency=10,
        latency_seconds=latency,
        # Generous: the run ends as soon as every row is final, so the bound only
        # decides how long a busy machine may take (CI shares two cores).
        timeout_seconds=max(240.0, messages / 100),
        on_start=sampler.start,
    )
    show(report)
    print(f"highest in flight {sampler.highest} of a budget of {budget}", file=sys.stderr)
    assert not report.violations, report.violations
    assert report.statuses == {"delivered": messages}
    assert report.record.dropped_for_age == []
    assert sampler.highest <= budget
    # No attempt was counted for a row that never started (invariant 4). A
    # sender near its deadline gives rows back unstarted: a busy machine makes
    # more of those, and they are records, not attempts. A machine starved
    # long enough for a started call to outrun the simulator's one-second
    # sender timeout makes the sender give that call up, which is an attempt
    # (a retry naming the deadline; the call may still land, the duplicate the
    # report explains). Every other row of the history is the one delivery of
    # its message, and every attempt a row spent is one of those rows.
    with sim_engine.connect() as conn:
        history = conn.execute(
            sa.text(
                "SELECT outcome, error = :deadline AS at_deadline, count(*) FROM outbox_attempt"
                " WHERE outcome <> 'not_started' GROUP BY 1, 2"
            ),
            {"deadline": sender.DEADLINE_EXCEEDED},
        ).all()
        spent = conn.execute(
            sa.text(
                "SELECT coalesce(sum(m.attempts), 0) FROM outbox_message AS m"
                " WHERE m.channel = :channel"
            ),
            {"channel": lambda_sim.CHANNEL},
        ).scalar_one()
    counts = {(outcome, bool(at_deadline)): n for outcome, at_deadline, n in history}
    given_up = counts.pop(("retry", True), 0)
    assert counts == {("delivered", False): messages}, history
    assert spent == messages + given_up


@pytest.mark.timeout(600)
def test_a_backlog_of_5000_drains_within_the_budget_with_no_event_dropped(
    sim_engine: sa.Engine,
) -> None:
    _backlog(sim_engine, 5000, latency=0.005)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_backlog_of_100000_for_reserved_concurrency_10_drains_with_no_event_dropped(
    sim_engine: sa.Engine,
) -> None:
    _backlog(sim_engine, 100_000, latency=0.005)


def test_without_a_budget_the_same_backlog_overflows_lambdas_queue(
    sim_engine: sa.Engine,
) -> None:
    """The control: the simulator reproduces the issue. Claiming the backlog as
    fast as the database allows queues more events than reserved concurrency
    can start before their maximum age, and Lambda drops them."""
    report = lambda_sim.run(
        sim_engine,
        lambda_sim.sim_settings(channel_concurrency={}),
        Faults(),
        messages=3000,
        concurrency=10,
        latency_seconds=0.25,  # an invocation of 20 rows takes about 0.75 s
        timeout_seconds=8,  # long enough to see the drops; the drain is not the point
    )
    show(report)
    assert report.record.dropped_for_age
    # More events queued than the budget would have allowed (600 rows, 30 events).
    assert report.record.max_queue_depth > 30


def test_a_provider_outage_of_ten_simulated_minutes_ends_no_message_dead(
    sim_engine: sa.Engine,
) -> None:
    """The retry window of the default settings, scaled, outlasts a 10-minute
    outage: every message is delivered once the provider is back."""
    defaults = RelaySettings()
    settings = lambda_sim.sim_settings(
        max_attempts=defaults.max_attempts,
        backoff_base_seconds=defaults.backoff_base_seconds / lambda_sim.SCALE,
        backoff_cap_seconds=defaults.backoff_cap_seconds / lambda_sim.SCALE,
    )
    outage = 600 / lambda_sim.SCALE
    report = lambda_sim.run(
        sim_engine,
        settings,
        Faults(),
        messages=200,
        concurrency=10,
        outage_seconds=outage,
        timeout_seconds=120,
    )
    show(report)
    assert not report.violations, report.violations
    assert report.statuses == {"delivered": 200}
    assert report.dead_never_sent == []
    assert report.refused_by_outage > 0
    assert report.first_send_after_seconds is not None
    assert report.first_send_after_seconds >= outage


def test_a_sender_that_crashes_at_init_surfaces_and_does_not_loop_forever(
    sim_engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A broken deploy: every invocation of the channel function fails at init,
    so no sender ever takes a receipt. No attempt is counted (capacity is not
    the message's fault), so nothing goes dead for it; it surfaces as the
    function's failed events (its on-failure destination, alarmed) and as the
    reaper's LeaseExpiredNotStarted metric (alarmed), and the deliver-by time
    ends the rows `expired` instead of letting them go round forever."""
    from outbox import reaper

    counted: Counter[str] = Counter()
    real_count = reaper.count

    def spy(name: str, value: float = 1) -> None:
        counted[name] += int(value)
        real_count(name, value)

    monkeypatch.setattr(reaper, "count", spy)
    report = lambda_sim.run(
        sim_engine,
        lambda_sim.sim_settings(default_ttl_seconds=6),
        Faults(init_crash=True),
        messages=40,
        concurrency=2,
        timeout_seconds=60,
    )
    show(report)
    assert not report.violations, report.violations
    assert report.statuses == {"expired": 40}
    assert report.attempt_counts == {0: 40}  # no attempt for a row never started
    assert report.sends == 0
    assert report.record.function_errors  # each crashed event: on-failure destination
    assert counted["LeaseExpiredNotStarted"] >= 40
    with sim_engine.connect() as conn:
        outcomes = dict(
            conn.execute(  # type: ignore[arg-type]
                sa.text("SELECT outcome, count(*) FROM outbox_attempt GROUP BY outcome")
            ).all()
        )
    assert outcomes.get("expired") == 40 and set(outcomes) <= {"expired", "not_started"}
