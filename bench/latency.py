"""Latency: enqueue -> delivered with the dispatcher loop running and a steady producer.

A producer process enqueues ``rate`` messages a second (``outbox.enqueue_many``
in small transactions, as an application would); this process runs the real
``dispatcher.run`` loop with a ``CallableInvoker`` that calls the real
``sender.run``. Latency is ``settled_at - created_at`` of each delivered row:
both come from the database clock, so no two clocks are compared.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from typing import Any

import sqlalchemy as sa

from . import common


def _producer(url: str, rate: float, seconds: float, per_tx: int, out: Any) -> None:
    try:
        common.quiet_process()
        import outbox

        common.register_channel()
        engine = common.engine_for(url)
        interval = per_tx / rate
        started = time.monotonic()
        sent = 0
        next_at = started
        while time.monotonic() - started < seconds:
            with engine.begin() as conn:
                outbox.enqueue_many(
                    conn,
                    [
                        {"channel": common.CHANNEL, "payload": common.python_payload(sent + i)}
                        for i in range(per_tx)
                    ],
                )
            sent += per_tx
            next_at += interval
            time.sleep(max(0.0, next_at - time.monotonic()))
        engine.dispose()
        out.put({"sent": sent})
    except BaseException as exc:
        out.put({"error": f"{type(exc).__name__}: {exc}"})


def run(
    url: str,
    rate: float = 100.0,
    seconds: float = 10.0,
    warmup: float = 1.0,
    linger: float | None = None,
) -> dict[str, Any]:
    """``linger``: run the dispatcher as sleep mode does (PACING_MODE=sleep:
    it would end after that many seconds with nothing due); None: poll mode."""
    from outbox import dispatcher, sender
    from outbox.handoff import CallableInvoker
    from outbox.relay_settings import RelaySettings

    ctx = mp.get_context("fork")
    out = ctx.Queue()
    per_tx = 5
    # Forked before this process opens any connection.
    producer = ctx.Process(target=_producer, args=(url, rate, seconds, per_tx, out), daemon=True)
    producer.start()
    common.register_channel()
    engine = common.engine_for(url, pool_size=4)
    settings = RelaySettings()  # the defaults the template ships: batch 100, poll 0.2 s

    def send(event: dict[str, Any]) -> None:
        wire = json.loads(json.dumps(event, separators=(",", ":")))
        sender.run(engine, wire, settings, lambda: 60.0, channel_name=common.CHANNEL)

    invoker = CallableInvoker({common.CHANNEL: send})
    # The first ``warmup`` seconds of messages are left out of the figures.
    stop_at = time.monotonic() + seconds + 2.0
    report = dispatcher.run(
        engine,
        invoker,
        settings,
        lambda: stop_at - time.monotonic() + settings.poll_interval_seconds,
        linger=linger,
    )
    produced = out.get(timeout=60)
    producer.join(timeout=10)
    if "error" in produced:
        raise RuntimeError(f"producer failed: {produced['error']}")
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT EXTRACT(EPOCH FROM settled_at - created_at) * 1000 AS ms, "
                "status FROM outbox_message "
                "WHERE created_at >= (SELECT min(created_at) FROM outbox_message) "
                "  + make_interval(secs => :warmup) ORDER BY id"
            ),
            {"warmup": warmup},
        ).all()
    engine.dispose()
    delivered = [float(r.ms) for r in rows if r.status == "delivered"]
    return {
        "rate_per_s": rate,
        "seconds": seconds,
        "produced": produced["sent"],
        "delivered": len(delivered),
        "not_delivered": len(rows) - len(delivered),
        "p50_ms": common.percentile(delivered, 50),
        "p99_ms": common.percentile(delivered, 99),
        "poll_interval_ms": settings.poll_interval_seconds * 1000,
        "dispatch_batches": report.batches,
        "pacing": "poll" if linger is None else "sleep",
        "ended": report.ended,
    }
