"""SMS through SNS: moto for the real calls; botocore's Stubber only for the
error codes moto cannot produce (each such test says so)."""

from __future__ import annotations

from typing import Any

import boto3
import pytest
import sqlalchemy as sa
from botocore.stub import Stubber
from channel_support import ACCOUNT, REGION, deliver, settled

import outbox
from outbox.channels import Deadline, Message
from outbox.channels.sms import OPTED_OUT, SmsChannel

SMS = {"to": "+15555550100", "message": "Your code is 1234", "sender_id": "Shop"}


def sms_backend() -> Any:
    from moto.sns.models import sns_backends

    return sns_backends[ACCOUNT][REGION]


def test_end_to_end_sms_is_published_with_its_attributes(engine: sa.Engine, aws: None) -> None:
    message_id, report = deliver(engine, "sms", {**SMS, "sms_type": "Transactional"})
    row, attempts = settled(engine, message_id)
    assert report.statuses == {"delivered": 1}
    assert row.status == "delivered"
    sent = sms_backend().sms_messages
    assert sent[row.provider_message_id] == ("+15555550100", "Your code is 1234")
    assert [a.provider_message_id for a in attempts] == [row.provider_message_id]


def test_an_opted_out_number_is_suppressed_and_not_published(engine: sa.Engine, aws: None) -> None:
    # moto reports numbers ending in 99 as opted out.
    message_id, report = deliver(engine, "sms", {**SMS, "to": "+15555550199"})
    row, attempts = settled(engine, message_id)
    assert report.statuses == {"suppressed": 1}
    assert (row.status, row.last_error) == ("suppressed", OPTED_OUT)
    assert [a.outcome for a in attempts] == ["suppressed"]
    assert sms_backend().sms_messages == {}


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({**SMS, "to": "5555550100"}, "payload.to"),
        ({**SMS, "to": "+05555550100"}, "payload.to"),
        ({**SMS, "to": "+1 555 555 0100"}, "payload.to"),
        ({**SMS, "to": "+1234567890123456"}, "payload.to"),
        ({**SMS, "to": "+12"}, "payload.to"),
        ({**SMS, "message": ""}, "payload.message"),
        ({**SMS, "message": "é" * 900}, "payload.message"),
        ({**SMS, "sender_id": "12345"}, "payload.sender_id"),
        ({**SMS, "sender_id": "TooLongSender1"}, "payload.sender_id"),
        ({**SMS, "sms_type": "Bulk"}, "payload.sms_type"),
        ({"to": "+15555550100"}, "payload"),
    ],
)
def test_invalid_sms_is_refused_at_enqueue(
    engine: sa.Engine, payload: dict[str, Any], field: str
) -> None:
    with engine.begin() as conn, pytest.raises(outbox.ValidationError) as caught:
        outbox.enqueue(conn, "sms", payload)
    assert caught.value.field == field


def _stubbed(opted_out: dict[str, Any] | Exception | None, publish: dict[str, Any] | str) -> Any:
    client = boto3.client("sns", region_name=REGION)
    stub = Stubber(client)
    if isinstance(opted_out, str):
        stub.add_client_error("check_if_phone_number_is_opted_out", service_error_code=opted_out)
    elif opted_out is not None:
        stub.add_response("check_if_phone_number_is_opted_out", opted_out)
    if isinstance(publish, str):
        status = {"Throttled": 429, "InternalError": 500}.get(publish, 400)
        stub.add_client_error("publish", service_error_code=publish, http_status_code=status)
    else:
        stub.add_response("publish", publish)
    return client, stub


# Stubber: moto never throttles, never fails internally, and accepts any number.
@pytest.mark.parametrize(
    ("code", "kind"),
    [
        ("Throttled", "deferred"),
        ("KMSThrottling", "deferred"),
        ("InternalError", "retry"),
        ("AuthorizationError", "retry"),
        ("InvalidParameter", "failed"),
        ("ParameterValueInvalid", "failed"),
    ],
)
def test_publish_errors_are_classified(code: str, kind: str) -> None:
    client, stub = _stubbed({"isOptedOut": False}, code)
    with stub:
        outcome = SmsChannel(client).send(Message(1, "sms", SMS, 1), Deadline(5))
    assert outcome.kind == kind
    assert outcome.error is not None and code in outcome.error
    assert "+1555" not in outcome.error  # never the number


# Stubber: moto's opt-out check never throttles or fails.
def test_a_throttled_opt_out_check_defers_without_publishing() -> None:
    client, stub = _stubbed(None, {"MessageId": "unused"})
    stub = Stubber(client)
    stub.add_client_error(
        "check_if_phone_number_is_opted_out", service_error_code="Throttled", http_status_code=429
    )
    with stub:
        outcome = SmsChannel(client).send(Message(1, "sms", SMS, 1), Deadline(5))
    assert outcome.kind == "deferred"
    stub.assert_no_pending_responses()


def test_a_failing_opt_out_check_still_publishes() -> None:
    # Stubber: an AuthorizationError on the check (no sns:CheckIfPhoneNumberIsOptedOut).
    client, stub = _stubbed("AuthorizationError", {"MessageId": "m-1"})
    with stub:
        outcome = SmsChannel(client).send(Message(1, "sms", SMS, 1), Deadline(5))
    assert (outcome.kind, outcome.provider_message_id) == ("delivered", "m-1")
    stub.assert_no_pending_responses()


def test_sender_id_and_sms_type_travel_as_message_attributes() -> None:
    # Stubber: moto does not keep the attributes of an SMS; this checks the request.
    client = boto3.client("sns", region_name=REGION)
    stub = Stubber(client)
    stub.add_response("check_if_phone_number_is_opted_out", {"isOptedOut": False})
    stub.add_response(
        "publish",
        {"MessageId": "m-2"},
        {
            "PhoneNumber": "+15555550100",
            "Message": "Your code is 1234",
            "MessageAttributes": {
                "AWS.SNS.SMS.SenderID": {"DataType": "String", "StringValue": "Shop"},
                "AWS.SNS.SMS.SMSType": {"DataType": "String", "StringValue": "Promotional"},
            },
        },
    )
    payload = {**SMS, "sms_type": "Promotional"}
    with stub:
        outcome = SmsChannel(client).send(Message(1, "sms", payload, 1), Deadline(5))
    assert outcome.provider_message_id == "m-2"
    stub.assert_no_pending_responses()
