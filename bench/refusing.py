"""A receiver that answers 503 for ever (issue 31, item 3):
``python -m bench.refusing``.

One message to a destination that answers every call with 503 and no
Retry-After. Simulated time: the relay runs only when a sleeping dispatcher
would wake, at the earliest time the database names
(``store.next_wake(...).earliest``, what it moves its wake schedule to) or
at the safety net's runs (every ``--safety-net-minutes``); between runs every
time the relay reads is moved into the past by the gap (as
tests/integration/test_rate_limits.py does), so an hour takes seconds. Each
wake-up claims and, if it claimed, sends through the real sender. The
figures: the calls the receiver got and the dispatcher's runs in the first
hour, against the safety net's own runs, and how the message ended.

Before the fix (issue 31, found on 0.3.x): about one request a second for ever (39 in 40 s),
never ``dead``, and a sleeping dispatcher that ran its whole budget and
started its successor again and again (25 hand-offs in 25 s).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import sqlalchemy as sa

from . import common

HOUR = 3600.0


def jump(conn: sa.Connection, seconds: float) -> None:
    """Every time the relay reads moves ``seconds`` into the past."""
    shift = {"s": seconds}
    conn.execute(
        sa.text(
            "UPDATE outbox_destination SET"
            " paused_until = paused_until - make_interval(secs => :s),"
            " rate_at = rate_at - make_interval(secs => :s),"
            " tokens_at = tokens_at - make_interval(secs => :s),"
            " minute_start = minute_start - make_interval(secs => :s)"
        ),
        shift,
    )
    conn.execute(
        sa.text(
            "UPDATE outbox_message SET available_at = available_at - make_interval(secs => :s),"
            " created_at = created_at - make_interval(secs => :s),"
            " expires_at = expires_at - make_interval(secs => :s)"
        ),
        shift,
    )


def run(url: str, safety_net_minutes: float, max_hours: float) -> dict[str, Any]:
    import outbox
    from outbox import channels, sender, store
    from outbox.channels import Deadline, Message, Outcome
    from outbox.handoff import HandOff
    from outbox.relay_settings import RelaySettings

    class Refusing(common.NoopChannel):
        name = common.CHANNEL
        calls = 0

        def send(self, message: Message, deadline: Deadline) -> Outcome:
            Refusing.calls += 1
            return Outcome.throttled("HTTP 503")

    channels.register(common.CHANNEL, lambda: Refusing())
    settings = RelaySettings()  # the production defaults: retry window, attempts
    engine = common.engine_for(url, pool_size=2)
    try:
        with engine.begin() as conn:
            message_id = outbox.enqueue(conn, common.CHANNEL, common.python_payload(1))
        simulated = 0.0
        safety_net = safety_net_minutes * 60
        runs_first_hour = calls_first_hour = None
        wakeups = 0
        status = "pending"
        while simulated < max_hours * HOUR and status == "pending":
            wakeups += 1
            with engine.begin() as conn:
                claims = store.claim(conn, settings.batch_size, settings.lease_seconds)
            if claims:
                event = HandOff(common.CHANNEL, tuple(claims)).to_event()
                sender.run(engine, event, settings, lambda: 30.0)
            with engine.begin() as conn:
                status = conn.execute(
                    sa.text("SELECT status FROM outbox_message WHERE id = :id"),
                    {"id": message_id},
                ).scalar_one()
                wake = store.next_wake(conn)
                earliest = wake.earliest
                step = (earliest - wake.now).total_seconds() if earliest is not None else None
                # The safety net runs at its own minutes whatever the schedule says.
                to_net = safety_net - (simulated % safety_net)
                step = to_net if step is None else min(max(step, 0.0) + 0.01, to_net)
                if runs_first_hour is None and simulated + step > HOUR:
                    runs_first_hour, calls_first_hour = wakeups, Refusing.calls
                jump(conn, step)
            simulated += step
        with engine.connect() as conn:
            row = conn.execute(
                sa.text("SELECT status, attempts, last_error FROM outbox_message WHERE id = :id"),
                {"id": message_id},
            ).one()
    finally:
        engine.dispose()
    if runs_first_hour is None:  # it ended within the hour
        runs_first_hour, calls_first_hour = wakeups, Refusing.calls
    return {
        "receiver_calls_first_hour": calls_first_hour,
        "dispatcher_runs_first_hour": runs_first_hour,
        "safety_net_runs_an_hour": round(HOUR / safety_net),
        "receiver_calls": Refusing.calls,
        "dispatcher_runs": wakeups,
        "simulated_seconds": round(simulated),
        "status": row.status,
        "attempts": row.attempts,
        "max_attempts": settings.max_attempts,
        "last_error": row.last_error,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--safety-net-minutes", type=float, default=10.0)
    parser.add_argument("--max-hours", type=float, default=24.0)
    args = parser.parse_args()
    admin = sa.create_engine(common.server_url(), isolation_level="AUTOCOMMIT")
    name = f"bench_refusing_{os.getpid()}"
    from outbox import migrate

    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f"CREATE DATABASE {name}"))
        url = common.url_for(common.server_url(), name)
        migrator = sa.create_engine(url, poolclass=sa.NullPool)
        migrate.upgrade(migrator)
        migrator.dispose()
        print(json.dumps(run(url, args.safety_net_minutes, args.max_hours), indent=1))
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name}"))
        admin.dispose()


if __name__ == "__main__":
    main()
