"""The dispatcher -> channel function event, and the ways to deliver it.

The event carries only ids, claim tokens and attempt numbers, never payloads:
the sender takes its rows by a compare-and-set receipt, so a stale, replayed
or duplicated event finds nothing to send and changes nothing.

    {"version": 1, "channel": "email",
     "messages": [{"id": 42, "claim_token": "5f0c...", "attempt": 1}, ...]}
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeGuard

from . import aws
from .errors import ValidationError
from .store import Claim

VERSION = 1
MAX_MESSAGES_PER_EVENT = 1000
MAX_MESSAGE_ID = 2**63 - 1  # bigint: a larger id is a field error, not a database error
MAX_ATTEMPT = 2**31 - 1  # integer


# A claim token as ``str(uuid.UUID)`` spells it. The sender keeps a token as
# this text (it only goes back into the fenced statements, which cast it):
# parsing each into a ``uuid.UUID`` and printing it again cost more than the
# rest of the event's checks. Another spelling is still accepted, through
# ``uuid.UUID``, and made canonical, so a pair listed twice is one claim.
_CANONICAL_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _whole_in(value: Any, hi: int) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= hi


@dataclass(frozen=True)
class HandOff:
    channel: str
    claims: tuple[Claim, ...]

    def to_event(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "channel": self.channel,
            "messages": [
                {"id": c.id, "claim_token": str(c.claim_token), "attempt": c.attempt}
                for c in self.claims
            ],
        }

    @classmethod
    def from_event(cls, event: Any) -> HandOff:
        """Parse and check an event; ValidationError names the first bad field."""
        if not isinstance(event, Mapping):
            raise ValidationError("event", f"must be an object, got {type(event).__name__}")
        if event.get("version") != VERSION:
            raise ValidationError("event.version", f"must be {VERSION}")
        channel = event.get("channel")
        if not isinstance(channel, str) or not channel:
            raise ValidationError("event.channel", "must be a non-empty string")
        messages = event.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValidationError("event.messages", "must be a non-empty list")
        if len(messages) > MAX_MESSAGES_PER_EVENT:
            raise ValidationError("event.messages", f"holds more than {MAX_MESSAGES_PER_EVENT}")
        claims: dict[tuple[int, str], Claim] = {}
        for i, item in enumerate(messages):
            # The field's name is spelt out only for an error (it is per message).
            if type(item) is not dict and not isinstance(item, Mapping):  # the ABC check is slow
                raise ValidationError(f"event.messages[{i}]", "must be an object")
            message_id, attempt = item.get("id"), item.get("attempt")
            if not _whole_in(message_id, MAX_MESSAGE_ID):
                raise ValidationError(
                    f"event.messages[{i}].id", f"must be an integer from 1 to {MAX_MESSAGE_ID}"
                )
            if not _whole_in(attempt, MAX_ATTEMPT):
                raise ValidationError(
                    f"event.messages[{i}].attempt", f"must be an integer from 1 to {MAX_ATTEMPT}"
                )
            raw_token = item.get("claim_token")
            if isinstance(raw_token, str) and _CANONICAL_UUID.fullmatch(raw_token):
                token = raw_token  # as to_event writes it: already the one spelling
            else:
                try:
                    token = str(uuid.UUID(str(raw_token)))  # any other spelling, made canonical
                except ValueError:
                    raise ValidationError(
                        f"event.messages[{i}].claim_token", "must be a UUID"
                    ) from None
            # A pair listed twice is one claim: it is sent once.
            claims.setdefault((message_id, token), Claim(message_id, channel, token, attempt))
        return cls(channel, tuple(claims.values()))


def chunk(claims: Sequence[Claim], size: int) -> list[HandOff]:
    """Group claims by channel, then split each group into events of ``size``."""
    by_channel: dict[str, list[Claim]] = {}
    for c in claims:
        by_channel.setdefault(c.channel, []).append(c)
    return [
        HandOff(channel, tuple(group[i : i + size]))
        for channel, group in sorted(by_channel.items())
        for i in range(0, len(group), size)
    ]


class HandOffThrottled(Exception):
    """The channel's function refused the event for now (Lambda's
    TooManyRequestsException, HTTP 429): the claims go back with a short
    delay, and the channel is handed nothing more for that long."""

    def __init__(self, channel: str) -> None:
        super().__init__(f"hand-off to channel {channel!r} throttled")
        self.channel = channel


class Invoker(Protocol):
    """How the dispatcher delivers hand-offs. A test double may subclass it
    for the default ``missing_route``."""

    def can_route(self, channel: str) -> bool: ...

    def missing_route(self, channel: str) -> str:
        """Why ``channel`` cannot be routed, in the invoker's words: the
        ``last_error`` of the rows the dispatcher then fails."""
        return f"no function is configured for channel {channel!r}"

    def hand_off(self, handoff: HandOff) -> None:
        """Deliver the event or raise; a raise releases the claims at once
        (HandOffThrottled: after a short delay)."""


class LambdaInvoker:
    """Asynchronous Lambda invoke (``InvocationType=Event``) of the channel's function."""

    def __init__(self, functions: Mapping[str, str], client: Any = None) -> None:
        self.functions = dict(functions)
        self._client = client

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = aws.lambda_client()
        return self._client

    def can_route(self, channel: str) -> bool:
        return channel in self.functions

    def missing_route(self, channel: str) -> str:
        return f"no function is configured for channel {channel!r} (CHANNEL_FUNCTIONS)"

    def hand_off(self, handoff: HandOff) -> None:
        from botocore.exceptions import ClientError

        try:
            response = self.client.invoke(
                FunctionName=self.functions[handoff.channel],
                InvocationType="Event",
                Payload=json.dumps(handoff.to_event(), separators=(",", ":")).encode(),
            )
        except ClientError as exc:
            if aws.is_invoke_throttled(exc):
                raise HandOffThrottled(handoff.channel) from exc
            raise
        if response.get("StatusCode") != 202:
            raise RuntimeError(f"async invoke answered {response.get('StatusCode')}")


class CallableInvoker:
    """In-process hand-off: each channel mapped to a callable taking the event dict."""

    def __init__(self, targets: Mapping[str, Callable[[dict[str, Any]], Any]]) -> None:
        self.targets = dict(targets)

    def can_route(self, channel: str) -> bool:
        return channel in self.targets

    def missing_route(self, channel: str) -> str:
        return (
            f"no function is configured for channel {channel!r} "
            "(it is not in this process's channel registry)"
        )

    def hand_off(self, handoff: HandOff) -> None:
        self.targets[handoff.channel](handoff.to_event())
