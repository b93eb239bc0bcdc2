"""Email through Amazon SES v2 ``SendEmail``."""

from __future__ import annotations

import os
from typing import Any

from ..errors import ValidationError
from . import Deadline, Message, Outcome, SchemaChannel, aws

_ADDRESS = {"type": "string", "minLength": 3, "maxLength": 320, "pattern": "^[^@\\s]+@[^@\\s]+$"}
_ADDRESSES = {"type": "array", "items": _ADDRESS, "maxItems": 50}
# SES accepts at most 50 recipients per message, across To, Cc and Bcc.
_MAX_RECIPIENTS = 50

# SES v2 error codes, by what sending again would achieve.
_FAILED = {
    "MessageRejected",
    "MailFromDomainNotVerifiedException",
    "BadRequestException",
    "NotFoundException",
}
_THROTTLED = {"TooManyRequestsException", "LimitExceededException", "Throttling"}
_PAUSED = {"SendingPausedException", "AccountSuspendedException"}
_THROTTLE_DELAY_SECONDS = 5.0
_PAUSED_DELAY_SECONDS = 300.0


class EmailChannel(SchemaChannel):
    name = "email"
    schema = {
        "type": "object",
        "required": ["from", "to", "subject"],
        "additionalProperties": False,
        "properties": {
            "from": _ADDRESS,
            "to": {**_ADDRESSES, "minItems": 1},
            "cc": _ADDRESSES,
            "bcc": _ADDRESSES,
            "reply_to": _ADDRESSES,
            "subject": {"type": "string", "minLength": 1, "maxLength": 998},
            "text": {"type": "string", "minLength": 1},
            "html": {"type": "string", "minLength": 1},
        },
    }

    def __init__(self, client: Any = None, configuration_set: str | None = None) -> None:
        self._client = client
        self.configuration_set = (
            configuration_set or os.environ.get("SES_CONFIGURATION_SET") or None
        )

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = aws.client("sesv2")
        return self._client

    def check(self, payload: dict[str, Any]) -> None:
        if "text" not in payload and "html" not in payload:
            raise ValidationError("payload.text", "text or html is required")
        recipients = sum(len(payload.get(k, [])) for k in ("to", "cc", "bcc"))
        if recipients > _MAX_RECIPIENTS:
            raise ValidationError(
                "payload.to", f"{recipients} recipients; SES allows {_MAX_RECIPIENTS}"
            )

    def send(self, message: Message, deadline: Deadline) -> Outcome:
        p = message.payload
        body: dict[str, Any] = {}
        if "text" in p:
            body["Text"] = {"Data": p["text"], "Charset": "UTF-8"}
        if "html" in p:
            body["Html"] = {"Data": p["html"], "Charset": "UTF-8"}
        request: dict[str, Any] = {
            "FromEmailAddress": p["from"],
            "Destination": {
                "ToAddresses": p["to"],
                "CcAddresses": p.get("cc", []),
                "BccAddresses": p.get("bcc", []),
            },
            "Content": {
                "Simple": {"Subject": {"Data": p["subject"], "Charset": "UTF-8"}, "Body": body}
            },
        }
        if p.get("reply_to"):
            request["ReplyToAddresses"] = p["reply_to"]
        if self.configuration_set:
            request["ConfigurationSetName"] = self.configuration_set
        try:
            response = self.client.send_email(**request)
        except Exception as exc:
            return classify(exc)
        return Outcome.delivered(response.get("MessageId"))


def classify(exc: BaseException) -> Outcome:
    code = aws.error_code(exc)
    error = aws.describe(exc)
    if code in _FAILED:
        return Outcome.failed(error)
    if code in _THROTTLED:
        return Outcome.deferred(error, _THROTTLE_DELAY_SECONDS)
    if code in _PAUSED:
        return Outcome.deferred(error, _PAUSED_DELAY_SECONDS)
    # Server errors, timeouts, connection resets: worth another attempt.
    return Outcome.retry(error)
