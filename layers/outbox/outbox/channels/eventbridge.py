"""Domain events through Amazon EventBridge ``PutEvents`` (one entry per message).

``PutEvents`` answers 200 even when the entry was refused; the entry's
``ErrorCode`` is the real answer and is always classified, never ignored.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from .. import aws
from ..errors import ValidationError
from ..outcomes import DETAIL_TYPES, SOURCE
from ..settings import EVENT_BUS_NAME
from . import Deadline, Message, Outcome
from .aws import AwsChannel
from .aws import classify as classify_common

# Per-entry codes AWS documents as retryable; every other entry code is final.
_ENTRY_RETRY = {"InternalFailure"}
# Whole-call errors that sending again cannot fix.
_CALL_FAILED = {"ValidationException", "ResourceNotFoundException", "InvalidArgument"}
# The relay's outcome events (outcomes.py) are published by the reaper alone:
# an application trusts an event with this source or these detail types to
# come from the relay, so a producer may not put one. Compared without case
# or surrounding spaces, and the source's sub-names (outbox.relay.*) too, so
# no rule with equals-ignore-case or a prefix can be reached either.
_RESERVED_DETAIL_TYPES = {t.casefold() for t in DETAIL_TYPES.values()}


def _reserved(payload: Mapping[str, Any]) -> ValidationError | None:
    source = str(payload.get("source", "")).strip().casefold()
    if source == SOURCE or source.startswith(SOURCE + "."):
        return ValidationError("payload.source", f"{SOURCE!r} is reserved for outcome events")
    if str(payload.get("detail_type", "")).strip().casefold() in _RESERVED_DETAIL_TYPES:
        return ValidationError(
            "payload.detail_type", "the relay's outcome events' detail types are reserved"
        )
    return None


class EventBridgeChannel(AwsChannel):
    service = "events"
    name = "eventbridge"
    schema: Mapping[str, Any] = {
        "type": "object",
        "required": ["source", "detail_type", "detail"],
        "additionalProperties": False,
        "properties": {
            "source": {"type": "string", "minLength": 1, "maxLength": 256},
            "detail_type": {"type": "string", "minLength": 1, "maxLength": 128},
            "detail": {"type": "object"},
            "event_bus": {"type": "string", "minLength": 1, "maxLength": 1600},
            "resources": {
                "type": "array",
                "maxItems": 10,
                "items": {"type": "string", "minLength": 1, "maxLength": 2048},
            },
        },
    }

    def __init__(self, client: Any = None, event_bus: str | None = None) -> None:
        super().__init__(client)
        self.event_bus = event_bus or EVENT_BUS_NAME.read(os.environ)

    def check(self, payload: dict[str, Any]) -> None:
        if payload["source"].startswith("aws."):
            raise ValidationError("payload.source", "the aws. prefix is reserved for AWS services")
        reserved = _reserved(payload)
        if reserved is not None:
            raise reserved

    def entry(self, payload: dict[str, Any]) -> dict[str, Any]:
        entry = {
            "Source": payload["source"],
            "DetailType": payload["detail_type"],
            "Detail": json.dumps(payload["detail"], separators=(",", ":"), ensure_ascii=False),
            "EventBusName": payload.get("event_bus") or self.event_bus,
        }
        if payload.get("resources"):
            entry["Resources"] = payload["resources"]
        return entry

    def send(self, message: Message, deadline: Deadline) -> Outcome:
        # Checked again here, whoever called send (validate runs before it in
        # the sender; a custom caller might not).
        reserved = _reserved(message.payload)
        if reserved is not None:
            return Outcome.failed(f"invalid payload: {reserved}")
        try:
            response = self.client.put_events(Entries=[self.entry(message.payload)])
        except Exception as exc:
            return classify_error(exc)
        entries = response.get("Entries") or []
        first = entries[0] if entries else {}
        code = first.get("ErrorCode")
        if response.get("FailedEntryCount", 0) == 0 and not code and first.get("EventId"):
            return Outcome.delivered(first["EventId"])
        return classify_entry(code)


def classify_entry(code: str | None) -> Outcome:
    error = f"entry refused: {code or 'no event id returned'}"
    if code is None:
        return Outcome.retry(error)
    if aws.is_throttling({code}):
        return Outcome.throttled(error)
    if code in _ENTRY_RETRY:
        return Outcome.retry(error)
    # InvalidArgument, MalformedDetail, AccessDeniedException, RedactionFailure,
    # NotAuthorizedForSourceException, NotAuthorizedForDetailTypeException, ...
    return Outcome.failed(error)


def classify_error(exc: BaseException) -> Outcome:
    return classify_common(exc, _CALL_FAILED)
