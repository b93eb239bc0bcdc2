"""Capacity-aware dispatch: a channel never has more rows claimed than its
function can start within the lease, a full channel does not hold up the
others, the budget costs one small statement per pass, and Lambda's throttling
answer gives the rows back soon, without an attempt, and rests the channel."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import boto3
import pytest
import sqlalchemy as sa
from botocore.stub import Stubber

from outbox import dispatcher, store
from outbox.handoff import CallableInvoker, HandOff, HandOffThrottled, LambdaInvoker
from support import db_now, enqueue, settings

WEBHOOK = {"url": "https://hooks.example.com/in", "event_type": "order.shipped", "body": {"n": 1}}


def claimed(engine: sa.Engine, channel: str) -> int:
    with engine.connect() as conn:
        return store.channel_load(conn, [channel]).claimed.get(channel, 0)


def collector() -> tuple[CallableInvoker, list[dict[str, Any]]]:
    events: list[dict[str, Any]] = []
    return CallableInvoker({"email": events.append, "webhook": events.append}), events


def test_the_dispatcher_never_claims_more_than_a_channels_budget(engine: sa.Engine) -> None:
    enqueue(engine, 100)
    invoker, events = collector()
    relay = settings(batch_size=10, channel_max_in_flight={"email": 35})
    reports = [dispatcher.dispatch_once(engine, invoker, relay) for _ in range(6)]
    # Three whole batches fit in 35; a fourth would not, so the channel sits out.
    assert [r.claimed for r in reports] == [10, 10, 10, 0, 0, 0]
    assert claimed(engine, "email") == 30
    assert sum(len(e["messages"]) for e in events) == 30

    # Senders finish 12 rows: room for one more batch (and not two).
    finished = [(m["id"], m["claim_token"]) for e in events for m in e["messages"]][:12]
    with engine.begin() as conn:
        store.settle(
            conn,
            [store.Settlement(i, t, "delivered") for i, t in finished],  # type: ignore[arg-type]
            relay.backoff(),
        )
    assert [dispatcher.dispatch_once(engine, invoker, relay).claimed for _ in range(2)] == [10, 0]
    assert claimed(engine, "email") == 28


def test_a_budget_below_the_batch_size_is_the_most_one_pass_claims(engine: sa.Engine) -> None:
    enqueue(engine, 20)
    invoker, _ = collector()
    relay = settings(batch_size=100, channel_max_in_flight={"email": 4})
    assert [dispatcher.dispatch_once(engine, invoker, relay).claimed for _ in range(3)] == [4, 0, 0]
    assert claimed(engine, "email") == 4


def test_a_channel_waiting_for_room_is_checked_again_soon_not_at_the_idle_poll(
    engine: sa.Engine,
) -> None:
    """A channel at its budget with rows due frees room at its senders' rate:
    waiting the idle poll (0.2 s by default) for it left environments without
    an event. The run checks again after ROOM_POLL_SECONDS instead; with
    nothing due, it keeps the idle poll."""
    enqueue(engine, 30)
    invoker, _ = collector()
    relay = settings(batch_size=10, poll_interval_seconds=0.2, channel_max_in_flight={"email": 10})
    # claimed 10, then at its budget
    assert waits_of_a_run(engine, invoker, relay, 3) == [dispatcher.ROOM_POLL_SECONDS] * 3

    store_settle_all(engine, relay)
    quiet = settings(poll_interval_seconds=0.2)
    with engine.begin() as conn:
        conn.execute(  # not due for an hour: nothing to claim
            sa.text(
                "UPDATE outbox_message SET available_at = now() + interval '1 hour' "
                "WHERE status = 'pending'"
            )
        )
    assert waits_of_a_run(engine, invoker, quiet, 2) == [0.2, 0.2]  # caught up: the idle poll


def waits_of_a_run(engine: sa.Engine, invoker: Any, relay: Any, passes: int) -> list[float]:
    """The sleeps of a dispatcher run, which ends after ``passes`` of them."""
    waits: list[float] = []
    dispatcher.run(
        engine,
        invoker,
        relay,
        time_left=lambda: 0.0 if len(waits) >= passes else 10.0,
        sleep=waits.append,
    )
    return waits


def store_settle_all(engine: sa.Engine, relay: Any) -> None:
    """Settle every claimed row as delivered (the senders, done)."""
    with engine.begin() as conn:
        held = conn.execute(
            sa.text("SELECT id, claim_token::text FROM outbox_message WHERE status = 'claimed'")
        ).all()
        store.settle(
            conn,
            [store.Settlement(i, t, "delivered") for i, t in held],  # type: ignore[arg-type]
            relay.backoff(),
        )


def test_a_full_channel_does_not_hold_up_the_others(engine: sa.Engine) -> None:
    enqueue(engine, 50)  # ahead of the webhook rows in claim order
    webhook_ids = enqueue(engine, 5, "webhook", WEBHOOK)
    invoker, events = collector()
    relay = settings(batch_size=10, channel_max_in_flight={"email": 10})
    first = dispatcher.dispatch_once(engine, invoker, relay)
    second = dispatcher.dispatch_once(engine, invoker, relay)
    assert (first.claimed, second.claimed) == (10, 5)
    assert sorted(m["id"] for e in events if e["channel"] == "webhook" for m in e["messages"]) == (
        webhook_ids
    )
    assert claimed(engine, "email") == 10


def test_the_budget_costs_one_small_statement_per_pass(engine: sa.Engine) -> None:
    statements: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        # the claim's savepoint exists only on this test's transactional
        # engine (store._sql.execute_fenced); the relay's autocommit sends none
        if "SAVEPOINT" not in statement:
            statements.append(statement)

    def count_pass(relay: Any) -> int:
        statements.clear()
        dispatcher.dispatch_once(engine, invoker, relay)
        return len(statements)

    invoker, _ = collector()
    budgeted = settings(channel_concurrency={"email": 10})
    sa.event.listen(engine, "before_cursor_execute", record)
    try:
        # Nothing pending: the load statement replaces the claim.
        assert (count_pass(settings()), count_pass(budgeted)) == (1, 1)
        enqueue(engine, 3, "webhook", WEBHOOK)
        assert count_pass(budgeted) == 2  # load, then claim
        load = statements[0]
        enqueue(engine, 3, "webhook", WEBHOOK)
        assert count_pass(settings()) == 1
    finally:
        sa.event.remove(engine, "before_cursor_execute", record)
    assert "status = 'claimed'" in load and "ORDER BY channel LIMIT 1" in load


def test_the_channel_load_is_index_probes_whatever_the_backlog(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO outbox_message (channel, payload) "
                "SELECT CASE WHEN g % 1000 = 0 THEN 'webhook' ELSE 'email' END, '{}' "
                "FROM generate_series(1, 20000) AS g"
            )
        )
        conn.execute(sa.text("ANALYZE outbox_message"))
        load = store.channel_load(conn, ["email"])
        plan = "\n".join(
            r[0]
            for r in conn.execute(
                sa.text("EXPLAIN " + str(store.delivery._CHANNEL_LOAD)), {"channels": "{email}"}
            )
        )
    assert load == store.ChannelLoad(["email", "webhook"], {})
    assert "outbox_message_due_by_channel" in plan and "Seq Scan" not in plan


class ThrottlingEmail:
    """An email function that Lambda throttles; counts the invokes it got."""

    def __init__(self) -> None:
        self.calls = 0
        self._lock = threading.Lock()

    def __call__(self, event: dict[str, Any]) -> None:
        with self._lock:
            self.calls += 1
        time.sleep(0.05)  # the hand-offs in flight at once all get the answer
        raise HandOffThrottled("email")


def test_a_throttled_hand_off_comes_back_soon_without_an_attempt_and_rests_the_channel(
    engine: sa.Engine,
) -> None:
    email_ids = enqueue(engine, 100)
    webhook_ids = enqueue(engine, 5, "webhook", WEBHOOK)
    email = ThrottlingEmail()
    webhook: list[dict[str, Any]] = []
    invoker = CallableInvoker({"email": email, "webhook": webhook.append})
    cooling: dict[str, float] = {}
    relay = settings(batch_size=200, handoff_chunk_size=5)

    before = db_now(engine)
    report = dispatcher.dispatch_once(engine, invoker, relay, cooling=cooling)
    after = db_now(engine)

    assert (report.claimed, report.throttled, report.handed_off) == (105, 100, 5)
    # 20 email hand-offs: once the first answer came, the rest were not tried.
    assert 1 <= email.calls <= dispatcher._HANDOFF_THREADS < 20
    assert sorted(m["id"] for e in webhook for m in e["messages"]) == webhook_ids
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT status, attempts, last_error, available_at "
                "FROM outbox_message WHERE id = ANY(CAST(:ids AS bigint[]))"
            ),
            {"ids": email_ids},
        ).all()
        history = conn.execute(sa.text("SELECT count(*) FROM outbox_attempt")).scalar_one()
    assert {(r.status, r.attempts, r.last_error) for r in rows} == {
        ("pending", 0, dispatcher.HANDOFF_THROTTLED)
    }
    # Due the throttle delay after the release, whose clock lies between the
    # two readings (however slow the machine).
    soon = timedelta(seconds=dispatcher.THROTTLE_RETRY_DELAY_SECONDS)
    assert all(before + soon <= r.available_at <= after + soon for r in rows)
    assert history == 0
    assert set(cooling) == {"email"}

    # While it rests, the channel is left out of the claim; the others are not.
    more_email = enqueue(engine, 3)
    more_webhook = enqueue(engine, 2, "webhook", WEBHOOK)
    calls = email.calls
    again = dispatcher.dispatch_once(engine, invoker, relay, cooling=cooling)
    assert (again.claimed, email.calls) == (2, calls)
    assert sorted(m["id"] for e in webhook[-1:] for m in e["messages"]) == more_webhook
    with engine.connect() as conn:
        assert {
            s
            for (s,) in conn.execute(
                sa.text("SELECT status FROM outbox_message WHERE id = ANY(CAST(:ids AS bigint[]))"),
                {"ids": more_email},
            )
        } == {"pending"}


@pytest.mark.parametrize(
    ("code", "status", "throttled"),
    [
        ("TooManyRequestsException", 429, True),
        ("ServiceException", 500, False),
        ("ResourceNotFoundException", 404, False),
    ],
)
def test_lambdas_throttling_answer_is_a_throttled_hand_off(
    code: str, status: int, throttled: bool
) -> None:
    client = boto3.client("lambda")
    handoff = HandOff("email", ())
    with Stubber(client) as stub:
        stub.add_client_error(
            "invoke", service_error_code=code, http_status_code=status, service_message="no"
        )
        invoker = LambdaInvoker({"email": "outbox-email"}, client=client)
        with pytest.raises(Exception) as caught:
            invoker.hand_off(handoff)
    assert isinstance(caught.value, HandOffThrottled) is throttled
    if throttled:
        assert caught.value.channel == "email"  # type: ignore[attr-defined]
