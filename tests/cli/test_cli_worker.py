"""`outbox worker`: the relay in one process. Several at once deliver each
message once; SIGTERM leaves no claim behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from outbox.channels import Outcome
from outbox.worker import BatchReport, Worker
from outbox_cli.cli import cli
from support import (
    EMAIL,
    ScriptedChannel,
    enqueue,
    install_channel,
    settings,
    statuses,
    wait_until,
)


def test_two_workers_over_one_backlog_deliver_each_message_once(engine: sa.Engine) -> None:
    channel = install_channel(ScriptedChannel())
    ids = enqueue(engine, 400, "scripted", {"n": 1})
    config = settings(batch_size=15, send_concurrency=4)
    start = threading.Barrier(2)
    workers = [
        Worker(engine, config, channels=["scripted"], reap_interval_seconds=3600) for _ in range(2)
    ]

    def run(worker: Worker) -> None:
        start.wait()
        worker.run(until_empty=True)

    threads = [threading.Thread(target=run, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    sent = Counter(channel.sent)
    assert sorted(sent) == ids and set(sent.values()) == {1}
    assert all(w.report.claimed > 0 for w in workers), "the workers did not overlap"
    assert sum(w.report.claimed for w in workers) == 400
    assert statuses(engine) == {"delivered": 400}
    with engine.connect() as conn:
        per_message = conn.execute(
            sa.text("SELECT message_id, count(*) FROM outbox_attempt GROUP BY message_id")
        ).all()
    assert len(per_message) == 400 and {n for _, n in per_message} == {1}


def test_worker_once_retries_and_batch_size(engine: sa.Engine) -> None:
    install_channel(ScriptedChannel(answers=[Outcome.retry("flaky"), Outcome.delivered()]))
    enqueue(engine, 5, "scripted", {"n": 1})
    worker = Worker(engine, settings(batch_size=2), channels=["scripted"])
    report = worker.run(once=True)
    assert (report.claimed, report.batches) == (2, 1)
    assert report.statuses == {"pending": 1, "delivered": 1}
    assert statuses(engine) == {"pending": 4, "delivered": 1}


def test_a_batch_reports_what_it_claimed_and_what_its_senders_owned(engine: sa.Engine) -> None:
    install_channel(ScriptedChannel())
    enqueue(engine, 3, "scripted", {"n": 1})
    worker = Worker(engine, settings(batch_size=2), channels=["scripted"])
    assert worker.run_once() == BatchReport(claimed=2, owned=2)
    worker.stop.set()  # not started: released, so not owned
    assert worker.run_once() == BatchReport(claimed=1, owned=0)


def test_a_stopped_worker_releases_what_it_did_not_start(engine: sa.Engine) -> None:
    install_channel(ScriptedChannel())
    enqueue(engine, 3, "scripted", {"n": 1})
    worker = Worker(engine, settings(), channels=["scripted"])
    worker.stop.set()  # stop arrives between the claim and the hand-off
    result = worker.run_once()
    assert result == BatchReport(claimed=3, owned=0) and worker.report.released == 3
    assert statuses(engine) == {"pending": 3}
    with engine.connect() as conn:
        attempts = conn.execute(sa.text("SELECT count(*) FROM outbox_attempt")).scalar_one()
        due = conn.execute(
            sa.text("SELECT count(*) FROM outbox_message WHERE available_at <= now()")
        ).scalar_one()
    assert attempts == 0 and due == 3  # no attempt counted, due again at once


def test_worker_command_until_empty_json(engine: sa.Engine, database_url: str) -> None:
    install_channel(ScriptedChannel())
    enqueue(engine, 7, "scripted", {"n": 1})
    result = CliRunner().invoke(
        cli,
        ["worker", "--until-empty", "--channels", "scripted", "--batch-size", "3", "--json"],
        env={"DATABASE_URL": database_url},
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["claimed"] == 7 and report["statuses"] == {"delivered": 7}
    assert statuses(engine) == {"delivered": 7}


def test_worker_command_rejects_bad_options(engine: sa.Engine, database_url: str) -> None:
    enqueue(engine, 2, "email", EMAIL)
    runner = CliRunner()
    for args, fragment in (
        (["--channels", "carrier-pigeon"], "unknown channel 'carrier-pigeon'"),
        (["--batch-size", "0"], "--batch-size"),
    ):
        result = runner.invoke(cli, ["worker", "--once", *args], env={"DATABASE_URL": database_url})
        assert result.exit_code == 2 and fragment in result.stderr, result.output
    bad_env = runner.invoke(
        cli, ["worker", "--once"], env={"DATABASE_URL": database_url, "LEASE_SECONDS": "10"}
    )
    assert bad_env.exit_code == 2 and "LEASE_SECONDS" in bad_env.stderr
    assert statuses(engine) == {"pending": 2}


@pytest.fixture
def moto_endpoint() -> Iterator[str]:
    from outbox_cli.local import moto_server  # the same moto server `make run` uses

    with moto_server() as url:
        yield url


def test_sigterm_mid_run_leaves_no_claimed_rows(
    engine: sa.Engine, database_url: str, moto_endpoint: str
) -> None:
    import boto3

    boto3.client("sesv2", endpoint_url=moto_endpoint).create_email_identity(
        EmailIdentity="example.com"
    )
    total = 3000
    enqueue(engine, total, "email", EMAIL)
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "AWS_ENDPOINT_URL": moto_endpoint,
        "POWERTOOLS_LOG_LEVEL": "ERROR",
        "POWERTOOLS_METRICS_DISABLED": "true",
    }
    worker = subprocess.Popen(
        [sys.executable, "-m", "outbox_cli", "worker", "--batch-size", "40", "--json"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: statuses(engine).get("delivered", 0) >= 50, process=worker)
        worker.send_signal(signal.SIGTERM)
        out, err = worker.communicate(timeout=60)
    finally:
        if worker.poll() is None:
            worker.kill()
    assert worker.returncode == 0, err
    report = json.loads(out)
    final = statuses(engine)
    assert "claimed" not in final, final
    assert 0 < final["delivered"] < total, "SIGTERM did not land mid-run"
    assert final["delivered"] + final.get("pending", 0) == total
    assert report["statuses"]["delivered"] == final["delivered"]
    with engine.connect() as conn:
        # Rows not begun when the signal came are "not_started": no attempt counted.
        counted = conn.execute(
            sa.text(
                "SELECT count(*) FROM outbox_attempt "
                "WHERE outcome NOT IN ('delivered', 'not_started')"
            )
        ).scalar_one()
        spent = conn.execute(
            sa.text("SELECT count(*) FROM outbox_message WHERE status = 'pending' AND attempts > 0")
        ).scalar_one()
    assert counted == 0 and spent == 0


def start_worker(
    channel: str, database_url: str, aws_endpoint: str, sender_timeout: int, **env: str
) -> subprocess.Popen[str]:
    """`outbox worker --channels CHANNEL --json` in a process of its own, with a
    short sender timeout, for the tests that signal it."""
    return subprocess.Popen(
        [sys.executable, "-m", "outbox_cli", "worker", "--channels", channel, "--json"],
        env={
            **os.environ,
            "DATABASE_URL": database_url,
            "AWS_ENDPOINT_URL": aws_endpoint,
            "SENDER_TIMEOUT_SECONDS": str(sender_timeout),
            "SETTLE_MARGIN_SECONDS": "0.5",
            "LEASE_SECONDS": "70",
            "POWERTOOLS_LOG_LEVEL": "ERROR",
            "POWERTOOLS_METRICS_DISABLED": "true",
            **env,
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def sigterm(worker: subprocess.Popen[str]) -> tuple[str, str, float]:
    """SIGTERM the worker: its stdout, its stderr, and the seconds it took to
    exit after the signal (the 90 s wait is a bound on the test, not a verdict)."""
    signalled = time.monotonic()
    worker.send_signal(signal.SIGTERM)
    out, err = worker.communicate(timeout=90)
    return out, err, time.monotonic() - signalled


def test_sigterm_while_receivers_drip_stops_within_the_grace(
    engine: sa.Engine, database_url: str, moto_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Webhook receivers that drip their answers a byte at a time: the worker
    still exits within SENDER_TIMEOUT_SECONDS (plus a settle) of SIGTERM, with
    no send thread left for the interpreter to wait for."""
    import boto3
    from channel_support import drip_receiver, new_secret

    secret_arn = boto3.client("secretsmanager", endpoint_url=moto_endpoint).create_secret(
        Name=f"webhooks/{uuid.uuid4().hex}", SecretString=new_secret()
    )["ARN"]
    sender_timeout = 3
    monkeypatch.setenv("WEBHOOK_ALLOW_INSECURE", "true")  # a loopback http receiver
    with drip_receiver("headers", interval=0.2, lasts=120) as rx:
        enqueue(engine, 4, "webhook", {"url": rx.url(), "event_type": "t", "body": {}})
        worker = start_worker(
            "webhook",
            database_url,
            moto_endpoint,
            sender_timeout,
            WEBHOOK_ALLOW_INSECURE="true",
            WEBHOOK_SECRET_ARN=secret_arn,
        )
        try:
            reached = wait_until(lambda: rx.requests >= 4, process=worker)
            assert reached, "the receivers were never reached"
            out, err, stopped_after = sigterm(worker)
        finally:
            if worker.poll() is None:
                worker.kill()
    assert worker.returncode == 0, err
    # Within the 3 s of sender time (and its settle), not after the receivers'
    # 120 s drip: the bound leaves a busy machine room, far short of the drip.
    assert stopped_after < 30, f"stopped {stopped_after:.1f} s after SIGTERM"
    assert statuses(engine) == {"pending": 4}  # each call cut off, counted, none left claimed
    assert json.loads(out)["statuses"] == {"pending": 4}


def test_a_stop_mid_batch_starts_no_further_call(engine: sa.Engine) -> None:
    """SIGTERM while a batch is being sent: the calls running finish and are
    settled; the rows no call had begun go back to pending, no attempt counted,
    and nothing more reaches the provider."""
    stop = threading.Event()

    class StopsTheWorker(ScriptedChannel):
        def send(self, message: Any, deadline: Any) -> Outcome:
            stop.set()  # the signal lands during the first call
            time.sleep(0.2)
            return super().send(message, deadline)

    channel = install_channel(StopsTheWorker())
    ids = enqueue(engine, 5, "scripted", {"n": 1})
    worker = Worker(engine, settings(send_concurrency=1), channels=["scripted"], stop=stop)
    worker.run_once()
    assert channel.sent == ids[:1]
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT id, status, attempts, last_error FROM outbox_message ORDER BY id")
        ).all()
    assert rows[0].status == "delivered"
    assert {(r.status, r.attempts, r.last_error) for r in rows[1:]} == {
        ("pending", 0, "stopping: not started")
    }


def test_sigterm_while_an_aws_provider_hangs_stops_within_the_grace(
    engine: sa.Engine, database_url: str, moto_endpoint: str
) -> None:
    """An AWS endpoint that accepts and never answers: botocore waits out its
    read timeout (here 120 s) whatever the relay's deadline, so the call is
    given up at the deadline and its thread left running. The worker must
    still exit within SENDER_TIMEOUT_SECONDS of SIGTERM: the send threads
    are daemon threads, which the interpreter does not wait for."""
    import socket

    from channel_support import silent_server

    hanging: list[socket.socket] = []  # the calls that reached the endpoint
    sender_timeout = 3
    enqueue(engine, 4, "email", EMAIL)
    with silent_server(hanging) as port:
        worker = start_worker(
            "email",
            database_url,
            moto_endpoint,
            sender_timeout,
            AWS_ENDPOINT_URL_SESV2=f"http://127.0.0.1:{port}",
            PROVIDER_READ_TIMEOUT_SECONDS="120",
            SES_SUPPRESSION_CHECK="false",
        )
        try:
            # Claimed, and the calls are hanging (the signal handler is in place
            # by then: a start slowed by a busy machine must not meet the signal
            # first). Waited for, not slept on: a busy machine is slow to get there.
            wait_until(lambda: len(hanging) >= 4, process=worker)
            assert hanging, "no call reached the endpoint"
            _, err, stopped_after = sigterm(worker)
        finally:
            if worker.poll() is None:
                worker.kill()
    assert worker.returncode == 0, err
    # Within the 3 s of sender time (and its settle), not after botocore's 120 s
    # read timeout: the bound leaves a busy machine room, far short of that.
    assert stopped_after < 30, f"stopped {stopped_after:.1f} s after SIGTERM"
    assert "claimed" not in statuses(engine)


def test_the_json_report_is_all_a_worker_writes_to_stdout(
    engine: sa.Engine, database_url: str
) -> None:
    """`outbox worker --json | jq` as a user runs it, at the default log
    level: the relay's log records (the reaper's run, each settle) go to
    stderr; stdout holds the report alone. They went to stdout before
    0.10.0, and the report could not be parsed."""
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "POWERTOOLS_METRICS_DISABLED": "true",
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9",  # nothing of AWS is asked: no bus, no send
    }
    env.pop("POWERTOOLS_LOG_LEVEL", None)
    env.pop("LOG_LEVEL", None)
    done = subprocess.run(
        [sys.executable, "-m", "outbox_cli", "worker", "--until-empty", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["claimed"] == 0
    assert '"message":"reaper run"' in done.stderr
