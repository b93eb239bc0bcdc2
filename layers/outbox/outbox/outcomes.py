"""Outcome events: what became of a message, published for applications.

Every transition to ``failed``, ``dead``, ``expired``, ``bounced`` or
``complained`` (and ``delivered`` when OUTCOME_EVENTS_DELIVERED is on, every
retry, ``retrying`` with its ``retry_at``, when OUTCOME_EVENTS_RETRYING is) leaves
a row in ``outbox_outcome_event``, written by a trigger in the transition's own
statement. The reaper publishes them here, after its recovery work, so a bus
that is down or refuses events never holds up a delivery:

1. take up to a batch of due events under a lease (``SKIP LOCKED``);
2. ``PutEvents`` them, ten entries a call (the API's limit);
3. delete the ones EventBridge accepted, in one statement; the refused ones
   keep their lease, which is their back-off, and go again after it.

At least once: a publisher that dies (or loses its database) between a
successful ``PutEvents`` and step 3 leaves those events leased, and the first
run after the lease ends publishes them again, with the same ``event_id``.
That is the only way an event is published twice; consumers deduplicate on
``detail.event_id``.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from . import aws, channels, store
from .redact import scrub_optional
from .relay_settings import OutcomeEventSettings

log = logging.getLogger(__name__)

SOURCE = "outbox.relay"
DETAIL_TYPES = {
    "failed": "Outbox Message Failed",
    "dead": "Outbox Message Dead",
    "expired": "Outbox Message Expired",
    "bounced": "Outbox Message Bounced",
    "complained": "Outbox Message Complained",
    "suppressed": "Outbox Message Suppressed",
    "delivered": "Outbox Message Delivered",
    "retrying": "Outbox Message Retrying",
}
# The detail's shape; 2 since the error is scrubbed and the keys opt-in (CHANGELOG).
DETAIL_VERSION = 2
# A provider's message id goes on the bus only from a built-in channel (AWS's
# ids, the relay's own) and only when it is a plain token: a custom channel's
# id is its own free text, which may be anything.
_PROVIDER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/+=-]{0,199}")
PUT_EVENTS_MAX_ENTRIES = 10
BATCH_SIZE = 100
_MIN_TIME_FOR_A_BATCH = 5.0


@dataclass
class PublishReport:
    published: int = 0
    refused: int = 0


def detail(event: store.OutcomeEvent, include_keys: bool = False) -> dict[str, Any]:
    """The event's ``detail``: ids, the status, codes and a scrubbed, bounded
    reason; never the payload, and the producer's keys only when the operator
    asked for them (OUTCOME_EVENTS_INCLUDE_KEYS): the bus is read by every
    rule of the account, and a key may name a person."""
    provider_id = event.provider_message_id
    body: dict[str, Any] = {
        "version": DETAIL_VERSION,
        "event_id": str(event.id),
        "id": event.message_id,
        "channel": event.channel,
        "status": event.status,
        "attempts": event.attempts,
        "last_error": scrub_optional(event.last_error),
        "provider_message_id": (
            provider_id
            if event.channel in channels.BUILT_IN
            and provider_id
            and _PROVIDER_ID.fullmatch(provider_id)
            else None
        ),
        "occurred_at": event.occurred_at.isoformat(),
        # the customer the message was for (0.7.0; None: no tenant)
        "tenant": event.tenant,
    }
    if event.status == "retrying":  # will it be tried again: yes, at retry_at
        body["retry_at"] = event.retry_at.isoformat() if event.retry_at else None
    if include_keys:
        body["dedupe_key"] = event.dedupe_key
        body["ordering_key"] = event.ordering_key
    return body


def entry(event: store.OutcomeEvent, bus: str, include_keys: bool = False) -> dict[str, Any]:
    return {
        "Source": SOURCE,
        "DetailType": DETAIL_TYPES[event.status],
        "Detail": json.dumps(
            detail(event, include_keys), separators=(",", ":"), ensure_ascii=False
        ),
        "EventBusName": bus,
        "Time": event.occurred_at,
    }


def publish(
    engine: sa.Engine,
    client: Any,
    settings: OutcomeEventSettings,
    time_left: Callable[[], float],
    batch_size: int = BATCH_SIZE,
) -> PublishReport:
    """Publish due outcome events until none are left or time runs short."""
    report = PublishReport()
    while time_left() > _MIN_TIME_FOR_A_BATCH:
        with engine.begin() as conn:
            events = store.take_outcome_events(conn, batch_size, settings.lease_seconds)
        if not events:
            break
        published, refused = put(client, events, settings.bus, settings.include_keys)
        with engine.begin() as conn:
            store.finish_outcome_events(conn, published, refused)
        report.published += len(published)
        report.refused += len(refused)
        if refused:
            log.warning(
                "outcome events refused by EventBridge, tried again after the lease",
                extra={
                    "refused": len(refused),
                    "errors": sorted(set(refused.values())),
                    "lease_seconds": settings.lease_seconds,
                },
            )
        if len(events) < batch_size or refused:
            break
    return report


def put(
    client: Any, events: Sequence[store.OutcomeEvent], bus: str, include_keys: bool = False
) -> tuple[list[int], dict[int, str]]:
    """PutEvents in chunks of ten: (ids accepted, {id: error code} refused).
    A whole call that fails refuses its chunk; the entry codes say the rest."""
    published: list[int] = []
    refused: dict[int, str] = {}
    for start in range(0, len(events), PUT_EVENTS_MAX_ENTRIES):
        chunk = events[start : start + PUT_EVENTS_MAX_ENTRIES]
        try:
            response = client.put_events(Entries=[entry(e, bus, include_keys) for e in chunk])
        except Exception as exc:
            refused.update({e.id: aws.describe(exc) for e in chunk})
            continue
        answers = response.get("Entries") or []
        for n, event in enumerate(chunk):
            answer = answers[n] if n < len(answers) else {}
            if answer.get("EventId") and not answer.get("ErrorCode"):
                published.append(event.id)
            else:
                refused[event.id] = str(answer.get("ErrorCode") or "no event id returned")
    return published, refused
