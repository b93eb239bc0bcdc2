"""The dispatcher: claim loop, hand-off (through moto's Lambda), release on failure."""

from __future__ import annotations

import io
import json
import threading
import zipfile
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import boto3
import pytest
import sqlalchemy as sa

import outbox
from outbox import dispatcher
from outbox.handoff import CallableInvoker, HandOff, LambdaInvoker
from support import db_now, enqueue, row, settings


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
    before = db_now(engine)
    report = dispatcher.dispatch_once(engine, invoker, settings())
    after = db_now(engine)
    assert (report.claimed, report.handed_off, report.released) == (3, 0, 3)
    with engine.connect() as conn:
        rows = [row(conn, i) for i in ids]
        history = conn.execute(sa.text("SELECT count(*) FROM outbox_attempt")).scalar_one()
    assert {(r.status, r.attempts, r.claim_token) for r in rows} == {("pending", 0, None)}
    # Not hot-looped back at once: due the retry delay after the release,
    # whose clock lies between the two readings (however slow the machine).
    delay = timedelta(seconds=dispatcher.HANDOFF_RETRY_DELAY_SECONDS)
    assert all(before + delay <= r.available_at <= after + delay for r in rows)
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


def test_a_pass_claims_whole_events_while_more_rows_are_due(engine: sa.Engine) -> None:
    """A batch of 100 in events of 32 would end in an event of 4: one
    environment's wave of calls for 4 rows, its other threads idle (the drain
    read 0.87 of its ideal so, 0.90 with whole events). The pass claims 96,
    and the rows left over go in the next pass's events."""
    enqueue(engine, 150)
    got: list[dict[str, Any]] = []
    relay = settings(batch_size=100, handoff_chunk_size=32)
    invoker = CallableInvoker({"email": got.append})
    first = dispatcher.dispatch_once(engine, invoker, relay)
    assert first.claimed == 96 and first.full
    assert sorted(len(e["messages"]) for e in got) == [32, 32, 32]
    second = dispatcher.dispatch_once(engine, invoker, relay)
    assert second.claimed == 54 and not second.full  # what is due: a part-filled event
    assert sorted(len(e["messages"]) for e in got) == [22, 32, 32, 32, 32]
    # A batch smaller than an event is claimed as it is.
    enqueue(engine, 10)
    assert dispatcher.dispatch_once(engine, invoker, settings(batch_size=5)).claimed == 5


def test_a_message_enqueued_while_the_loop_runs_goes_out_within_a_poll(engine: sa.Engine) -> None:
    """Counted in the loop's pauses, not timed: the message committed during
    one pause goes out in the pass right after it."""
    handed: dict[int, int] = {}  # message id -> pauses the loop had taken
    pauses = 0
    arrived: list[int] = []

    def target(event: dict[str, Any]) -> None:
        for m in event["messages"]:
            handed[m["id"]] = pauses

    def pause(seconds: float) -> None:  # the loop's poll interval, run by the test
        nonlocal pauses
        pauses += 1
        if pauses == 1:
            arrived.extend(enqueue(engine, 1))

    report = dispatcher.run(
        engine,
        CallableInvoker({"email": target}),
        settings(poll_interval_seconds=0.05),
        lambda: 0.0 if handed or pauses >= 5 else 60.0,
        sleep=pause,
    )
    assert arrived, "the loop never paused to poll"
    assert handed == {arrived[0]: 1} and report.claimed == 1


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
