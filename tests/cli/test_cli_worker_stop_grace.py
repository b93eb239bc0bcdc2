"""`outbox worker` after SIGTERM: calls already running get
WORKER_STOP_GRACE_SECONDS, not their whole deadline (up to
SENDER_TIMEOUT_SECONDS); then they are settled as retries and the worker exits.

The verdicts read states and attempt rows from the database, never a clock:
the sender timeout here is 30 s and the grace 1 s, and a row cut by the grace
says so in its error, where one that waited out its deadline would not."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from outbox import sender
from outbox.channels import Deadline, Message, Outcome
from outbox.worker import Worker
from support import ScriptedChannel, enqueue, install_channel, settings, statuses, wait_until


@pytest.fixture
def moto_endpoint() -> Iterator[str]:
    from outbox_cli.local import moto_server

    with moto_server() as url:
        yield url


def cut_rows(engine: sa.Engine) -> list[tuple[Any, ...]]:
    """Each message's state and its attempt rows."""
    with engine.connect() as conn:
        return [
            tuple(r)
            for r in conn.execute(
                sa.text(
                    "SELECT m.status, m.attempts, m.last_error, a.attempt, a.outcome, a.error "
                    "FROM outbox_message m JOIN outbox_attempt a ON a.message_id = m.id "
                    "ORDER BY m.id, a.id"
                )
            ).all()
        ]


def test_sigterm_cuts_dripping_calls_at_the_stop_grace_and_settles_them_as_retries(
    engine: sa.Engine, database_url: str, moto_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import boto3
    from channel_support import drip_receiver, new_secret

    monkeypatch.setenv("WEBHOOK_ALLOW_INSECURE", "true")  # a loopback http receiver

    secret_arn = boto3.client("secretsmanager", endpoint_url=moto_endpoint).create_secret(
        Name=f"webhooks/{uuid.uuid4().hex}", SecretString=new_secret()
    )["ARN"]
    with drip_receiver("headers", interval=0.2, lasts=120) as rx:
        enqueue(engine, 4, "webhook", {"url": rx.url(), "event_type": "t", "body": {}})
        worker = subprocess.Popen(
            [sys.executable, "-m", "outbox_cli", "worker", "--channels", "webhook", "--json"],
            env={
                **os.environ,
                "DATABASE_URL": database_url,
                "AWS_ENDPOINT_URL": moto_endpoint,
                "SENDER_TIMEOUT_SECONDS": "30",
                "LEASE_SECONDS": "120",
                "WORKER_STOP_GRACE_SECONDS": "1",
                "WEBHOOK_ALLOW_INSECURE": "true",
                "WEBHOOK_SECRET_ARN": secret_arn,
                "POWERTOOLS_LOG_LEVEL": "ERROR",
                "POWERTOOLS_METRICS_DISABLED": "true",
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            reached = wait_until(lambda: rx.requests >= 4, process=worker)
            assert reached, "the receivers were never reached"
            worker.send_signal(signal.SIGTERM)
            out, err = worker.communicate(timeout=90)  # a bound on the test, not a verdict
        finally:
            if worker.poll() is None:
                worker.kill()
    assert worker.returncode == 0, err
    assert json.loads(out)["statuses"] == {"pending": 4}
    assert statuses(engine) == {"pending": 4}
    cut = sender.STOP_GRACE_EXCEEDED
    assert cut_rows(engine) == [("pending", 1, cut, 1, "retry", cut)] * 4


class Hangs(ScriptedChannel):
    """The first call signals the stop, then hangs until the test lets it go."""

    def __init__(self, stop: threading.Event) -> None:
        super().__init__(name="hangs")
        self.stop = stop
        self.release = threading.Event()

    def send(self, message: Message, deadline: Deadline) -> Outcome:
        self.stop.set()
        self.release.wait(60)
        return super().send(message, deadline)


def test_a_stopped_worker_cuts_its_running_call_and_releases_the_rest(engine: sa.Engine) -> None:
    stop = threading.Event()
    channel = install_channel(Hangs(stop))
    ids = enqueue(engine, 3, "hangs", {"n": 1})
    worker = Worker(
        engine,
        settings(send_concurrency=1, sender_timeout_seconds=30),
        channels=["hangs"],
        stop=stop,
        stop_grace_seconds=0.2,
    )
    try:
        worker.run_once()
    finally:
        channel.release.set()
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT id, status, attempts, last_error FROM outbox_message ORDER BY id")
        ).all()
    assert [tuple(r) for r in rows] == [
        (ids[0], "pending", 1, sender.STOP_GRACE_EXCEEDED),
        (ids[1], "pending", 0, sender.STOPPING),
        (ids[2], "pending", 0, sender.STOPPING),
    ]
    assert worker.report.statuses == {"pending": 1, "not_started": 2}


def test_the_stop_grace_is_read_from_its_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    engine: Any = None
    monkeypatch.setenv("WORKER_STOP_GRACE_SECONDS", "2.5")
    assert Worker(engine, settings()).stop_grace_seconds == 2.5
    monkeypatch.delenv("WORKER_STOP_GRACE_SECONDS")
    assert Worker(engine, settings()).stop_grace_seconds == 10.0
