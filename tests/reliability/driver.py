"""One relay process of the fault campaign: ``python -m reliability.driver ROLE``.

ROLE is dispatcher, sender or reaper. Settings come from the environment:
REL_DB_URL, REL_UNTIL (epoch seconds to stop at), REL_KILL_POINT (one of
harness.ALL_POINTS, or empty), REL_KILL_PROB, REL_SEED, REL_LEASE, REL_CALM
(1: no faults injected by this process), REL_DRIP_URL (the dripping receiver).

The dispatcher claims with ``outbox.dispatcher.dispatch_once`` and hands off
through the ``rel_queue`` table; the sender takes one event at a time from
that queue and runs ``outbox.sender.run`` on it; the reaper runs
``outbox.reaper.run``. Every database error is survived (recorded as a crash
for the claims in hand) and the loop goes on, as a new Lambda invocation would.
"""

from __future__ import annotations

import os
import sys
import time

from outbox import channels, dispatcher, reaper, sender
from outbox.db import create_engine
from outbox.relay_settings import DatabaseSettings, RelaySettings

from . import harness


def settings(lease: float) -> RelaySettings:
    return RelaySettings(
        batch_size=8,
        lease_seconds=int(lease),
        max_attempts=6,
        backoff_base_seconds=0.05,
        backoff_cap_seconds=0.4,
        min_deferral_seconds=0.05,  # scaled down with the backoff
        handoff_chunk_size=4,
        send_concurrency=4,
        settle_margin_seconds=0.5,
        poll_interval_seconds=0.05,
    )


def error_kind(exc: BaseException) -> str:
    text = str(exc)
    if "57014" in text or "statement timeout" in text:
        return "statement_timeout"
    if (
        "57P01" in text
        or "terminat" in text
        or "network error" in text.lower()
        or isinstance(exc, ConnectionError)
    ):
        return "connection_dropped"
    return type(exc).__name__


def main(role: str) -> None:
    url = os.environ["REL_DB_URL"]
    until = float(os.environ["REL_UNTIL"])
    point = os.environ.get("REL_KILL_POINT") or None
    probability = float(os.environ.get("REL_KILL_PROB", "0.2"))
    seed = int(os.environ.get("REL_SEED", "0"))
    lease = float(os.environ.get("REL_LEASE", "3"))

    # A calm run (the poisoned-payload and slow-drip runs): no kills, stalls
    # or slow statements, so every fault in it is the one under test.
    calm = os.environ.get("REL_CALM") == "1"

    aux = harness.aux_engine(url)
    recorder = harness.Recorder(aux)
    killer = None if calm else harness.Killer(recorder, point, probability, seed)
    harness.install_wrappers(recorder, killer, lease)
    provider = harness.FakeProvider(recorder, killer)
    channels.register(harness.CHANNEL, lambda: provider)
    # Dispatchers and reapers run as the Lambda functions do, in autocommit (each
    # store operation is one statement). Senders keep a transaction around the
    # settle so that the "mid_settle" kill point lands between UPDATE and COMMIT.
    engine = create_engine(
        DatabaseSettings(url=url, sslmode="disable"), autocommit=role != "sender"
    )
    relay = settings(lease)

    if role == "dispatcher":
        invoker = harness.QueueInvoker(aux, killer, fail_rate=0.05, seed=seed)
        while time.time() < until:
            try:
                report = dispatcher.dispatch_once(engine, invoker, relay)
            except Exception as exc:
                recorder.events(f"error:dispatcher:{error_kind(exc)}", [])
                time.sleep(0.05)
                continue
            if report.claimed == 0:
                time.sleep(0.05)
    elif role == "sender":
        while time.time() < until:
            event = harness.pop_event(aux)
            if event is None:
                time.sleep(0.03)
                continue
            pairs = harness.event_pairs(event)
            provider.tokens.update(pairs)
            provider.in_flight = pairs
            try:
                sender.run(engine, event, relay, lambda: 30.0, channel_name=harness.CHANNEL)
            except Exception as exc:
                # A dropped connection or a statement timeout: whatever was
                # sent but not settled is the reaper's now.
                recorder.events("crash", pairs)
                recorder.events(f"error:sender:{error_kind(exc)}", [])
    elif role == "reaper":
        # Outlive the senders' last events (a stalled settle among them).
        while time.time() < until + lease + 2:
            try:
                reaper.run(engine, relay, lambda: 10.0)
            except Exception as exc:
                recorder.events(f"error:reaper:{error_kind(exc)}", [])
            time.sleep(0.2)
    else:
        raise SystemExit(f"unknown role {role!r}")
    # Hung provider threads finish (and record their late accepts) before exit.


if __name__ == "__main__":
    main(sys.argv[1])
