"""A released claim is one that no sender started: ``store.release`` never
takes back a claim whose sender took its receipt (the reaper is the one
recovery path for those, invariant 5).

The case that matters: the dispatcher's Invoke call times out after Lambda
had queued the event. The sender runs it anyway; the dispatcher, which only
saw the timeout, releases the claims. Taking back a received claim would
refuse that sender's settle ("lease lost") and let the next pass send the
message a second time, with the first delivery recorded nowhere.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import sqlalchemy as sa

import outbox
from outbox import dispatcher, sender, store
from outbox.channels import Deadline, Message, Outcome
from outbox.handoff import CallableInvoker, HandOff, Invoker
from support import LambdaContext, ScriptedChannel, attempts, install_channel, row, settings


class HeldChannel(ScriptedChannel):
    """Counts provider calls; each waits until the test lets it finish."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []
        self.started = threading.Event()
        self.finish = threading.Event()

    def send(self, message: Message, deadline: Deadline) -> Outcome:
        self.calls.append(message.id)
        self.started.set()
        self.finish.wait(30)
        return Outcome.delivered(f"p-{message.id}")


def run_sender(engine: sa.Engine, event: dict[str, Any]) -> sender.SendReport:
    ctx = LambdaContext(30)
    return sender.run(engine, event, settings(), lambda: ctx.get_remaining_time_in_millis() / 1000)


class QueuedThenTimedOut(Invoker):
    """An Invoke call that Lambda accepted (the sender runs the event) but
    whose answer never reached the dispatcher: it raises once the sender has
    taken its receipt and is calling the provider."""

    def __init__(self, engine: sa.Engine, channel: HeldChannel) -> None:
        self.engine = engine
        self.channel = channel
        self.threads: list[threading.Thread] = []
        self.reports: list[sender.SendReport] = []

    def can_route(self, name: str) -> bool:
        return name == self.channel.name

    def hand_off(self, handoff: HandOff) -> None:
        event = handoff.to_event()
        thread = threading.Thread(
            target=lambda: self.reports.append(run_sender(self.engine, event))
        )
        thread.start()
        self.threads.append(thread)
        assert self.channel.started.wait(30), "the sender never reached the provider"
        raise TimeoutError("Read timeout on endpoint URL (the event was queued)")


@pytest.fixture
def held() -> HeldChannel:
    return install_channel(HeldChannel())


def test_release_does_not_take_back_a_received_claim(engine: sa.Engine) -> None:
    install_channel(ScriptedChannel())
    with engine.begin() as conn:
        (message_id,) = outbox.enqueue_many(conn, [{"channel": "scripted", "payload": {"n": 1}}])
        (claim,) = store.claim(conn, 10, 120)
    with engine.begin() as conn:
        store.receive_claimed(conn, "scripted", [claim], 5)
    with engine.begin() as conn:
        assert store.release(conn, [claim], reason="hand-off failed") == set()
        after = row(conn, message_id)
    assert (after.status, str(after.claim_token)) == ("claimed", str(claim.claim_token))


def test_an_invoke_that_times_out_after_lambda_queued_the_event_sends_once(
    engine: sa.Engine, held: HeldChannel
) -> None:
    with engine.begin() as conn:
        (message_id,) = outbox.enqueue_many(conn, [{"channel": "scripted", "payload": {"n": 1}}])
    invoker = QueuedThenTimedOut(engine, held)
    first = dispatcher.dispatch_once(engine, invoker, settings())
    assert (first.claimed, first.handed_off) == (1, 0)
    held.finish.set()
    for thread in invoker.threads:
        thread.join(30)
    (report,) = invoker.reports
    assert report.lease_lost == []  # its settle was taken
    # The next pass finds nothing left to send.
    again = CallableInvoker({"scripted": lambda event: run_sender(engine, event)})
    assert dispatcher.dispatch_once(engine, again, settings()).claimed == 0
    assert held.calls == [message_id]
    with engine.connect() as conn:
        assert row(conn, message_id).status == "delivered"
        assert [(a.attempt, a.outcome) for a in attempts(conn, message_id)] == [(1, "delivered")]
