"""Pausing a channel: the claim (dispatcher and worker alike) leaves its rows
pending with no attempt counted; resuming lets them go. Per-channel backlog
figures, paused channels included, come from one grouped statement."""

from __future__ import annotations

import threading

import sqlalchemy as sa

from outbox import store
from outbox.dispatcher import dispatch_once
from outbox.handoff import CallableInvoker
from outbox.worker import Worker
from support import ScriptedChannel, enqueue, expire_leases, install_channel, settings


def rows(engine: sa.Engine) -> dict[int, tuple[str, int]]:
    with engine.connect() as conn:
        result = conn.execute(sa.text("SELECT id, status, attempts FROM outbox_message")).all()
    return {r.id: (r.status, r.attempts) for r in result}


def attempt_count(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM outbox_attempt")).scalar_one())


def test_a_paused_channel_is_not_claimed_and_resume_releases_it(engine: sa.Engine) -> None:
    emails = enqueue(engine, 3, "email")
    sms = enqueue(engine, 2, "sms", {"to": "+15555550100", "message": "hi"})
    with engine.begin() as conn:
        assert store.pause_channel(conn, "email", "provider incident") is True
    with engine.begin() as conn:
        claimed = store.claim(conn, 100, 60)
    assert sorted(c.id for c in claimed) == sorted(sms)
    with engine.begin() as conn:  # the paused rows stay pending and untouched
        assert store.claim(conn, 100, 60) == []
    assert {i: rows(engine)[i] for i in emails} == {i: ("pending", 0) for i in emails}

    with engine.begin() as conn:
        assert store.resume_channel(conn, "email") is True
        assert store.resume_channel(conn, "email") is False  # already resumed
    with engine.begin() as conn:
        assert sorted(c.id for c in store.claim(conn, 100, 60)) == sorted(emails)


def test_pausing_twice_keeps_the_first_time_and_a_given_reason(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        assert store.pause_channel(conn, "sms", "carrier outage") is True
    with engine.begin() as conn:
        first = store.paused_channels(conn)
    with engine.begin() as conn:
        assert store.pause_channel(conn, "sms") is False
        assert store.paused_channels(conn) == first  # no reason given: the old one stays
        assert store.pause_channel(conn, "sms", "still down") is False
        [again] = store.paused_channels(conn)
    assert (again.channel, again.reason, again.paused_at) == (
        "sms",
        "still down",
        first[0].paused_at,
    )


def test_bad_channel_names_are_refused_and_change_nothing(engine: sa.Engine) -> None:
    import pytest

    for bad in ("Email", "", "x" * 65, "e'mail; DROP TABLE outbox_message"):
        with pytest.raises(ValueError, match="not a channel name"), engine.begin() as conn:
            store.pause_channel(conn, bad)
    with engine.connect() as conn:
        assert store.paused_channels(conn) == []


def test_the_dispatcher_leaves_paused_rows_pending_without_an_attempt(engine: sa.Engine) -> None:
    ids = enqueue(engine, 4, "email")
    handed: list[dict[str, object]] = []
    invoker = CallableInvoker({"email": handed.append})
    with engine.begin() as conn:
        store.pause_channel(conn, "email")
    report = dispatch_once(engine, invoker, settings())
    assert (report.claimed, handed) == (0, [])
    assert rows(engine) == {i: ("pending", 0) for i in ids}
    assert attempt_count(engine) == 0

    with engine.begin() as conn:
        store.resume_channel(conn, "email")
    assert dispatch_once(engine, invoker, settings()).claimed == 4


def test_a_claim_taken_before_the_pause_is_still_reaped_as_usual(engine: sa.Engine) -> None:
    """A pause does not touch claims in flight: their lease rules are unchanged."""
    [message_id] = enqueue(engine, 1, "email")
    with engine.begin() as conn:
        store.claim(conn, 10, 60)
        store.pause_channel(conn, "email")
    expire_leases(engine)
    with engine.begin() as conn:
        released = store.reap_expired(conn, 10, store.Backoff(0, 0, 5))
    assert {i: r.status for i, r in released.items()} == {message_id: "pending"}
    with engine.begin() as conn:  # back to pending, and the pause now holds it
        conn.execute(sa.text("UPDATE outbox_message SET available_at = now()"))
        assert store.claim(conn, 10, 60) == []


def test_the_worker_honours_a_pause(engine: sa.Engine) -> None:
    channel = install_channel(ScriptedChannel())
    held = enqueue(engine, 3, "scripted", {"n": 1})
    with engine.begin() as conn:
        store.pause_channel(conn, "scripted", "review")
    worker = Worker(engine, settings(), stop=threading.Event(), reap_interval_seconds=3600)
    worker.run(until_empty=True)
    assert channel.sent == []
    assert rows(engine) == {i: ("pending", 0) for i in held}

    with engine.begin() as conn:
        store.resume_channel(conn, "scripted")
    worker.run(until_empty=True)
    assert sorted(channel.sent) == sorted(held)
    assert rows(engine) == {i: ("delivered", 1) for i in held}


def test_channel_backlog_groups_every_channel_and_lists_paused_ones(engine: sa.Engine) -> None:
    enqueue(engine, 3, "email")
    enqueue(engine, 1, "sms", {"to": "+15555550100", "message": "hi"})
    with engine.begin() as conn:
        [first, *_] = store.claim(conn, 1, 60, ["email"])
        store.pause_channel(conn, "email")
        store.pause_channel(conn, "push")  # no rows at all
        conn.execute(
            sa.text(
                "UPDATE outbox_message SET available_at = now() - interval '90 seconds' "
                "WHERE channel = 'sms'"
            )
        )
    expire_leases(engine, [first.id])
    with engine.connect() as conn:
        figures = {b.channel: b for b in store.channel_backlog(conn)}
    assert sorted(figures) == ["email", "push", "sms"]
    email, push, sms = figures["email"], figures["push"], figures["sms"]
    assert (email.pending, email.due, email.claimed, email.expired_claims, email.paused) == (
        2,
        2,
        1,
        1,
        True,
    )
    assert (push.pending, push.claimed, push.dead, push.paused) == (0, 0, 0, True)
    assert (sms.pending, sms.paused) == (1, False)
    assert 89 < sms.oldest_due_age_seconds < 120
