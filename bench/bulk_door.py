"""The bulk door's own checks (migration 0021) against 0020's door, which
trusted its caller: ``python -m bench.bulk_door``.

Two fresh databases, one at revision 0020 and one at the head; the same
100-email call of ``outbox_enqueue_many`` runs on each in turn (interleaved,
so the machine's noise falls on both), 60 rounds, the first 10 left out.
Custom channels skip the built-in field checks, so emails are the worst case.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any

import sqlalchemy as sa

from . import common

CALL_ROWS = 100
ROUNDS = 60
WARM = 10


def run(rounds: int = ROUNDS) -> dict[str, Any]:
    from outbox import migrate
    from outbox.db import create_engine
    from outbox.relay_settings import DatabaseSettings

    server = common.server_url()
    admin = sa.create_engine(server, isolation_level="AUTOCOMMIT")
    engines: dict[str, sa.Engine] = {}
    try:
        for revision in ("0020", migrate.head()):
            name = f"bench_bulk_door_{os.getpid()}_{revision}"
            with admin.connect() as conn:
                conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name}"))
                conn.execute(sa.text(f"CREATE DATABASE {name}"))
            engine = create_engine(
                DatabaseSettings(url=common.url_for(server, name), sslmode="disable")
            )
            migrate.upgrade(engine)
            if revision != migrate.head():
                migrate.downgrade(engine, revision)
            engines[revision] = engine
        email = {
            "from": "orders@example.com",
            "to": ["ada@example.net"],
            "subject": "Your order",
            "text": "x" * 400,
        }
        nulls = "{" + ",".join(["NULL"] * CALL_ROWS) + "}"
        call = sa.text(
            "SELECT count(*) FROM outbox_enqueue_many(CAST(:c AS text[]), CAST(:p AS jsonb), "
            f"'{nulls}', '{nulls}', NULL, NULL, '{nulls}', NULL, NULL, NULL)"
        )
        params = {
            "c": "{" + ",".join(["email"] * CALL_ROWS) + "}",
            "p": json.dumps([email] * CALL_ROWS),
        }
        times: dict[str, list[float]] = {revision: [] for revision in engines}
        for _ in range(rounds):
            for revision, engine in engines.items():
                with engine.begin() as conn:
                    started = time.perf_counter()
                    conn.execute(call, params).scalar_one()
                    times[revision].append(time.perf_counter() - started)
        medians = {
            r: statistics.median(t[min(WARM, rounds // 2) :]) * 1000 for r, t in times.items()
        }
        old, new = medians["0020"], medians[migrate.head()]
        return {"ms_per_call_0020": old, "ms_per_call_head": new, "ratio": new / old}
    finally:
        for engine in engines.values():
            engine.dispose()
        with admin.connect() as conn:
            for revision in engines:
                conn.execute(
                    sa.text(f"DROP DATABASE IF EXISTS bench_bulk_door_{os.getpid()}_{revision}")
                )
        admin.dispose()


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
