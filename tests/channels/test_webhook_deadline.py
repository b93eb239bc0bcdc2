"""One absolute deadline per webhook call, against real
loopback receivers that drip their answer a byte at a time: the status line,
endless headers, or a body that never ends."""

from __future__ import annotations

import threading
import time

import pytest
import sqlalchemy as sa
from channel_support import DRIP_MODES, deliver, drip_receiver, elapsed, settled
from test_channel_webhook import channel_for, send

from support import LocalCA


@pytest.mark.parametrize("tls", [True, False], ids=["https", "http"])
@pytest.mark.parametrize("mode", DRIP_MODES)
def test_a_dripping_receiver_is_cut_off_at_the_deadline(
    mode: str, tls: bool, local_ca: LocalCA, signing_secret: tuple[str, str]
) -> None:
    arn, _ = signing_secret
    channel = channel_for(local_ca if tls else None, arn)
    with drip_receiver(mode, local_ca if tls else None) as rx:
        host = "webhook.test" if tls else "127.0.0.1"
        outcome, seconds = elapsed(lambda: send(channel, rx.url(host=host), deadline=3.0))
        assert rx.requests == 1
    # The receiver drips for 30 s: ending well before it proves the cut-off at
    # the 3 s deadline. The deadline leaves a loaded machine time to send the
    # request at all, and the bound has room for its scheduling.
    assert seconds < 15.0, f"{mode}: {seconds:.1f}s against a 3 s deadline"
    if mode == "body":
        # The status line came in time: it is the answer; the body is dropped.
        assert outcome.kind == "delivered"
    else:
        assert (outcome.kind, outcome.error) == ("retry", "timeout: no answer before the deadline")


def send_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(("send", "socket-watchdog"))]


def test_warm_invocations_against_dripping_receivers_leave_no_threads_or_sockets_behind(
    engine: sa.Engine, signing_secret: tuple[str, str]
) -> None:
    arn, _ = signing_secret
    channel = channel_for(None, arn)
    concurrency = 8  # support.settings(): the sender's pool size
    # Threads other tests of the session left behind (their own pools) are
    # not this test's: only the threads these invocations started count.
    before = set(send_threads())
    with drip_receiver("headers") as rx:
        for _ in range(5):
            (message_id, _), seconds = elapsed(
                lambda: deliver(
                    engine,
                    "webhook",
                    {"url": rx.url(), "event_type": "t", "body": {}},
                    channel=channel,
                    remaining=3.0,
                )
            )
            # Against a 30 s drip: cut off at the 3 s deadline. The bound is
            # loose on purpose (a busy machine is slow, but never 15 s slow).
            assert seconds < 15.0
            row, _ = settled(engine, message_id)
            assert (row.status, row.last_error) == (
                "pending",
                "timeout: no answer before the deadline",
            )
            with engine.begin() as conn:  # out of the next invocation's claim
                conn.execute(sa.text("UPDATE outbox_message SET available_at = 'infinity'"))
        assert rx.requests == 5
        # Every call ended at its deadline: the pool kept its threads (none
        # stuck, none retired), and the receiver saw every socket closed.
        assert len(set(send_threads()) - before) <= concurrency + 1
        # (the receiver notices a closed socket at its next write or two)
        # (polled up to a generous bound: a busy machine schedules it late)
        settle_by = time.monotonic() + 10.0
        while rx.open_connections and time.monotonic() < settle_by:
            time.sleep(0.02)
        assert rx.open_connections == 0
