"""Dedupe scoped to the recipient against the real database:
a key names an event, one event fans out to many recipients, a replay comes
back as the existing message, and a different payload under the same key and
recipient is refused without writing anything."""

from __future__ import annotations

import hashlib
import hmac
import threading
from typing import Any

import pytest
import sqlalchemy as sa

import outbox
from outbox import DedupeConflict, Enqueued, store
from support import EMAIL, waits_on_a_lock


def email_to(*addresses: str, **extra: Any) -> dict[str, Any]:
    return {**EMAIL, "to": list(addresses), **extra}


def counts(engine: sa.Engine) -> tuple[int, int]:
    with engine.connect() as conn:
        return (
            conn.execute(sa.text("SELECT count(*) FROM outbox_message")).scalar_one(),
            conn.execute(sa.text("SELECT count(*) FROM outbox_dedupe")).scalar_one(),
        )


def shipped(recipients: list[str]) -> list[dict[str, Any]]:
    """One event ("order 42 shipped"), one message per recipient."""
    return [
        {"channel": "email", "payload": email_to(r), "dedupe_key": "order-42-shipped"}
        for r in recipients
    ]


def test_a_replayed_producer_transaction_creates_no_second_message_per_recipient(
    engine: sa.Engine,
) -> None:
    recipients = ["ada@example.net", "grace@example.org", "alan@example.com"]

    def producer_transaction() -> list[Enqueued]:
        with engine.begin() as conn:
            conn.execute(sa.text("SELECT 1"))  # the application's own change
            return outbox.enqueue_many(conn, shipped(recipients), return_created=True)

    first = producer_transaction()
    replay = producer_transaction()
    assert [r.created for r in first] == [True, True, True]
    assert len({r.id for r in first}) == 3
    assert replay == [Enqueued(r.id, False) for r in first]
    assert counts(engine) == (3, 3)
    # enqueue keeps its plain int by default
    with engine.begin() as conn:
        again = outbox.enqueue(conn, **shipped(recipients)[1])
    assert again == first[1].id and type(again) is int


def test_fifty_recipients_under_one_event_key_make_fifty_messages(engine: sa.Engine) -> None:
    recipients = [f"customer{i}@example.net" for i in range(50)]
    with engine.begin() as conn:
        ids = outbox.enqueue_many(conn, shipped(recipients))
    assert len(set(ids)) == 50 and counts(engine) == (50, 50)
    # one at a time too, and the same for a channel with another recipient field
    with engine.begin() as conn:
        sms = [
            outbox.enqueue(
                conn,
                "sms",
                {"to": f"+1555555{i:04d}", "message": "shipped"},
                dedupe_key="order-42-shipped",
            )
            for i in range(50)
        ]
    assert len(set(sms) | set(ids)) == 100 and counts(engine) == (100, 100)


def test_a_conflicting_payload_is_refused_and_writes_nothing(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        held = outbox.enqueue(conn, "email", email_to("ada@example.net"), dedupe_key="k-1")
    before = counts(engine)
    with engine.begin() as conn:
        with pytest.raises(DedupeConflict) as caught:
            outbox.enqueue_many(
                conn,
                [
                    {"channel": "email", "payload": email_to("new@example.net")},
                    {"channel": "email", "payload": email_to("x@example.net"), "dedupe_key": "k-2"},
                    {
                        "channel": "email",
                        "payload": email_to("ada@example.net", subject="Changed"),
                        "dedupe_key": "k-1",
                    },
                ],
            )
        error = caught.value
        assert isinstance(error, outbox.ValidationError)
        assert error.field == "messages[2].dedupe_key" and error.dedupe_key == "k-1"
        assert error.existing_id == held and "'k-1'" in str(error)
        assert "ada@example.net" not in str(error)  # the key is named, never the address
        # the caller's transaction is still usable and nothing of the list was written
        assert outbox.enqueue(conn, "email", email_to("later@example.net")) > held
    assert counts(engine) == (before[0] + 1, before[1])

    with engine.begin() as conn, pytest.raises(DedupeConflict) as caught:
        outbox.enqueue(conn, "email", email_to("ada@example.net", text="other"), dedupe_key="k-1")
    assert caught.value.field == "dedupe_key" and caught.value.existing_id == held


def test_a_conflict_within_one_list_names_both_messages_and_writes_nothing(
    engine: sa.Engine,
) -> None:
    with engine.begin() as conn, pytest.raises(DedupeConflict) as caught:
        outbox.enqueue_many(
            conn,
            [
                {"channel": "email", "payload": email_to("ada@example.net"), "dedupe_key": "k"},
                {"channel": "email", "payload": email_to("bob@example.net"), "dedupe_key": "k"},
                {
                    "channel": "email",
                    "payload": email_to("ada@example.net", subject="2"),
                    "dedupe_key": "k",
                },
            ],
        )
    assert caught.value.field == "messages[2].dedupe_key"
    assert caught.value.first_index == 0 and caught.value.existing_id is None
    assert "messages[0]" in str(caught.value)
    assert counts(engine) == (0, 0)
    # the same payload twice in one list is one message
    with engine.begin() as conn:
        ids = outbox.enqueue_many(
            conn,
            [{"channel": "email", "payload": email_to("ada@example.net"), "dedupe_key": "k"}] * 2,
            return_created=True,
        )
    assert ids[0].created and ids[1] == Enqueued(ids[0].id, False)


def _race(
    engine: sa.Engine, first: list[dict[str, Any]], second: list[dict[str, Any]], commit: bool
) -> tuple[list[Enqueued], Any]:
    """``first`` is enqueued and held uncommitted while ``second`` runs in
    another transaction (it waits on the key's index entry); then ``first``
    commits or rolls back. Returns first's results and second's outcome."""
    outcome: dict[str, Any] = {}
    conn = engine.connect()
    tx = conn.begin()
    mine = outbox.enqueue_many(conn, first, return_created=True)

    def other() -> None:
        try:
            with engine.begin() as c:
                outcome["result"] = outbox.enqueue_many(c, second, return_created=True)
        except Exception as exc:
            outcome["result"] = exc

    thread = threading.Thread(target=other)
    thread.start()
    # the other transaction is now blocked on our uncommitted key
    assert waits_on_a_lock(engine, thread), (
        "the second enqueue should wait for the first transaction's key"
    )
    (tx.commit if commit else tx.rollback)()
    conn.close()
    thread.join(10)
    return mine, outcome["result"]


def test_concurrent_enqueues_of_the_same_key_and_recipient_yield_one_row(
    engine: sa.Engine,
) -> None:
    message = {"channel": "email", "payload": email_to("ada@example.net"), "dedupe_key": "k"}
    mine, theirs = _race(engine, [message], [message], commit=True)
    assert theirs == [Enqueued(mine[0].id, False)]
    assert counts(engine) == (1, 1)


def test_a_concurrent_conflict_takes_back_everything_the_loser_wrote(engine: sa.Engine) -> None:
    message = {"channel": "email", "payload": email_to("ada@example.net"), "dedupe_key": "k"}
    changed = {**message, "payload": email_to("ada@example.net", subject="other")}
    unkeyed = {"channel": "email", "payload": email_to("bob@example.net")}
    fresh_key = {"channel": "email", "payload": email_to("bob@example.net"), "dedupe_key": "k2"}
    mine, theirs = _race(engine, [message], [unkeyed, fresh_key, changed], commit=True)
    assert isinstance(theirs, DedupeConflict) and theirs.existing_id == mine[0].id
    assert theirs.field == "messages[2].dedupe_key"
    assert counts(engine) == (1, 1)


def test_a_key_whose_holder_rolled_back_is_free(engine: sa.Engine) -> None:
    message = {"channel": "email", "payload": email_to("ada@example.net"), "dedupe_key": "k"}
    mine, theirs = _race(engine, [message], [message], commit=False)
    assert theirs[0].created and theirs[0].id != mine[0].id
    assert counts(engine) == (1, 1)


# --- who the recipient is, per channel ------------------------------------------


def fingerprint(engine: sa.Engine, channel: str, payload: dict[str, Any]) -> bytes:
    with engine.connect() as conn:
        return bytes(
            conn.execute(
                sa.text("SELECT outbox_recipient_fingerprint(:c, CAST(:p AS jsonb))"),
                {"c": channel, "p": store.payload_json(payload)},
            ).scalar_one()
        )


SAME_RECIPIENT = [
    (
        "email",
        email_to("Ada@Example.NET", "bob@example.net"),
        {**EMAIL, "to": ["bob@example.net"], "cc": ["ada@example.net"], "subject": "x"},
    ),
    ("email", email_to("ada@example.net", "ada@example.net"), email_to("ada@example.net")),
    ("sms", {"to": "+15555550100", "message": "a"}, {"to": "+15555550100", "message": "b"}),
    ("push", {"endpoint_arn": "arn:e/1", "body": "a"}, {"endpoint_arn": "arn:e/1", "body": "b"}),
    (
        "webhook",
        {"url": "https://a.example/h", "event_type": "t", "body": {}},
        {"url": "https://a.example/h", "event_type": "u", "body": {"x": 1}},
    ),
    (
        "eventbridge",
        {"source": "shop", "detail_type": "Shipped", "detail": {"a": 1}},
        {"source": "shop", "detail_type": "Shipped", "detail": {"a": 2}},
    ),
    (
        "sqs",
        {"queue_url": "https://sqs/q", "body": "a"},
        {"queue_url": "https://sqs/q", "body": "b"},
    ),
    ("custom", {"anything": 1}, {"anything": 2}),  # a channel SQL does not know: channel-wide
]
OTHER_RECIPIENT = [
    ("email", email_to("ada@example.net"), email_to("ada@example.net", "bob@example.net")),
    ("email", email_to("ada@example.net"), {**EMAIL, "to": ["bob@example.net"]}),
    ("sms", {"to": "+15555550100"}, {"to": "+15555550101"}),
    ("push", {"endpoint_arn": "arn:e/1"}, {"endpoint_arn": "arn:e/2"}),
    ("webhook", {"url": "https://a.example/h"}, {"url": "https://a.example/H"}),
    (
        "eventbridge",
        {"source": "shop", "detail_type": "Shipped"},
        {"source": "shop", "detail_type": "Returned"},
    ),
    (
        "eventbridge",
        {"source": "shop", "detail_type": "S"},
        {"source": "shop", "detail_type": "S", "event_bus": "audit"},
    ),
    ("sqs", {"queue_url": "https://sqs/q1"}, {"queue_url": "https://sqs/q2"}),
]


@pytest.mark.parametrize(("channel", "a", "b"), SAME_RECIPIENT)
def test_each_channel_names_the_same_recipient_the_same_way(
    engine: sa.Engine, channel: str, a: dict[str, Any], b: dict[str, Any]
) -> None:
    assert fingerprint(engine, channel, a) == fingerprint(engine, channel, b)


@pytest.mark.parametrize(("channel", "a", "b"), OTHER_RECIPIENT)
def test_each_channel_tells_recipients_apart(
    engine: sa.Engine, channel: str, a: dict[str, Any], b: dict[str, Any]
) -> None:
    assert fingerprint(engine, channel, a) != fingerprint(engine, channel, b)


def test_the_fingerprint_is_an_hmac_under_the_installations_key(engine: sa.Engine) -> None:
    with engine.connect() as conn:
        key = bytes(conn.execute(sa.text("SELECT key FROM outbox_fingerprint_key")).scalar_one())
        stored = conn.execute(
            sa.text("SELECT outbox_fingerprint('ada@example.net'), outbox_fingerprint('')")
        ).one()
    assert len(key) == 32 and key != bytes(32)
    expected = [hmac.new(key, m, hashlib.sha256).digest() for m in (b"ada@example.net", b"")]
    assert [bytes(v) for v in stored] == expected
    assert fingerprint(engine, "email", email_to("Ada@example.net")) == expected[0]
    with engine.begin() as conn:
        message_id = outbox.enqueue(conn, "email", email_to("b@example.net", "ada@example.net"))
        (fps,) = conn.execute(
            sa.text("SELECT recipient_fingerprints FROM outbox_message WHERE id = :id"),
            {"id": message_id},
        ).one()
    assert [bytes(f) for f in fps] == [
        expected[0],
        hmac.new(key, b"b@example.net", hashlib.sha256).digest(),
    ]


# --- the dedupe window, apart from the messages' retention -------------------------


def test_a_key_outlives_its_pruned_message_until_the_dedupe_window_ends(
    engine: sa.Engine,
) -> None:
    message = {"channel": "email", "payload": email_to("ada@example.net"), "dedupe_key": "k"}
    with engine.begin() as conn:
        (first,) = outbox.enqueue_many(conn, [message])
        conn.execute(
            sa.text(
                "UPDATE outbox_message SET status = 'delivered', "
                "settled_at = now() - interval '8 days'"
            )
        )
        conn.execute(sa.text("UPDATE outbox_dedupe SET created_at = now() - interval '8 days'"))
    with engine.begin() as conn:
        assert store.prune(conn, 7 * 86400, 100) == 1
        # the window (30 days here) has not ended: still a replay, though the row is gone
        assert store.prune_dedupe_keys(conn, 30 * 86400, 100) == 0
        assert outbox.enqueue_many(conn, [message], return_created=True) == [Enqueued(first, False)]
    with engine.begin() as conn:
        assert store.prune_dedupe_keys(conn, 7 * 86400, 100) == 1
        (again,) = outbox.enqueue_many(conn, [message], return_created=True)
    assert again.created and again.id != first


def test_dedupe_keys_are_released_in_bounded_batches_oldest_first(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        outbox.enqueue_many(
            conn,
            [
                {"channel": "email", "payload": email_to(f"r{i}@example.net"), "dedupe_key": "k"}
                for i in range(7)
            ],
        )
        conn.execute(
            sa.text("UPDATE outbox_dedupe SET created_at = now() - interval '2 days' * message_id")
        )
    with engine.begin() as conn:
        assert store.prune_dedupe_keys(conn, 86400 * 2.5, 3) == 3
        assert store.prune_dedupe_keys(conn, 86400 * 2.5, 3) == 3
        assert store.prune_dedupe_keys(conn, 86400 * 2.5, 3) == 0
        left = conn.execute(sa.text("SELECT message_id FROM outbox_dedupe")).scalars().all()
    assert left == [1]


BUILT_IN = {
    "email": {**EMAIL, "to": ["Ada@Example.net", "bob@example.net"], "bcc": ["ADA@example.net"]},
    "sms": {"to": "+15555550100", "message": "hi"},
    "push": {
        "endpoint_arn": "arn:aws:sns:us-east-1:123456789012:endpoint/GCM/app/0a1b",
        "body": "hi",
    },
    "webhook": {"url": "https://hooks.example.com/in", "event_type": "order.shipped", "body": {}},
    "eventbridge": {"source": "shop", "detail_type": "T", "detail": {}},
    "sqs": {"queue_url": "https://sqs.us-east-1.amazonaws.com/123456789012/q", "body": "x"},
}


def test_the_batch_insert_fingerprints_exactly_as_the_sql_functions_do(engine: sa.Engine) -> None:
    """Producers in other languages call the single-row SQL functions; the
    bulk INSERT must store the same values."""
    with engine.begin() as conn:
        outbox.enqueue_many(
            conn,
            [
                {"channel": c, "payload": p, "dedupe_key": "k"}
                for c, p in [*BUILT_IN.items(), ("email", email_to("solo@example.net"))]
            ],
        )
        rows = conn.execute(
            sa.text(
                "SELECT m.channel, d.recipient_fingerprint "
                "= outbox_recipient_fingerprint(m.channel, m.payload) AS dedupe_ok, "
                "m.recipient_fingerprints = outbox_recipient_fingerprints(m.channel, m.payload) "
                "AS send_log_ok, cardinality(m.recipient_fingerprints) AS n, "
                "outbox_recipients(m.channel, m.payload) AS addresses "
                "FROM outbox_message m JOIN outbox_dedupe d ON d.message_id = m.id ORDER BY m.id"
            )
        ).all()
    assert [(r.channel, r.dedupe_ok, r.send_log_ok) for r in rows] == [
        (c, True, True) for c in [*BUILT_IN, "email"]
    ]
    assert rows[0].addresses == ["ada@example.net", "bob@example.net"]
    assert [r.n for r in rows] == [2, 1, 1, 1, 1, 1, 1]


def test_a_producer_in_sql_dedupes_by_the_same_rules(engine: sa.Engine) -> None:
    """outbox_take_dedupe_key: what an enqueue written in SQL (another
    language's producer) calls; it shares the keys with outbox.enqueue."""
    take = sa.text("SELECT outbox_take_dedupe_key('email', 'k', CAST(:p AS jsonb), :id)")
    payload = store.payload_json(email_to("Ada@example.net"))
    with engine.begin() as conn:
        assert conn.execute(take, {"p": payload, "id": 4242}).scalar_one() is None
        assert conn.execute(take, {"p": payload, "id": 4243}).scalar_one() == 4242
    with engine.begin() as conn:  # the Python producer sees the same key
        replay = outbox.enqueue(
            conn, "email", email_to("Ada@example.net"), dedupe_key="k", return_created=True
        )
        assert replay == (4242, False)
    with pytest.raises(sa.exc.DBAPIError) as caught, engine.begin() as conn:
        conn.execute(take, {"p": store.payload_json(email_to("ada@example.net")), "id": 1})
    assert "'k' already names email message 4242" in str(caught.value.orig)
    assert counts(engine) == (0, 1)
