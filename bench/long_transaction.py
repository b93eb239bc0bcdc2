"""A long transaction elsewhere in the database, beside a relay at a steady
rate (issue 30, item 4): ``python -m bench.long_transaction``.

A producer inserts ``--rate`` messages a second (40 every 100 ms); one relay
claims and settles them (``store.claim`` batch 100, then ``store.settle``;
it polls every 50 ms when nothing is due). After ``--before`` seconds a
session opens a REPEATABLE READ transaction, takes a snapshot and sits idle in
it for ``--hold`` seconds (an application's forgotten ``BEGIN``), then commits;
the run goes on ``--after`` seconds. Autovacuum is emulated (this machine's
Postgres runs with it off): ``VACUUM ANALYZE`` of the live partition every
``--vacuum-every`` seconds, which is what autovacuum does to a table churned
this hard. Per ``--bucket`` seconds: claim p50 and p99, the relay's busy
fraction (time in claim and settle over wall time), the dead tuples of the
live partition, and the reaper's gauge (``store.oldest_snapshot``) at its
highest. Times are the relay's own, read around each statement; the figures
to compare are the buckets during the hold against those before it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from typing import Any

import sqlalchemy as sa

from . import common
from .destinations import _engine

_PRODUCE = """
INSERT INTO outbox_message (channel, payload)
SELECT 'bench', {payload} FROM generate_series(1, :n) AS g
"""


class _Clock:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.start


def _producer(url: str, rate: float, stop: threading.Event, clock: _Clock) -> None:
    engine = _engine(url)
    per_tick = max(1, round(rate / 10))
    statement = sa.text(_PRODUCE.format(payload=common.payload_sql(180, 300)))
    next_tick = clock.now()
    try:
        while not stop.is_set():
            with engine.begin() as conn:
                conn.execute(statement, {"n": per_tick})
            next_tick += 0.1
            time.sleep(max(0.0, next_tick - clock.now()))
    finally:
        engine.dispose()


def _relay(
    url: str, stop: threading.Event, clock: _Clock, claims: list[tuple[float, float, float]]
) -> None:
    """(when, claim seconds, claim + settle seconds) per batch claimed."""
    from outbox import store
    from outbox.relay_settings import RelaySettings

    backoff = RelaySettings().backoff()
    engine = _engine(url)
    try:
        while not stop.is_set():
            started = time.perf_counter()
            with engine.begin() as conn:
                batch = store.claim(conn, 100, 120, default_ttl_seconds=86400)
                claimed = time.perf_counter()
                store.settle(
                    conn,
                    [store.Settlement(c.id, c.claim_token, "delivered") for c in batch],
                    backoff,
                )
            ended = time.perf_counter()
            claims.append((clock.now(), claimed - started, ended - started))
            if not batch:
                time.sleep(0.05)
    finally:
        engine.dispose()


def _vacuum(url: str, every: float, stop: threading.Event) -> None:
    admin = sa.create_engine(url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    try:
        while not stop.wait(every):
            with admin.connect() as conn:
                conn.execute(sa.text("VACUUM ANALYZE outbox_message_live"))
    finally:
        admin.dispose()


def _monitor(
    url: str, stop: threading.Event, clock: _Clock, samples: list[tuple[float, float, int]]
) -> None:
    """(when, the gauge's age in seconds, dead tuples of the live partition) every 2 s."""
    from outbox import store

    engine = _engine(url)
    try:
        while not stop.wait(2.0):
            with engine.begin() as conn:
                age = store.oldest_snapshot(conn).age_seconds
                dead = conn.execute(
                    sa.text(
                        "SELECT n_dead_tup FROM pg_stat_user_tables "
                        "WHERE relname = 'outbox_message_live'"
                    )
                ).scalar_one()
            samples.append((clock.now(), age, int(dead)))
    finally:
        engine.dispose()


def _holder(url: str, begin_at: float, hold: float, clock: _Clock) -> None:
    admin = sa.create_engine(url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    time.sleep(max(0.0, begin_at - clock.now()))
    try:
        with admin.connect() as conn:
            conn.execute(sa.text("BEGIN ISOLATION LEVEL REPEATABLE READ"))
            conn.execute(sa.text("SELECT count(*) FROM outbox_channel"))  # the snapshot
            time.sleep(hold)
            conn.execute(sa.text("COMMIT"))
    finally:
        admin.dispose()


def run(
    url: str, rate: float, before: float, hold: float, after: float, bucket: float, vacuum: float
) -> list[dict[str, Any]]:
    common.register_channel()
    clock = _Clock()
    stop = threading.Event()
    claims: list[tuple[float, float, float]] = []
    samples: list[tuple[float, float, int]] = []
    threads = [
        threading.Thread(target=_producer, args=(url, rate, stop, clock), daemon=True),
        threading.Thread(target=_relay, args=(url, stop, clock, claims), daemon=True),
        threading.Thread(target=_vacuum, args=(url, vacuum, stop), daemon=True),
        threading.Thread(target=_monitor, args=(url, stop, clock, samples), daemon=True),
    ]
    holder = threading.Thread(target=_holder, args=(url, before, hold, clock), daemon=True)
    for thread in threads:
        thread.start()
    holder.start()
    time.sleep(before + hold + after)
    stop.set()
    for thread in threads:
        thread.join()
    holder.join()
    cells = []
    edge = 0.0
    while edge + bucket <= before + hold + after + 1e-9:
        inside = [c for c in claims if edge <= c[0] < edge + bucket]
        times = sorted(c[1] * 1000 for c in inside)
        seen = [s for s in samples if edge <= s[0] < edge + bucket]
        phase = (
            "before" if edge + bucket <= before else "after" if edge >= before + hold else "held"
        )
        cells.append(
            {
                "name": "long_transaction",
                "from_s": round(edge),
                "phase": phase,
                "claims": len(inside),
                "claim_p50_ms": round(statistics.median(times), 2) if times else None,
                "claim_p99_ms": round(common.percentile(times, 99), 2) if times else None,
                "busy": round(sum(c[2] for c in inside) / bucket, 2),
                "dead_tuples_max": max((s[2] for s in seen), default=None),
                "snapshot_age_max_s": round(max((s[1] for s in seen), default=0.0)),
            }
        )
        edge += bucket
    return cells


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.long_transaction")
    parser.add_argument("--rate", type=float, default=400.0, help="messages per second")
    parser.add_argument("--before", type=float, default=60.0)
    parser.add_argument("--hold", type=float, default=300.0, help="seconds the snapshot is held")
    parser.add_argument("--after", type=float, default=60.0)
    parser.add_argument("--bucket", type=float, default=60.0)
    parser.add_argument("--vacuum-every", type=float, default=15.0)
    args = parser.parse_args(argv)
    databases = common.Databases(common.server_url())
    try:
        databases.prepare_template()
        with databases.fresh("long_transaction") as url:
            cells = run(
                url, args.rate, args.before, args.hold, args.after, args.bucket, args.vacuum_every
            )
    finally:
        databases.close()
    for cell in cells:
        print(json.dumps(cell))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
