"""Mobile push through SNS platform endpoints (moto), Stubber only where moto
cannot produce the error (each such test says so)."""

from __future__ import annotations

import json
from typing import Any

import boto3
import pytest
import sqlalchemy as sa
from botocore.stub import Stubber
from channel_support import ACCOUNT, REGION, deliver, settled

import outbox
from outbox.channels import Deadline, Message
from outbox.channels.push import ENDPOINT_DISABLED, PushChannel, render


def platform_endpoint(enabled: bool = True) -> str:
    sns = boto3.client("sns", region_name=REGION)
    app = sns.create_platform_application(
        Name="shop-android", Platform="GCM", Attributes={"PlatformCredential": "key"}
    )["PlatformApplicationArn"]
    return sns.create_platform_endpoint(
        PlatformApplicationArn=app,
        Token="device-token-1",
        Attributes={"Enabled": "true" if enabled else "false"},
    )["EndpointArn"]


def push(arn: str, **extra: Any) -> dict[str, Any]:
    return {"endpoint_arn": arn, "title": "Shipped", "body": "Order 42 is on its way", **extra}


def endpoint_messages(arn: str) -> dict[str, str]:
    from moto.sns.models import sns_backends

    return dict(sns_backends[ACCOUNT][REGION].platform_endpoints[arn].messages)


def test_end_to_end_push_reaches_the_endpoint(engine: sa.Engine, aws: None) -> None:
    arn = platform_endpoint()
    message_id, report = deliver(engine, "push", push(arn, data={"order": "42"}))
    row, _ = settled(engine, message_id)
    assert report.statuses == {"delivered": 1} and row.status == "delivered"
    sent = endpoint_messages(arn)
    structure = json.loads(sent[row.provider_message_id])
    assert structure["default"] == "Order 42 is on its way"
    gcm = json.loads(structure["GCM"])["fcmV1Message"]["message"]
    assert gcm == {
        "notification": {"title": "Shipped", "body": "Order 42 is on its way"},
        "data": {"order": "42"},
    }


def test_a_disabled_endpoint_is_suppressed_and_says_why(engine: sa.Engine, aws: None) -> None:
    arn = platform_endpoint()
    boto3.client("sns", region_name=REGION).set_endpoint_attributes(
        EndpointArn=arn, Attributes={"Enabled": "false"}
    )
    message_id, report = deliver(engine, "push", push(arn))
    row, attempts = settled(engine, message_id)
    assert report.statuses == {"suppressed": 1}
    assert row.status == "suppressed"
    assert row.last_error.startswith(ENDPOINT_DISABLED)
    assert "EndpointDisabled" in row.last_error
    assert [a.outcome for a in attempts] == ["suppressed"]
    assert endpoint_messages(arn) == {}


def test_a_deleted_endpoint_fails(aws: None) -> None:
    arn = platform_endpoint()
    boto3.client("sns", region_name=REGION).delete_endpoint(EndpointArn=arn)
    outcome = PushChannel().send(Message(1, "push", push(arn), 1), Deadline(5))
    assert outcome.kind == "failed"
    assert outcome.error is not None and outcome.error.startswith("device endpoint not found")


# Stubber: moto never throttles, fails internally or disables a platform application.
@pytest.mark.parametrize(
    ("code", "kind"),
    [
        ("Throttled", "deferred"),
        ("InternalError", "retry"),
        ("PlatformApplicationDisabled", "retry"),
        ("InvalidParameter", "failed"),
        ("EndpointDisabled", "suppressed"),
    ],
)
def test_publish_errors_are_classified(code: str, kind: str) -> None:
    client = boto3.client("sns", region_name=REGION)
    stub = Stubber(client)
    stub.add_client_error("publish", service_error_code=code, http_status_code=400)
    arn = f"arn:aws:sns:{REGION}:{ACCOUNT}:endpoint/GCM/shop-android/0a1b2c3d"
    with stub:
        outcome = PushChannel(client).send(Message(1, "push", push(arn), 1), Deadline(5))
    assert outcome.kind == kind
    assert outcome.error is not None and code in outcome.error


def test_render_gives_every_platform_its_structure() -> None:
    structure = json.loads(render({"endpoint_arn": "x", "body": "Hi", "data": {"k": "v"}}))
    assert set(structure) == {"default", "APNS", "APNS_SANDBOX", "GCM"}
    apns = json.loads(structure["APNS"])
    assert apns == {"k": "v", "aps": {"alert": {"body": "Hi"}}}
    assert structure["APNS_SANDBOX"] == structure["APNS"]
    assert json.loads(structure["GCM"]) == {
        "fcmV1Message": {"message": {"notification": {"body": "Hi"}, "data": {"k": "v"}}}
    }


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"endpoint_arn": "arn:aws:sns:us-east-1:123456789012:my-topic", "body": "x"}, "payload"),
        (push(f"arn:aws:sns:{REGION}:{ACCOUNT}:endpoint/GCM/a/b", body=""), "payload.body"),
        (push(f"arn:aws:sns:{REGION}:{ACCOUNT}:endpoint/GCM/a/b", data={"n": 1}), "payload.data"),
        (push(f"arn:aws:sns:{REGION}:{ACCOUNT}:endpoint/GCM/a/b", data={"aps": "x"}), "payload"),
    ],
)
def test_invalid_push_is_refused_at_enqueue(
    engine: sa.Engine, payload: dict[str, Any], field: str
) -> None:
    with engine.begin() as conn, pytest.raises(outbox.ValidationError) as caught:
        outbox.enqueue(conn, "push", payload)
    assert caught.value.field.startswith(field)
