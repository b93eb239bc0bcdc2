"""Email through SES v2 (moto), with Stubber for the suppression list (moto
does not implement GetSuppressedDestination) and the errors moto cannot produce."""

from __future__ import annotations

from typing import Any

import boto3
import pytest
import sqlalchemy as sa
from botocore.stub import Stubber
from channel_support import ACCOUNT, REGION, deliver, settled

from outbox.channels import Deadline, Message
from outbox.channels.email import SUPPRESSED, EmailChannel
from support import EMAIL


def ses_backend() -> Any:
    from moto.ses.models import ses_backends

    return ses_backends[ACCOUNT][REGION]


def test_end_to_end_email_with_a_configuration_set(
    engine: sa.Engine, aws: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SES_CONFIGURATION_SET", "transactional")
    sesv2 = boto3.client("sesv2", region_name=REGION)
    sesv2.create_configuration_set(ConfigurationSetName="transactional")
    boto3.client("ses", region_name=REGION).verify_email_identity(EmailAddress=EMAIL["from"])
    message_id, report = deliver(engine, "email", EMAIL)
    row, _ = settled(engine, message_id)
    assert report.statuses == {"delivered": 1} and row.status == "delivered"
    (sent,) = ses_backend().sent_messages
    assert sent.id == row.provider_message_id
    assert sent.destinations["ToAddresses"] == EMAIL["to"]


def test_an_unverified_sender_is_rejected_and_failed(engine: sa.Engine, aws: None) -> None:
    message_id, _ = deliver(engine, "email", EMAIL)
    row, _ = settled(engine, message_id)
    assert (row.status, row.last_error) == ("failed", "MessageRejected: MessageRejected")


def test_configuration_set_is_sent_with_the_request() -> None:
    # Stubber: moto does not record the configuration set of a sent message.
    client = boto3.client("sesv2", region_name=REGION)
    stub = Stubber(client)
    stub.add_response(
        "send_email",
        {"MessageId": "m-1"},
        {
            "FromEmailAddress": EMAIL["from"],
            "Destination": {"ToAddresses": EMAIL["to"], "CcAddresses": [], "BccAddresses": []},
            "Content": {
                "Simple": {
                    "Subject": {"Data": EMAIL["subject"], "Charset": "UTF-8"},
                    "Body": {"Text": {"Data": EMAIL["text"], "Charset": "UTF-8"}},
                }
            },
            "ConfigurationSetName": "transactional",
        },
    )
    channel = EmailChannel(client, configuration_set="transactional", check_suppression=False)
    with stub:
        outcome = channel.send(Message(1, "email", EMAIL, 1), Deadline(5))
    assert outcome.provider_message_id == "m-1"
    stub.assert_no_pending_responses()


def _suppressed(address: str) -> dict[str, Any]:
    return {
        "SuppressedDestination": {
            "EmailAddress": address,
            "Reason": "BOUNCE",
            "LastUpdateTime": "2026-01-01T00:00:00Z",
        }
    }


# Stubber for every suppression test: moto has no SES suppression list.
def test_every_recipient_suppressed_is_suppressed_without_sending() -> None:
    client = boto3.client("sesv2", region_name=REGION)
    stub = Stubber(client)
    payload = {**EMAIL, "to": ["a@example.net"], "cc": ["b@example.net"]}
    stub.add_response("get_suppressed_destination", _suppressed("a@example.net"))
    stub.add_response("get_suppressed_destination", _suppressed("b@example.net"))
    with stub:  # no send_email is stubbed: a send would raise
        outcome = EmailChannel(client).send(Message(1, "email", payload, 1), Deadline(5))
    assert (outcome.kind, outcome.error) == ("suppressed", SUPPRESSED)
    stub.assert_no_pending_responses()


def test_one_reachable_recipient_is_enough_to_send() -> None:
    client = boto3.client("sesv2", region_name=REGION)
    stub = Stubber(client)
    payload = {**EMAIL, "to": ["a@example.net", "b@example.net"]}
    stub.add_response("get_suppressed_destination", _suppressed("a@example.net"))
    stub.add_client_error(
        "get_suppressed_destination", service_error_code="NotFoundException", http_status_code=404
    )
    stub.add_response("send_email", {"MessageId": "m-2"})
    with stub:
        outcome = EmailChannel(client).send(Message(1, "email", payload, 1), Deadline(5))
    assert (outcome.kind, outcome.provider_message_id) == ("delivered", "m-2")
    stub.assert_no_pending_responses()


def test_a_throttled_suppression_check_defers() -> None:
    client = boto3.client("sesv2", region_name=REGION)
    stub = Stubber(client)
    stub.add_client_error(
        "get_suppressed_destination",
        service_error_code="TooManyRequestsException",
        http_status_code=429,
    )
    with stub:
        outcome = EmailChannel(client).send(Message(1, "email", EMAIL, 1), Deadline(5))
    assert outcome.kind == "deferred"


def test_an_unavailable_suppression_check_still_sends(aws: None) -> None:
    # moto raises NotImplementedError for GetSuppressedDestination: SES enforces
    # the list itself, so the send goes ahead.
    boto3.client("ses", region_name=REGION).verify_email_identity(EmailAddress=EMAIL["from"])
    outcome = EmailChannel().send(Message(1, "email", EMAIL, 1), Deadline(5))
    assert outcome.kind == "delivered"


# Stubber: moto never throttles, pauses sending or fails internally.
@pytest.mark.parametrize(
    ("code", "message", "status", "kind", "delay", "pause"),
    [
        # the account's rate: the destination (the account) pauses briefly
        ("TooManyRequestsException", "", 429, "deferred", None, "destination"),
        ("LimitExceededException", "", 400, "deferred", None, "destination"),
        (
            "ThrottlingException",
            "Maximum sending rate exceeded.",
            400,
            "deferred",
            None,
            "destination",
        ),
        # a quota, or sending stopped: the whole channel pauses for an hour
        (
            "ThrottlingException",
            "Daily message quota exceeded.",
            400,
            "deferred",
            3600.0,
            "channel",
        ),
        ("SendingPausedException", "", 400, "deferred", 3600.0, "channel"),
        ("AccountSuspendedException", "", 400, "deferred", 3600.0, "channel"),
        ("MessageRejected", "", 400, "failed", None, None),
        ("MailFromDomainNotVerifiedException", "", 400, "failed", None, None),
        ("NotFoundException", "", 404, "failed", None, None),
        ("BadRequestException", "", 400, "failed", None, None),
        ("InternalFailure", "", 500, "retry", None, None),
    ],
)
def test_send_errors_are_classified(
    code: str, message: str, status: int, kind: str, delay: Any, pause: str | None
) -> None:
    client = boto3.client("sesv2", region_name=REGION)
    stub = Stubber(client)
    stub.add_client_error(
        "send_email", service_error_code=code, service_message=message, http_status_code=status
    )
    with stub:
        outcome = EmailChannel(client, check_suppression=False).send(
            Message(1, "email", EMAIL, 1), Deadline(5)
        )
    assert (outcome.kind, outcome.delay_seconds, outcome.pause) == (kind, delay, pause)
    # the provider's text is compared, never kept
    assert message == "" or message.rstrip(".") not in (outcome.error or "")


def test_many_recipients_skip_the_suppression_lookups() -> None:
    # Stubber: only send_email is answered; a lookup would raise.
    client = boto3.client("sesv2", region_name=REGION)
    stub = Stubber(client)
    stub.add_response("send_email", {"MessageId": "m-3"})
    payload = {**EMAIL, "to": [f"r{i}@example.net" for i in range(6)]}
    with stub:
        outcome = EmailChannel(client).send(Message(1, "email", payload, 1), Deadline(5))
    assert outcome.provider_message_id == "m-3"
