"""Feedback end to end in moto: an email sent by the real email function with
an SES v2 configuration set whose event destination is an SNS topic; the
bounce SES publishes to that topic (the recorded sample, carrying the real
message id) as SNS wraps it; the real feedback function; the reaper's
outcome event on EventBridge."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import boto3
import pytest
import sqlalchemy as sa
from logscan import find_leaks
from outcome_support import BUS, Bus
from test_email_end_to_end import load_handler

import outbox
from outbox import reaper
from outbox.handoff import CallableInvoker
from outbox.relay_settings import OutcomeEventSettings
from support import EMAIL, LambdaContext, attempts, row, settings

EVENTS = Path(__file__).resolve().parents[2] / "events"
CONFIGURATION_SET = "outbox-relay-outbox"


@pytest.fixture
def ses_to_sns(aws: None, relay_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """SES v2 identity and configuration set; its event destination is an SNS
    topic; an SQS subscription keeps what SNS delivers, envelope and all."""
    sesv2, sns, sqs = boto3.client("sesv2"), boto3.client("sns"), boto3.client("sqs")
    sesv2.create_email_identity(EmailIdentity="relay@example.com")
    sesv2.create_configuration_set(ConfigurationSetName=CONFIGURATION_SET)
    topic = sns.create_topic(Name="ses-feedback")["TopicArn"]
    # SES v2's event destination API is not in moto; SES v1's writes the same set.
    boto3.client("ses").create_configuration_set_event_destination(
        ConfigurationSetName=CONFIGURATION_SET,
        EventDestination={
            "Name": "outbox-feedback",
            "Enabled": True,
            "MatchingEventTypes": ["bounce", "complaint", "delivery"],
            "SNSDestination": {"TopicARN": topic},
        },
    )
    queue = sqs.create_queue(QueueName="sns-deliveries")["QueueUrl"]
    queue_arn = sqs.get_queue_attributes(QueueUrl=queue, AttributeNames=["QueueArn"])["Attributes"][
        "QueueArn"
    ]
    sns.subscribe(TopicArn=topic, Protocol="sqs", Endpoint=queue_arn)
    monkeypatch.setenv("SES_CONFIGURATION_SET", CONFIGURATION_SET)
    return sns, sqs, queue


def event_destination_topic() -> str:
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.ses.models import ses_backends

    backend = ses_backends[DEFAULT_ACCOUNT_ID]["us-east-1"]
    destination = backend.config_set_event_destination[CONFIGURATION_SET]
    return str(destination["SNSDestination"]["TopicARN"])


def as_lambda_event(envelope: dict[str, Any], topic: str) -> dict[str, Any]:
    """What SNS hands a subscribed Lambda: the same notification in a record."""
    sns = {
        **{k: v for k, v in envelope.items() if k not in ("SigningCertURL", "UnsubscribeURL")},
        "SigningCertUrl": envelope.get("SigningCertURL"),
        "UnsubscribeUrl": envelope.get("UnsubscribeURL"),
        "MessageAttributes": envelope.get("MessageAttributes", {}),
    }
    return {
        "Records": [
            {
                "EventSource": "aws:sns",
                "EventVersion": "1.0",
                "EventSubscriptionArn": f"{topic}:subscription",
                "Sns": sns,
            }
        ]
    }


def test_a_bounce_published_by_the_configuration_set_moves_the_email_to_bounced(
    engine: sa.Engine, ses_to_sns: Any
) -> None:
    sns, sqs, queue = ses_to_sns
    dispatcher_fn, email_fn = load_handler("dispatcher"), load_handler("email")
    dispatcher_fn.runtime._invoker = CallableInvoker(
        {"email": lambda event: email_fn.handler(event, LambdaContext(30, "email"))}
    )
    with engine.begin() as conn:
        # to the sample's recipient: feedback counts only a recipient it sent to
        to = json.loads((EVENTS / "feedback-bounce.json").read_text())["Records"][0]["Sns"]
        recipient = json.loads(to["Message"])["bounce"]["bouncedRecipients"][0]["emailAddress"]
        mid = outbox.enqueue(conn, "email", {**EMAIL, "to": [recipient]}, dedupe_key="order-42")
    dispatcher_fn.handler({"execution_id": "exec-1"}, LambdaContext(3, "dispatcher"))
    with engine.connect() as conn:
        sent = row(conn, mid)
    assert sent.status == "delivered" and sent.provider_message_id

    # SES publishes the bounce of that message to the destination's topic.
    sample = json.loads((EVENTS / "feedback-bounce.json").read_text())
    bounce = json.loads(sample["Records"][0]["Sns"]["Message"])
    bounce["mail"]["messageId"] = sent.provider_message_id
    topic = event_destination_topic()
    sns.publish(TopicArn=topic, Message=json.dumps(bounce))
    (delivered,) = sqs.receive_message(QueueUrl=queue, MaxNumberOfMessages=10)["Messages"]
    lambda_event = as_lambda_event(json.loads(delivered["Body"]), topic)

    feedback_fn = load_handler("feedback")
    first = feedback_fn.handler(lambda_event, LambdaContext(10, "feedback"))
    again = feedback_fn.handler(lambda_event, LambdaContext(10, "feedback"))  # SNS retried

    assert first["moved"] == {"bounced": 1} and again["repeated"] == 1 and not again["moved"]
    with engine.connect() as conn:
        bounced, history = row(conn, mid), attempts(conn, mid)
    assert bounced.status == "bounced"
    assert [a.outcome for a in history] == ["delivered", "bounced"]

    # The application hears about it once, on its bus, without the address.
    bus = Bus()
    report = reaper.run(
        engine,
        settings(),
        lambda: 30.0,
        OutcomeEventSettings(bus=BUS),
        lambda: boto3.client("events"),
    )
    assert report.events_published == 1
    (event,) = bus.received()
    assert event["detail-type"] == "Outbox Message Bounced"
    assert event["detail"]["id"] == mid and "dedupe_key" not in event["detail"]  # opt-in
    assert event["detail"]["provider_message_id"] == sent.provider_message_id
    assert find_leaks(event["detail"]) == []
