"""Growth: claim latency on a fresh table against the same backlog on a grown one.

Both runs hold ``pending`` due rows and run the same steady loop: claim one
batch with the real ``store.claim`` (timed), settle it as delivered with the
real ``store.settle``, and enqueue as many new rows, so the backlog stays put.

* fresh: a new database, the pending rows, VACUUM ANALYZE.
* grown: the same, plus ``settled`` delivered rows and the dead tuples of a
  busy day (``busy`` rows that went pending -> claimed -> delivered in bulk
  updates, leaving their dead versions and dead entries at the head of the
  claim index), and no VACUUM between any of it and the measurement:
  only what the migration ships (partial indexes, autovacuum settings) helps.
  The table is analyzed (statistics, as autovacuum keeps them; nothing removed).
"""

from __future__ import annotations

import time
from typing import Any

import sqlalchemy as sa

from outbox.relay_settings import RelaySettings

from . import common

# The claim as the relay runs it: with the production default deliver-by time.
DEFAULT_TTL = float(RelaySettings().default_ttl_seconds)

# Settled rows as the relay leaves them: claimed, received, settled, and the
# deliver-by time the claim wrote down (now past). Without that last one the
# table's statistics hid the plan flip history caused (issue 30).
_INSERT = (
    "INSERT INTO outbox_message (channel, payload, status, available_at, created_at, "
    "claimed_at, received_at, settled_at, attempts, provider_message_id, expires_at) "
    "SELECT :channel, {payload}, :status, now() - interval '1 day' + g * interval '50 ms', "
    "now() - interval '1 day' + g * interval '50 ms', "
    "CASE WHEN :status = 'delivered' THEN now() - interval '1 day' + g * interval '51 ms' END, "
    "CASE WHEN :status = 'delivered' THEN now() - interval '1 day' + g * interval '51 ms' END, "
    "CASE WHEN :status = 'delivered' THEN now() - interval '1 day' + g * interval '52 ms' END, "
    "CASE WHEN :status = 'delivered' THEN 1 ELSE 0 END, "
    "CASE WHEN :status = 'delivered' THEN 'p-' || g END, "
    "CASE WHEN :status = 'delivered' THEN now() - interval '1 day' + g * interval '50 ms' "
    "+ interval '1 second' END "
    "FROM generate_series(1, :rows) AS g"
)


def grow(url: str, settled: int, busy: int, *, autovacuum: bool = False) -> dict[str, float]:
    """Add ``settled`` delivered rows and a busy day's churn of ``busy`` rows;
    no VACUUM, or with ``autovacuum`` the one the live partition's own
    settings (0018: a vacuum every 1 % of its rows changed, at least 1,000)
    would have run long before the day ended (autovacuum is off on the
    bench machines, so the cell runs it)."""
    engine = sa.create_engine(
        url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool, hide_parameters=True
    )
    timings: dict[str, float] = {}
    try:
        with engine.connect() as conn:
            started = time.perf_counter()
            conn.execute(
                sa.text(_INSERT.format(payload=common.payload_sql(180, 300))),
                {"channel": common.CHANNEL, "status": "delivered", "rows": settled},
            )
            timings["settled_insert_s"] = time.perf_counter() - started
            started = time.perf_counter()
            # A busy day: rows enqueued as pending, claimed, then delivered. Each
            # step leaves a dead version behind, and the claim index keeps the
            # entries of rows that are no longer pending until a vacuum.
            conn.execute(
                sa.text(
                    "INSERT INTO outbox_message (channel, payload, available_at) "
                    f"SELECT :channel, {common.payload_sql(180, 300)}, "
                    "now() - interval '12 hours' + g * interval '10 ms' "
                    "FROM generate_series(1, :rows) AS g"
                ),
                {"channel": common.CHANNEL, "rows": busy},
            )
            conn.execute(
                sa.text(
                    "UPDATE outbox_message SET status = 'claimed', "
                    "claim_token = gen_random_uuid(), claimed_at = now(), "
                    "lease_expires_at = now() + interval '2 minutes' "
                    "WHERE status = 'pending'"
                )
            )
            conn.execute(
                sa.text(
                    "UPDATE outbox_message SET status = 'delivered', claim_token = NULL, "
                    "lease_expires_at = NULL, attempts = 1, settled_at = now() "
                    "WHERE status = 'claimed'"
                )
            )
            timings["busy_day_s"] = time.perf_counter() - started
            if autovacuum:
                conn.execute(sa.text("VACUUM outbox_message_live"))
            dead = conn.execute(
                sa.text(
                    "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = 'outbox_message'"
                )
            ).scalar()
            timings["dead_tuples_reported"] = float(dead or 0)
    finally:
        engine.dispose()
    return timings


def measure(url: str, pending: int, batch: int, samples: int, *, vacuum: bool) -> dict[str, Any]:
    """Steady state around ``pending`` due rows: claim latency percentiles in ms."""
    from outbox import store

    common.register_channel()
    engine = common.engine_for(url)
    backoff = store.Backoff(2.0, 900.0, 5)
    latencies: list[float] = []
    drained, draining_s = 0, 0.0  # rows claimed and settled, and the time it took
    try:
        common.seed_pending(url, pending, vacuum=vacuum)
        if not vacuum:
            # The statistics a table that grew over days has, its backlog
            # included: autovacuum's analyze follows every 2% of changed rows
            # (0001). ANALYZE removes nothing: the dead versions and dead index
            # entries stay. Without statistics (a table bulk-loaded seconds
            # ago) the planner guesses few due rows, costs the claim above
            # jit_above_cost, and JIT compilation adds 10 to 15 ms to every
            # claim (bench/README.md, "Claim latency on a grown table").
            with engine.connect() as conn:
                conn.exec_driver_sql("ANALYZE outbox_message")
        for _ in range(samples):
            with engine.begin() as conn:
                started = time.perf_counter()
                claims = store.claim(conn, batch, 120, default_ttl_seconds=DEFAULT_TTL)
                latencies.append((time.perf_counter() - started) * 1000)
            if not claims:
                raise RuntimeError("the backlog ran dry during the growth measurement")
            with engine.begin() as conn:
                store.settle(
                    conn,
                    [store.Settlement(c.id, c.claim_token, "delivered") for c in claims],
                    backoff,
                )
            draining_s += time.perf_counter() - started
            drained += len(claims)
            with engine.begin() as conn:
                # Keep the backlog where it was: as many new rows as were settled.
                conn.execute(
                    sa.text(
                        "INSERT INTO outbox_message (channel, payload) "
                        f"SELECT :channel, {common.payload_sql()} "
                        "FROM generate_series(1, :rows) AS g"
                    ),
                    {"channel": common.CHANNEL, "rows": len(claims)},
                )
        with engine.connect() as conn:
            plan = conn.execute(
                # the claim the relay runs here: one tenant, no limit, no pause
                sa.text(
                    "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "
                    + store.delivery._CLAIMS[store.delivery.LEAN, False].text
                ),
                {"batch_size": batch, "lease_seconds": 120.0, "default_ttl": DEFAULT_TTL},
            ).scalar()
            conn.rollback()  # EXPLAIN ANALYZE ran the UPDATE: undo it
    finally:
        engine.dispose()
    top = plan[0] if isinstance(plan, list) else {}
    return {
        "samples": len(latencies),
        "p50_ms": common.percentile(latencies, 50),
        "p99_ms": common.percentile(latencies, 99),
        "max_ms": max(latencies) if latencies else 0.0,
        # the drain's rate: rows claimed and settled a second (the refill apart)
        "drain_rows_per_s": drained / draining_s if draining_s else 0.0,
        "plan_execution_ms": top.get("Execution Time", 0.0),
        "plan_shared_buffers": _buffers(top.get("Plan", {})),
    }


def _buffers(node: dict[str, Any]) -> int:
    return int(node.get("Shared Hit Blocks", 0)) + int(node.get("Shared Read Blocks", 0))
