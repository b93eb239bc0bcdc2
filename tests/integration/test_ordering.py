"""Ordering keys under concurrent producers, and what a
failed row does to the rows after it in its key."""

from __future__ import annotations

import json
import threading

import pytest
import sqlalchemy as sa

import outbox
from outbox import reaper, store
from outbox.errors import ValidationError
from support import (
    ScriptedChannel,
    attempts,
    claim_ids,
    claim_plans,
    enqueue,
    install_channel,
    row,
    settings,
    waits_on_a_lock,
)


@pytest.fixture(autouse=True)
def _scripted_channel() -> None:
    install_channel(ScriptedChannel())


def settle(engine: sa.Engine, message_id: int, outcome: str) -> None:
    with engine.begin() as conn:
        token = conn.execute(
            sa.text("SELECT claim_token FROM outbox_message WHERE id = :i"), {"i": message_id}
        ).scalar_one()
        assert store.settle(
            conn,
            [store.Settlement(message_id, token, outcome, error=f"test {outcome}")],
            store.Backoff(0, 0, 1),
        )


def test_ids_of_one_key_follow_commit_order_under_concurrent_producers(
    engine: sa.Engine,
) -> None:
    """The issue's interleaving: transaction 1 enqueues on K and stays open;
    transaction 2 enqueues on K. Without the key lock, 2 commits first with the
    higher id and is sent; 1 then commits and is sent while 2 is in flight.
    With it, 2 waits for 1's commit, so its row is the later one."""
    second_id: list[int] = []
    with engine.begin() as conn:  # a first enqueue of the channel would be a wait of its own
        conn.execute(
            sa.text("INSERT INTO outbox_channel (name) VALUES ('scripted') ON CONFLICT DO NOTHING")
        )
    with engine.connect() as first:
        first.begin()
        first_id = outbox.enqueue(first, "scripted", {"n": 1}, ordering_key="K")

        def producer_two() -> None:
            with engine.begin() as conn:
                second_id.append(outbox.enqueue(conn, "scripted", {"n": 2}, ordering_key="K"))

        two = threading.Thread(target=producer_two)
        two.start()
        # (on the key's lock, not on a first insert of the channel's name)
        assert waits_on_a_lock(engine, two, "advisory"), "the second producer did not wait"
        assert claim_ids(engine) == []  # nothing of K is committed yet
        first.commit()
    two.join(5)
    assert second_id and second_id[0] > first_id
    assert claim_ids(engine) == [first_id]  # the first committed goes first
    assert claim_ids(engine) == []  # and alone


def test_producers_of_different_keys_do_not_wait_for_each_other(engine: sa.Engine) -> None:
    done: list[int] = []
    with engine.connect() as first:
        first.begin()
        outbox.enqueue(first, "scripted", {"n": 1}, ordering_key="K")

        def other_key() -> None:
            with engine.begin() as conn:
                done.append(outbox.enqueue(conn, "scripted", {"n": 2}, ordering_key="L"))
                done.append(outbox.enqueue(conn, "scripted", {"n": 3}))

        t = threading.Thread(target=other_key)
        t.start()
        t.join(5)
        assert len(done) == 2
        first.rollback()


def test_a_row_is_never_claimed_while_another_row_of_its_key_is_claimed(
    engine: sa.Engine,
) -> None:
    """Rows written without the key lock (e.g. by hand) in the bad order: the
    later id is claimed first; the earlier one must then wait for it."""
    insert = sa.text(
        "INSERT INTO outbox_message (channel, payload, ordering_key) "
        "VALUES ('scripted', '{\"n\": 1}', 'K') RETURNING id"
    )
    with engine.connect() as early:
        early.begin()
        early_id = early.execute(insert).scalar_one()
        with engine.begin() as conn:
            late_id = conn.execute(insert).scalar_one()
        assert claim_ids(engine) == [late_id]
        early.commit()
    assert early_id < late_id
    assert claim_ids(engine) == []  # the key's other row is in flight
    settle(engine, late_id, "delivered")
    assert claim_ids(engine) == [early_id]


def test_a_failed_row_holds_its_successors_until_an_operator_acts(engine: sa.Engine) -> None:
    head, second, third = enqueue(engine, 3, "scripted", ordering_key="calendar-7")
    (other,) = enqueue(engine, 1, "scripted", ordering_key="calendar-8")
    assert sorted(claim_ids(engine)) == [head, other]
    settle(engine, head, "failed")  # e.g. the "create" answered 412
    settle(engine, other, "delivered")
    assert claim_ids(engine) == []  # the "delete" after it does not run
    with engine.begin() as conn:
        assert store.held_count(conn) == 2
        assert store.backlog(conn).held == 2
    report = reaper.run(engine, settings(), lambda: 30.0)
    assert report.cancelled == 0 and report.backlog is not None and report.backlog.held == 2
    with engine.connect() as conn:
        assert {row(conn, i).status for i in (second, third)} == {"pending"}
    # The operator redrives the head: it goes first, the rest after it.
    with engine.begin() as conn:
        assert store.redrive(conn, [head]) == {head}
    assert claim_ids(engine) == [head]
    settle(engine, head, "delivered")
    assert claim_ids(engine) == [second]
    settle(engine, second, "retry")  # out of attempts (max 1): dead, holds third
    assert claim_ids(engine) == []
    with engine.begin() as conn:  # cancelling the dead row releases the key
        assert row(conn, second).status == "dead"
        assert store.cancel(conn, [second], "operator gave up") == {second}
    assert claim_ids(engine) == [third]


def test_successors_that_asked_for_it_are_cancelled_naming_the_failed_row(
    engine: sa.Engine,
) -> None:
    head, second, third = enqueue(
        engine, 3, "scripted", ordering_key="K", on_predecessor_failure="cancel"
    )
    assert claim_ids(engine) == [head]
    settle(engine, head, "failed")
    assert claim_ids(engine) == []
    report = reaper.run(engine, settings(), lambda: 30.0)
    assert report.cancelled == 2
    with engine.connect() as conn:
        for i in (second, third):
            r = row(conn, i)
            assert r.status == "cancelled" and r.settled_at is not None
            assert r.last_error == (
                f"cancelled: message {head} before it in its ordering key did not succeed"
            )
            assert attempts(conn, i) == []
        assert row(conn, head).status == "failed"
        assert store.held_count(conn) == 0


def test_the_policy_is_checked_at_enqueue(engine: sa.Engine) -> None:
    with engine.begin() as conn, pytest.raises(ValidationError) as err:
        outbox.enqueue(conn, "scripted", {"n": 1}, ordering_key="K", on_predecessor_failure="skip")
    assert err.value.field == "on_predecessor_failure"
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM outbox_message")).scalar_one() == 0


def test_the_claim_stays_an_index_lookup_on_a_key_with_many_settled_rows(
    engine: sa.Engine,
) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO outbox_message (channel, payload, ordering_key, status, settled_at) "
                "SELECT 'scripted', '{}', 'K', 'delivered', now() FROM generate_series(1, 20000)"
            )
        )
        conn.execute(
            sa.text(
                "INSERT INTO outbox_message (channel, payload, ordering_key) "
                "SELECT 'scripted', '{}', 'K' FROM generate_series(1, 5)"
            )
        )
        conn.execute(sa.text("ANALYZE outbox_message"))
        plans = claim_plans(conn)
    for plan in plans:
        text = json.dumps(plan)
        found = scans(plan)
        # The settled rows of the key are history: the claim never reads them,
        # and the key's probe reads the live and unresolved rows by key alone.
        assert not any(r.startswith("outbox_message_resolved") for _, r in found), text
        # The pause table (a few rows) is read whole, once; the messages' big
        # partitions never are (the live one, five rows here, may be).
        assert not any(
            node == "Seq Scan" and relation.startswith("outbox_message_resolved")
            for node, relation in found
        ), text


def scans(plan: object) -> set[tuple[str, str]]:
    """(node type, relation) of every node of an EXPLAIN (FORMAT JSON) plan."""
    found: set[tuple[str, str]] = set()
    if isinstance(plan, list):
        for item in plan:
            found |= scans(item)
    elif isinstance(plan, dict):
        if "Relation Name" in plan:
            found.add((plan.get("Node Type", ""), plan["Relation Name"]))
        for value in plan.values():
            found |= scans(value)
    return found
