"""Outcome events: one EventBridge event per transition to failed, dead,
expired, bounced or complained (delivered when turned on), published by the
reaper. Real Postgres; EventBridge in moto, read back through a rule whose
target is an SQS queue."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
import sqlalchemy as sa
from logscan import find_leaks
from outcome_support import BACKOFF, BUS, Bus, lease_ends, settle_all

import outbox
from outbox import feedback, reaper, store
from outbox.relay_settings import OutcomeEventSettings
from support import EMAIL, enqueue, expire_leases, receive, settings


@pytest.fixture
def bus(aws: None) -> Bus:
    return Bus()


ON = OutcomeEventSettings(bus=BUS)


def reap(engine: sa.Engine, client: Any = None, events: OutcomeEventSettings = ON) -> Any:
    client = client or boto3.client("events")
    return reaper.run(engine, settings(), lambda: 30.0, events, lambda: client)


def waiting(engine: sa.Engine) -> list[sa.Row[Any]]:
    with engine.connect() as conn:
        return conn.execute(sa.text("SELECT * FROM outbox_outcome_event ORDER BY id")).all()


def bounce_event(provider_id: str, kind: str = "Bounce") -> dict[str, Any]:
    """An SES notice about EMAIL's recipient (feedback counts only those)."""
    recipients = [{"emailAddress": to} for to in EMAIL["to"]]
    part = (
        {
            "bounce": {
                "bounceType": "Permanent",
                "bounceSubType": "General",
                "feedbackId": "f1",
                "bouncedRecipients": recipients,
            }
        }
        if kind == "Bounce"
        else {
            "complaint": {
                "complaintFeedbackType": "abuse",
                "feedbackId": "f2",
                "complainedRecipients": recipients,
            }
        }
    )
    message = {"eventType": kind, "mail": {"messageId": provider_id}, **part}
    return {"Records": [{"EventSource": "aws:sns", "Sns": {"Message": json.dumps(message)}}]}


def test_every_kind_of_transition_publishes_one_event_and_never_the_payload(
    engine: sa.Engine, bus: Bus
) -> None:
    failed, dead, reaped, bounced, complained, delivered = enqueue(
        engine, 6, dedupe_key=None, ordering_key=None
    )
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE outbox_message SET max_attempts = 1 WHERE id = ANY(:ids)"),
            {"ids": [dead, reaped]},
        )
        conn.execute(
            sa.text(
                "UPDATE outbox_message SET dedupe_key = 'order-42', ordering_key = 'c-7' "
                "WHERE id = :id"
            ),
            {"id": failed},
        )
    # Claim everything; the reaped one is left to its lease.
    with engine.begin() as conn:
        claims = {c.id: c for c in store.claim(conn, 100, 60)}
    with engine.begin() as conn:
        store.settle(
            conn,
            [
                store.Settlement(failed, claims[failed].claim_token, "failed", "MessageRejected"),
                store.Settlement(dead, claims[dead].claim_token, "retry", "InternalFailure"),
                *[
                    store.Settlement(i, claims[i].claim_token, "delivered", None, f"ses-{i}")
                    for i in (bounced, complained, delivered)
                ],
            ],
            BACKOFF,
        )
    receive(engine, [claims[reaped]])  # its sender started, then died
    expire_leases(engine, [reaped])
    feedback.handle(engine, bounce_event(f"ses-{bounced}"))
    feedback.handle(engine, bounce_event(f"ses-{complained}", "Complaint"))

    report = reap(engine)

    assert report.dead == 1 and report.events_published == 5 and report.events_waiting == 0
    got = bus.received()
    by_id = {e["detail"]["id"]: e for e in got}
    assert len(got) == 5 and set(by_id) == {failed, dead, reaped, bounced, complained}
    assert {i: (e["detail-type"], e["detail"]["status"]) for i, e in by_id.items()} == {
        failed: ("Outbox Message Failed", "failed"),
        dead: ("Outbox Message Dead", "dead"),
        reaped: ("Outbox Message Dead", "dead"),
        bounced: ("Outbox Message Bounced", "bounced"),
        complained: ("Outbox Message Complained", "complained"),
    }
    assert all(e["source"] == "outbox.relay" for e in got)
    assert by_id[failed]["detail"] == {
        "version": 2,
        "event_id": by_id[failed]["detail"]["event_id"],
        "id": failed,
        "channel": "email",
        "status": "failed",
        "attempts": 1,
        "last_error": "MessageRejected",
        "provider_message_id": None,
        "occurred_at": by_id[failed]["detail"]["occurred_at"],
        "tenant": None,
    }  # no dedupe or ordering key: OUTCOME_EVENTS_INCLUDE_KEYS is off by default
    assert by_id[bounced]["detail"]["provider_message_id"] == f"ses-{bounced}"
    assert by_id[reaped]["detail"]["last_error"] == store.LEASE_EXPIRED_ERROR
    for event in got:  # no payload, address or token in anything the relay wrote
        assert find_leaks(event["detail"]) == [], event

    # Published once: the next run finds nothing, and so does a second publisher.
    assert reap(engine).events_published == 0 and bus.received() == []
    assert waiting(engine) == []


def test_delivered_is_published_only_when_turned_on(engine: sa.Engine, bus: Bus) -> None:
    enqueue(engine, 1)
    settle_all(engine, "delivered")
    assert waiting(engine) == []  # off by default: a delivery costs no event row
    with engine.begin() as conn:
        assert store.set_delivered_outcome_events(conn, True) is True
        assert store.set_delivered_outcome_events(conn, True) is False  # already on
    try:
        (second,) = enqueue(engine, 1)
        settle_all(engine, "delivered")
        assert reap(engine).events_published == 1
    finally:
        with engine.begin() as conn:
            store.set_delivered_outcome_events(conn, False)
    (event,) = bus.received()
    assert event["detail-type"] == "Outbox Message Delivered"
    assert (
        event["detail"]["id"] == second and event["detail"]["provider_message_id"] == f"p-{second}"
    )


def test_a_retry_is_published_only_when_turned_on_with_when_it_is_due(
    engine: sa.Engine, bus: Bus
) -> None:
    enqueue(engine, 1)
    settle_all(engine, "retry", "timed out")
    assert waiting(engine) == []  # off by default: a retry costs no event row
    with engine.begin() as conn:
        assert store.set_retrying_outcome_events(conn, True) is True
        assert store.set_retrying_outcome_events(conn, True) is False  # already on
    (second,) = enqueue(engine, 1)
    settle_all(engine, "retry", "timed out")  # the first message is not due yet
    with engine.connect() as conn:
        due = conn.execute(
            sa.text("SELECT attempts, available_at FROM outbox_message WHERE id = :id"),
            {"id": second},
        ).one()
    with engine.begin() as conn:
        # a deferred send counts no attempt: no event
        conn.execute(
            sa.text("UPDATE outbox_message SET available_at = now() WHERE id = :id"),
            {"id": second},
        )
        claims = store.claim(conn, 10, 60)
        deferred = [store.Settlement(c.id, c.claim_token, "deferred") for c in claims]
        assert store.settle(conn, deferred, BACKOFF) == {second: "pending"}
    assert reap(engine).events_published == 1
    (event,) = bus.received()
    assert event["detail-type"] == "Outbox Message Retrying"
    assert (event["detail"]["id"], event["detail"]["status"]) == (second, "retrying")
    assert (event["detail"]["attempts"], event["detail"]["last_error"]) == (1, "timed out")
    assert event["detail"]["retry_at"] == due.available_at.isoformat() and due.attempts == 1


def test_migrate_switches_the_delivered_event_as_configured(
    migrated_engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    from outbox import migrate

    query = sa.text(
        "SELECT tgenabled FROM pg_trigger WHERE tgname = 'outbox_message_delivered_event'"
    )
    retrying = sa.text(
        "SELECT tgenabled FROM pg_trigger WHERE tgname = 'outbox_message_retrying_event'"
    )
    monkeypatch.setenv("OUTCOME_EVENTS_DELIVERED", "true")
    monkeypatch.setenv("OUTCOME_EVENTS_RETRYING", "true")
    try:
        migrate.upgrade(migrated_engine)
        with migrated_engine.connect() as conn:
            assert conn.execute(query).scalar() == "O"  # enabled
            assert conn.execute(retrying).scalar() == "O"
    finally:
        monkeypatch.delenv("OUTCOME_EVENTS_DELIVERED")
        monkeypatch.delenv("OUTCOME_EVENTS_RETRYING")
        migrate.upgrade(migrated_engine)
    with migrated_engine.connect() as conn:
        assert conn.execute(query).scalar() == "D"
        assert conn.execute(retrying).scalar() == "D"


def test_a_transition_committed_late_is_still_published(engine: sa.Engine, bus: Bus) -> None:
    """Event rows are numbered when written, not when committed: a cursor over
    the ids would skip the early number committed last. The lease does not."""
    early, late = enqueue(engine, 2)
    with engine.begin() as conn:
        claims = {c.id: c for c in store.claim(conn, 10, 60)}
    slow = engine.connect()
    slow_txn = slow.begin()
    store.settle(
        slow, [store.Settlement(early, claims[early].claim_token, "failed", "x")], BACKOFF
    )  # its event row takes the lower id, uncommitted
    with engine.begin() as conn:
        store.settle(
            conn, [store.Settlement(late, claims[late].claim_token, "failed", "y")], BACKOFF
        )
    assert reap(engine).events_published == 1
    slow_txn.commit()
    slow.close()
    assert reap(engine).events_published == 1
    assert [e["detail"]["id"] for e in bus.received()] == [late, early]
    assert waiting(engine) == []


class Killed(BaseException):
    """The publisher's process ending right after EventBridge accepted a batch."""


class DiesAfterPutEvents:
    def __init__(self, client: Any) -> None:
        self.client = client

    def put_events(self, **kwargs: Any) -> Any:
        self.client.put_events(**kwargs)
        raise Killed


def test_a_publisher_killed_after_put_events_publishes_again_with_the_same_event_ids(
    engine: sa.Engine, bus: Bus
) -> None:
    ids = enqueue(engine, 12)
    assert set(settle_all(engine, "failed", "MessageRejected")) == set(ids)
    with pytest.raises(Killed):
        reap(engine, DiesAfterPutEvents(boto3.client("events")))
    first = bus.received()
    assert len(first) == 10  # the first PutEvents (ten entries) went out, then it died

    # While the dead publisher's lease lasts, nobody publishes its events.
    assert reap(engine).events_published == 0 and bus.received() == []
    lease_ends(engine)
    assert reap(engine).events_published == 12
    second = bus.received()
    assert reap(engine).events_published == 0 and bus.received() == []

    copies = Counter(e["detail"]["event_id"] for e in first + second)
    assert len(copies) == 12  # every transition published
    # Exactly the ten in flight when it died went twice, with the same event id.
    assert sorted(copies.values()) == [1, 1] + [2] * 10
    assert {e["detail"]["event_id"] for e in first} == {k for k, n in copies.items() if n == 2}


def test_a_bus_that_refuses_delays_the_events_and_never_the_relay(
    engine: sa.Engine, aws: None
) -> None:
    ids = enqueue(engine, 3)
    with engine.begin() as conn:
        claims = store.claim(conn, 10, 60)
    settle_all_ids = {c.id for c in claims}
    assert settle_all_ids == set(ids)
    with engine.begin() as conn:
        store.settle(
            conn, [store.Settlement(claims[0].id, claims[0].claim_token, "failed", "x")], BACKOFF
        )
    receive(engine, claims[1:])  # their senders started, then died
    expire_leases(engine, [c.id for c in claims[1:]])

    report = reap(engine)  # no bus "outbox-outcomes" in this account yet
    assert report.reclaimed == 2  # the reaper's own work is done regardless
    assert report.events_published == 0 and report.events_refused == 1
    (event,) = waiting(engine)
    assert event.publish_attempts == 1 and event.publish_error

    bus = Bus()
    assert reap(engine).events_published == 0  # the lease is its back-off
    lease_ends(engine)
    assert reap(engine).events_published == 1
    assert [e["detail"]["id"] for e in bus.received()] == [claims[0].id]


def test_with_publishing_off_events_are_dropped_after_the_retention(engine: sa.Engine) -> None:
    ids = enqueue(engine, 2)
    settle_all(engine, "failed", "x")
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE outbox_outcome_event SET occurred_at = now() - interval '8 days' "
                "WHERE message_id = :id"
            ),
            {"id": ids[0]},
        )
    report = reaper.run(engine, settings(), lambda: 30.0)  # no bus: publishing off
    assert report.events_dropped == 1 and report.events_waiting == 1
    assert [e.message_id for e in waiting(engine)] == [ids[1]]


def test_publishers_never_share_an_event(engine: sa.Engine) -> None:
    enqueue(engine, 3)
    settle_all(engine, "failed", "x")
    with engine.begin() as first, engine.begin() as second:
        taken_first = store.take_outcome_events(first, 2, 300)
        taken_second = store.take_outcome_events(second, 10, 300)  # skips the locked rows
    assert len(taken_first) == 2 and len(taken_second) == 1
    assert {e.id for e in taken_first}.isdisjoint(e.id for e in taken_second)


@pytest.fixture(autouse=True)
def _no_leftover_trigger(migrated_engine: sa.Engine) -> Iterator[None]:
    yield
    with migrated_engine.begin() as conn:
        store.set_delivered_outcome_events(conn, False)
        store.set_retrying_outcome_events(conn, False)


def test_the_worker_publishes_them_too(engine: sa.Engine, bus: Bus) -> None:
    from outbox.worker import Worker

    (failed,) = enqueue(engine, 1)
    settle_all(engine, "failed", "x")
    Worker(engine, settings(), channels=["email"], outcome_events=ON).reap()
    assert [e["detail"]["id"] for e in bus.received()] == [failed]


def test_a_message_past_its_deliver_by_time_publishes_expired(engine: sa.Engine, bus: Bus) -> None:
    from datetime import UTC, datetime, timedelta

    with engine.begin() as conn:
        late = outbox.enqueue(
            conn, "email", EMAIL, expires_at=datetime.now(UTC) - timedelta(hours=1)
        )
    report = reap(engine)
    assert report.expired == 1 and report.events_published == 1
    (event,) = bus.received()
    assert event["detail-type"] == "Outbox Message Expired"
    assert (event["detail"]["id"], event["detail"]["status"]) == (late, "expired")


def test_a_message_the_cooldown_suppressed_publishes_suppressed(
    engine: sa.Engine, bus: Bus
) -> None:
    # Issue 31, item 10: suppressed was the one final outcome never published.
    with engine.begin() as conn:
        first = outbox.enqueue(conn, "email", EMAIL, cooldown_key="k", cooldown=3600)
    with engine.begin() as conn:
        (claimed,) = store.claim(conn, 10, 120)
        store.settle(
            conn, [store.Settlement(claimed.id, claimed.claim_token, "delivered")], BACKOFF
        )
    with engine.begin() as conn:
        later = outbox.enqueue(
            conn, "email", EMAIL, cooldown_key="k", cooldown=3600, on_cooldown="suppress"
        )
    with engine.begin() as conn:
        assert store.claim(conn, 10, 120) == []
    report = reap(engine)
    assert report.events_published == 1
    (event,) = bus.received()
    assert event["detail-type"] == "Outbox Message Suppressed"
    assert (event["detail"]["id"], event["detail"]["status"]) == (later, "suppressed")
    assert first != later


# --- no free text or producer keys on the bus (issue 23, finding 6) -----------


def test_outcome_events_carry_scrubbed_errors_and_keys_only_when_asked(
    engine: sa.Engine, bus: Bus
) -> None:
    chatty, keyed = enqueue(engine, 2, dedupe_key=None, ordering_key=None)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE outbox_message SET dedupe_key = 'ada@example.net', "
                "ordering_key = 'customer +44 20 7946 0958/' || id WHERE id = ANY(:ids)"
            ),
            {"ids": [chatty, keyed]},
        )
    with engine.begin() as conn:
        claims = {c.id: c for c in store.claim(conn, 100, 60)}
    # Settled straight through the store, as a message settled before the
    # sender scrubbed errors was: the publisher scrubs again.
    gateway = "refused +1 (415) 555-2671 code 482913 for Ada <ada@example.net> " + "x" * 5000
    with engine.begin() as conn:
        store.settle(
            conn,
            [
                store.Settlement(i, claims[i].claim_token, "failed", gateway, f"Ada {i} <a@b.c>")
                for i in (chatty, keyed)
            ],
            BACKOFF,
        )
        conn.execute(  # a second event for `keyed`, published with the keys
            sa.text("DELETE FROM outbox_outcome_event WHERE message_id = :id"), {"id": keyed}
        )
    reap(engine)
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE outbox_message SET status = 'dead' WHERE id = :id"), {"id": keyed}
        )
    reap(engine, events=OutcomeEventSettings(bus=BUS, include_keys=True))

    default, opted_in = (e["detail"] for e in bus.received())
    assert default["id"] == chatty and opted_in["id"] == keyed
    assert "dedupe_key" not in default and "ordering_key" not in default
    assert (opted_in["dedupe_key"], opted_in["ordering_key"]) == (
        "ada@example.net",
        f"customer +44 20 7946 0958/{keyed}",
    )
    for detail in (default, opted_in):
        assert detail["last_error"].startswith("refused <number> code <number> for <address>")
        assert len(detail["last_error"]) <= 200
        assert detail["provider_message_id"] is None  # free text, not a provider's token
    assert find_leaks(default) == []


def test_a_custom_channels_provider_id_stays_off_the_bus() -> None:
    import dataclasses
    from datetime import UTC, datetime

    from outbox import outcomes

    custom = store.OutcomeEvent(
        1, 7, "memo", "failed", 1, None, "15551234567", "k", "o", datetime.now(UTC)
    )
    sqs = dataclasses.replace(
        custom, channel="sqs", provider_message_id="b6f0b8a4-1c2d-4e5f-8a9b-0c1d2e3f4a5b"
    )
    assert outcomes.detail(custom)["provider_message_id"] is None
    assert outcomes.detail(sqs)["provider_message_id"] == sqs.provider_message_id
