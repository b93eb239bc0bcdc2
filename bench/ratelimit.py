"""A receiver that admits a steady rate: the issue 21 table, through ``outbox worker``.

A real HTTP receiver on 127.0.0.1 admits ``rate`` requests a second (a token
bucket holding one second's worth) and answers ``429 Retry-After: 1`` beyond
it. ``rows`` webhook messages to it are drained by the command's loop
(``Worker.run``, as ``outbox worker --channels webhook`` runs it) with the
template's batch size and send concurrency; no limit is configured, so the
relay learns the receiver's rate from its answers. Figures: wall time against
the ideal (``rows / rate``, less the second's worth the receiver's bucket
starts with: "of the bound"), refused calls (counted at the receiver) per
delivered message, the most requests the receiver admitted within any one
second, attempts counted for throttling and dead rows (from the database).

    .venv/bin/python -m bench.ratelimit --rows 600 --rate 20
    .venv/bin/python -m bench.ratelimit --rows 600 --rate 20 --limit 20 --workers 4
    .venv/bin/python -m bench.ratelimit --rows 600 --rate 10 --other-rows 3000
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
    """A token bucket at the receiver: ``rate`` a second, one second's worth at
    once (None: admits everything), each answer after ``latency`` seconds."""

    def __init__(self, rate: float | None, latency: float = 0.0) -> None:
        self.rate = rate
        self.latency = latency
        self.tokens = rate or 0.0
        self.at = time.monotonic()
        self.admitted: list[float] = []  # when, on the monotonic clock
        self.refused = 0
        self.lock = threading.Lock()

    def admit(self) -> bool:
        with self.lock:
            now = time.monotonic()
            if self.rate is not None:
                self.tokens = min(self.rate, self.tokens + (now - self.at) * self.rate)
                self.at = now
                if self.tokens < 1:
                    self.refused += 1
                    return False
                self.tokens -= 1
            self.admitted.append(now)
            return True

    def busiest_second(self) -> int:
        """The most requests admitted within any one second."""
        times, most, first = sorted(self.admitted), 0, 0
        for last, at in enumerate(times):
            while at - times[first] >= 1.0:
                first += 1
            most = max(most, last - first + 1)
        return most


@contextmanager
def receiver(rate: float | None, latency: float = 0.0) -> Iterator[tuple[Admitting, int]]:
    state = Admitting(rate, latency)

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            if state.latency:
                time.sleep(state.latency)
            if state.admit():
                self.send_response(200)
            else:
                self.send_response(429)
                self.send_header("Retry-After", "1")
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    server.request_queue_size = 128
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


def _insert(engine: Any, port: int, host: str, rows: int) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO outbox_message (channel, payload) "
                "SELECT 'webhook', jsonb_build_object('url', CAST(:url AS text),"
                " 'event_type', 'bench', 'body', jsonb_build_object('n', g))"
                " FROM generate_series(1, :rows) AS g"
            ),
            {"url": f"http://{host}:{port}/in", "rows": rows},
        )


def run(
    url: str,
    rows: int,
    rate: float,
    *,
    limit: float | None = None,
    workers: int = 1,
    other_rows: int = 0,
    other_latency: float = 0.02,
) -> dict[str, Any]:
    """``rows`` to a receiver admitting ``rate`` a second, drained by
    ``workers`` worker loops; with ``limit``, a configured limit (rate and
    burst) for that destination, else the relay learns it; with
    ``other_rows``, as many to a second receiver that admits everything, each
    answer after ``other_latency`` seconds, in the same run."""
    from outbox import channels, store
    from outbox.channels.webhook import WebhookChannel
    from outbox.relay_settings import RelaySettings
    from outbox.worker import Worker

    channel = WebhookChannel(
        allow_insecure=True,
        default_secret_id="bench",
        resolver=lambda host, port: ["127.0.0.1"],
        secrets=_Secrets(),
    )
    channels.register("webhook", lambda: channel)
    settings = RelaySettings()
    engine = common.engine_for(url, pool_size=4 * workers)
    stop = threading.Event()
    try:
        with receiver(rate) as (rx, port), receiver(None, other_latency) as (other, other_port):
            _insert(engine, port, "limited.bench", rows)
            if other_rows:
                _insert(engine, other_port, "other.bench", other_rows)
            if limit is not None:
                with engine.begin() as conn:
                    store.set_limit(conn, "webhook", f"limited.bench:{port}", limit, limit)
            threads = [
                threading.Thread(
                    target=Worker(engine, settings, channels=["webhook"], stop=stop).run,
                    daemon=True,
                )
                for _ in range(workers)
            ]
            started = time.monotonic()
            for thread in threads:
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
            elapsed = max(rx.admitted) - started if rx.admitted else 0.0
            stop.set()
            for thread in threads:
                thread.join()
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
                sa.text("SELECT rate FROM outbox_destination WHERE destination LIKE 'limited%'")
            ).scalar_one_or_none()
    finally:
        stop.set()
        engine.dispose()
    delivered = len(rx.admitted)
    # The receiver's bucket starts full: one second's worth comes at once.
    ideal = max(rows - rate, 0) / rate
    cell: dict[str, Any] = {
        "rows": rows,
        "receiver_admits_per_s": rate,
        "limit_per_s": limit,
        "workers": workers,
        "wall_s": round(elapsed, 1),
        "ideal_s": round(ideal, 1),
        "of_bound": round(ideal / elapsed, 3) if elapsed else None,
        "refused_calls": rx.refused,
        "refused_per_delivered": round(rx.refused / max(delivered, 1), 4),
        "busiest_second": rx.busiest_second(),
        "attempts_counted_for_throttling": int(counted),
        "delivered": int(counts.get("delivered", 0)),
        "dead": int(counts.get("dead", 0)),
        "learned_rate_per_s": None if learned is None else round(float(learned), 2),
        "batch_size": settings.batch_size,
        "send_concurrency": settings.send_concurrency,
    }
    if other_rows:
        span = max(other.admitted) - started
        bound = workers * settings.send_concurrency / other_latency
        cell.update(
            other_rows=other_rows,
            other_latency_ms=round(other_latency * 1000),
            other_rows_per_s=round(other_rows / span, 1),
            other_bound_rows_per_s=round(bound, 1),
            other_of_bound=round(other_rows / span / bound, 3),
        )
    return cell


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=600)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--limit", type=float, default=None, help="a configured limit")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--other-rows", type=int, default=0, help="to an unlimited receiver")
    args = parser.parse_args()
    undo = common.quiet_process()
    dbs = common.Databases(common.server_url())
    try:
        dbs.prepare_template()
        with dbs.fresh("ratelimit") as url:
            cell = {
                "name": "ratelimit",
                **run(
                    url,
                    args.rows,
                    args.rate,
                    limit=args.limit,
                    workers=args.workers,
                    other_rows=args.other_rows,
                ),
            }
    finally:
        dbs.close()
        undo()
    print(json.dumps(cell, indent=2))


if __name__ == "__main__":
    main()
