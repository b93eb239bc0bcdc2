"""The producer API against the real database."""

from __future__ import annotations

from datetime import timedelta

import pytest
import sqlalchemy as sa

import outbox
from outbox import ValidationError
from support import EMAIL, row


def count(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return conn.execute(sa.text("SELECT count(*) FROM outbox_message")).scalar_one()


def test_enqueue_writes_a_pending_row_in_the_callers_transaction(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        message_id = outbox.enqueue(conn, "email", EMAIL, priority=5, max_attempts=7)
    with engine.connect() as conn:
        r = row(conn, message_id)
    assert (r.channel, r.status, r.priority, r.max_attempts, r.attempts) == (
        "email",
        "pending",
        5,
        7,
        0,
    )
    assert r.payload == EMAIL


def test_rollback_of_the_callers_transaction_leaves_no_message(engine: sa.Engine) -> None:
    with pytest.raises(RuntimeError), engine.begin() as conn:
        outbox.enqueue(conn, "email", EMAIL)
        raise RuntimeError("the business change failed")
    assert count(engine) == 0


def test_repeated_dedupe_key_returns_the_existing_id(engine: sa.Engine) -> None:
    other = {**EMAIL, "to": ["other@example.net"]}
    with engine.begin() as conn:
        first = outbox.enqueue(conn, "email", EMAIL, dedupe_key="order-1")
    with engine.begin() as conn:
        second = outbox.enqueue(conn, "email", EMAIL, dedupe_key="order-1", return_created=True)
        ids = outbox.enqueue_many(
            conn,
            [
                {"channel": "email", "payload": EMAIL, "dedupe_key": "order-2"},
                {"channel": "email", "payload": EMAIL},
                {"channel": "email", "payload": EMAIL, "dedupe_key": "order-1"},
                {"channel": "email", "payload": EMAIL, "dedupe_key": "order-2"},
                {"channel": "email", "payload": other, "dedupe_key": "order-1"},
            ],
        )
    assert second == outbox.Enqueued(first, created=False)
    assert ids[2] == first and ids[0] == ids[3] and len({ids[0], ids[1], first, ids[4]}) == 4
    assert count(engine) == 4


def test_enqueue_many_returns_ids_in_input_order(engine: sa.Engine) -> None:
    messages = [{"channel": "email", "payload": {**EMAIL, "subject": f"n{i}"}} for i in range(50)]
    with engine.begin() as conn:
        ids = outbox.enqueue_many(conn, messages)
        subjects = dict(
            conn.execute(sa.text("SELECT id, payload->>'subject' FROM outbox_message")).all()  # type: ignore[arg-type]
        )
    assert [subjects[i] for i in ids] == [f"n{i}" for i in range(50)]
    assert ids == sorted(ids)


def test_delay_sets_available_at_from_the_database_clock(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        message_id = outbox.enqueue(conn, "email", EMAIL, delay=timedelta(minutes=5))
        ahead = conn.execute(
            sa.text(
                "SELECT EXTRACT(EPOCH FROM available_at - now()) FROM outbox_message WHERE id = :id"
            ),
            {"id": message_id},
        ).scalar_one()
    assert 299 <= float(ahead) <= 300


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"channel": "pigeon"}, "channel"),
        ({"payload": {**EMAIL, "to": []}}, "payload.to"),
        ({"payload": {**EMAIL, "to": ["not-an-address"]}}, "payload.to[0]"),
        ({"payload": {k: v for k, v in EMAIL.items() if k != "text"}}, "payload.text"),
        ({"payload": {**EMAIL, "surprise": 1}}, "payload"),
        ({"payload": {**EMAIL, "text": "x" * 300_000}}, "payload"),
        ({"dedupe_key": ""}, "dedupe_key"),
        ({"dedupe_key": 5}, "dedupe_key"),
        ({"ordering_key": "k" * 256}, "ordering_key"),
        ({"priority": "high"}, "priority"),
        ({"priority": 40_000}, "priority"),
        ({"delay": -1}, "delay"),
        ({"delay": "soon"}, "delay"),
        ({"max_attempts": 0}, "max_attempts"),
        ({"max_attempts": True}, "max_attempts"),
    ],
)
def test_bad_input_raises_one_clear_error_and_writes_nothing(
    engine: sa.Engine, kwargs: dict, field: str
) -> None:
    args = {"channel": "email", "payload": EMAIL, **kwargs}
    with engine.begin() as conn:
        with pytest.raises(ValidationError) as caught:
            outbox.enqueue(conn, args.pop("channel"), args.pop("payload"), **args)
        assert caught.value.field == field
        assert field in str(caught.value)
    assert count(engine) == 0


def test_enqueue_many_names_the_bad_message_and_writes_none(engine: sa.Engine) -> None:
    with engine.begin() as conn, pytest.raises(ValidationError) as caught:
        outbox.enqueue_many(
            conn,
            [
                {"channel": "email", "payload": EMAIL},
                {"channel": "email", "payload": {**EMAIL, "to": "x"}},
            ],
        )
    assert caught.value.field == "messages[1].payload.to"
    assert count(engine) == 0


def test_enqueue_many_with_nothing_is_a_no_op(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        assert outbox.enqueue_many(conn, []) == []
