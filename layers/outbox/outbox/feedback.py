"""Provider feedback: SES bounce, complaint and delivery events.

SES event publishing (a configuration set's event destination) sends each
event to an SNS topic, which invokes the feedback function with the SES
notification as the ``Message`` string of an SNS record; an EventBridge
destination sends the same notification as an event's ``detail``. Both are
read here. A notification names its message by the SES message id (stored as
``provider_message_id`` when the email was sent) and its recipients by
address; it becomes one ``store.Feedback`` per recipient, and the whole batch
is recorded by ``store.record_feedback``:

* a notice counts only when its SES message id names an email message AND
  its recipient is one that message was sent to (the recipient's keyed
  fingerprint among those of the delivered attempt): a forged notice needs
  both, and a notice for another recipient changes nothing;
* each recipient's notice is an attempt row of its own, recorded once per
  (message, recipient, outcome and type): a replay with a fresh feedback id is
  the same notice;
* the message moves ``delivered -> bounced | complained`` once every recipient
  it was sent to has a permanent bounce or a complaint on record: to
  ``complained`` if any of them complained, else ``bounced`` (for one
  recipient: its first permanent bounce or complaint);
* a transient (or undetermined) bounce and a delivery only add an attempt row.

What cannot be used (another event type, a malformed or oversized record, a
message id or recipient no sent email has) is counted and logged by kind only,
never raised: the function must not fail on data it will never be able to
use. One bad record never costs the others: every record is parsed within
bounds (size, nesting depth, field lengths) before anything is written.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from . import store
from .observability import count
from .redact import scrub

log = logging.getLogger(__name__)

# SES event types this function records; every other SES event type (Send,
# Open, Click, DeliveryDelay, ...) is counted as ignored.
_RECORDED_TYPES = {"Bounce", "Complaint", "Delivery"}
# Bounds on what is parsed. SNS refuses messages over 256 KiB, SES notices
# nest six levels deep and a message has at most 50 recipients: anything past
# these is not from SES, and is refused before it costs more.
MESSAGE_MAX_BYTES = 256 * 1024
MAX_DEPTH = 32
MAX_RECIPIENTS = 50
_ID_MAX_CHARS = 256
_ADDRESS_MAX_CHARS = 320  # RFC 5321: a 64-character local part, a 255-character domain
_KIND_MAX_CHARS = 64


class Unrecognized(ValueError):
    """A record that is not a usable SES notification (malformed or out of bounds)."""


@dataclass
class FeedbackReport:
    received: int = 0
    recorded: Counter[str] = field(default_factory=Counter)  # by outcome
    moved: Counter[str] = field(default_factory=Counter)  # by new status
    repeated: int = 0
    unmatched: int = 0
    ignored: int = 0  # SES event types this function does not record
    unrecognized: int = 0  # not an SES event at all

    def as_dict(self) -> dict[str, Any]:
        return {
            "received": self.received,
            "recorded": dict(self.recorded),
            "moved": dict(self.moved),
            "repeated": self.repeated,
            "unmatched": self.unmatched,
            "ignored": self.ignored,
            "unrecognized": self.unrecognized,
        }


def handle(engine: sa.Engine, event: Any) -> FeedbackReport:
    """Record every usable SES event of one invocation; never raises on bad data."""
    report = FeedbackReport()
    parsed: dict[tuple[str, str, str, str], store.Feedback] = {}
    for notification in notifications(event):
        report.received += 1
        try:
            notices = from_notification(notification)
        except (KeyError, TypeError, ValueError, AttributeError, RecursionError):
            report.unrecognized += 1
            continue
        if notices is None:
            report.ignored += 1
            continue
        for notice in notices:
            key = (notice.provider_message_id, notice.outcome, notice.kind, notice.recipient)
            if key in parsed:
                report.repeated += 1  # the same notice twice in one batch
            parsed[key] = notice
    if parsed:
        with engine.begin() as conn:
            results = store.record_feedback(conn, list(parsed.values()))
        for result in results:
            if result.message_id is None:
                report.unmatched += 1
            elif not result.recorded:
                report.repeated += 1
            else:
                report.recorded[result.outcome] += 1
                if result.new_status:
                    report.moved[result.new_status] += 1
    _report(report)
    return report


def _report(report: FeedbackReport) -> None:
    count("FeedbackBounced", report.moved["bounced"])
    count("FeedbackComplained", report.moved["complained"])
    count("FeedbackTransientBounces", report.recorded["transient_bounce"])
    count("FeedbackDeliveries", report.recorded["delivery_confirmed"])
    count("FeedbackRepeated", report.repeated)
    count("FeedbackUnmatched", report.unmatched)
    count("FeedbackUnrecognized", report.unrecognized + report.ignored)
    extra = report.as_dict()
    if report.unmatched or report.unrecognized:
        # Counts only: the events hold addresses and the mail's headers.
        log.warning("feedback events unmatched or not from SES", extra=extra)
    else:
        log.info("feedback recorded", extra=extra)


def notifications(event: Any) -> Iterator[Any]:
    """The SES notifications in a Lambda event: the ``Message`` of each SNS
    record, or the ``detail`` of an EventBridge event from ``aws.ses``.
    Anything else (an unreadable or oversized ``Message`` included) yields
    itself, to be counted as unrecognized."""
    if isinstance(event, Mapping) and isinstance(event.get("Records"), list):
        for record in event["Records"]:
            sns = record.get("Sns") if isinstance(record, Mapping) else None
            message = sns.get("Message") if isinstance(sns, Mapping) else None
            if not isinstance(message, str) or len(message) > MESSAGE_MAX_BYTES:
                yield record
                continue
            try:
                yield json.loads(message)
            except (ValueError, RecursionError):  # json's own depth guard
                yield message
    elif isinstance(event, Mapping) and event.get("source") == "aws.ses" and "detail" in event:
        yield event["detail"]
    else:
        yield event


def from_notification(notification: Any) -> list[store.Feedback] | None:
    """One SES notification as a ``store.Feedback`` per recipient; None for an
    SES event type that is not recorded. Raises KeyError/TypeError/ValueError
    when it is not a usable SES notification."""
    if not isinstance(notification, Mapping):
        raise TypeError("not an object")
    _check_depth(notification)
    # Event publishing says eventType; identity notifications say notificationType.
    event_type = notification.get("eventType") or notification["notificationType"]
    message_id = _bounded(notification["mail"]["messageId"], _ID_MAX_CHARS)
    if not isinstance(event_type, str):
        raise Unrecognized("no event type")
    if event_type not in _RECORDED_TYPES:
        return None
    if event_type == "Bounce":
        bounce = notification["bounce"]
        permanent = bounce.get("bounceType") == "Permanent"
        kind = _bounce_kind(bounce)
        return [
            store.Feedback(
                provider_message_id=message_id,
                outcome="bounced" if permanent else "transient_bounce",
                recipient=_address(r.get("emailAddress")),
                kind=kind,
                reason=bounce_reason(kind, r),
            )
            for r in _recipients(bounce.get("bouncedRecipients"))
        ]
    if event_type == "Complaint":
        complaint = notification["complaint"]
        return [
            store.Feedback(
                provider_message_id=message_id,
                outcome="complained",
                recipient=_address(r.get("emailAddress")),
                kind=_complaint_kind(complaint),
                reason=complaint_reason(complaint),
            )
            for r in _recipients(complaint.get("complainedRecipients"))
        ]
    delivery = notification["delivery"]
    response = delivery.get("smtpResponse")
    addresses = _recipients(delivery.get("recipients"), of=str)
    reason = _clean(
        f"delivered: {response if isinstance(response, str) else 'accepted'}", about=addresses
    )
    return [
        store.Feedback(
            provider_message_id=message_id,
            outcome="delivery_confirmed",
            recipient=_address(address),
            kind="delivery",
            reason=reason,
        )
        for address in addresses
    ]


def bounce_reason(kind: str, recipient: Mapping[str, Any]) -> str:
    """``bounced: Permanent/General, 5.1.1 smtp; 550 5.1.1 user unknown``: the
    bounce's type and subtype and this recipient's status and diagnostic code,
    scrubbed, without this recipient's local part or name in any form."""
    detail = " ".join(
        recipient[k] for k in ("status", "diagnosticCode") if isinstance(recipient.get(k), str)
    )
    address = recipient.get("emailAddress")
    return _clean(
        f"bounced: {kind}" + (f", {detail}" if detail else ""),
        about=[address] if isinstance(address, str) else [],
    )


def _bounce_kind(bounce: Mapping[str, Any]) -> str:
    """``Permanent/General``: the bounce's type and subtype."""
    kind = _word(bounce.get("bounceType"), "Undetermined")
    return f"{kind}/{_word(bounce.get('bounceSubType'), '?')}"


def complaint_reason(complaint: Mapping[str, Any]) -> str:
    return _clean(f"complained: {_complaint_kind(complaint)}")


def _complaint_kind(complaint: Mapping[str, Any]) -> str:
    kind = complaint.get("complaintFeedbackType") or complaint.get("complaintSubType")
    return _word(kind, "unknown")


def _clean(text: str, about: list[str] | None = None) -> str:
    """The one scrubber (``outbox.redact``): no addresses or numbers (nor the
    local part or name of the recipients ``about``), one line, as long as any
    error the relay stores."""
    return scrub(text, about=about or ())


def _word(value: Any, default: str) -> str:
    """A short SES enumeration value (bounce type, complaint type), scrubbed."""
    return scrub(value, _KIND_MAX_CHARS) if isinstance(value, str) and value else default


def _bounded(value: Any, limit: int) -> str:
    if not isinstance(value, str) or not value or len(value) > limit:
        raise Unrecognized("missing, not text or too long")
    return value


def _address(value: Any) -> str:
    """A recipient as the fingerprint compares it (SQL normalises it again)."""
    return _bounded(value, _ADDRESS_MAX_CHARS).strip().lower()


def _recipients(value: Any, of: type = Mapping) -> list[Any]:
    if not isinstance(value, list) or not 0 < len(value) <= MAX_RECIPIENTS:
        raise Unrecognized("no recipients, or more than SES sends to")
    if not all(isinstance(r, of) for r in value):
        raise Unrecognized("a recipient of the wrong shape")
    return value


def _check_depth(value: Any) -> None:
    """Refuse a document nested deeper than any SES notice (without recursion)."""
    level: list[Any] = [value]
    for _ in range(MAX_DEPTH):
        level = [
            child
            for item in level
            if isinstance(item, (Mapping, list))
            for child in (item.values() if isinstance(item, Mapping) else item)
        ]
        if not level:
            return
    raise Unrecognized(f"nested deeper than {MAX_DEPTH} levels")
