"""Domain events through Amazon SQS ``SendMessage``.

On a FIFO queue (``.fifo``) the message group is the outbox message's
``ordering_key`` (``DEFAULT_GROUP`` when it has none, so such messages share
one ordered group) and the deduplication id is the outbox message id: a
redelivery of the same message inside SQS's five-minute window is dropped by
SQS itself.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ..errors import ValidationError
from . import Deadline, Message, Outcome
from .aws import AwsChannel
from .aws import classify as classify_common

DEFAULT_GROUP = "outbox"
QUEUE_URL = "^https?://[A-Za-z0-9.-]+(:[0-9]+)?/[0-9]{12}/[A-Za-z0-9_-]{1,80}(\\.fifo)?$"
_ATTRIBUTE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,256}$")
_FAILED = {
    "QueueDoesNotExist",
    "AWS.SimpleQueueService.NonExistentQueue",
    "InvalidParameterValue",
    "InvalidMessageContents",
    "UnsupportedOperation",
    "AWS.SimpleQueueService.UnsupportedOperation",
    "InvalidAddress",
    "MissingParameter",
    "InvalidAttributeName",
    "InvalidAttributeValue",
    "ValidationError",
}


def is_fifo(queue_url: str) -> bool:
    return queue_url.endswith(".fifo")


class SqsChannel(AwsChannel):
    service = "sqs"
    name = "sqs"
    schema: Mapping[str, Any] = {
        "type": "object",
        "required": ["queue_url", "body"],
        "additionalProperties": False,
        "properties": {
            "queue_url": {"type": "string", "maxLength": 1024, "pattern": QUEUE_URL},
            "body": {"type": "string", "minLength": 1},
            "delay_seconds": {"type": "integer", "minimum": 0, "maximum": 900},
            "attributes": {
                "type": "object",
                "maxProperties": 10,
                "additionalProperties": {"type": "string", "minLength": 1},
            },
        },
    }

    def check(self, payload: dict[str, Any]) -> None:
        if is_fifo(payload["queue_url"]) and "delay_seconds" in payload:
            raise ValidationError("payload.delay_seconds", "FIFO queues take no per-message delay")
        for name in payload.get("attributes", {}):
            if (
                not _ATTRIBUTE_NAME.match(name)
                or name.lower().startswith(("aws.", "amazon."))
                or ".." in name
                or name.startswith(".")
                or name.endswith(".")
            ):
                raise ValidationError(
                    f"payload.attributes.{name}", "is not a valid SQS attribute name"
                )

    def request(self, message: Message) -> dict[str, Any]:
        p = message.payload
        request: dict[str, Any] = {"QueueUrl": p["queue_url"], "MessageBody": p["body"]}
        if "delay_seconds" in p:
            request["DelaySeconds"] = p["delay_seconds"]
        if p.get("attributes"):
            request["MessageAttributes"] = {
                k: {"DataType": "String", "StringValue": v} for k, v in p["attributes"].items()
            }
        if is_fifo(p["queue_url"]):
            request["MessageGroupId"] = message.ordering_key or DEFAULT_GROUP
            request["MessageDeduplicationId"] = str(message.id)
        return request

    def send(self, message: Message, deadline: Deadline) -> Outcome:
        try:
            response = self.client.send_message(**self.request(message))
        except Exception as exc:
            return classify(exc)
        return Outcome.delivered(response.get("MessageId"))


def classify(exc: BaseException) -> Outcome:
    """SQS SendMessage errors: the common AWS table."""
    return classify_common(exc, _FAILED)
