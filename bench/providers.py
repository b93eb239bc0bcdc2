"""A provider with real latency: delivered messages per second of one sender instance.

A Lambda instance of a channel function handles one hand-off event at a time,
and runs up to ``send_concurrency`` provider calls at once within it, so its
ceiling is ``send_concurrency / latency`` messages per second. The cell
claims every row first (the dispatcher's hand-off events are collected, not
sent), then times one sender instance working through those events one after
another, with the template's defaults for chunk size and send concurrency and
a channel whose every call takes ``latency_ms``.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from . import common

CHANNEL = "slow"


def run(url: str, rows: int, latency_ms: int) -> dict[str, Any]:
    from outbox import channels, dispatcher, sender
    from outbox.channels import Deadline, Message, Outcome
    from outbox.handoff import CallableInvoker
    from outbox.relay_settings import RelaySettings
    from outbox.runtime import cold_start_done

    delay = latency_ms / 1000

    class SlowChannel(common.NoopChannel):
        name = CHANNEL

        def send(self, message: Message, deadline: Deadline) -> Outcome:
            time.sleep(delay)
            return Outcome.delivered(f"slow-{message.id}")

    channels.register(CHANNEL, SlowChannel)
    defaults = RelaySettings()
    settings = RelaySettings(batch_size=1000, lease_seconds=900)
    engine = common.engine_for(url, pool_size=2)
    thresholds = gc.get_threshold()
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "INSERT INTO outbox_message (channel, payload, available_at) "
                f"SELECT '{CHANNEL}', {common.payload_sql()}, now() - interval '1 second' "
                f"FROM generate_series(1, {int(rows)}) AS g"
            )
        events: list[dict[str, Any]] = []
        invoker = CallableInvoker({CHANNEL: events.append})
        while dispatcher.dispatch_once(engine, invoker, settings).claimed:
            pass
        # The statistics a running relay has (0001 sets the table's analyze
        # threshold to 2% of its rows, so autovacuum follows within its
        # minute): planned on the stale "no row claimed", each receipt and
        # settle would read every claimed row through the lease index.
        with engine.connect() as conn:
            conn.exec_driver_sql("ANALYZE outbox_message")
        # A warm instance, as the throughput cells' workers are before their
        # clock starts: the channel loaded, its validator compiled, the send
        # threads started, the statements' placeholders converted.
        warm_up = events.pop()
        sender.run(engine, warm_up, settings, lambda: 900.0, channel_name=CHANNEL)
        timed_rows = rows - len(warm_up["messages"])
        cold_start_done()  # as the function's cold start does
        started = time.monotonic()
        delivered = 0
        for event in events:
            report = sender.run(engine, event, settings, lambda: 900.0, channel_name=CHANNEL)
            delivered += report.statuses.get("delivered", 0)
        elapsed = time.monotonic() - started
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
        engine.dispose()
    bound = defaults.send_concurrency / delay
    rate = delivered / elapsed if elapsed else 0.0
    return {
        "latency_ms": latency_ms,
        "rows": timed_rows,  # the rows of the events on the clock (not the warm-up's)
        "delivered": delivered,
        "chunk_size": defaults.handoff_chunk_size,
        "send_concurrency": defaults.send_concurrency,
        "rows_per_s": round(rate, 1),
        "bound_rows_per_s": round(bound, 1),
        "of_bound": round(rate / bound, 3),
    }
