"""The dispatcher: claim loop, hand-off (through moto's Lambda), release on failure."""

from __future__ import annotations

import io
import json
import threading
import zipfile
from collections import Counter
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
import sqlalchemy as sa

import outbox
from outbox import dispatcher
from outbox.handoff import CallableInvoker, HandOff, LambdaInvoker
from support import EMAIL, row, settings


def enqueue(engine: sa.Engine, n: int, channel: str = "email") -> list[int]:
    with engine.begin() as conn:
        return outbox.enqueue_many(conn, [{"channel": channel, "payload": EMAIL} for _ in range(n)])


@pytest.fixture
def lambda_functions() -> Iterator[Any]:
    """moto's Lambda without Docker: an invoke of an existing function is accepted."""
    from moto import mock_aws

    with mock_aws(config={"lambda": {"use_docker": False}}):
        iam = boto3.client("iam")
        role = iam.create_role(RoleName="sender", AssumeRolePolicyDocument="{}")["Role"]["Arn"]
        code = io.BytesIO()
        with zipfile.ZipFile(code, "w") as z:
            z.writestr("app.py", "def handler(event, context):\n    return event\n")
        client = boto3.client("lambda")
        client.create_function(
            FunctionName="outbox-email",
            Runtime="python3.12",
            Role=role,
            Handler="app.handler",
            Code={"ZipFile": code.getvalue()},
        )
        yield client


def test_hand_off_through_the_real_lambda_invoke_call(
    engine: sa.Engine, lambda_functions: Any
) -> None:
    ids = enqueue(engine, 45)
    sent: list[dict[str, Any]] = []

    def capture(params: dict[str, Any], **_: Any) -> None:
        sent.append(
            {
                "function": params["FunctionName"],
                "type": params["InvocationType"],
                "event": json.loads(params["Payload"]),
            }
        )

    lambda_functions.meta.events.register("provide-client-params.lambda.Invoke", capture)
    invoker = LambdaInvoker({"email": "outbox-email"}, client=lambda_functions)
    report = dispatcher.dispatch_once(engine, invoker, settings(handoff_chunk_size=20))

    assert (report.claimed, report.handed_off, report.released) == (45, 45, 0)
    assert [len(s["event"]["messages"]) for s in sent] and sorted(
        len(s["event"]["messages"]) for s in sent
    ) == [5, 20, 20]
    assert {(s["function"], s["type"]) for s in sent} == {("outbox-email", "Event")}
    carried = sorted(m["id"] for s in sent for m in s["event"]["messages"])
    assert carried == ids
    # The event carries ids, tokens and attempt numbers only: never the payload.
    assert set(sent[0]["event"]["messages"][0]) == {"id", "claim_token", "attempt"}
    HandOff.from_event(sent[0]["event"])  # and parses back
    with engine.connect() as conn:
        assert {row(conn, i).status for i in ids} == {"claimed"}


def test_failed_hand_off_releases_the_claims_without_an_attempt(engine: sa.Engine) -> None:
    from botocore.config import Config

    ids = enqueue(engine, 3)
    # The Lambda API is unreachable (a closed port on loopback): the invoke raises.
    unreachable = boto3.client(
        "lambda",
        endpoint_url="http://127.0.0.1:9",
        config=Config(retries={"total_max_attempts": 1}, connect_timeout=1),
    )
    invoker = LambdaInvoker({"email": "outbox-email"}, client=unreachable)
    report = dispatcher.dispatch_once(engine, invoker, settings())
    assert (report.claimed, report.handed_off, report.released) == (3, 0, 3)
    with engine.connect() as conn:
        rows = [row(conn, i) for i in ids]
        wait = conn.execute(
            sa.text("SELECT min(EXTRACT(EPOCH FROM available_at - now())) FROM outbox_message")
        ).scalar_one()
        history = conn.execute(sa.text("SELECT count(*) FROM outbox_attempt")).scalar_one()
    assert {(r.status, r.attempts, r.claim_token) for r in rows} == {("pending", 0, None)}
    assert float(wait) > 4  # not hot-looped back at once
    assert history == 0


def test_a_row_of_an_unroutable_channel_fails_alone(engine: sa.Engine) -> None:
    from support import ScriptedChannel, install_channel

    install_channel(ScriptedChannel())
    good = enqueue(engine, 2)
    with engine.begin() as conn:
        orphan = outbox.enqueue(conn, "scripted", {"n": 1})
    got: list[dict[str, Any]] = []
    report = dispatcher.dispatch_once(engine, CallableInvoker({"email": got.append}), settings())
    assert (report.claimed, report.handed_off, report.unroutable) == (3, 2, 1)
    with engine.connect() as conn:
        failed = row(conn, orphan)
        assert {row(conn, i).status for i in good} == {"claimed"}
    assert failed.status == "failed" and "no function is configured" in failed.last_error


def test_run_keeps_claiming_until_the_backlog_is_empty(engine: sa.Engine) -> None:
    enqueue(engine, 250)
    got: list[dict[str, Any]] = []
    report = dispatcher.run(
        engine,
        CallableInvoker({"email": got.append}),
        settings(batch_size=100),
        time_left=lambda: 10.0,
        until_empty=True,
    )
    assert report.claimed == 250 and report.batches == 4
    assert sum(len(e["messages"]) for e in got) == 250


def test_a_message_enqueued_while_the_loop_runs_goes_out_within_a_poll(engine: sa.Engine) -> None:
    import time

    handed: dict[int, float] = {}

    def target(event: dict[str, Any]) -> None:
        for m in event["messages"]:
            handed[m["id"]] = time.monotonic()

    stop_at = time.monotonic() + 2.0
    loop = threading.Thread(
        target=dispatcher.run,
        args=(
            engine,
            CallableInvoker({"email": target}),
            settings(poll_interval_seconds=0.05),
            lambda: stop_at - time.monotonic(),
        ),
    )
    loop.start()
    time.sleep(0.5)
    enqueued_at = time.monotonic()
    (mid,) = enqueue(engine, 1)
    loop.join()
    assert mid in handed and handed[mid] - enqueued_at < 0.5


def test_several_dispatchers_at_once_hand_off_each_row_once(engine: sa.Engine) -> None:
    ids = enqueue(engine, 3000)
    lock = threading.Lock()
    seen: Counter[int] = Counter()

    def target(event: dict[str, Any]) -> None:
        with lock:
            seen.update(m["id"] for m in event["messages"])

    threads = [
        threading.Thread(
            target=dispatcher.run,
            args=(
                engine,
                CallableInvoker({"email": target}),
                settings(batch_size=50),
                lambda: 30.0,
            ),
            kwargs={"until_empty": True},
        )
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(seen) == ids and set(seen.values()) == {1}


def test_no_budget_still_makes_one_pass(engine: sa.Engine) -> None:
    enqueue(engine, 3)
    got: list[dict[str, Any]] = []
    report = dispatcher.run(engine, CallableInvoker({"email": got.append}), settings(), lambda: 0.0)
    assert report.batches == 1 and report.claimed == 3
