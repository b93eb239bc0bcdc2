"""``python -m bench.history_claim``: the claim beside history (issue 30, item 2).

One fresh database: ``--settled`` settled rows shaped like the relay's own
(claimed, received, settled, deliver-by times past, 80 % email with SES ids,
0.5 % dead), then ``--due`` due rows (a backlog after an outage), VACUUM
ANALYZE as autovacuum would; then ``store.claim`` at ``--batch`` ``--runs``
times, each rolled back (every run sees the same table), and the median, and
the claim's plan (whether it walks the due index, whether JIT compiled it).

    .venv/bin/python -m bench.history_claim --settled 1000000 --due 100000 --batch 100
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import sqlalchemy as sa

from . import common
from .destinations import _engine

_SETTLED = """
INSERT INTO outbox_message (channel, payload, status, available_at, created_at, claimed_at,
    received_at, settled_at, attempts, provider_message_id, expires_at)
SELECT CASE WHEN mod(g, 5) = 0 THEN 'webhook' ELSE 'email' END, {payload},
    CASE WHEN mod(g, 200) = 0 THEN 'dead' ELSE 'delivered' END,
    now() - interval '20 days' + g * interval '1 second',
    now() - interval '20 days' + g * interval '1 second',
    now() - interval '20 days' + g * interval '1 second',
    now() - interval '20 days' + g * interval '1 second',
    now() - interval '20 days' + g * interval '1 second' + interval '1 second', 1,
    CASE WHEN mod(g, 5) <> 0 THEN 'ses-' || g END,
    now() - interval '19 days' + g * interval '1 second'
FROM generate_series(1, :n) AS g
"""
_DUE = """
INSERT INTO outbox_message (channel, payload, available_at)
SELECT 'email', {payload}, now() - interval '1 hour' + g * interval '1 ms'
FROM generate_series(1, :n) AS g
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.history_claim")
    parser.add_argument("--settled", type=int, default=1_000_000)
    parser.add_argument("--due", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args(argv)
    from outbox import store
    from outbox.store import delivery

    databases = common.Databases(common.server_url())
    try:
        databases.prepare_template()
        with databases.fresh("history") as url:
            admin = sa.create_engine(url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
            payload = common.payload_sql(180, 300)
            with admin.connect() as conn:
                conn.execute(sa.text(_SETTLED.format(payload=payload)), {"n": args.settled})
                conn.execute(sa.text(_DUE.format(payload=payload)), {"n": args.due})
                conn.execute(sa.text("VACUUM ANALYZE outbox_message"))
            admin.dispose()
            engine = _engine(url)
            times: list[float] = []
            with engine.connect() as conn:
                for _ in range(args.runs):
                    with conn.begin() as tx:
                        started = time.perf_counter()
                        store.claim(conn, args.batch, 120, default_ttl_seconds=86400)
                        times.append(time.perf_counter() - started)
                        tx.rollback()
                with conn.begin() as tx:
                    plan = conn.execute(
                        sa.text(
                            "EXPLAIN (ANALYZE, FORMAT JSON) "
                            + delivery._CLAIMS[delivery.LEAN, False].text
                        ),
                        {"batch_size": args.batch, "lease_seconds": 120.0, "default_ttl": 86400.0},
                    ).scalar_one()
                    tx.rollback()
            engine.dispose()
    finally:
        databases.close()
    text = json.dumps(plan)
    print(
        f"settled={args.settled} due={args.due} batch={args.batch} "
        f"claim median={statistics.median(times) * 1e3:.1f} ms "
        f"walks the due index={'outbox_message_due' in text} jit={'JIT' in text}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
