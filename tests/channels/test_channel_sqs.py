"""SQS SendMessage (moto, including FIFO deduplication), Stubber only for the
errors moto cannot produce (each such test says so)."""

from __future__ import annotations

from typing import Any

import boto3
import pytest
import sqlalchemy as sa
from botocore.stub import Stubber
from channel_support import REGION, deliver, settled

import outbox
from outbox.channels import Deadline, Message
from outbox.channels.sqs import DEFAULT_GROUP, SqsChannel


def queue(name: str) -> str:
    attributes = {"FifoQueue": "true"} if name.endswith(".fifo") else {}
    sqs = boto3.client("sqs", region_name=REGION)
    return sqs.create_queue(QueueName=name, Attributes=attributes)["QueueUrl"]


def receive(url: str) -> list[dict[str, Any]]:
    return (
        boto3.client("sqs", region_name=REGION)
        .receive_message(
            QueueUrl=url,
            MaxNumberOfMessages=10,
            MessageAttributeNames=["All"],
            MessageSystemAttributeNames=["All"],
        )
        .get("Messages", [])
    )


def test_end_to_end_to_a_standard_queue(engine: sa.Engine, aws: None) -> None:
    url = queue("events")
    payload = {"queue_url": url, "body": '{"order":42}', "attributes": {"type": "OrderShipped"}}
    message_id, report = deliver(engine, "sqs", payload)
    row, _ = settled(engine, message_id)
    assert report.statuses == {"delivered": 1} and row.status == "delivered"
    (got,) = receive(url)
    assert got["MessageId"] == row.provider_message_id
    assert got["Body"] == '{"order":42}'
    assert got["MessageAttributes"]["type"]["StringValue"] == "OrderShipped"


def test_end_to_end_fifo_uses_the_ordering_key_and_the_outbox_id(
    engine: sa.Engine, aws: None
) -> None:
    url = queue("events.fifo")
    message_id, report = deliver(
        engine, "sqs", {"queue_url": url, "body": "one"}, ordering_key="customer-7"
    )
    assert report.statuses == {"delivered": 1}
    (got,) = receive(url)
    assert got["Attributes"]["MessageGroupId"] == "customer-7"
    assert got["Attributes"]["MessageDeduplicationId"] == str(message_id)


def test_a_fifo_redelivery_is_dropped_by_sqs_itself(aws: None) -> None:
    url = queue("events.fifo")
    channel = SqsChannel()
    message = Message(77, "sqs", {"queue_url": url, "body": "once"}, 1)
    again = Message(77, "sqs", {"queue_url": url, "body": "once"}, 2)  # the retry
    assert channel.send(message, Deadline(5)).kind == "delivered"
    assert channel.send(again, Deadline(5)).kind == "delivered"
    got = receive(url)
    assert [m["Body"] for m in got] == ["once"]
    assert got[0]["Attributes"]["MessageGroupId"] == DEFAULT_GROUP


def test_a_missing_queue_fails(aws: None) -> None:
    url = "https://sqs.us-east-1.amazonaws.com/123456789012/nope"
    outcome = SqsChannel().send(Message(1, "sqs", {"queue_url": url, "body": "x"}, 1), Deadline(5))
    assert outcome.kind == "failed"
    assert outcome.error is not None and "NonExistentQueue" in outcome.error


# Stubber: moto never throttles, fails internally, or refuses message contents.
@pytest.mark.parametrize(
    ("code", "status", "kind"),
    [
        ("RequestThrottled", 400, "deferred"),
        ("ThrottlingException", 400, "deferred"),
        ("KmsThrottled", 400, "deferred"),
        ("InternalError", 500, "retry"),
        ("ServiceUnavailable", 503, "retry"),
        ("KmsAccessDenied", 400, "retry"),
        ("InvalidMessageContents", 400, "failed"),
        ("InvalidParameterValue", 400, "failed"),
        ("QueueDoesNotExist", 400, "failed"),
    ],
)
def test_errors_are_classified(code: str, status: int, kind: str) -> None:
    client = boto3.client("sqs", region_name=REGION)
    stub = Stubber(client)
    stub.add_client_error("send_message", service_error_code=code, http_status_code=status)
    url = "https://sqs.us-east-1.amazonaws.com/123456789012/events"
    with stub:
        outcome = SqsChannel(client).send(
            Message(1, "sqs", {"queue_url": url, "body": "x"}, 1), Deadline(5)
        )
    assert outcome.kind == kind


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        (
            {"queue_url": "https://sqs.us-east-1.amazonaws.com/1/q", "body": "x"},
            "payload.queue_url",
        ),
        (
            {
                "queue_url": "https://sqs.us-east-1.amazonaws.com/123456789012/q.fifo",
                "body": "x",
                "delay_seconds": 5,
            },
            "payload.delay_seconds",
        ),
        (
            {
                "queue_url": "https://sqs.us-east-1.amazonaws.com/123456789012/q",
                "body": "x",
                "attributes": {"AWS.trace": "x"},
            },
            "payload.attributes.AWS.trace",
        ),
        (
            {
                "queue_url": "https://sqs.us-east-1.amazonaws.com/123456789012/q",
                "body": "x",
                "delay_seconds": 901,
            },
            "payload.delay_seconds",
        ),
    ],
)
def test_invalid_sqs_payloads_are_refused_at_enqueue(
    engine: sa.Engine, payload: dict[str, Any], field: str
) -> None:
    with engine.begin() as conn, pytest.raises(outbox.ValidationError) as caught:
        outbox.enqueue(conn, "sqs", payload)
    assert caught.value.field == field
