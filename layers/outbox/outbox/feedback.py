"""Provider feedback: SES bounce, complaint and delivery events.

SES event publishing (a configuration set's event destination) sends each
event to an SNS topic, which invokes the feedback function with the SES
notification as the ``Message`` string of an SNS record; an EventBridge
destination sends the same notification as an event's ``detail``. Both are
read here. Each event is correlated with its message by the SES message id
(stored as ``provider_message_id`` when the email was sent) and the whole
batch is recorded by one statement (``store.record_feedback``):

* a permanent bounce moves ``delivered -> bounced``; a complaint moves
  ``delivered -> complained``; both add an attempt row with the reason;
* a transient (or undetermined) bounce and a delivery only add an attempt row.

What cannot be used (another event type, a malformed record, a message id no
email message has) is counted and logged by kind only, never raised: the
function must not fail on data it will never be able to use.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from . import store
from .observability import count

log = logging.getLogger(__name__)

# SES event types this function records; every other SES event type (Send,
# Open, Click, DeliveryDelay, ...) is counted as ignored.
_RECORDED_TYPES = {"Bounce", "Complaint", "Delivery"}
_REASON_MAX_CHARS = 300
# Anything shaped like an address, with its angle brackets: diagnostic codes
# echo the recipient ("550 5.1.1 <ada@example.net>: Recipient address rejected").
_ADDRESS = re.compile(r"<?[^\s<>@\"'(),;:]+@[^\s<>\"'(),;:]+>?")


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
    parsed: dict[tuple[str, str], store.Feedback] = {}
    for notification in notifications(event):
        report.received += 1
        try:
            feedback = from_notification(notification)
        except (KeyError, TypeError, ValueError, AttributeError):
            report.unrecognized += 1
            continue
        if feedback is None:
            report.ignored += 1
            continue
        key = (feedback.provider_message_id, feedback.feedback_id)
        if key in parsed:
            report.repeated += 1  # the same event twice in one batch
        parsed[key] = feedback
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
    Anything else yields itself, to be counted as unrecognized."""
    if isinstance(event, Mapping) and isinstance(event.get("Records"), list):
        for record in event["Records"]:
            sns = record.get("Sns") if isinstance(record, Mapping) else None
            message = sns.get("Message") if isinstance(sns, Mapping) else None
            if not isinstance(message, str):
                yield record
                continue
            try:
                yield json.loads(message)
            except ValueError:
                yield message
    elif isinstance(event, Mapping) and event.get("source") == "aws.ses" and "detail" in event:
        yield event["detail"]
    else:
        yield event


def from_notification(notification: Any) -> store.Feedback | None:
    """One SES notification as a ``store.Feedback``; None for an SES event
    type that is not recorded. Raises KeyError/TypeError/ValueError when it
    is not an SES notification."""
    if not isinstance(notification, Mapping):
        raise TypeError("not an object")
    # Event publishing says eventType; identity notifications say notificationType.
    kind = notification.get("eventType") or notification["notificationType"]
    message_id = notification["mail"]["messageId"]
    if not isinstance(kind, str) or not isinstance(message_id, str) or not message_id:
        raise ValueError("no event type or message id")
    if kind not in _RECORDED_TYPES:
        return None
    if kind == "Bounce":
        bounce = notification["bounce"]
        permanent = bounce.get("bounceType") == "Permanent"
        return store.Feedback(
            provider_message_id=message_id,
            outcome="bounced" if permanent else "transient_bounce",
            feedback_id=_feedback_id(notification, bounce),
            reason=bounce_reason(bounce),
        )
    if kind == "Complaint":
        complaint = notification["complaint"]
        return store.Feedback(
            provider_message_id=message_id,
            outcome="complained",
            feedback_id=_feedback_id(notification, complaint),
            reason=complaint_reason(complaint),
        )
    delivery = notification["delivery"]
    return store.Feedback(
        provider_message_id=message_id,
        outcome="delivery_confirmed",
        feedback_id=_feedback_id(notification, delivery),
        reason=_clean(f"delivered: {delivery.get('smtpResponse') or 'accepted'}"),
    )


def bounce_reason(bounce: Mapping[str, Any]) -> str:
    """``bounced: Permanent/General, 5.1.1 smtp; 550 5.1.1 user unknown`` with
    every address taken out; the first recipient's status speaks for the rest."""
    kind = f"{bounce.get('bounceType') or 'Undetermined'}/{bounce.get('bounceSubType') or '?'}"
    recipients = bounce.get("bouncedRecipients") or []
    first = recipients[0] if recipients and isinstance(recipients[0], Mapping) else {}
    detail = " ".join(
        str(first[k]) for k in ("status", "diagnosticCode") if isinstance(first.get(k), str)
    )
    more = f" (+{len(recipients) - 1} more recipients)" if len(recipients) > 1 else ""
    return _clean(f"bounced: {kind}" + (f", {detail}" if detail else "") + more)


def complaint_reason(complaint: Mapping[str, Any]) -> str:
    kind = complaint.get("complaintFeedbackType") or complaint.get("complaintSubType") or "unknown"
    return _clean(f"complained: {kind}")


def _clean(text: str) -> str:
    """No addresses, one line, bounded."""
    text = " ".join(_ADDRESS.sub("<address>", text).split())
    return text[:_REASON_MAX_CHARS]


def _feedback_id(notification: Mapping[str, Any], part: Mapping[str, Any]) -> str:
    """SES's own feedback id when the event has one (bounces, complaints), else
    a digest of the whole event: the same event always gets the same id."""
    kind = notification.get("eventType") or notification.get("notificationType")
    if isinstance(part.get("feedbackId"), str) and part["feedbackId"]:
        return f"{kind}:{part['feedbackId']}"
    canonical = json.dumps(notification, sort_keys=True, separators=(",", ":"))
    return f"{kind}:sha256:{hashlib.sha256(canonical.encode()).hexdigest()}"
