"""Mobile push through Amazon SNS ``Publish`` to a platform endpoint.

The payload is rendered into SNS's per-platform message structure
(``MessageStructure="json"``): APNs (and its sandbox) get an ``aps`` alert
with the data keys beside it, FCM gets an HTTP v1 message with a
notification and string data, and ``default`` carries the body for any
other platform.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .. import aws
from . import Deadline, Message, Outcome
from .aws import AwsChannel
from .sms import classify as classify_publish

ENDPOINT_ARN = "^arn:aws[a-z-]*:sns:[a-z0-9-]+:[0-9]{12}:endpoint/[A-Za-z_]+/[^/]+/[A-Za-z0-9-]+$"
ENDPOINT_DISABLED = "device endpoint disabled"
ENDPOINT_NOT_FOUND = "device endpoint not found"
PLATFORM_DISABLED = "platform application disabled"


def render(payload: dict[str, Any]) -> str:
    """The JSON message structure SNS fans out to each platform."""
    title, body, data = payload.get("title"), payload["body"], payload.get("data") or {}
    alert: dict[str, str] = {"body": body}
    notification: dict[str, str] = {"body": body}
    if title is not None:
        alert["title"] = title
        notification["title"] = title
    apns = json.dumps({**data, "aps": {"alert": alert}}, separators=(",", ":"))
    fcm: dict[str, Any] = {"notification": notification}
    if data:
        fcm["data"] = data
    gcm = json.dumps({"fcmV1Message": {"message": fcm}}, separators=(",", ":"))
    return json.dumps(
        {"default": body, "APNS": apns, "APNS_SANDBOX": apns, "GCM": gcm}, separators=(",", ":")
    )


class PushChannel(AwsChannel):
    service = "sns"
    name = "push"
    schema: Mapping[str, Any] = {
        "type": "object",
        "required": ["endpoint_arn", "body"],
        "additionalProperties": False,
        "properties": {
            "endpoint_arn": {"type": "string", "maxLength": 1024, "pattern": ENDPOINT_ARN},
            "title": {"type": "string", "minLength": 1, "maxLength": 256},
            "body": {"type": "string", "minLength": 1, "maxLength": 4096},
            # FCM data values must be strings; "aps" is APNs' own key.
            "data": {
                "type": "object",
                "maxProperties": 100,
                "additionalProperties": {"type": "string"},
                "not": {"required": ["aps"]},
            },
        },
    }

    def send(self, message: Message, deadline: Deadline) -> Outcome:
        p = message.payload
        try:
            response = self.client.publish(
                TargetArn=p["endpoint_arn"], MessageStructure="json", Message=render(p)
            )
        except Exception as exc:
            return classify(exc)
        return Outcome.delivered(response.get("MessageId"))


def classify(exc: BaseException) -> Outcome:
    codes = aws.error_codes(exc)
    if "EndpointDisabled" in codes:
        # The platform told SNS the token is dead (app removed, token expired).
        return Outcome.suppressed(f"{ENDPOINT_DISABLED} ({aws.describe(exc)})")
    if "NotFound" in codes:
        return Outcome.failed(f"{ENDPOINT_NOT_FOUND} ({aws.describe(exc)})")
    if "PlatformApplicationDisabled" in codes:
        # The app's APNs/FCM credentials were rejected: an operator fixes them.
        return Outcome.retry(f"{PLATFORM_DISABLED} ({aws.describe(exc)})")
    return classify_publish(exc)
