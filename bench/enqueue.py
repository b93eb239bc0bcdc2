"""Enqueue: ``outbox.enqueue_many`` against a raw multi-row INSERT on the same driver.

Both write ``rows`` realistic messages in transactions of ``per_tx`` rows into
a fresh database. The relay validates every payload against the channel's
schema and serialises it; the baseline sends ready JSON text.
"""

from __future__ import annotations

import json
import time
from typing import Any

from . import common


def relay(url: str, rows: int, per_tx: int) -> dict[str, Any]:
    import outbox

    common.register_channel()
    engine = common.engine_for(url)
    payloads = [common.python_payload(i) for i in range(rows)]
    try:
        with engine.begin() as conn:  # warm: connection, validator
            outbox.enqueue_many(conn, [{"channel": common.CHANNEL, "payload": payloads[0]}])
        started = time.perf_counter()
        for lo in range(0, rows, per_tx):
            with engine.begin() as conn:
                outbox.enqueue_many(
                    conn,
                    [{"channel": common.CHANNEL, "payload": p} for p in payloads[lo : lo + per_tx]],
                )
        elapsed = time.perf_counter() - started
    finally:
        engine.dispose()
    return {"rows": rows, "seconds": elapsed, "rows_per_s": rows / elapsed}


def baseline(url: str, rows: int, per_tx: int) -> dict[str, Any]:
    import pg8000.native

    payloads = [json.dumps(common.python_payload(i), separators=(",", ":")) for i in range(rows)]
    conn = pg8000.native.Connection(**common.native_params(url))
    common.no_delay(conn)  # the same socket setting as the relay's engine
    try:
        conn.run("INSERT INTO outbox_message (channel, payload) VALUES ('warm', '{}')")
        started = time.perf_counter()
        for lo in range(0, rows, per_tx):
            chunk = payloads[lo : lo + per_tx]
            values = ", ".join(f"(:c, CAST(:p{i} AS jsonb))" for i in range(len(chunk)))
            params = {f"p{i}": p for i, p in enumerate(chunk)}
            conn.run(
                f"INSERT INTO outbox_message (channel, payload) VALUES {values}",
                c=common.CHANNEL,
                **params,
            )
        elapsed = time.perf_counter() - started
    finally:
        conn.close()
    return {"rows": rows, "seconds": elapsed, "rows_per_s": rows / elapsed}
