"""Email through Amazon SES v2 ``SendEmail``.

Suppression: SES never delivers to an address on the account-level
suppression list, yet ``SendEmail`` still answers with a message id (the
drop shows up later as a bounce event). So, unless ``SES_SUPPRESSION_CHECK``
is ``false``, the channel first asks ``GetSuppressedDestination`` for each
recipient (of messages with at most ``MAX_SUPPRESSION_CHECKS`` of them) and
records ``suppressed`` when every recipient is on the list. A
check that fails (other than by throttling) lets the send go ahead: SES
enforces the list itself, the check only makes the outcome honest.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .. import aws
from ..errors import ValidationError
from ..settings import SES_CONFIGURATION_SET, SES_SUPPRESSION_CHECK
from . import Deadline, Message, Outcome
from .aws import AwsChannel
from .aws import classify as classify_common

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
# The account may not send at all now: the whole channel pauses.
_PAUSED = {"SendingPausedException", "AccountSuspendedException"}
# SES answers a spent daily quota with its throttling code and this message;
# the quota is a rolling 24 hours, so the channel waits this long, then tries
# once more (one refused call per sender) rather than a message at a time.
_DAILY_QUOTA = "daily message quota exceeded"
QUOTA_PAUSE_SECONDS = 3600.0
SUPPRESSED = "every recipient is on the SES suppression list"
# Messages with more recipients than this skip the suppression lookups.
MAX_SUPPRESSION_CHECKS = 5


class EmailChannel(AwsChannel):
    service = "sesv2"
    name = "email"
    schema: Mapping[str, Any] = {
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

    def __init__(
        self,
        client: Any = None,
        configuration_set: str | None = None,
        check_suppression: bool | None = None,
    ) -> None:
        super().__init__(client)
        self.configuration_set = configuration_set or SES_CONFIGURATION_SET.read(os.environ)
        if check_suppression is None:
            check_suppression = SES_SUPPRESSION_CHECK.read(os.environ)
        self.check_suppression = check_suppression

    def check(self, payload: dict[str, Any]) -> None:
        if "text" not in payload and "html" not in payload:
            raise ValidationError("payload.text", "text or html is required")
        if "\r" in payload["subject"] or "\n" in payload["subject"]:
            # One header line: a CR or LF would start another header.
            raise ValidationError("payload.subject", "must be one line (no CR or LF)")
        recipients = sum(len(payload.get(k, [])) for k in ("to", "cc", "bcc"))
        if recipients > _MAX_RECIPIENTS:
            raise ValidationError(
                "payload.to", f"{recipients} recipients; SES allows {_MAX_RECIPIENTS}"
            )

    def provider_rate_limit(self) -> float | None:
        """The account's maximum send rate (SES ``GetAccount``'s
        ``SendQuota.MaxSendRate``, messages a second), or None when SES names
        none. The relay makes it the email limit where no operator or
        configuration set one (``coldstart_limits``)."""
        quota = self.client.get_account().get("SendQuota") or {}
        rate = quota.get("MaxSendRate")
        if isinstance(rate, bool) or not isinstance(rate, int | float):
            return None
        return float(rate)

    def suppressed(self, payload: dict[str, Any]) -> Outcome | None:
        """``suppressed`` when every recipient is on the SES suppression list."""
        recipients = {a.lower() for k in ("to", "cc", "bcc") for a in payload.get(k, [])}
        if len(recipients) > MAX_SUPPRESSION_CHECKS:
            return None  # one lookup per recipient is too dear; SES still enforces the list
        for address in sorted(recipients):
            try:
                self.client.get_suppressed_destination(EmailAddress=address)
            except Exception as exc:
                codes = aws.error_codes(exc)
                if "NotFoundException" in codes:
                    return None  # this one is not suppressed: send
                if aws.is_throttling(codes):
                    return Outcome.throttled(aws.describe(exc))
                return None  # cannot tell: SES enforces the list itself
        return Outcome.suppressed(SUPPRESSED)

    def send(self, message: Message, deadline: Deadline) -> Outcome:
        p = message.payload
        if self.check_suppression:
            outcome = self.suppressed(p)
            if outcome is not None:
                return outcome
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
    """A spent quota or paused sending pauses the channel; the rest is the
    common AWS table, whose throttling test (``aws.is_throttling``) knows SES's
    own ``ThrottlingException`` as every other AWS channel's throttling codes."""
    codes = aws.error_codes(exc)
    if codes & _PAUSED:
        return Outcome.quota(aws.describe(exc), QUOTA_PAUSE_SECONDS)
    if aws.is_throttling(codes) and _DAILY_QUOTA in aws.error_message(exc).lower():
        # Only compared, never stored or logged: provider text stays out.
        return Outcome.quota(f"{aws.describe(exc)}: daily quota exceeded", QUOTA_PAUSE_SECONDS)
    return classify_common(exc, _FAILED)
