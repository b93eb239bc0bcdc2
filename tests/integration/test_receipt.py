"""A claim is sent at most once, whatever the transport does.

The sender takes its rows by a compare-and-set receipt, so a duplicated or
replayed hand-off event, an Invoke retried after a timeout, or an id listed
twice in one event finds nothing more to send; a lease that ends with no
receipt was never started and counts no attempt.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import sqlalchemy as sa

from outbox import reaper, sender, store
from outbox.channels import Deadline, Message, Outcome
from outbox.handoff import HandOff, LambdaInvoker
from support import (
    LambdaContext,
    ScriptedChannel,
    attempts,
    claim,
    enqueue,
    expire_leases,
    install_channel,
    make_due,
    receive,
    row,
    settings,
    waits_on_a_lock,
)


@pytest.fixture(autouse=True)
def _scripted_channel() -> None:
    install_channel(ScriptedChannel())


def run_sender(engine: sa.Engine, event: dict[str, Any]) -> sender.SendReport:
    ctx = LambdaContext(30)
    return sender.run(engine, event, settings(), lambda: ctx.get_remaining_time_in_millis() / 1000)


class SlowCountingChannel(ScriptedChannel):
    """Counts provider calls; each takes a while (until ``go_on`` is set, when
    there is one), so two senders overlap."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []
        self._lock = threading.Lock()
        self.go_on: threading.Event | None = None

    def send(self, message: Message, deadline: Deadline) -> Outcome:
        with self._lock:
            self.calls.append(message.id)
        if self.go_on is None:
            threading.Event().wait(0.05)
        else:
            self.go_on.wait(30)
        return Outcome.delivered(f"p-{message.id}")


def test_two_senders_handed_the_same_event_at_once_call_the_provider_once(
    engine: sa.Engine,
) -> None:
    channel = install_channel(SlowCountingChannel())
    for _ in range(10):  # rounds: the race must come out the same every time
        channel.calls.clear()
        ids = enqueue(engine, 5, "scripted")
        event = HandOff("scripted", tuple(claim(engine))).to_event()
        start = threading.Barrier(2)
        reports: list[sender.SendReport] = []
        # The provider calls of whichever twin took the receipt last until the
        # other twin has said why it got none: "at once", however the machine
        # schedules them (a twin that looks after the settle reads a lost lease).
        channel.go_on = twin_done = threading.Event()

        def handle(
            event: dict[str, Any] = event,
            start: threading.Barrier = start,
            reports: list[sender.SendReport] = reports,
            twin_done: threading.Event = twin_done,
        ) -> None:
            start.wait()
            report = run_sender(engine, event)
            reports.append(report)
            if report.owned == 0:
                twin_done.set()

        threads = [threading.Thread(target=handle) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(channel.calls) == ids  # each message reached the provider once
        assert sorted(r.owned for r in reports) == [0, 5]
        # the twin that found the receipt taken says so: a duplicate, not a lost lease
        assert sorted(len(r.duplicates) for r in reports) == [0, 5]
        assert [r.lease_lost for r in reports] == [[], []]
        with engine.connect() as conn:
            for i in ids:
                assert row(conn, i).status == "delivered"
                assert [a.outcome for a in attempts(conn, i)] == ["delivered"]


def test_a_receipt_taken_by_an_uncommitted_sender_is_not_given_to_a_second(
    engine: sa.Engine,
) -> None:
    """The second compare-and-set waits for the first and then matches nothing
    (READ COMMITTED re-checks ``received_at`` on the row the first one wrote)."""
    (mid,) = enqueue(engine, channel="scripted")
    (c,) = claim(engine)
    pair = [c]
    second: list[list[store.ClaimedMessage]] = []
    with engine.connect() as first:
        first.begin()
        assert [m.id for m in store.receive_claimed(first, "scripted", pair, 3)] == [mid]

        def take() -> None:
            with engine.begin() as conn:
                second.append(store.receive_claimed(conn, "scripted", pair, 3))

        waiter = threading.Thread(target=take)
        waiter.start()
        assert waits_on_a_lock(engine, waiter), "the second receipt did not wait for the first"
        first.commit()
    waiter.join(5)
    assert second == [[]]


def test_an_id_listed_twice_in_one_event_is_sent_once(engine: sa.Engine) -> None:
    channel = install_channel(SlowCountingChannel())
    (mid,) = enqueue(engine, channel="scripted")
    (c,) = claim(engine)
    event = HandOff("scripted", (c, c)).to_event()
    assert len(event["messages"]) == 2
    report = run_sender(engine, event)
    assert channel.calls == [mid]
    assert (report.received, report.owned, dict(report.statuses)) == (1, 1, {"delivered": 1})
    with engine.connect() as conn:
        assert [(a.attempt, a.outcome) for a in attempts(conn, mid)] == [(1, "delivered")]
    # and the store drops a repeated pair itself, for any caller
    (mid2,) = enqueue(engine, channel="scripted")
    (c2,) = claim(engine)
    with engine.begin() as conn:
        taken = store.receive_claimed(conn, "scripted", [c2, c2], 3)
    assert [m.id for m in taken] == [mid2]


def test_a_replayed_event_finds_nothing_to_send(engine: sa.Engine) -> None:
    channel = install_channel(SlowCountingChannel())
    (mid,) = enqueue(engine, channel="scripted")
    event = HandOff("scripted", tuple(claim(engine))).to_event()
    assert run_sender(engine, event).owned == 1
    assert run_sender(engine, event).lease_lost == [mid]
    assert channel.calls == [mid]


def test_a_replay_while_the_first_sender_is_still_sending_finds_nothing(
    engine: sa.Engine,
) -> None:
    """The claim is still ``claimed`` with a live lease; only the receipt stops
    the replay (the old fenced read would have sent it a second time)."""
    install_channel(ScriptedChannel())
    (mid,) = enqueue(engine, channel="scripted")
    claims = claim(engine)
    receive(engine, claims)  # the first sender took it and is calling the provider
    report = run_sender(engine, HandOff("scripted", tuple(claims)).to_event())
    assert (report.owned, report.duplicates, report.lease_lost) == (0, [mid], [])
    with engine.connect() as conn:
        assert row(conn, mid).status == "claimed"


def test_a_lease_that_ends_with_no_receipt_counts_no_attempt(engine: sa.Engine) -> None:
    """The event never reached a sender (dropped for age, throttled, lost):
    back to pending at once, no attempt, an attempt row that says so."""
    ids = enqueue(engine, 2, "scripted", max_attempts=1)
    claims = claim(engine)
    receive(engine, claims[:1])  # the first was started, the second never was
    expire_leases(engine)
    report = reaper.run(engine, settings(), lambda: 30.0)
    assert (report.reclaimed, report.not_started, report.dead) == (0, 1, 1)
    with engine.connect() as conn:
        started, never = row(conn, ids[0]), row(conn, ids[1])
        assert (started.status, started.attempts) == ("dead", 1)
        assert (never.status, never.attempts) == ("pending", 0)
        assert never.last_error == store.NOT_STARTED_ERROR
        assert [(a.attempt, a.outcome, a.error) for a in attempts(conn, ids[1])] == [
            (1, "not_started", store.NOT_STARTED_ERROR)
        ]
        due_now = conn.execute(
            sa.text("SELECT available_at <= now() FROM outbox_message WHERE id = :i"),
            {"i": ids[1]},
        ).scalar_one()
    assert due_now
    # a sender that never started a row, however often, never makes it dead
    for _ in range(5):
        make_due(engine)
        assert [c.id for c in claim(engine)] == [ids[1]]
        expire_leases(engine)
        reaper.run(engine, settings(), lambda: 30.0)
    with engine.connect() as conn:
        assert (row(conn, ids[1]).status, row(conn, ids[1]).attempts) == ("pending", 0)


def test_a_lease_with_no_receipt_is_bounded_by_the_deliver_by_time(engine: sa.Engine) -> None:
    (mid,) = enqueue(engine, channel="scripted", ttl=3600)
    claim(engine)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE outbox_message SET expires_at = now() - interval '1 second'"))
    expire_leases(engine)
    report = reaper.run(engine, settings(), lambda: 30.0)
    assert (report.not_started, report.expired) == (0, 1)
    with engine.connect() as conn:
        r = row(conn, mid)
        assert (r.status, r.attempts) == ("expired", 0) and r.settled_at is not None
        assert r.last_error.startswith("deliver-by time passed")
        assert [a.outcome for a in attempts(conn, mid)] == ["expired"]


class _InvokeEndpoint(BaseHTTPRequestHandler):
    """A Lambda Invoke endpoint that always answers 500."""

    requests: list[str] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        type(self).requests.append(self.path)
        body = b'{"Type":"Service","message":"internal"}'
        self.send_response(500)
        self.send_header("Content-Type", "application/json")
        self.send_header("x-amzn-ErrorType", "ServiceException")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def invoke_endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _InvokeEndpoint)
    _InvokeEndpoint.requests = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    yield _InvokeEndpoint.requests
    server.shutdown()
    server.server_close()


def test_the_lambda_invoker_makes_one_attempt(invoke_endpoint: list[str]) -> None:
    """A retried Invoke could queue a second event when the first was accepted
    (a read timeout); a failed hand-off releases its claims instead."""
    invoker = LambdaInvoker({"scripted": "outbox-scripted"})
    claim = store.Claim(1, "scripted", uuid.uuid4(), 1)
    with pytest.raises(Exception):  # noqa: B017 - botocore's ClientError for the 500
        invoker.hand_off(HandOff("scripted", (claim,)))
    assert len(invoke_endpoint) == 1


def test_a_duplicated_hand_off_is_counted_as_one_not_as_a_lost_lease(
    engine: sa.Engine, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """What an operator is told: the same event delivered twice is expected now
    and then (INFO, `DuplicateHandOff`); a claim that is over (a token the
    database no longer holds) is a lost lease (WARNING, `LeaseLost`)."""
    import json

    from outbox import observability

    observability.flush_metrics()
    capsys.readouterr()
    (mid,) = enqueue(engine, channel="scripted")
    claims = claim(engine)
    receive(engine, claims)  # the first delivery of the event is sending it
    (other,) = enqueue(engine, channel="scripted")
    stale = store.Claim(other, "scripted", str(uuid.uuid4()), 1)  # not its claim
    with caplog.at_level("INFO", logger="outbox"):
        report = run_sender(engine, HandOff("scripted", (*claims, stale)).to_event())
    assert (report.owned, report.duplicates, report.lease_lost) == (0, [mid], [other])
    observability.flush_metrics()
    records = [
        json.loads(line) for line in capsys.readouterr().out.splitlines() if '"_aws"' in line
    ]
    counted = {
        name: r[name] for r in records for name in ("DuplicateHandOff", "LeaseLost") if name in r
    }
    assert counted == {"DuplicateHandOff": [1.0], "LeaseLost": [1.0]}
    levels = {r.getMessage(): r.levelname for r in caplog.records if "skipped" in r.getMessage()}
    assert levels == {
        "claims already taken by another delivery of this hand-off; skipped": "INFO",
        "claims no longer held (settled, reaped or claimed again); skipped": "WARNING",
    }


def test_a_sample_events_claim_is_reported_as_never_live_not_as_a_lost_lease(
    engine: sa.Engine, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """A sample event (events/*.json) carries a placeholder token no claim
    issues, here for a real message's id; another names an id no message of
    the channel has: INFO "no such claim" saying where a live claim comes
    from; no `LeaseLost` is counted and nothing changes. A real id under a
    stale token is still a lost lease."""
    import json

    from outbox import observability

    observability.flush_metrics()
    capsys.readouterr()
    sampled, mid = enqueue(engine, 2, "scripted")
    sample = store.Claim(sampled, "scripted", "00000000-0000-0000-0000-000000000001", 1)
    elsewhere = store.Claim(mid + 1000, "scripted", str(uuid.uuid4()), 1)
    stale = store.Claim(mid, "scripted", str(uuid.uuid4()), 1)
    event = HandOff("scripted", (sample, elsewhere, stale)).to_event()
    with caplog.at_level("INFO", logger="outbox"):
        report = run_sender(engine, event)
    assert (report.owned, sorted(report.unknown), report.lease_lost) == (
        0,
        [sampled, mid + 1000],
        [mid],
    )
    observability.flush_metrics()
    records = [
        json.loads(line) for line in capsys.readouterr().out.splitlines() if '"_aws"' in line
    ]
    assert [r["LeaseLost"] for r in records if "LeaseLost" in r] == [[1.0]]
    levels = {r.getMessage(): r.levelname for r in caplog.records if "skipped" in r.getMessage()}
    never_live = [m for m in levels if m.startswith("no such claim:")]
    assert len(never_live) == 1 and levels[never_live[0]] == "INFO"
    assert "--claim" in never_live[0]
    with engine.connect() as conn:
        assert store.statuses_of(conn, [sampled, mid]) == {sampled: "pending", mid: "pending"}


@pytest.mark.parametrize("path", ["worker", "lambda"])
def test_each_received_row_carries_its_own_payload_in_the_batchs_order(
    engine: sa.Engine, path: str
) -> None:
    """The claim's and the receipt's answers carry the rows' fields in one
    JSON value and their payloads as rows apart (store.delivery._answer):
    each payload must come back with its own row, in the batch's order
    (priority first, not the ids'), whichever path takes the receipt."""
    expected: dict[int, int] = {}
    for i in range(12):  # later rows more urgent: the batch's order is not the ids'
        (message_id,) = enqueue(engine, channel="scripted", payload={"n": i}, priority=i % 4)
        expected[message_id] = i
    make_due(engine)
    with engine.begin() as conn:
        if path == "worker":
            received = store.claim_and_receive(conn, 100, 120, 5)
        else:
            claims = store.claim(conn, 100, 120)
            received = store.receive_claimed(conn, "scripted", claims, 5)
    assert {r.id: json.loads(r.payload)["n"] for r in received} == expected
    priorities = [expected[r.id] % 4 for r in received]
    assert priorities == sorted(priorities, reverse=True)
    assert all(r.claim_token and r.attempt == 1 and r.max_attempts == 5 for r in received)
