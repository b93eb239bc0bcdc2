"""``python -m bench.destinations``: the claim beside many learned destinations
(issue 31, item 1).

Every receiver that ever answered "slow down" has a row in
``outbox_destination``. Two cells, each a fresh database with the same due
rows (``--rows`` webhook rows spread over 50 receivers, 8 of them with a
learned rate and a full bucket):

* ``none``: no other destination row;
* ``learned``: ``--learned`` more destinations that throttled within the last
  15 minutes (learned rates, full buckets, nothing due), 8 of them stale (the
  oldest draw times, as quiet receivers that once answered 429 have), the
  others drawn from since the 8 throttled ones;
* ``all-stale``: the same, every one of them drawn from before the 8
  throttled ones (the turn must rotate past all of them).

In each, ``store.claim`` (batch 100) and a raw-SQL claim (the compare-and-set
of the due index, nothing else) run alternately ``--runs`` times, each in a
transaction rolled back (so every run sees the same table); the figures are
the median wall time of each and their ratio, and the ``learned`` cell's claim
against the ``none`` cell's, each as a ratio to its own baseline (the machine's
load moves both alike). Then committed claims run until each of the 8
throttled destinations with rows due was served once: how many it took.

    .venv/bin/python -m bench.destinations --learned 20000
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import sqlalchemy as sa

from . import common

_BASELINE = sa.text(
    """
    UPDATE outbox_message AS m SET status = 'claimed', claim_token = gen_random_uuid(),
        claimed_at = now(), lease_expires_at = now() + interval '2 minutes'
    WHERE m.id IN (SELECT id FROM outbox_message WHERE status = 'pending'
                   ORDER BY priority DESC, available_at, id LIMIT 100 FOR UPDATE SKIP LOCKED)
    RETURNING m.id
    """
)


def _seed(url: str, rows: int, learned: int, stale: int) -> None:
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO outbox_message (channel, payload, available_at) "
                    "SELECT 'webhook', jsonb_build_object('url', "
                    "'https://r' || mod(g, 50) || '.example/h', 'event_type', 't', "
                    "'body', jsonb_build_object('n', g)), now() - interval '1 second' "
                    "FROM generate_series(1, :rows) AS g"
                ),
                {"rows": rows},
            )
            # 8 of the 50 receivers with due rows throttled: learned rate, full bucket
            conn.execute(
                sa.text(
                    "INSERT INTO outbox_destination (channel, destination, paused_until, rate,"
                    " rate_at, tokens, tokens_at) SELECT 'webhook', 'r' || g || '.example',"
                    " now() - interval '1 minute', 1000, now() - interval '1 minute', 1000,"
                    " now() - interval '1 second' FROM generate_series(0, 7) AS g"
                )
            )
            conn.execute(
                sa.text(
                    "INSERT INTO outbox_destination (channel, destination, paused_until, rate,"
                    " rate_at, tokens, tokens_at) SELECT 'webhook', 'quiet' || g || '.example',"
                    " now() - interval '10 minutes', 5, now() - interval '10 minutes', 5,"
                    " CASE WHEN g <= :stale THEN now() - interval '10 minutes'"
                    " ELSE now() END - make_interval(secs => g / 1e6)"
                    " FROM generate_series(1, :n) AS g"
                ),
                {"n": learned, "stale": stale},
            )
            conn.execute(sa.text("VACUUM ANALYZE outbox_message"))
            conn.execute(sa.text("VACUUM ANALYZE outbox_destination"))
    finally:
        engine.dispose()


def _engine(url: str) -> sa.Engine:
    """The relay's engine, with transactions (bench.common's autocommits, which
    would make the rollback below a no-op)."""
    from outbox.db import create_engine
    from outbox.relay_settings import DatabaseSettings

    return create_engine(DatabaseSettings(url=url, sslmode="disable"), pool_size=1)


def _cell(url: str, runs: int) -> dict[str, Any]:
    from outbox import store

    engine = _engine(url)
    relay: list[float] = []
    baseline: list[float] = []
    try:
        with engine.connect() as conn:
            for i in range(runs):
                for kind in ("relay", "baseline") if i % 2 else ("baseline", "relay"):
                    with conn.begin() as tx:
                        started = time.perf_counter()
                        if kind == "relay":
                            store.claim(conn, 100, 120)
                            relay.append(time.perf_counter() - started)
                        else:
                            conn.execute(_BASELINE).all()
                            baseline.append(time.perf_counter() - started)
                        tx.rollback()
    finally:
        engine.dispose()
    relay_ms, baseline_ms = statistics.median(relay) * 1e3, statistics.median(baseline) * 1e3
    return {
        "relay_ms": relay_ms,
        "baseline_ms": baseline_ms,
        "relay_of_baseline": relay_ms / baseline_ms,
        "claims_to_serve_all": _claims_to_serve_all(url),
    }


def _claims_to_serve_all(url: str, most: int = 2000) -> int | None:
    """Committed claims (batch 100) until every one of the 8 throttled
    destinations with rows due has been served at least once (None: not
    within ``most``)."""
    from outbox import store

    engine = _engine(url)
    waiting = {f"r{i}.example" for i in range(8)}
    try:
        with engine.connect() as conn:
            for n in range(1, most + 1):
                with conn.begin():
                    ids = [c.id for c in store.claim(conn, 100, 120)]
                    waiting -= set(
                        conn.execute(
                            sa.text(
                                "SELECT DISTINCT destination FROM outbox_message "
                                "WHERE id = ANY(:ids)"
                            ),
                            {"ids": ids},
                        ).scalars()
                    )
                if not waiting:
                    return n
    finally:
        engine.dispose()
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.destinations")
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--learned", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args(argv)
    databases = common.Databases(common.server_url())
    results: dict[str, dict[str, Any]] = {}
    try:
        databases.prepare_template()
        cells = (("none", 0, 0), ("learned", args.learned, 8), ("all-stale", args.learned, None))
        for label, learned, stale in cells:
            with databases.fresh(label) as url:
                _seed(url, args.rows, learned, learned if stale is None else stale)
                results[label] = _cell(url, args.runs)
            r = results[label]
            print(
                f"{label:9} learned={learned:<6} claim={r['relay_ms']:.2f} ms "
                f"baseline={r['baseline_ms']:.2f} ms claim/baseline={r['relay_of_baseline']:.2f} "
                f"claims until the 8 throttled ones were served={r['claims_to_serve_all']}"
            )
    finally:
        databases.close()
    ratio = results["learned"]["relay_of_baseline"] / results["none"]["relay_of_baseline"]
    print(f"learned/none (each against its baseline): {ratio:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
