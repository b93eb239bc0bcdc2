"""Hot rows apart from history (migration 0018): the live rows' partition, the
unresolved rows' table, the resolved rows by UTC day, retention by DROP."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import sqlalchemy as sa

from outbox import store
from support import claim, enqueue, settings, waits_on_a_lock

BACKOFF = settings().backoff()


def partition_of(conn: sa.Connection, message_id: int) -> str:
    return conn.execute(
        sa.text("SELECT tableoid::regclass::text FROM outbox_message WHERE id = :id"),
        {"id": message_id},
    ).scalar_one()


def settle(engine: sa.Engine, claims: list[store.Claim], outcome: str = "delivered") -> Any:
    with engine.begin() as conn:
        return store.settle(
            conn,
            [
                store.Settlement(c.id, c.claim_token, outcome, provider_message_id="ses-1")
                for c in claims
            ],
            BACKOFF,
        )


def test_a_settled_row_moves_to_its_day_and_is_read_by_the_same_name(engine: sa.Engine) -> None:
    (message_id,) = enqueue(engine)
    with engine.connect() as conn:
        assert partition_of(conn, message_id) == "outbox_message_live"
    claims = claim(engine)
    assert settle(engine, claims) == {message_id: "delivered"}
    with engine.connect() as conn:
        day = conn.execute(sa.text("SELECT to_char(now() AT TIME ZONE 'UTC', 'YYYYMMDD')")).scalar()
        assert partition_of(conn, message_id) == f"outbox_message_resolved_p{day}"
        row = conn.execute(
            sa.text("SELECT status, attempts, settled_at FROM outbox_message WHERE id = :id"),
            {"id": message_id},
        ).one()
        live = conn.execute(sa.text("SELECT count(*) FROM outbox_message_live")).scalar()
    assert (row.status, row.attempts, row.settled_at is not None, live) == ("delivered", 1, True, 0)


def test_a_settle_behind_a_move_it_waited_for_is_fenced_not_an_error(engine: sa.Engine) -> None:
    """The reaper ends a claim dead (a move to the unresolved table) while the
    late sender's settle waits on the row: Postgres refuses an UPDATE of a row
    another transaction moved (40001); the settle finds the row not its own."""
    enqueue(engine)
    claims = claim(engine)
    results: list[Any] = []
    with engine.connect() as reaper:
        reaper.begin()
        reaper.execute(
            sa.text(
                "UPDATE outbox_message SET status = 'dead', claim_token = NULL, "
                "lease_expires_at = NULL, settled_at = now() WHERE id = :id"
            ),
            {"id": claims[0].id},
        )

        def late_settle() -> None:
            try:
                results.append(settle(engine, claims))
            except Exception as exc:  # the verdict is read below
                results.append(exc)

        sender = threading.Thread(target=late_settle)
        sender.start()
        assert waits_on_a_lock(engine, sender)
        reaper.commit()
        sender.join(60)
    assert results == [{}]
    with engine.connect() as conn:
        assert partition_of(conn, claims[0].id) == "outbox_message_unresolved"


def test_a_settle_no_day_covers_lands_in_the_default_and_moves_when_the_day_is_made(
    engine: sa.Engine,
) -> None:
    """An operator dropped today's partition by hand: the settle still
    succeeds, and the next upkeep makes the day again, with that row in it."""
    with engine.begin() as conn:
        (today,) = [p.name for p in store.history_partitions(conn) if p.name.endswith(_today(conn))]
        conn.execute(sa.text(f"DROP TABLE {today}"))
    enqueue(engine)
    claims = claim(engine)
    assert settle(engine, claims) == {claims[0].id: "delivered"}
    with engine.begin() as conn:
        assert partition_of(conn, claims[0].id) == "outbox_message_resolved_default"
        assert store.make_history_partitions(conn) == 1
        assert partition_of(conn, claims[0].id) == today


def _today(conn: sa.Connection) -> str:
    return conn.execute(sa.text("SELECT to_char(now() AT TIME ZONE 'UTC', 'YYYYMMDD')")).scalar()


def _past_day(conn: sa.Connection, days_ago: int, rows: int, status: str = "delivered") -> str:
    """A day partition ``days_ago`` UTC days back (as the reaper made it
    then), with ``rows`` rows settled in it."""
    day = conn.execute(
        sa.text("SELECT ((now() AT TIME ZONE 'UTC')::date - CAST(:n AS int))"), {"n": days_ago}
    ).scalar_one()
    name = f"outbox_message_resolved_p{day:%Y%m%d}"
    conn.execute(
        sa.text(
            f"CREATE TABLE {name} PARTITION OF outbox_message_resolved "
            f"FOR VALUES FROM ('{day}T00:00Z') TO ('{day}T00:00Z'::timestamptz + interval '1 day')"
        )
    )
    conn.execute(
        sa.text(
            "INSERT INTO outbox_message (channel, payload, status, settled_at, attempts) "
            "SELECT 'email', '{}', :status, CAST(:day AS timestamp) AT TIME ZONE 'UTC' "
            "+ interval '12 hours', 1 FROM generate_series(1, :rows)"
        ),
        {"status": status, "day": str(day), "rows": rows},
    )
    return name


def _wal_bytes(conn: sa.Connection, since: str) -> int:
    return int(
        conn.execute(
            sa.text("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), CAST(:since AS pg_lsn))"),
            {"since": since},
        ).scalar_one()
    )


def test_retention_drops_whole_days_and_keeps_what_a_rule_keeps(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        old_day = _past_day(conn, 10, 20_000)
        boundary_day = _past_day(conn, 7, 10)
        # rows no day partition caught: pruned by row
        conn.execute(
            sa.text(
                "INSERT INTO outbox_message (channel, payload, status, settled_at, attempts) "
                "VALUES ('email', '{}', 'cancelled', now() - interval '30 days', 0), "
                "       ('email', '{}', 'dead', now() - interval '30 days', 3), "
                "       ('email', '{}', 'delivered', now() - interval '1 day', 1)"
            )
        )
        (live,) = enqueue(conn)
        conn.execute(sa.text("CHECKPOINT"))
        since = conn.execute(sa.text("SELECT CAST(pg_current_wal_lsn() AS text)")).scalar_one()
    with engine.begin() as conn:
        pruned = store.prune(conn, 7 * 86400, 1000, store.RESOLVED_STATUSES)
    with engine.connect() as conn:
        wal = _wal_bytes(conn, since)
        left = dict(
            conn.execute(
                sa.text("SELECT status, count(*) FROM outbox_message GROUP BY status")
            ).all()
        )
        tables = set(
            conn.execute(sa.text("SELECT name FROM outbox_history_partitions()")).scalars()
        )
    # the 20,000 rows of the old day went whole; the rows 7.5 days old wait
    # for their whole day to pass; the dead row waits for an operator
    assert pruned == 20_001
    assert old_day not in tables and boundary_day in tables
    assert left == {"delivered": 11, "dead": 1, "pending": 1}, live
    # a drop, not 20,000 deletes (those write some 2 MB: ~100 bytes a row)
    assert wal < 512 * 1024, wal


def test_the_operators_count_is_what_prune_removes(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        _past_day(conn, 12, 300)
        _past_day(conn, 6, 5)
        conn.execute(
            sa.text(
                "INSERT INTO outbox_message (channel, payload, status, settled_at, attempts) "
                "VALUES ('email', '{}', 'cancelled', now() - interval '9 days', 0)"
            )
        )
        cutoff = store.prune_cutoff(conn, 7 * 86400)
        wanted = list(store.RESOLVED_STATUSES)
        counted = store.count_prunable(conn, cutoff, wanted)
        removed = store.prune_settled_before(conn, cutoff, 1000, wanted)
        again = store.count_prunable(conn, cutoff, wanted)
    assert (counted, removed, again) == (301, 301, 0)


@pytest.mark.parametrize("cutoff", ["infinity", None])
def test_a_cutoff_that_is_no_time_is_refused_and_drops_nothing(
    engine: sa.Engine, cutoff: str | None
) -> None:
    with engine.connect() as conn:
        before = store.history_partitions(conn)
        with pytest.raises(sa.exc.DBAPIError, match="finite time"):
            conn.execute(
                sa.text("SELECT * FROM outbox_drop_history_before(CAST(:c AS timestamptz))"),
                {"c": cutoff},
            )
        conn.rollback()
        assert store.history_partitions(conn) == before


@pytest.mark.parametrize("days", [-1, 32])
def test_days_ahead_out_of_bounds_are_refused(engine: sa.Engine, days: int) -> None:
    with engine.connect() as conn, pytest.raises(sa.exc.DBAPIError, match="days ahead"):
        store.make_history_partitions(conn, days)


def test_feedback_days_later_and_a_redrive_of_an_old_dead_row(engine: sa.Engine) -> None:
    """A bounce for a message settled 10 days ago finds it by its SES id; a
    dead row of a month ago is redriven back to the live rows."""
    ids = enqueue(engine, 2)
    claims = claim(engine)
    with engine.begin() as conn:
        store.settle(
            conn,
            [
                store.Settlement(
                    claims[0].id, claims[0].claim_token, "delivered", provider_message_id="ses-old"
                ),
                store.Settlement(claims[1].id, claims[1].claim_token, "failed", error="no"),
            ],
            BACKOFF,
        )
        conn.execute(
            sa.text(
                "UPDATE outbox_message SET settled_at = settled_at - interval '10 days' "
                "WHERE id = ANY(CAST(:ids AS bigint[]))"
            ),
            {"ids": store.array_literal(ids)},
        )
    with engine.begin() as conn:
        results = store.record_feedback(
            conn,
            [store.Feedback("ses-old", "bounced", "someone@example.net", "Permanent", "550 gone")],
        )
        redriven = store.redrive(conn, [ids[1]])
    assert results[0].new_status == "bounced"
    assert redriven == {ids[1]}
    with engine.connect() as conn:
        assert partition_of(conn, ids[1]) == "outbox_message_live"
        assert partition_of(conn, ids[0]) == "outbox_message_resolved_default"
