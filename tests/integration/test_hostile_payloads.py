"""Hostile payloads: a bounded payload shape at enqueue,
one undecodable row failing alone in the sender, and an engine that never
reuses a connection whose statement raised mid-read (real Postgres, pg8000)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import sqlalchemy as sa

import outbox
from outbox import dispatcher, payloads, sender, store
from outbox.db import create_engine
from outbox.errors import ValidationError
from outbox.handoff import CallableInvoker, HandOff
from outbox.relay_settings import DatabaseSettings
from support import ScriptedChannel, insert_raw, install_channel, settings


def nested(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for _ in range(depth - 1):
        value = {"a": value}
    return {"n": 1, "a": value} if depth > 1 else {"n": 1}


def deep_json(depth: int) -> str:
    return '{"n": 1, "a": ' + "[" * depth + "]" * depth + "}"


def count_rows(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM outbox_message")).scalar_one())


def test_payload_depth_is_bounded_at_enqueue_naming_the_field(engine: sa.Engine) -> None:
    install_channel(ScriptedChannel())
    with engine.begin() as conn:
        outbox.enqueue(conn, "scripted", nested(payloads.MAX_DEPTH))
    # Far deeper than any Python's recursion limit: refused by the iterative
    # walk with a field error, never a RecursionError, on every Python.
    for depth in (payloads.MAX_DEPTH + 1, 990, 1_500, 10_000, 200_000):
        with engine.begin() as conn, pytest.raises(ValidationError) as caught:
            outbox.enqueue(conn, "scripted", nested(depth))
        assert caught.value.field.startswith("payload.a.a")
        assert f"nested deeper than {payloads.MAX_DEPTH} levels" in caught.value.problem
    assert count_rows(engine) == 1


@pytest.mark.parametrize(
    ("payload", "field", "problem"),
    [
        (
            {"n": 1, "big": {f"k{i}": i for i in range(payloads.MAX_OBJECT_KEYS + 1)}},
            "payload.big",
            f"has {payloads.MAX_OBJECT_KEYS + 1} keys",
        ),
        (
            {"n": 1, "list": [0] * (payloads.MAX_ARRAY_LENGTH + 1)},
            "payload.list",
            f"has {payloads.MAX_ARRAY_LENGTH + 1} elements",
        ),
        (
            {"n": 1, "x": [[0] * 1000 for _ in range(200)]},
            "payload",
            f"holds more than {payloads.MAX_VALUES} values",
        ),
        ({"n": 1, "z": [[[[]]], nested(40)]}, "payload.z[1].a.a", "nested deeper"),
    ],
)
def test_payload_key_count_array_length_and_size_are_bounded(
    engine: sa.Engine, payload: Any, field: str, problem: str
) -> None:
    install_channel(ScriptedChannel())
    with engine.begin() as conn, pytest.raises(ValidationError) as caught:
        outbox.enqueue(conn, "scripted", payload)
    assert caught.value.field.startswith(field)
    assert problem in caught.value.problem
    assert count_rows(engine) == 0


def test_a_cyclic_payload_is_a_field_error_not_a_crash(engine: sa.Engine) -> None:
    install_channel(ScriptedChannel())
    cyclic: dict[str, Any] = {"n": 1}
    cyclic["self"] = cyclic
    with engine.begin() as conn, pytest.raises(ValidationError) as caught:
        outbox.enqueue(conn, "scripted", cyclic)
    assert caught.value.field.startswith("payload.self.self")


def test_a_payload_too_deep_to_decode_fails_alone_and_the_batch_is_delivered(
    database_url: str, engine: sa.Engine
) -> None:
    """Rows written past the producer (an older relay, raw SQL): the sender
    reads payloads as text and decodes each row by itself."""
    scripted = install_channel(ScriptedChannel())
    relay = settings(send_concurrency=2)
    with engine.begin() as conn:
        good = outbox.enqueue_many(
            conn, [{"channel": "scripted", "payload": {"n": i}} for i in range(3)]
        )
    poisoned = insert_raw(engine, "scripted", deep_json(5_000))  # beyond the recursion limit
    too_deep = insert_raw(engine, "scripted", json.dumps(nested(payloads.MAX_DEPTH + 5)))
    with engine.begin() as conn:
        good += outbox.enqueue_many(
            conn, [{"channel": "scripted", "payload": {"n": i}} for i in range(3, 6)]
        )
    # The functions' own engine: one pooled connection, autocommit.
    relay_engine = create_engine(
        DatabaseSettings(url=database_url, sslmode="disable"), autocommit=True
    )
    try:
        invoker = CallableInvoker(
            {
                "scripted": lambda event: sender.run(
                    relay_engine, event, relay, lambda: 30.0, channel_name="scripted"
                )
            }
        )
        report = dispatcher.dispatch_once(relay_engine, invoker, relay)
        assert report.claimed == 8
        with relay_engine.connect() as conn:
            rows = {
                r.id: r
                for r in conn.execute(sa.text("SELECT id, status, last_error FROM outbox_message"))
            }
    finally:
        relay_engine.dispose()
    assert sorted(scripted.sent) == sorted(good)
    assert all(rows[i].status == "delivered" for i in good)
    for bad in (poisoned, too_deep):
        assert rows[bad].status == "failed"
        assert rows[bad].last_error.startswith("invalid payload: payload")
        assert "nested deeper than" in rows[bad].last_error


def test_a_row_far_past_the_size_limit_fails_alone_at_send(engine: sa.Engine) -> None:
    """The 256 KiB limit holds at send time too, for a row the producer never
    saw (raw SQL, another language): it fails alone, unsent, and the rest of
    its batch is delivered. The sender's own bound is twice the limit (the
    stored text of a row written before the producer measured it as jsonb
    stores it could be up to twice its canonical JSON), so such a row is
    never refused at send."""
    scripted = install_channel(ScriptedChannel())
    with engine.begin() as conn:
        good = outbox.enqueue_many(conn, [{"channel": "scripted", "payload": {"n": 1}}])
    # Many small values: the stored text (", " between them) is past 256 KiB
    # while the canonical JSON is not (the producer refuses it now).
    many_small = {"n": 2, "pad": [[0] * 9_000 for _ in range(11)]}
    good.append(insert_raw(engine, "scripted", json.dumps(many_small, separators=(",", ":"))))
    huge = insert_raw(engine, "scripted", json.dumps({"n": 3, "pad": "x" * 5_000_000}))
    with engine.begin() as conn:
        stored = conn.execute(
            sa.text("SELECT octet_length(CAST(payload AS text)) FROM outbox_message WHERE id = :i"),
            {"i": good[1]},
        ).scalar_one()
        assert stored > payloads.MAX_PAYLOAD_BYTES
        claims = store.claim(conn, 10, 120)
    event = HandOff("scripted", tuple(claims)).to_event()
    sender.run(engine, event, settings(), lambda: 30.0, channel_name="scripted")
    with engine.connect() as conn:
        rows = {r.id: r for r in conn.execute(sa.text("SELECT * FROM outbox_message"))}
    assert sorted(scripted.sent) == sorted(good)
    assert rows[huge].status == "failed"
    assert rows[huge].last_error == "invalid payload: payload: is over the 256 KiB limit"


def test_a_statement_that_raised_mid_read_never_shifts_later_results(database_url: str) -> None:
    """The driver decodes jsonb while reading the answer; a RecursionError
    there left the rest of the answer on the socket, and later statements on
    that pooled connection read the previous one's results."""
    relay_engine = create_engine(
        DatabaseSettings(url=database_url, sslmode="disable"), autocommit=True
    )
    try:
        with relay_engine.connect() as conn, pytest.raises(RecursionError):
            conn.execute(sa.text("SELECT CAST(:doc AS jsonb), 'tail'"), {"doc": deep_json(5_000)})
        for n in range(1, 6):
            with relay_engine.connect() as conn:
                assert conn.execute(sa.text(f"SELECT {n}")).scalar_one() == n
    finally:
        relay_engine.dispose()


def test_a_server_error_keeps_the_pool_and_the_next_statement_answers(database_url: str) -> None:
    relay_engine = create_engine(
        DatabaseSettings(url=database_url, sslmode="disable"), pool_size=2, autocommit=True
    )
    try:
        with relay_engine.connect() as conn:
            assert conn.execute(sa.text("SELECT 1")).scalar_one() == 1
        with relay_engine.connect() as conn, pytest.raises(sa.exc.DBAPIError) as caught:
            conn.execute(sa.text("SELECT 1/0"))
        assert "division by zero" in str(caught.value)
        with relay_engine.connect() as conn:
            assert conn.execute(sa.text("SELECT 7")).scalar_one() == 7
    finally:
        relay_engine.dispose()


def test_a_row_far_past_the_size_limit_never_reaches_the_sender(engine: sa.Engine) -> None:
    """Its text stays in the database: the receipt (and the worker's claim)
    returns none for it, so no sender holds megabytes for one row (a Lambda
    of 512 MB could run out of memory and fail its whole event, each time).
    5 MB of one character compresses on disk to a few kilobytes."""
    install_channel(ScriptedChannel())
    with engine.begin() as conn:
        (small,) = outbox.enqueue_many(conn, [{"channel": "scripted", "payload": {"n": 1}}])
    huge = insert_raw(engine, "scripted", json.dumps({"n": 3, "pad": "x" * 5_000_000}))
    with engine.begin() as conn:
        on_disk = conn.execute(
            sa.text("SELECT pg_column_size(payload) FROM outbox_message WHERE id = :i"),
            {"i": huge},
        ).scalar_one()
        assert on_disk < 100_000  # compressed: the size on disk alone would not tell
        claims = store.claim(conn, 10, 120)
        received = {m.id: m.payload for m in store.receive_claimed(conn, "scripted", claims, 3)}
    assert received[huge] is None
    assert json.loads(received[small]) == {"n": 1}
    with engine.begin() as conn:  # the worker's claim takes its receipt the same way
        conn.execute(
            sa.text(
                "UPDATE outbox_message SET status = 'pending', claim_token = NULL, "
                "claimed_at = NULL, lease_expires_at = NULL, received_at = NULL"
            )
        )
        taken = {m.id: m.payload for m in store.claim_and_receive(conn, 10, 120, 3)}
    assert taken[huge] is None and taken[small] is not None
