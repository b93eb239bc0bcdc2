"""The outcome-event publisher SIGKILLed right after EventBridge accepted a
batch, before it could delete those rows: a real process, a real kill, a moto
server for EventBridge (a rule with an SQS target shows what was published).

The documented promise: every transition is published, and the only
duplicates are the events in flight at the kill, published again after the
lease with the same ``event_id``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from outcome_support import BUS, Bus, lease_ends, settle_all

import outbox
from outbox import reaper
from outbox.relay_settings import OutcomeEventSettings
from support import EMAIL, settings

PUBLISHER = r"""
import os, signal, sys
import boto3
from outbox import outcomes
from outbox.relay_settings import DatabaseSettings, OutcomeEventSettings
from outbox.db import create_engine

engine = create_engine(
    DatabaseSettings(url=os.environ["DATABASE_URL"], sslmode="disable"), autocommit=True
)
events = boto3.client("events")


class KilledAfterPutEvents:
    def put_events(self, **kwargs):
        events.put_events(**kwargs)  # EventBridge has the batch now
        os.kill(os.getpid(), signal.SIGKILL)  # and the rows were never deleted


outcomes.publish(engine, KilledAfterPutEvents(), OutcomeEventSettings(bus=sys.argv[1]), lambda: 30.0)
"""


@pytest.fixture
def moto_endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    from outbox_cli.local import moto_server

    with moto_server() as url:
        monkeypatch.setenv("AWS_ENDPOINT_URL", url)
        yield url


def test_a_sigkilled_publisher_loses_nothing_and_repeats_only_its_batch_in_flight(
    engine: sa.Engine, database_url: str, moto_endpoint: str
) -> None:
    bus = Bus()
    with engine.begin() as conn:
        ids = outbox.enqueue_many(conn, [{"channel": "email", "payload": EMAIL}] * 25)
    assert set(settle_all(engine, "failed", "MessageRejected")) == set(ids)

    publisher = subprocess.run(
        [sys.executable, "-c", PUBLISHER, BUS],
        env={**os.environ, "DATABASE_URL": database_url, "POWERTOOLS_LOG_LEVEL": "ERROR"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert publisher.returncode == -signal.SIGKILL, publisher.stderr
    in_flight = bus.received()
    assert len(in_flight) == 10  # one PutEvents of ten went out before the kill

    def reap() -> reaper.ReapReport:
        return reaper.run(
            engine, settings(), lambda: 30.0, OutcomeEventSettings(bus=BUS), lambda: bus.events
        )

    # The dead publisher still holds its lease on all 25 (it took a batch of 100).
    assert reap().events_published == 0
    lease_ends(engine)
    assert reap().events_published == 25
    after = bus.received()
    assert reap().events_published == 0 and bus.received() == []
    with engine.connect() as conn:
        left = conn.execute(sa.text("SELECT count(*) FROM outbox_outcome_event")).scalar_one()
    assert left == 0

    copies = Counter(e["detail"]["event_id"] for e in in_flight + after)
    assert len(copies) == 25 and {e["detail"]["id"] for e in after} == set(ids)
    twice = {k for k, n in copies.items() if n == 2}
    assert twice == {e["detail"]["event_id"] for e in in_flight}
    assert max(copies.values()) == 2
