"""Sleep mode under its faults, over simulated time (pacing_sim.py): lost,
duplicated and early nudges, nudges for rolled-back transactions, a wake
schedule that fires late or twice, hand-offs that never ran, a storm of
nudges. 0 lost, 0 sent twice, every delayed message sent on time, or within
the safety net's interval of its due time when every nudge and wake-up is lost."""

from __future__ import annotations

import random
import threading

import pytest
import sqlalchemy as sa

import outbox
from reliability.pacing_sim import CHANNEL, Faults, PacingSim, arrivals

HOUR = 3600.0
# Sent "on time": within the minute the wake schedule rounds up to (Scheduler's
# precision), plus the real time the simulated runs take on a busy machine
# (not a timing assert: a missed wake-up would cost up to ten minutes).
ON_TIME = 70.0


def run(engine: sa.Engine, database_url: str, faults: Faults, seed: int, **kw: float):  # type: ignore[no-untyped-def]
    sim = PacingSim(engine, database_url, faults, seed=seed, **kw)
    plan = arrivals(random.Random(seed), 24, HOUR - 1200, 900)
    return sim, sim.run(plan, HOUR)


def assert_whole(report) -> None:  # type: ignore[no-untyped-def]
    assert report.lost == []
    assert report.sent_twice == []
    assert report.sent_rolled_back == 0
    assert report.delivered == report.committed > 0


def test_with_every_nudge_and_wake_up_on_time_each_message_goes_out_when_due(
    engine: sa.Engine, database_url: str
) -> None:
    _, report = run(engine, database_url, Faults(), seed=11)
    assert_whole(report)
    # Delays are met by the wake schedule (to the minute it rounds up to),
    # not by polling: no run but those the nudges, the wake-ups and the
    # safety net started.
    # (lateness counts the run's real time too: a few seconds on a busy machine)
    assert max(report.lateness.values()) <= ON_TIME, report.lateness
    assert report.runs["outbox.wake"] > 0


def test_with_every_nudge_lost_and_no_wake_schedule_the_safety_net_delivers_within_its_interval(
    engine: sa.Engine, database_url: str
) -> None:
    sim, report = run(engine, database_url, Faults(lose_nudges=1.0), seed=12)
    sim.runtime.wake_schedule = None  # and no wake-up either: the safety net alone
    sim2 = PacingSim(engine, database_url, Faults(lose_nudges=1.0), seed=13)
    sim2.runtime.wake_schedule = None
    report2 = sim2.run(arrivals(random.Random(13), 24, HOUR - 1200, 900), HOUR)
    for r in (report, report2):
        assert_whole(r)
    assert max(report2.lateness.values()) <= sim2.safety_net, report2.lateness
    assert report2.runs["outbox.nudge"] == 0 and report2.runs["outbox.wake"] == 0
    # With the wake schedule (the first run), lost nudges cost only the
    # wait for the next scheduled run of any kind.
    assert max(report.lateness.values()) <= sim.safety_net


@pytest.mark.parametrize(
    "faults",
    [
        Faults(duplicate_nudges=0.5),
        Faults(nudge_before_commit=0.5),
        Faults(rolled_back=0.3),
        Faults(wake_late_seconds=45.0, wake_twice=True),
        Faults(lose_handoffs=0.2),
        Faults(
            lose_nudges=0.3,
            duplicate_nudges=0.3,
            nudge_before_commit=0.3,
            rolled_back=0.2,
            wake_late_seconds=20.0,
            wake_twice=True,
            lose_handoffs=0.1,
        ),
    ],
    ids=["duplicated", "before-commit", "rolled-back", "wake-late-twice", "lost-hand-offs", "all"],
)
def test_faults_lose_nothing_and_send_nothing_twice(
    engine: sa.Engine, database_url: str, faults: Faults
) -> None:
    sim, report = run(engine, database_url, faults, seed=21)
    assert_whole(report)
    # Every message within the safety net of its due time, whatever failed
    # (a lost hand-off waits for its lease, 120 s, on top).
    bound = sim.safety_net + (sim.runtime.settings.lease_seconds if faults.lose_handoffs else 0)
    assert max(report.lateness.values()) <= bound, report.lateness
    if faults.wake_late_seconds and not faults.lose_nudges:
        assert max(report.lateness.values()) <= faults.wake_late_seconds + ON_TIME


def test_a_storm_of_nudges_runs_at_most_the_reserved_concurrency(
    engine: sa.Engine, database_url: str
) -> None:
    """500 messages committed at once and 200 nudges from 40 threads at once:
    at most two dispatcher runs at a time (the others throttled and dropped),
    never one run per nudge, and every message sent once."""
    sim = PacingSim(engine, database_url, Faults(), concurrency=2)
    with engine.begin() as conn:
        ids = outbox.enqueue_many(conn, [{"channel": CHANNEL, "payload": {"n": 1}}] * 500)
    barrier = threading.Barrier(40)

    def nudges() -> None:
        barrier.wait()
        for _ in range(5):
            sim.dispatch("outbox.nudge")

    threads = [threading.Thread(target=nudges) for _ in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    while sim.successors:  # a run out of budget started its successor
        sim.successors.clear()
        sim.dispatch("outbox.successor")
    report = sim.report
    assert report.max_concurrent_runs <= 2
    assert report.runs["outbox.nudge"] + report.runs["throttled"] == 200
    assert report.runs["outbox.nudge"] < 100 < report.runs["throttled"]
    sends = sorted(sim.channel.sent)
    assert sends == sorted(ids)
