"""What the database pays per delivered message: WAL bytes and transactions.

WAL is written cluster-wide, so on a shared server every other session's
writes would land in the figure. This cell therefore runs on a private
embedded Postgres (``pgserver``, a dev dependency) where nothing else writes,
with autovacuum off (its WAL is the table's, not the drain's). Each kind
drains the same seeded rows with one worker at batch 100, right after seeding
them, and the cell records ``pg_current_wal_lsn()`` around the drain.
Full-page images are left out that way: the seeding dirtied every page since
the last checkpoint. After a checkpoint each kind pays one image per page it
first touches, the same pages for all of them. Statements per message come
from the client side (a counter on every statement each kind sends).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from . import common, peer, throughput


def _admin(url: str) -> sa.Engine:
    return sa.create_engine(url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)


def _wal_position(url: str) -> int:
    engine = _admin(url)
    try:
        with engine.connect() as conn:
            return int(
                conn.execute(
                    sa.text("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint")
                ).scalar_one()
            )
    finally:
        engine.dispose()


def _measure(dbs: common.Databases, kind: str, rows: int, batch: int) -> dict[str, Any]:
    with dbs.fresh(f"wal_{kind}") as url:
        if kind == "pgqueuer":
            peer.seed(url, rows)
        else:
            common.seed_pending(url, rows)
        wal0 = _wal_position(url)
        if kind == "pgqueuer":
            result = peer.run_cell(url, batch, 1)
        else:
            result = throughput.run_cell(url, kind, batch, 1)
        wal1 = _wal_position(url)
    delivered = result["rows"]
    return {
        "kind": kind,
        "rows": delivered,
        "wal_bytes_per_message": round((wal1 - wal0) / delivered, 1) if delivered else None,
        "statements_per_message": round(result["statements"] / delivered, 4) if delivered else None,
    }


def run(rows: int, batch: int = 100) -> list[dict[str, Any]]:
    """One cell per kind on a private embedded server; ratios against the raw baseline."""
    from outbox import devdb

    kinds = ["baseline", "protocol", "relay", "worker"]
    if peer.available():
        kinds.append("pgqueuer")
    with (
        tempfile.TemporaryDirectory(prefix="outbox-bench-wal-") as folder,
        devdb.embedded(Path(folder) / "pgdata") as server,
    ):
        admin = _admin(server)
        with admin.connect() as conn:
            conn.execute(sa.text("ALTER SYSTEM SET autovacuum = off"))
            conn.execute(sa.text("SELECT pg_reload_conf()"))
        admin.dispose()
        dbs = common.Databases(server)
        try:
            dbs.prepare_template()
            figures = [_measure(dbs, kind, rows, batch) for kind in kinds]
        finally:
            dbs.close()
    base = next(f for f in figures if f["kind"] == "baseline")["wal_bytes_per_message"]
    for f in figures:
        if base and f["wal_bytes_per_message"] is not None:
            f["wal_vs_baseline"] = round(f["wal_bytes_per_message"] / base, 3)
    return [{"name": "wal", "batch": batch, **f} for f in figures]
