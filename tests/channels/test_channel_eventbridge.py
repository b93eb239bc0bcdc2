"""EventBridge PutEvents (moto), with Stubber only for the answers moto
cannot give: throttling and per-entry failures (each such test says so)."""

from __future__ import annotations

import json
from typing import Any

import boto3
import pytest
import sqlalchemy as sa
from botocore.stub import Stubber
from channel_support import REGION, deliver, settled

import outbox
from outbox import outcomes
from outbox.channels import Deadline, Message
from outbox.channels.eventbridge import EventBridgeChannel

EVENT = {"source": "shop.orders", "detail_type": "OrderShipped", "detail": {"order": 42}}


def bus_with_queue(bus: str) -> str:
    """A bus whose rule forwards shop.orders events to an SQS queue (its URL)."""
    events, sqs = (
        boto3.client("events", region_name=REGION),
        boto3.client("sqs", region_name=REGION),
    )
    if bus != "default":
        events.create_event_bus(Name=bus)
    url = sqs.create_queue(QueueName=f"{bus}-tap")["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"][
        "QueueArn"
    ]
    events.put_rule(
        Name="tap", EventBusName=bus, EventPattern=json.dumps({"source": ["shop.orders"]})
    )
    events.put_targets(Rule="tap", EventBusName=bus, Targets=[{"Id": "q", "Arn": arn}])
    return url


def received(url: str) -> list[dict[str, Any]]:
    sqs = boto3.client("sqs", region_name=REGION)
    messages = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10).get("Messages", [])
    return [json.loads(m["Body"]) for m in messages]


def test_end_to_end_event_reaches_the_bus(engine: sa.Engine, aws: None) -> None:
    url = bus_with_queue("orders")
    message_id, report = deliver(engine, "eventbridge", {**EVENT, "event_bus": "orders"})
    row, _ = settled(engine, message_id)
    assert report.statuses == {"delivered": 1} and row.status == "delivered"
    (event,) = received(url)
    assert event["id"] == row.provider_message_id
    assert (event["source"], event["detail-type"], event["detail"]) == (
        "shop.orders",
        "OrderShipped",
        {"order": 42},
    )


def test_the_bus_defaults_to_the_function_setting_then_default(
    aws: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EVENT_BUS_NAME", "domain")
    assert EventBridgeChannel().entry(EVENT)["EventBusName"] == "domain"
    assert EventBridgeChannel().entry({**EVENT, "event_bus": "x"})["EventBusName"] == "x"
    monkeypatch.delenv("EVENT_BUS_NAME")
    url = bus_with_queue("default")
    outcome = EventBridgeChannel().send(Message(1, "eventbridge", EVENT, 1), Deadline(5))
    assert outcome.kind == "delivered"
    assert len(received(url)) == 1


def test_a_missing_bus_fails(aws: None) -> None:
    outcome = EventBridgeChannel().send(
        Message(1, "eventbridge", {**EVENT, "event_bus": "nope"}, 1), Deadline(5)
    )
    assert outcome.kind == "failed"
    assert outcome.error == "ResourceNotFoundException: ResourceNotFoundException"


def _stubbed_entry(code: str) -> Any:
    client = boto3.client("events", region_name=REGION)
    stub = Stubber(client)
    stub.add_response(
        "put_events",
        {"FailedEntryCount": 1, "Entries": [{"ErrorCode": code, "ErrorMessage": "no"}]},
    )
    return client, stub


# Stubber: moto never throttles or fails an entry internally, nor refuses a source.
@pytest.mark.parametrize(
    ("code", "kind"),
    [
        ("ThrottlingException", "deferred"),
        ("InternalFailure", "retry"),
        ("InvalidArgument", "failed"),
        ("MalformedDetail", "failed"),
        ("NotAuthorizedForSourceException", "failed"),
        ("NotAuthorizedForDetailTypeException", "failed"),
        ("AccessDeniedException", "failed"),
    ],
)
def test_per_entry_failures_are_classified_never_ignored(code: str, kind: str) -> None:
    client, stub = _stubbed_entry(code)
    with stub:
        outcome = EventBridgeChannel(client).send(Message(1, "eventbridge", EVENT, 1), Deadline(5))
    assert outcome.kind == kind
    assert outcome.error == f"entry refused: {code}"


# Stubber: whole-call errors moto cannot produce.
@pytest.mark.parametrize(
    ("code", "status", "kind"),
    [
        ("ThrottlingException", 400, "deferred"),
        ("InternalException", 500, "retry"),
        ("ValidationException", 400, "failed"),
    ],
)
def test_call_errors_are_classified(code: str, status: int, kind: str) -> None:
    client = boto3.client("events", region_name=REGION)
    stub = Stubber(client)
    stub.add_client_error("put_events", service_error_code=code, http_status_code=status)
    with stub:
        outcome = EventBridgeChannel(client).send(Message(1, "eventbridge", EVENT, 1), Deadline(5))
    assert outcome.kind == kind


def test_an_answer_without_an_event_id_is_not_taken_for_a_delivery() -> None:
    # Stubber: a malformed success (no entries at all) must not count as delivered.
    client = boto3.client("events", region_name=REGION)
    stub = Stubber(client)
    stub.add_response("put_events", {"FailedEntryCount": 0, "Entries": []})
    with stub:
        outcome = EventBridgeChannel(client).send(Message(1, "eventbridge", EVENT, 1), Deadline(5))
    assert outcome.kind == "retry"


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({**EVENT, "source": "aws.orders"}, "payload.source"),
        ({**EVENT, "detail": "text"}, "payload.detail"),
        ({"source": "shop.orders", "detail": {}}, "payload"),
    ],
)
def test_invalid_events_are_refused_at_enqueue(
    engine: sa.Engine, payload: dict[str, Any], field: str
) -> None:
    with engine.begin() as conn, pytest.raises(outbox.ValidationError) as caught:
        outbox.enqueue(conn, "eventbridge", payload)
    assert caught.value.field == field


# --- outcome events cannot be forged through the relay (issue 23, finding 5) --

FORGED = {
    "source": outcomes.SOURCE,
    "detail_type": outcomes.DETAIL_TYPES["bounced"],
    "detail": {"id": 1, "status": "bounced"},
}


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        (FORGED, "payload.source"),
        ({**FORGED, "source": " Outbox.Relay"}, "payload.source"),
        ({**FORGED, "source": "outbox.relay.audit"}, "payload.source"),
        ({**EVENT, "detail_type": outcomes.DETAIL_TYPES["dead"]}, "payload.detail_type"),
        ({**EVENT, "detail_type": "outbox message failed"}, "payload.detail_type"),
    ],
)
def test_the_relays_own_source_and_detail_types_are_refused_at_enqueue(
    engine: sa.Engine, payload: dict[str, Any], field: str
) -> None:
    with engine.begin() as conn, pytest.raises(outbox.ValidationError) as caught:
        outbox.enqueue(conn, "eventbridge", payload)
    assert caught.value.field == field
    assert "outcome events" in str(caught.value)


def test_a_forged_outcome_event_enqueued_in_sql_never_reaches_the_bus(
    engine: sa.Engine, aws: None
) -> None:
    # The SQL enqueue does not run the channel's Python checks: the sender's do.
    events, sqs = (
        boto3.client("events", region_name=REGION),
        boto3.client("sqs", region_name=REGION),
    )
    url = sqs.create_queue(QueueName="application")["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"][
        "QueueArn"
    ]
    # the application's rule, as the README tells it to write it
    events.put_rule(Name="app", EventPattern=json.dumps({"source": [outcomes.SOURCE]}))
    events.put_targets(Rule="app", Targets=[{"Id": "q", "Arn": arn}])
    with engine.begin() as conn:
        message_id = conn.execute(
            sa.text("SELECT outbox_enqueue('eventbridge', CAST(:p AS jsonb))"),
            {"p": json.dumps(FORGED)},
        ).scalar_one()
    _, report = deliver(engine, "eventbridge", None, message_id=message_id)
    row, history = settled(engine, message_id)
    assert report.statuses == {"failed": 1} and row.status == "failed"
    assert history[-1].error.startswith("invalid payload: payload.source")
    assert received(url) == []


def test_the_channel_refuses_to_put_a_forged_event_even_unvalidated() -> None:
    # Defence in depth: send() checks again, whoever calls it. Stubber with no
    # answers queued: any PutEvents call would raise instead of returning.
    client = boto3.client("events", region_name=REGION)
    with Stubber(client):
        outcome = EventBridgeChannel(client).send(Message(1, "eventbridge", FORGED, 1), Deadline(5))
    assert outcome.kind == "failed"
    assert outcome.error is not None and "outcome events" in outcome.error
