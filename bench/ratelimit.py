"""A receiver that admits a steady rate: the issue 21 table, through ``outbox worker``.

A real HTTP receiver on 127.0.0.1 admits ``rate`` requests a second (a token
bucket holding one second's worth) and answers ``429 Retry-After: 1`` beyond
it. ``rows`` webhook messages to it are drained by the command's loop
(``Worker.run``, as ``outbox worker --channels webhook`` runs it) with the
template's batch size and send concurrency; no limit is configured, so the
relay learns the receiver's rate from its answers. Figures: wall time against
the ideal ``rows / rate`` (of the bound), refused calls (counted at the
receiver) per delivered message, attempts counted for throttling and dead
rows (both from the database).

    .venv/bin/python -m bench.ratelimit --rows 600 --rate 20
"""

from __future__ import annotations

import argparse
import http.server
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa

from . import common

SECRET = "whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"  # a bench-only signing key


class Admitting:
    """A token bucket at the receiver: ``rate`` a second, one second's worth at once."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.tokens = rate
        self.at = time.monotonic()
        self.admitted = 0
        self.refused = 0
        self.lock = threading.Lock()

    def admit(self) -> bool:
        with self.lock:
            now = time.monotonic()
            self.tokens = min(self.rate, self.tokens + (now - self.at) * self.rate)
            self.at = now
            if self.tokens >= 1:
                self.tokens -= 1
                self.admitted += 1
                return True
            self.refused += 1
            return False


@contextmanager
def receiver(rate: float) -> Iterator[tuple[Admitting, int]]:
    state = Admitting(rate)

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            if state.admit():
                self.send_response(200)
            else:
                self.send_response(429)
                self.send_header("Retry-After", "1")
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield state, server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


class _Secrets:
    def get(self, name: str, max_age: int = 0) -> str:
        return SECRET


def run(url: str, rows: int, rate: float) -> dict[str, Any]:
    from outbox import channels
    from outbox.channels.webhook import WebhookChannel
    from outbox.config import RelaySettings
    from outbox.worker import Worker

    channel = WebhookChannel(
        allow_insecure=True,
        default_secret_id="bench",
        resolver=lambda host, port: ["127.0.0.1"],
        secrets=_Secrets(),
    )
    channels.register("webhook", lambda: channel)
    settings = RelaySettings()
    engine = common.engine_for(url, pool_size=4)
    stop = threading.Event()
    try:
        with receiver(rate) as (rx, port):
            with engine.begin() as conn:
                conn.execute(
                    sa.text(
                        "INSERT INTO outbox_message (channel, payload) "
                        "SELECT 'webhook', jsonb_build_object('url', CAST(:url AS text),"
                        " 'event_type', 'bench', 'body', jsonb_build_object('n', g))"
                        " FROM generate_series(1, :rows) AS g"
                    ),
                    {"url": f"http://receiver.bench:{port}/in", "rows": rows},
                )
            worker = Worker(engine, settings, channels=["webhook"], stop=stop)
            thread = threading.Thread(target=worker.run, daemon=True)
            started = time.monotonic()
            thread.start()
            while True:
                time.sleep(0.1)
                with engine.connect() as conn:
                    left = conn.execute(
                        sa.text(
                            "SELECT count(*) FROM outbox_message "
                            "WHERE status IN ('pending', 'claimed')"
                        )
                    ).scalar_one()
                if left == 0:
                    break
            elapsed = time.monotonic() - started
            stop.set()
            thread.join()
            refused = rx.refused
        with engine.connect() as conn:
            counts: dict[str, int] = dict(
                conn.execute(
                    sa.text("SELECT status, count(*) FROM outbox_message GROUP BY status")
                ).all()
            )
            counted = conn.execute(
                sa.text(
                    "SELECT count(*) FROM outbox_attempt WHERE outcome IN ('retry', 'dead')"
                    " AND (error LIKE 'HTTP 429%' OR error LIKE 'HTTP 503%'"
                    "      OR error LIKE 'deferred%')"
                )
            ).scalar_one()
            learned = conn.execute(
                sa.text("SELECT rate, throttled_total FROM outbox_destination")
            ).one_or_none()
    finally:
        stop.set()
        engine.dispose()
    delivered = int(counts.get("delivered", 0))
    ideal = rows / rate
    return {
        "rows": rows,
        "receiver_admits_per_s": rate,
        "wall_s": round(elapsed, 1),
        "ideal_s": round(ideal, 1),
        "of_bound": round(ideal / elapsed, 3),
        "refused_calls": refused,
        "refused_per_delivered": round(refused / max(delivered, 1), 3),
        "attempts_counted_for_throttling": int(counted),
        "delivered": delivered,
        "dead": int(counts.get("dead", 0)),
        "learned_rate_per_s": None if learned is None else round(float(learned.rate), 2),
        "batch_size": settings.batch_size,
        "send_concurrency": settings.send_concurrency,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=600)
    parser.add_argument("--rate", type=float, default=20.0)
    args = parser.parse_args()
    undo = common.quiet_process()
    dbs = common.Databases(common.server_url())
    try:
        dbs.prepare_template()
        with dbs.fresh("ratelimit") as url:
            cell = {"name": "ratelimit", **run(url, args.rows, args.rate)}
    finally:
        dbs.close()
        undo()
    print(json.dumps(cell, indent=2))


if __name__ == "__main__":
    main()
