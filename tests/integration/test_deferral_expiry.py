"""Every delay a channel returns is bounded, deferrals are
counted and capped, and a message not delivered by its deliver-by time ends
``expired``."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

import outbox
from outbox import reaper, sender, states, store
from outbox.channels import Outcome
from outbox.errors import ValidationError
from outbox.handoff import HandOff
from support import (
    ScriptedChannel,
    attempts,
    claim,
    enqueue,
    install_channel,
    make_due,
    row,
    send,
    settings,
    wait_after_settle,
)


def test_a_bad_delay_from_a_channel_touches_its_own_row_only(engine: sa.Engine) -> None:
    """An infinite or NaN delay used to break the one settle statement of the
    whole batch: rows already delivered stayed claimed and were sent again."""
    bad: list[Outcome | Exception | float] = [
        Outcome.deferred("throttled", math.inf),
        Outcome("deferred", error="throttled", delay_seconds=math.nan),
        Outcome.retry("busy", delay_seconds=math.inf),
        Outcome.retry("busy", delay_seconds=-5),
        Outcome.deferred("throttled", 1e12),
        Outcome("deferred", error="throttled", delay_seconds="soon"),  # type: ignore[arg-type]
        Outcome("retry", error="busy", delay_seconds=10**400),  # type: ignore[arg-type]
    ]
    channel = install_channel(ScriptedChannel(answers=[Outcome.delivered(), *bad]))
    ids = enqueue(engine, 1 + len(bad), "scripted")
    report = send(engine, claim(engine), backoff_cap_seconds=60)
    assert report.statuses == {"delivered": 1, "deferred": 4, "pending": 3}
    assert channel.sent == [ids[0]]
    with engine.connect() as conn:
        assert row(conn, ids[0]).status == "delivered"
        waits = [wait_after_settle(conn, i) for i in ids[1:]]
        assert {row(conn, i).status for i in ids[1:]} == {"pending"}
    day = store.policy.MAX_DEFERRAL_SECONDS
    assert day - 5 <= waits[0] <= day  # inf: the longest deferral
    assert 2 <= waits[1] <= 5  # NaN: the floor
    assert 55 <= waits[2] <= 60  # a retry delay is held to the backoff cap
    assert waits[3] <= 0.5  # negative: now
    assert day - 5 <= waits[4] <= day  # 31,700 years: one day
    assert 2 <= waits[5] <= 5  # not a number: the floor
    assert 55 <= waits[6] <= 60  # beyond float range: the cap


def test_a_deferral_of_zero_waits_at_least_the_floor(engine: sa.Engine) -> None:
    """A receiver answering 503 with Retry-After: 0 cannot turn the relay into
    a hot loop of claims and hand-offs."""
    install_channel(ScriptedChannel(answers=[Outcome.deferred("503 Retry-After: 0", 0)]))
    (mid,) = enqueue(engine, channel="scripted")
    send(engine, claim(engine))
    with engine.connect() as conn:
        assert 2 <= wait_after_settle(conn, mid) <= 5
    assert claim(engine) == []


def test_deferrals_are_counted_and_capped_then_count_attempts(engine: sa.Engine) -> None:
    install_channel(ScriptedChannel(answers=[Outcome.deferred("throttled", 1)] * 20))
    (mid,) = enqueue(engine, channel="scripted", max_attempts=2)
    policy = {"max_deferrals": 3, "backoff_base_seconds": 100, "backoff_cap_seconds": 100}
    for _ in range(5):
        send(engine, claim(engine), **policy)
        make_due(engine)
    with engine.connect() as conn:
        r, history = row(conn, mid), attempts(conn, mid)
    assert (r.status, r.attempts, r.deferrals) == ("dead", 2, 5)
    assert [(a.attempt, a.outcome) for a in history] == [
        (1, "deferred"),
        (1, "deferred"),
        (1, "deferred"),
        (1, "retry"),
        (2, "dead"),
    ]
    assert history[3].error == "deferred 3 times, now counted as an attempt: throttled"


def test_a_counted_deferral_waits_at_least_the_backoff(engine: sa.Engine) -> None:
    install_channel(ScriptedChannel(answers=[Outcome.deferred("throttled", 1)] * 2))
    (mid,) = enqueue(engine, channel="scripted")
    policy = {"max_deferrals": 1, "backoff_base_seconds": 100, "backoff_cap_seconds": 100}
    send(engine, claim(engine), **policy)
    make_due(engine)
    send(engine, claim(engine), **policy)
    with engine.connect() as conn:
        assert row(conn, mid).attempts == 1
        assert 50 <= wait_after_settle(conn, mid) <= 100


def test_the_claim_never_hands_out_a_row_past_its_deliver_by_time(engine: sa.Engine) -> None:
    past = datetime.now(UTC) - timedelta(hours=1)
    late, fresh = (
        enqueue(engine, 1, "scripted", expires_at=past)[0],
        enqueue(engine, 1, "scripted", ttl=3600)[0],
    )
    assert [c.id for c in claim(engine)] == [fresh]
    report = reaper.run(engine, settings(), lambda: 30.0)
    assert report.expired == 1
    with engine.connect() as conn:
        r = row(conn, late)
        assert (r.status, r.attempts) == ("expired", 0) and r.settled_at is not None
        assert r.last_error == "deliver-by time passed before it was delivered"
        assert [(a.attempt, a.outcome) for a in attempts(conn, late)] == [(1, "expired")]


def test_the_relay_default_ttl_counts_from_when_the_row_is_first_due(engine: sa.Engine) -> None:
    delayed, ready = (
        enqueue(engine, 1, "scripted", delay=7200)[0],
        enqueue(engine, 1, "scripted")[0],
    )
    with engine.begin() as conn:  # the ready row has waited 2 hours: past a 1 h default
        conn.execute(
            sa.text(
                "UPDATE outbox_message SET available_at = now() - interval '2 hours' WHERE id = :i"
            ),
            {"i": ready},
        )
    assert claim(engine, default_ttl_seconds=3600) == []
    report = reaper.run(engine, settings(default_ttl_seconds=3600), lambda: 30.0)
    assert report.expired == 1
    with engine.connect() as conn:
        assert row(conn, ready).status == "expired"
        assert row(conn, delayed).status == "pending"  # due in 2 h: its hour starts then
    make_due(engine)
    (c,) = claim(engine, default_ttl_seconds=3600)
    with engine.connect() as conn:  # the claim writes the default down; retries do not move it
        deadline = conn.execute(
            sa.text(
                "SELECT EXTRACT(EPOCH FROM expires_at - now()) FROM outbox_message WHERE id = :i"
            ),
            {"i": delayed},
        ).scalar_one()
    assert c.id == delayed and 3590 <= float(deadline) <= 3600


def test_a_retry_whose_next_try_falls_after_the_deliver_by_time_expires_at_once(
    engine: sa.Engine,
) -> None:
    install_channel(
        ScriptedChannel(
            answers=[Outcome.retry("busy", delay_seconds=600), Outcome.deferred("slow", 600)]
        )
    )
    ids = enqueue(engine, 2, "scripted", ttl=60)
    report = send(engine, claim(engine), backoff_cap_seconds=900)
    assert report.statuses == {"expired": 2}
    with engine.connect() as conn:
        for i, kind in zip(ids, ("retry", "deferred"), strict=True):
            r = row(conn, i)
            assert r.status == "expired" and r.settled_at is not None, kind
            assert r.last_error.startswith("deliver-by time passed before the next try")
            assert [a.outcome for a in attempts(conn, i)] == ["expired"]


def test_expired_rows_are_terminal_and_an_operator_can_redrive_them(engine: sa.Engine) -> None:
    (mid,) = enqueue(
        engine, channel="scripted", expires_at=datetime.now(UTC) - timedelta(seconds=1)
    )
    reaper.run(engine, settings(), lambda: 30.0)
    with engine.begin() as conn:
        assert row(conn, mid).status == "expired"
        assert "expired" in states.TERMINAL_STATUSES
        assert store.redrive(conn, [mid]) == {mid}
        r = row(conn, mid)
    assert (r.status, r.attempts, r.deferrals, r.expires_at) == ("pending", 0, 0, None)
    assert [c.id for c in claim(engine)] == [mid]


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"expires_at": datetime(2030, 1, 1)}, "expires_at"),  # naive on purpose
        ({"expires_at": "2030-01-01T00:00:00Z"}, "expires_at"),
        ({"ttl": 0}, "ttl"),
        ({"ttl": -1}, "ttl"),
        ({"ttl": math.inf}, "ttl"),
        ({"ttl": "1h"}, "ttl"),
        ({"ttl": 60, "expires_at": datetime(2030, 1, 1, tzinfo=UTC)}, "ttl"),
    ],
)
def test_a_bad_deliver_by_time_is_refused_and_writes_nothing(
    engine: sa.Engine, options: dict[str, Any], field: str
) -> None:
    install_channel(ScriptedChannel())
    with engine.begin() as conn, pytest.raises(ValidationError) as err:
        outbox.enqueue(conn, "scripted", {"n": 1}, **options)
    assert err.value.field == field
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM outbox_message")).scalar_one() == 0


@pytest.fixture(autouse=True)
def _scripted_channel() -> None:
    install_channel(ScriptedChannel())


def test_the_default_retry_window_outlives_a_half_hour_outage(engine: sa.Engine) -> None:
    """With the production defaults, the waits between the
    attempts of a message that keeps failing add up to 30.75-61.5 minutes
    (jitter 50-100 %) before it is dead."""
    from outbox.relay_settings import RelaySettings

    defaults = RelaySettings()
    install_channel(ScriptedChannel(answers=[Outcome.retry("provider down")] * 20))
    (mid,) = enqueue(engine, channel="scripted")
    waits = []
    for _ in range(defaults.max_attempts):
        (c,) = claim(engine)
        with engine.begin() as conn:
            store.settle(
                conn,
                [store.Settlement(c.id, c.claim_token, "retry", error="provider down")],
                defaults.backoff(),
            )
            if row(conn, mid).status == "pending":
                waits.append(wait_after_settle(conn, mid))
        make_due(engine)
    with engine.connect() as conn:
        assert (row(conn, mid).status, row(conn, mid).attempts) == ("dead", 8)
    assert len(waits) == 7
    assert 1845 - 1 <= sum(waits) <= 3690
    assert max(waits) <= 1800  # the cap


def test_a_row_no_call_was_started_for_never_spends_deferrals_or_attempts(
    engine: sa.Engine,
) -> None:
    """Rows a sender never began (its deadline came first: slow calls ahead of
    them, a short Lambda) are capacity's fault, not the message's: they go back
    due at once with no attempt and no deferral counted, however often it
    happens, and only their deliver-by time bounds it."""
    install_channel(ScriptedChannel())
    (mid,) = enqueue(engine, channel="scripted")
    rounds = settings().max_deferrals + 5
    due_in = []
    for _ in range(rounds):
        # The Lambda has less time left than the settle margin: nothing may start.
        event = HandOff("scripted", tuple(claim(engine))).to_event()
        sender.run(engine, event, settings(settle_margin_seconds=0.5), lambda: 0.4)
        with engine.connect() as conn:
            due_in.append(wait_after_settle(conn, mid))
        make_due(engine)
    with engine.connect() as conn:
        r, history = row(conn, mid), attempts(conn, mid)
    assert (r.status, r.attempts, r.deferrals) == ("pending", 0, 0)
    assert r.last_error == sender.NOT_STARTED
    assert max(due_in) <= 0.0  # due again at once: another invocation may have the time
    assert {(a.outcome, a.attempt) for a in history} == {("not_started", 1)}
    assert len(history) == rounds


def test_a_deferral_counted_as_an_attempt_is_reported_as_a_retry(engine: sa.Engine) -> None:
    """The sender's report, log line and metrics say what the attempt row says."""
    install_channel(ScriptedChannel(answers=[Outcome.deferred("throttled", 1)] * 3))
    (mid,) = enqueue(engine, channel="scripted")
    policy = {"max_deferrals": 1, "backoff_base_seconds": 100, "backoff_cap_seconds": 100}
    reports = []
    for _ in range(2):
        reports.append(send(engine, claim(engine), **policy))
        make_due(engine)
    with engine.connect() as conn:
        history = attempts(conn, mid)
    assert [a.outcome for a in history] == ["deferred", "retry"]
    assert [dict(r.statuses) for r in reports] == [{"deferred": 1}, {"pending": 1}]
