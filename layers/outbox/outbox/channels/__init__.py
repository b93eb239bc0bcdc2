"""Channels: how a message leaves the relay.

A channel is a small class with a ``name``, a JSON ``schema`` for its payload,
``validate(payload)`` (called at enqueue and again before sending) and
``send(message, deadline) -> Outcome``. The registry maps a channel name to a
factory so that a function only imports the provider code it uses: the email
function never pays for the SNS channel's imports at cold start.

Adding a channel: write the class, ``register("name", "module:Class")`` (or
pass the class itself), add its function to template.yaml and an event to events/.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol, runtime_checkable

from ..errors import ValidationError
from ..states import AttemptOutcome

# What an Outcome's ``pause`` stops.
DESTINATION = "destination"
CHANNEL = "channel"


class Outcome(NamedTuple):
    """What a send came to. Build one with the class methods below.

    Immutable, like every record of the hot path, and a NamedTuple because
    one is made for every message: a frozen dataclass cost four times as much
    to build."""

    # One of states.SEND_OUTCOMES: delivered | retry | failed | suppressed | deferred
    kind: str
    provider_message_id: str | None = None
    error: str | None = None
    delay_seconds: float | None = None
    # What a throttling or quota answer stops besides this message: None (only
    # this message), DESTINATION (every message to the same destination) or
    # CHANNEL (the whole channel). Set by ``throttled`` and ``quota``.
    pause: str | None = None

    @classmethod
    def delivered(cls, provider_message_id: str | None = None) -> Outcome:
        return cls(AttemptOutcome.DELIVERED, provider_message_id=provider_message_id)

    @classmethod
    def retry(cls, error: str, delay_seconds: float | None = None) -> Outcome:
        """A transient failure: counts an attempt, backs off (or waits ``delay_seconds``)."""
        return cls(AttemptOutcome.RETRY, error=error, delay_seconds=delay_seconds)

    @classmethod
    def failed(cls, error: str) -> Outcome:
        """A permanent failure: sending again cannot help."""
        return cls(AttemptOutcome.FAILED, error=error)

    @classmethod
    def suppressed(cls, error: str) -> Outcome:
        """The recipient must not be contacted (opted out, bounced, device gone)."""
        return cls(AttemptOutcome.SUPPRESSED, error=error)

    @classmethod
    def deferred(cls, reason: str, delay_seconds: float = 0.0) -> Outcome:
        """Throttled (or told to come back later): back to pending after the delay,
        without counting an attempt, up to MAX_DEFERRALS times."""
        return cls(AttemptOutcome.DEFERRED, error=reason, delay_seconds=max(0.0, delay_seconds))

    @classmethod
    def throttled(cls, error: str, delay_seconds: float | None = None) -> Outcome:
        """The provider asked the whole destination to slow down (HTTP 429 or
        503, an AWS throttling code): the destination is paused for
        ``delay_seconds`` (None: the relay's own backoff) and its rate cut; this
        message and the destination's others stay pending, no attempt and no
        deferral counted."""
        return cls(
            AttemptOutcome.DEFERRED, error=error, delay_seconds=delay_seconds, pause=DESTINATION
        )

    @classmethod
    def quota(cls, error: str, delay_seconds: float | None = None) -> Outcome:
        """A quota is spent (a daily sending quota, sending paused by the
        provider): the whole channel is paused for ``delay_seconds`` (None: the
        relay's default) and nothing of it is sent meanwhile, no attempt counted."""
        return cls(AttemptOutcome.DEFERRED, error=error, delay_seconds=delay_seconds, pause=CHANNEL)


class Message(NamedTuple):
    """What a channel sees of a claimed row (immutable; a NamedTuple, as Outcome)."""

    id: int
    channel: str
    payload: Any
    attempt: int
    dedupe_key: str | None = None
    ordering_key: str | None = None


class Deadline:
    """A point on the monotonic clock by which a provider call must be over."""

    def __init__(self, seconds_from_now: float) -> None:
        self._end = time.monotonic() + seconds_from_now

    def remaining(self) -> float:
        return max(0.0, self._end - time.monotonic())

    def expired(self) -> bool:
        return self.remaining() <= 0.0


@runtime_checkable
class Channel(Protocol):
    name: str
    schema: Mapping[str, Any]

    def validate(self, payload: Any) -> None:
        """Raise ValidationError naming the field when the payload is unusable."""

    def send(self, message: Message, deadline: Deadline) -> Outcome:
        """Deliver once; classify every provider answer into an Outcome."""


class SchemaChannel:
    """Base class: validation from the class's JSON schema (fastjsonschema)."""

    name: str = ""
    schema: Mapping[str, Any] = {}
    _validator: Callable[[Any], Any] | None = None

    def validate(self, payload: Any) -> None:
        cls = type(self)
        if cls.__dict__.get("_validator") is None:
            import fastjsonschema

            cls._validator = staticmethod(fastjsonschema.compile(dict(self.schema)))
        try:
            cls._validator(payload)  # type: ignore[misc]
        except Exception as exc:  # fastjsonschema.JsonSchemaValueException
            path = str(getattr(exc, "name", "data") or "data")
            field = "payload" + path[4:]  # "data.to[0]" -> "payload.to[0]"
            problem = str(getattr(exc, "message", exc))
            if problem.startswith(path):  # "data.to[0] must match ..." -> "must match ..."
                problem = problem[len(path) :].strip()
            raise ValidationError(field, problem) from None
        self.check(payload)

    def check(self, payload: Any) -> None:
        """Rules a JSON schema cannot say; override to add them."""

    def send(self, message: Message, deadline: Deadline) -> Outcome:  # pragma: no cover
        raise NotImplementedError


ChannelFactory = Callable[[], Channel]

# Built-in channels, by import path so a function imports only its own.
_registry: dict[str, str | ChannelFactory] = {
    "email": "outbox.channels.email:EmailChannel",
    "sms": "outbox.channels.sms:SmsChannel",
    "push": "outbox.channels.push:PushChannel",
    "webhook": "outbox.channels.webhook:WebhookChannel",
    "eventbridge": "outbox.channels.eventbridge:EventBridgeChannel",
    "sqs": "outbox.channels.sqs:SqsChannel",
}
# Their provider ids come from AWS or the relay itself, never free text.
BUILT_IN = frozenset(_registry)
_instances: dict[str, Channel] = {}


def register(name: str, factory: str | ChannelFactory) -> None:
    """Add (or replace) a channel: ``factory`` is a callable or "module:Class"."""
    _registry[name] = factory
    _instances.pop(name, None)


def names() -> list[str]:
    return sorted(_registry)


def missing_piece(channel: Any) -> str | None:
    """What keeps ``channel`` from sending, or None: a ``send`` or ``validate``
    that is missing, or still the base class's unimplemented one."""
    name = getattr(channel, "name", None) or type(channel).__name__
    for method in ("validate", "send"):
        if not callable(getattr(channel, method, None)):
            return f"channel {name!r} has no {method} method"
    if getattr(type(channel), "send", None) is SchemaChannel.send:
        return f"channel {name!r} does not implement send"
    return None


def load(name: str) -> tuple[Channel | None, str | None]:
    """The channel for ``name`` and None, or None and what is missing (not in
    this registry, its module fails to import, or it cannot send)."""
    if name not in _registry:
        return None, f"channel {name!r} is not in this sender's channel registry"
    try:
        channel = get(name)
    except Exception as exc:  # ImportError, AttributeError, a failing constructor
        return None, f"channel {name!r} cannot be loaded: {type(exc).__name__}"
    missing = missing_piece(channel)
    return (None, missing) if missing else (channel, None)


def get(name: str) -> Channel:
    """The channel instance for ``name``; ValidationError for an unknown name."""
    channel = _instances.get(name)
    if channel is not None:
        return channel
    factory = _registry.get(name) if isinstance(name, str) else None
    if factory is None:
        raise ValidationError("channel", f"unknown channel {name!r}; known: {', '.join(names())}")
    if isinstance(factory, str):
        module_name, _, attr = factory.partition(":")
        factory = getattr(importlib.import_module(module_name), attr)
    channel = factory()
    _instances[name] = channel
    return channel
