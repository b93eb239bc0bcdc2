"""SMS through Amazon SNS ``Publish`` to a phone number.

Opt-outs: SNS itself never delivers to an opted-out number, but ``Publish``
still answers with a message id, so the relay asks
``CheckIfPhoneNumberIsOptedOut`` first and records ``suppressed`` instead of
a delivery that did not happen. If that check fails for any reason other
than throttling the publish goes ahead: SNS enforces the opt-out anyway.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import aws
from ..errors import ValidationError
from . import Deadline, Message, Outcome
from .aws import AwsChannel
from .aws import classify as classify_common

# E.164: a plus, a non-zero country code digit, at most 15 digits in all.
E164 = "^\\+[1-9][0-9]{6,14}$"
# SNS splits long texts into parts; it refuses anything over 1600 bytes.
MAX_MESSAGE_BYTES = 1600

# SNS Publish error codes that sending again cannot fix.
_FAILED = {
    "InvalidParameter",
    "ParameterValueInvalid",
    "InvalidParameterValue",
    "ValidationException",
    "NotFound",
}
OPTED_OUT = "phone number opted out of SMS"


class SmsChannel(AwsChannel):
    service = "sns"
    name = "sms"
    schema: Mapping[str, Any] = {
        "type": "object",
        "required": ["to", "message"],
        "additionalProperties": False,
        "properties": {
            "to": {"type": "string", "pattern": E164},
            "message": {"type": "string", "minLength": 1, "maxLength": MAX_MESSAGE_BYTES},
            # Alphanumeric sender ID: 1 to 11 letters and digits, at least one letter.
            "sender_id": {"type": "string", "pattern": "^[A-Za-z0-9]{1,11}$"},
            "sms_type": {"enum": ["Transactional", "Promotional"]},
        },
    }

    def check(self, payload: dict[str, Any]) -> None:
        size = len(payload["message"].encode("utf-8"))
        if size > MAX_MESSAGE_BYTES:
            raise ValidationError(
                "payload.message", f"is {size} bytes; SNS allows {MAX_MESSAGE_BYTES}"
            )
        sender_id = payload.get("sender_id")
        if sender_id is not None and sender_id.isdigit():
            raise ValidationError("payload.sender_id", "must contain at least one letter")

    def send(self, message: Message, deadline: Deadline) -> Outcome:
        p = message.payload
        try:
            opted_out = self.client.check_if_phone_number_is_opted_out(phoneNumber=p["to"])
        except Exception as exc:
            if aws.is_throttling(aws.error_codes(exc)):
                return Outcome.throttled(aws.describe(exc))
            opted_out = {}  # SNS enforces opt-outs itself; go ahead
        if opted_out.get("isOptedOut") is True:
            return Outcome.suppressed(OPTED_OUT)
        attributes: dict[str, Any] = {}
        if p.get("sender_id"):
            attributes["AWS.SNS.SMS.SenderID"] = {
                "DataType": "String",
                "StringValue": p["sender_id"],
            }
        if p.get("sms_type"):
            attributes["AWS.SNS.SMS.SMSType"] = {"DataType": "String", "StringValue": p["sms_type"]}
        if deadline.expired():
            return Outcome.deferred("deadline near: not started")
        try:
            response = self.client.publish(
                PhoneNumber=p["to"], Message=p["message"], MessageAttributes=attributes
            )
        except Exception as exc:
            return classify(exc)
        return Outcome.delivered(response.get("MessageId"))


def classify(exc: BaseException) -> Outcome:
    """SNS Publish errors (shared by the SMS and push channels)."""
    return classify_common(exc, _FAILED)
