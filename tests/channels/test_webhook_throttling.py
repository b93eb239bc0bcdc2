"""A real receiver on 127.0.0.1 that admits a few requests, then answers
429 with Retry-After: the relay pauses that destination after one refused
call, counts no attempt and no deferral, and keeps sending to another
receiver in the same batch (docs/design.md, invariant 10)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from channel_support import loopback_resolver

import outbox
from outbox import channels, sender, store
from outbox.channels.webhook import WebhookChannel
from outbox.handoff import HandOff
from support import settings


class Admitting:
    """Answers 200 to the first ``admit`` requests, then 429 Retry-After."""

    def __init__(self, admit: int | None, retry_after: str = "30") -> None:
        self.admit = admit
        self.retry_after = retry_after
        self.requests = 0
        self.port = 0
        self.lock = threading.Lock()


@contextmanager
def admitting(admit: int | None, retry_after: str = "30") -> Iterator[Admitting]:
    state = Admitting(admit, retry_after)

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            with state.lock:
                state.requests += 1
                admitted = state.admit is None or state.requests <= state.admit
            self.send_response(200 if admitted else 429)
            if not admitted:
                self.send_header("Retry-After", state.retry_after)
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    state.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()


def hook(host: str, port: int, n: int) -> dict[str, Any]:
    return {"url": f"http://{host}:{port}/in", "event_type": "t", "body": {"n": n}}


def test_a_429_pauses_its_destination_and_the_other_receiver_keeps_going(
    engine: sa.Engine, signing_secret: tuple[str, str]
) -> None:
    arn, _ = signing_secret
    channel = WebhookChannel(
        allow_insecure=True, default_secret_id=arn, resolver=loopback_resolver()
    )
    channels.register("webhook", lambda: channel)
    with admitting(2) as slow, admitting(None) as fast:
        with engine.begin() as conn:  # interleaved: slow, fast, slow, fast, ...
            ids = outbox.enqueue_many(
                conn,
                [
                    {"channel": "webhook", "payload": hook(host, rx.port, n)}
                    for n in range(6)
                    for host, rx in (("slow.test", slow), ("fast.test", fast))
                ],
            )
        slow_ids, fast_ids = ids[0::2], ids[1::2]
        with engine.begin() as conn:
            claims = store.claim(conn, 100, 120)
        report = sender.run(
            engine,
            HandOff("webhook", tuple(claims)).to_event(),
            settings(send_concurrency=1),
            lambda: 30.0,
            channel_name="webhook",
        )
        assert slow.requests == 3  # two admitted, one refused, then no more calls
        assert fast.requests == 6  # the other receiver: every message, same batch
        assert report.statuses == {"delivered": 8, "not_started": 4}

        with engine.connect() as conn:
            rows = {
                r.id: r
                for r in conn.execute(
                    sa.text(
                        "SELECT id, status, attempts, deferrals, last_error FROM outbox_message"
                    )
                )
            }
            [paused] = store.destination_figures(conn)
            paused_for = conn.execute(
                sa.text("SELECT EXTRACT(EPOCH FROM paused_until - now()) FROM outbox_destination")
            ).scalar_one()
        assert {rows[i].status for i in fast_ids} == {"delivered"}
        waiting = slow_ids[2:]
        assert {(rows[i].status, rows[i].attempts, rows[i].deferrals) for i in waiting} == {
            ("pending", 0, 0)
        }
        assert rows[slow_ids[2]].last_error == "HTTP 429 with Retry-After"
        assert (paused.channel, paused.destination) == ("webhook", f"slow.test:{slow.port}")
        assert paused.throttled_last_minute == 1
        assert 20 < float(paused_for) <= 30  # Retry-After: 30, from the database clock

        # While it is paused, its rows stay put; the other receiver's new rows go.
        with engine.begin() as conn:
            (more,) = outbox.enqueue_many(
                conn, [{"channel": "webhook", "payload": hook("fast.test", fast.port, 9)}]
            )
        with engine.begin() as conn:
            assert [c.id for c in store.claim(conn, 100, 120)] == [more]
