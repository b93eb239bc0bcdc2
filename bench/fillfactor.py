"""``python -m bench.fillfactor``: what the live partition's fillfactor buys
(issue 30, item 4).

0018 made ``outbox_message_live`` with ``fillfactor = 90``, so that an update
of a row may stay on its page (a HOT update: no new index entries). Which of
the relay's updates can be HOT: the claim changes ``status``, which every
live index's predicate names (``WHERE status = 'pending'``), so it never is;
the settle moves the row to another partition (a delete and an insert); the
receipt (``received_at``: the Lambda path's second statement; ``outbox
worker`` takes it in the claim) and a retry's or deferral's settle that
stays pending may be. This drains the same due backlog with the relay's
Lambda path (``relay``: the dispatcher's claim, the sender's receipt and
settle) and with ``outbox worker``, on fresh databases whose live partition
has each fillfactor, the cells alternating round after round, and reports
per path and fillfactor the median rate, the share of the live partition's
updates that were HOT, and the WAL a message.

    .venv/bin/python -m bench.fillfactor --rows 20000 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import sqlalchemy as sa

from . import common, throughput

FILLFACTORS = (100, 90, 70)
KINDS = ("relay", "worker")


def cell(url: str, kind: str, fillfactor: int, rows: int, batch: int) -> dict[str, Any]:
    admin = sa.create_engine(url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    try:
        with admin.connect() as conn:
            conn.execute(
                sa.text(f"ALTER TABLE outbox_message_live SET (fillfactor = {fillfactor})")
            )
        common.seed_pending(url, rows)  # after the ALTER: the pages are filled to it
        with admin.connect() as conn:
            wal_before = conn.execute(sa.text("SELECT pg_current_wal_lsn()")).scalar_one()
        step, close = throughput.STEPPERS[kind](url, batch)
        started, done = time.perf_counter(), 0
        try:
            while (n := step()) > 0:
                done += n
        finally:
            close()
        elapsed = time.perf_counter() - started
        with admin.connect() as conn:
            wal = conn.execute(
                sa.text("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), :before)"),
                {"before": wal_before},
            ).scalar_one()
            conn.execute(sa.text("SELECT pg_stat_force_next_flush()"))
            updated, hot = conn.execute(
                sa.text(
                    "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables "
                    "WHERE relname = 'outbox_message_live'"
                )
            ).one()
    finally:
        admin.dispose()
    return {
        "kind": kind,
        "fillfactor": fillfactor,
        "rows": done,
        "rows_per_s": done / elapsed,
        "hot_share": hot / updated if updated else 0.0,
        "wal_bytes_per_message": float(wal) / done if done else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fillfactor")
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    common.register_channel()
    databases = common.Databases(common.server_url())
    results: dict[tuple[str, int], list[dict[str, Any]]] = {
        (k, f): [] for k in KINDS for f in FILLFACTORS
    }
    try:
        databases.prepare_template()
        for round_ in range(args.rounds):
            for kind, fillfactor in results:
                with databases.fresh(f"ff_{kind}_{fillfactor}_{round_}") as url:
                    result = cell(url, kind, fillfactor, args.rows, args.batch)
                print(result, flush=True)
                results[kind, fillfactor].append(result)
    finally:
        databases.close()
    for (kind, fillfactor), runs in results.items():
        base = statistics.median(r["rows_per_s"] for r in results[kind, FILLFACTORS[0]])
        rate = statistics.median(r["rows_per_s"] for r in runs)
        print(
            f"{kind:<6} fillfactor {fillfactor:>3}: {rate:,.0f} rows/s ({rate / base:.2f} of "
            f"{FILLFACTORS[0]}), HOT {statistics.median(r['hot_share'] for r in runs):.0%} "
            f"of the live partition's updates, "
            f"{statistics.median(r['wal_bytes_per_message'] for r in runs):,.0f} WAL bytes "
            "a message"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
