"""``python -m bench.retention``: retention of settled rows (issue 30, items 1 and 5).

Two fresh databases with the same ``--settled`` relay-shaped resolved rows
(80 % email with SES ids), settled 9 to 12 days ago, and a 7-day retention:

* ``by day``: the rows sit in the day partitions the reaper made on those
  days (the layout since 0018); ``store.prune`` drops the days;
* ``by row``: the same rows sit in the default partition (what no day
  covers, and the shape of the whole table before 0018); ``store.prune``
  deletes them row by row, as every prune did before.

Each reports the WAL the prune wrote (after a CHECKPOINT, so full-page images
count as in production), its time, and the history's size before and after;
and the rate of a relay draining a due backlog beside it (claim and settle,
batch 100), over the prune against the same time just before. Then
``--upgrade``: a database at revision 0017 holding the same rows (and 1 % of
them live) is taken to the head by ``outbox migrate``'s code, timed.

    .venv/bin/python -m bench.retention --settled 1000000
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

import sqlalchemy as sa

from . import common
from .destinations import _engine

_SETTLED = """
INSERT INTO outbox_message (channel, payload, status, available_at, created_at, claimed_at,
    received_at, settled_at, attempts, provider_message_id, expires_at)
SELECT CASE WHEN mod(g, 5) = 0 THEN 'webhook' ELSE 'email' END, {payload}, 'delivered',
    t, t, t, t, t + interval '1 second', 1,
    CASE WHEN mod(g, 5) <> 0 THEN 'ses-' || g END, t + interval '1 day'
FROM (SELECT g, (((now() AT TIME ZONE 'UTC')::date - 12)::timestamp
                   + (g * 3.0 / :n) * interval '1 day') AT TIME ZONE 'UTC' AS t
      FROM generate_series(1, :n) AS g) AS s
"""
_DUE = """
INSERT INTO outbox_message (channel, payload, available_at)
SELECT 'email', {payload}, now() - interval '1 hour' FROM generate_series(1, :n) AS g
"""
_DAYS_BACK = 12


def _make_past_days(conn: sa.Connection) -> None:
    """The day partitions the reaper would have made on each of those days."""
    conn.execute(
        sa.text(
            f"""
            DO $$
            DECLARE day date;
            BEGIN
                FOR i IN 1 .. {_DAYS_BACK} LOOP
                    day := (now() AT TIME ZONE 'UTC')::date - i;
                    EXECUTE format('CREATE TABLE %I PARTITION OF outbox_message_resolved '
                                   'FOR VALUES FROM (%L) TO (%L)',
                                   'outbox_message_resolved_p' || to_char(day, 'YYYYMMDD'),
                                   day::timestamp AT TIME ZONE 'UTC',
                                   (day + 1)::timestamp AT TIME ZONE 'UTC');
                END LOOP;
            END
            $$
            """
        )
    )


def _history_bytes(conn: sa.Connection) -> int:
    return int(
        conn.execute(
            sa.text(
                "SELECT sum(pg_total_relation_size(relid)) "
                "FROM pg_partition_tree('outbox_message_resolved')"
            )
        ).scalar_one()
    )


class _Drainer(threading.Thread):
    """A relay draining the due backlog: claim and settle, batch 100, and the
    time each batch ended."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.engine = _engine(url)
        self.ends: list[tuple[float, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        from outbox import store
        from outbox.relay_settings import RelaySettings

        backoff = RelaySettings().backoff()
        while not self.stop.is_set():
            with self.engine.begin() as conn:
                claims = store.claim(conn, 100, 120, default_ttl_seconds=86400)
                store.settle(
                    conn,
                    [store.Settlement(c.id, c.claim_token, "delivered") for c in claims],
                    backoff,
                )
            if not claims:
                break
            self.ends.append((time.perf_counter(), len(claims)))

    def rate(self, start: float, end: float) -> float:
        rows = sum(n for t, n in self.ends if start <= t < end)
        return rows / (end - start) if end > start else 0.0


def cell(url: str, settled: int, by_day: bool, drain: bool, due: int = 200_000) -> dict[str, Any]:
    from outbox import store

    admin = sa.create_engine(url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    payload = common.payload_sql(180, 300)
    with admin.connect() as conn:
        if by_day:
            _make_past_days(conn)
        conn.execute(sa.text(_SETTLED.format(payload=payload)), {"n": settled})
        conn.execute(sa.text(_DUE.format(payload=payload)), {"n": due})
        conn.execute(sa.text("VACUUM ANALYZE outbox_message"))
        conn.execute(sa.text("CHECKPOINT"))
        before_bytes = _history_bytes(conn)
    drainer = _Drainer(url)
    if drain:
        drainer.start()
        time.sleep(3)  # the drain at its pace before
    engine = _engine(url)
    with admin.connect() as conn:
        lsn = conn.execute(sa.text("SELECT pg_current_wal_lsn()::text")).scalar_one()
    started = time.perf_counter()
    pruned = 0
    while True:
        with engine.begin() as conn:
            removed = store.prune(conn, 7 * 86400, 10_000, store.RESOLVED_STATUSES)
        pruned += removed
        if removed < 10_000:
            break
    elapsed = time.perf_counter() - started
    window = max(elapsed, 2.0)
    if drain:
        time.sleep(max(0.0, started + window - time.perf_counter()))
        drainer.stop.set()
        drainer.join()
    with admin.connect() as conn:
        wal = conn.execute(
            sa.text("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), CAST(:lsn AS pg_lsn))"),
            {"lsn": lsn},
        ).scalar_one()
        after_bytes = _history_bytes(conn)
    engine.dispose()
    drainer.engine.dispose()
    admin.dispose()
    before_rate = drainer.rate(started - window, started)
    during_rate = drainer.rate(started, started + window)
    if drain:  # (its settles write WAL too: the WAL is read without it)
        return {
            "layout": ("by day" if by_day else "by row") + ", beside a drain",
            "pruned": pruned,
            "seconds": round(elapsed, 3),
            "drain_during_over_before": round(during_rate / before_rate, 2)
            if before_rate
            else None,
            "window_seconds": round(window, 2),
        }
    return {
        "layout": "by day" if by_day else "by row",
        "pruned": pruned,
        "seconds": round(elapsed, 3),
        "wal_mb": round(float(wal) / 1e6, 2),
        "history_mb_before": round(before_bytes / 1e6),
        "history_mb_after": round(after_bytes / 1e6),
    }


def _upgrade(databases: common.Databases, settled: int) -> dict[str, Any]:
    from outbox import migrate
    from outbox.db import create_engine
    from outbox.relay_settings import DatabaseSettings

    name = f"{databases.prefix}_upgrade"
    databases._execute(f'CREATE DATABASE "{name}"')
    databases._made.append(name)
    url = common.url_for(databases.server, name)
    engine = create_engine(DatabaseSettings(url=url, sslmode="disable"))
    try:
        migrate.upgrade(engine, "0017")
        payload = common.payload_sql(180, 300)
        with engine.begin() as conn:
            conn.execute(sa.text(_SETTLED.format(payload=payload)), {"n": settled})
            conn.execute(sa.text(_DUE.format(payload=payload)), {"n": settled // 100})
        with engine.connect() as conn:
            conn.execute(sa.text("COMMIT"))
        admin = sa.create_engine(url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
        with admin.connect() as conn:
            conn.execute(sa.text("VACUUM ANALYZE outbox_message"))
        admin.dispose()
        # A relay beside it: one read of a message by id after another, each
        # timed; the longest is how long the upgrade held the table.
        stop = threading.Event()
        waits: list[float] = []

        beside = create_engine(DatabaseSettings(url=url, sslmode="disable"))

        def relay() -> None:
            with beside.connect() as conn:
                while not stop.is_set():
                    began = time.perf_counter()
                    conn.execute(sa.text("SELECT status FROM outbox_message WHERE id = 1")).all()
                    conn.commit()
                    waits.append(time.perf_counter() - began)
                    time.sleep(0.01)

        reader = threading.Thread(target=relay)
        reader.start()
        time.sleep(0.5)
        started = time.perf_counter()
        try:
            migrate.upgrade(engine)
        finally:
            elapsed = time.perf_counter() - started
            stop.set()
            reader.join()
            beside.dispose()
    finally:
        engine.dispose()
    return {
        "upgrade_settled": settled,
        "live": settled // 100,
        "seconds": round(elapsed, 2),
        "relay_longest_wait_seconds": round(max(waits), 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.retention")
    parser.add_argument("--settled", type=int, default=1_000_000)
    parser.add_argument("--no-upgrade", action="store_true")
    parser.add_argument("--upgrade-only", action="store_true")
    args = parser.parse_args(argv)
    databases = common.Databases(common.server_url())
    results = []
    try:
        databases.prepare_template()
        for drain in () if args.upgrade_only else (False, True):
            for by_day in (True, False):
                with databases.fresh(f"{by_day}_{drain}") as url:
                    results.append(cell(url, args.settled, by_day, drain))
        if not args.no_upgrade:
            results.append(_upgrade(databases, args.settled))
    finally:
        databases.close()
    for result in results:
        print(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
