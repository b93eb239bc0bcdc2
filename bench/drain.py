"""Drain a backlog under Lambda's limits, through the Lambda async simulator.

The real dispatcher, senders and reaper run against the Postgres of the cell,
with the hand-off going through ``tests/reliability/lambda_sim.py``: one queue
for the channel function, served by as many execution environments as its
reserved concurrency, and events dropped when they wait past the maximum
event age. The provider takes ``latency_ms`` per call and never fails. The
ideal bound is ``reserved concurrency x send concurrency / latency`` messages
per second: every execution environment always busy with full waves of calls.
The simulator's durations are scaled down (lease 4 s, event age 2 s; see its
docstring), which does not change the bound.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any

import sqlalchemy as sa

_TESTS = Path(__file__).resolve().parents[1] / "tests"


def simulator(**overrides: Any) -> tuple[Any, Any]:
    """The Lambda simulator's module, and its settings: the simulator's time
    scale with the production chunk and send concurrency (and ``overrides``)."""
    if str(_TESTS) not in sys.path:
        sys.path.insert(0, str(_TESTS))
    from reliability import lambda_sim

    from outbox.relay_settings import RelaySettings

    defaults = RelaySettings()
    settings = lambda_sim.sim_settings(
        handoff_chunk_size=defaults.handoff_chunk_size,
        send_concurrency=defaults.send_concurrency,
        **overrides,
    )
    return lambda_sim, settings


def run(url: str, rows: int, latency_ms: int, concurrency: int = 10) -> dict[str, Any]:
    from . import common

    lambda_sim, settings = simulator()
    from reliability.lambda_sim import Faults

    from outbox.runtime import cold_start_done

    engine = common.engine_for(url, pool_size=concurrency + 4)
    thresholds = gc.get_threshold()
    try:
        from outbox import channels

        # (the run registers its own provider: this one only lets the enqueue check)
        channels.register(lambda_sim.CHANNEL, lambda: lambda_sim.SimProvider(Faults(), 0, 0.0))
        ids = lambda_sim.enqueue(engine, rows)
        # What autovacuum does within a minute of the backlog's arrival (it is
        # off on the bench machines): without statistics the claim's estimate
        # of the due rows is a guess, and a guess crosses jit_above_cost.
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("VACUUM ANALYZE outbox_message_live"))
        # What each function's cold start does (runtime.cold_start_done): the
        # simulator's environments share this one process, so once here.
        cold_start_done()
        report = lambda_sim.run(
            engine,
            settings,
            Faults(),
            ids=ids,
            concurrency=concurrency,
            latency_seconds=latency_ms / 1000,
            timeout_seconds=max(120.0, rows / 50),
        )
        elapsed = report.seconds  # from the simulator's start to the last row final
        with engine.connect() as conn:
            other_attempts = dict(
                conn.execute(
                    sa.text(
                        "SELECT outcome || ': ' || COALESCE(error, ''), count(*) "
                        "FROM outbox_attempt WHERE outcome <> 'delivered' GROUP BY 1"
                    )
                ).all()
            )
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
        engine.dispose()
    delivered = report.statuses.get("delivered", 0)
    bound = concurrency * settings.send_concurrency / (latency_ms / 1000)
    rate = delivered / elapsed if elapsed else 0.0
    return {
        "rows": rows,
        "delivered": delivered,
        "reserved_concurrency": concurrency,
        "send_concurrency": settings.send_concurrency,
        "chunk_size": settings.handoff_chunk_size,
        "latency_ms": latency_ms,
        "seconds": round(elapsed, 2),
        "ideal_seconds": round(rows / bound, 2),
        "rows_per_s": round(rate, 1),
        "of_bound": round(rate / bound, 3),
        "dropped_for_age": len(report.record.dropped_for_age),
        "other_attempt_rows": sum(other_attempts.values()),
        "other_attempts": other_attempts,
        "violations": list(report.violations),
    }
