"""The producer API: write messages inside the application's own transaction.

    with engine.begin() as conn:
        conn.execute(orders.insert().values(...))
        outbox.enqueue(conn, "email", {"from": ..., "to": [...], ...}, dedupe_key="order-42")

Everything is validated before anything is written; bad input raises
ValidationError naming the field and leaves the transaction untouched.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal, overload

import sqlalchemy as sa

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

from . import channels, payloads, store, wake
from .errors import DedupeConflict, SchemaMissing, ValidationError
from .payloads import MAX_PAYLOAD_BYTES
from .states import CooldownAction, PredecessorFailure
from .store import Enqueued
from .tenants import check_tenant

MAX_KEY_LENGTH = 255
MAX_DELAY_SECONDS = 365 * 24 * 3600
MAX_TTL_SECONDS = 366 * 24 * 3600
MAX_COOLDOWN_SECONDS = 366 * 24 * 3600  # = the door's bound (migration 0013)
_PRIORITY_RANGE = (-32768, 32767)  # smallint
_MAX_ATTEMPTS_RANGE = (1, 1000)
# A JSON escape of NUL: "\u0000" after an even number of backslashes (an odd
# number would make it the literal text "\u0000", which is fine).
_NUL_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")
_FIELDS = {
    "channel",
    "payload",
    "dedupe_key",
    "ordering_key",
    "priority",
    "delay",
    "max_attempts",
    "expires_at",
    "ttl",
    "on_predecessor_failure",
    "cooldown",
    "cooldown_key",
    "on_cooldown",
    "tenant",
}


def _key(field: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValidationError(field, f"must be a string, got {type(value).__name__}")
    if not value or len(value) > MAX_KEY_LENGTH:
        raise ValidationError(field, f"must be 1 to {MAX_KEY_LENGTH} characters")
    if "\x00" in value:
        raise ValidationError(field, "must not contain NUL characters")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValidationError(field, "must be valid Unicode (no lone surrogates)") from None
    return value


def _int_in(field: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationError(field, f"must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise ValidationError(field, f"must be between {lo} and {hi}, got {value}")
    return value


def _delay_seconds(value: Any) -> float:
    if value is None:
        return 0.0
    return _seconds("delay", value, 0, MAX_DELAY_SECONDS)


def _seconds(field: str, value: Any, lo: float, hi: float) -> float:
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise ValidationError(field, "must be a timedelta or a number of seconds")
    if not math.isfinite(seconds) or not lo <= seconds <= hi:
        raise ValidationError(field, f"must be between {lo:.0f} and {hi:.0f} seconds")
    return seconds


def _deliver_by(expires_at: Any, ttl: Any) -> tuple[str | None, float | None]:
    """(expires_at as ISO 8601 text, ttl in seconds): at most one of them."""
    if expires_at is not None and ttl is not None:
        raise ValidationError("ttl", "give expires_at or ttl, not both")
    if ttl is not None:
        seconds = _seconds("ttl", ttl, 0.0, MAX_TTL_SECONDS)
        if seconds <= 0:
            raise ValidationError("ttl", "must be more than 0 seconds")
        return None, seconds
    if expires_at is None:
        return None, None
    if not isinstance(expires_at, datetime):
        raise ValidationError("expires_at", f"must be a datetime, got {type(expires_at).__name__}")
    if expires_at.tzinfo is None or expires_at.utcoffset() is None:
        # A naive time would be read in the database session's zone: refuse the guess.
        raise ValidationError("expires_at", "must be timezone-aware (e.g. datetime.now(UTC))")
    return expires_at.isoformat(), None


def _on_predecessor_failure(value: Any) -> PredecessorFailure:
    choices = tuple(PredecessorFailure)
    if value not in choices:
        raise ValidationError(
            "on_predecessor_failure",
            f"must be one of {', '.join(repr(str(p)) for p in choices)}, got {value!r}",
        )
    return PredecessorFailure(value)


def _cooldown(
    cooldown: Any, cooldown_key: Any, on_cooldown: Any
) -> tuple[float | None, str | None, CooldownAction]:
    """(window in seconds, key, action): a window and a key together, or neither."""
    choices = tuple(CooldownAction)
    if on_cooldown not in choices:
        raise ValidationError(
            "on_cooldown",
            f"must be one of {', '.join(repr(str(c)) for c in choices)}, got {on_cooldown!r}",
        )
    action = CooldownAction(on_cooldown)
    if cooldown is None and cooldown_key is None:
        if action is not CooldownAction.WAIT:
            raise ValidationError("on_cooldown", "only with cooldown and cooldown_key")
        return None, None, action
    if cooldown is None:
        raise ValidationError("cooldown", "is required with cooldown_key")
    if cooldown_key is None:
        raise ValidationError("cooldown_key", "is required with cooldown")
    seconds = _seconds("cooldown", cooldown, 0.0, MAX_COOLDOWN_SECONDS)
    if seconds <= 0:
        raise ValidationError("cooldown", "must be more than 0 seconds")
    key = _key("cooldown_key", cooldown_key)
    # what the door refuses too: C0 and C1 control characters, DEL
    if key is not None and any(c < " " or "\x7f" <= c <= "\x9f" for c in key):
        raise ValidationError("cooldown_key", "must not contain control characters")
    return seconds, key, action


def _payload_json(channel: channels.Channel, payload: Any) -> str:
    # The shape first: a schema validator and the JSON encoder both recurse.
    payloads.check_shape(payload)
    channel.validate(payload)
    try:
        text = store.payload_json(payload)
    except (TypeError, ValueError) as exc:
        raise ValidationError("payload", f"must be JSON-serialisable: {exc}") from None
    if "\\u0000" in text and _NUL_ESCAPE.search(text):
        # Postgres jsonb cannot store NUL characters.
        raise ValidationError("payload", "must not contain NUL characters")
    try:
        size = payloads.stored_size(payload, text)
    except UnicodeEncodeError:
        raise ValidationError("payload", "must be valid Unicode (no lone surrogates)") from None
    if size > MAX_PAYLOAD_BYTES:
        raise ValidationError("payload", f"is {size} bytes; the limit is {MAX_PAYLOAD_BYTES}")
    return text


def prepare(
    channel: Any,
    payload: Any,
    *,
    dedupe_key: Any = None,
    ordering_key: Any = None,
    priority: Any = 0,
    delay: Any = None,
    max_attempts: Any = None,
    expires_at: Any = None,
    ttl: Any = None,
    on_predecessor_failure: Any = "hold",
    cooldown: Any = None,
    cooldown_key: Any = None,
    on_cooldown: Any = "wait",
    tenant: Any = None,
) -> store.NewMessage:
    """Validate one message; raises ValidationError naming the field."""
    if not isinstance(channel, str):
        raise ValidationError("channel", f"must be a string, got {type(channel).__name__}")
    impl = channels.get(channel)
    deadline, ttl_seconds = _deliver_by(expires_at, ttl)
    cooldown_seconds, key, action = _cooldown(cooldown, cooldown_key, on_cooldown)
    return store.NewMessage(
        channel=channel,
        payload_json=_payload_json(impl, payload),
        dedupe_key=_key("dedupe_key", dedupe_key),
        ordering_key=_key("ordering_key", ordering_key),
        priority=_int_in("priority", priority, *_PRIORITY_RANGE),
        delay_seconds=_delay_seconds(delay),
        max_attempts=None
        if max_attempts is None
        else _int_in("max_attempts", max_attempts, *_MAX_ATTEMPTS_RANGE),
        expires_at=deadline,
        ttl_seconds=ttl_seconds,
        on_predecessor_failure=_on_predecessor_failure(on_predecessor_failure),
        cooldown_seconds=cooldown_seconds,
        cooldown_key=key,
        on_cooldown=action,
        tenant=check_tenant(tenant),
    )


@contextmanager
def _redacted_errors() -> Iterator[None]:
    """The application's engine may show bound parameters in its errors (the
    payloads: phone numbers, one-time codes); an error from ``enqueue`` never
    does, whatever engine the caller built. The exception keeps its type, so
    the caller's retry logic (a lock or serialization failure) still works.

    An undefined table or function means the relay's schema is not there
    (or older than this release): ``SchemaMissing`` says to migrate, without
    the statement's text. Only the error path looks."""
    try:
        yield
    except sa.exc.StatementError as exc:
        from .db import redact
        from .errors import UNDEFINED_OBJECT_SQLSTATES, sqlstate

        if sqlstate(exc) in UNDEFINED_OBJECT_SQLSTATES:
            raise SchemaMissing() from None
        redact(exc)
        raise


def _check_connection(conn: Any) -> sa.Connection:
    """The caller's Connection; an ORM Session gives its own (``session.connection()``:
    the Session's transaction, begun if need be), so the message commits or rolls
    back with the Session's work."""
    if isinstance(conn, sa.Connection):
        return conn
    # Only look for the ORM if the caller loaded it: `import outbox` stays Core-only.
    orm = sys.modules.get("sqlalchemy.orm")
    if orm is not None and isinstance(conn, orm.Session):
        return conn.connection()
    raise ValidationError(
        "conn", "must be a SQLAlchemy Connection (engine.begin() gives one) or an ORM Session"
    )


@overload
def enqueue(
    conn: sa.Connection | Session,
    channel: str,
    payload: Any,
    *,
    dedupe_key: str | None = ...,
    ordering_key: str | None = ...,
    priority: int = ...,
    delay: timedelta | float | None = ...,
    max_attempts: int | None = ...,
    expires_at: datetime | None = ...,
    ttl: timedelta | float | None = ...,
    on_predecessor_failure: str = ...,
    cooldown: timedelta | float | None = ...,
    cooldown_key: str | None = ...,
    on_cooldown: str = ...,
    tenant: str | None = ...,
    return_created: Literal[False] = ...,
) -> int: ...
@overload
def enqueue(
    conn: sa.Connection | Session,
    channel: str,
    payload: Any,
    *,
    dedupe_key: str | None = ...,
    ordering_key: str | None = ...,
    priority: int = ...,
    delay: timedelta | float | None = ...,
    max_attempts: int | None = ...,
    expires_at: datetime | None = ...,
    ttl: timedelta | float | None = ...,
    on_predecessor_failure: str = ...,
    cooldown: timedelta | float | None = ...,
    cooldown_key: str | None = ...,
    on_cooldown: str = ...,
    tenant: str | None = ...,
    return_created: Literal[True],
) -> Enqueued: ...
def enqueue(
    conn: sa.Connection | Session,
    channel: str,
    payload: Any,
    *,
    dedupe_key: str | None = None,
    ordering_key: str | None = None,
    priority: int = 0,
    delay: timedelta | float | None = None,
    max_attempts: int | None = None,
    expires_at: datetime | None = None,
    ttl: timedelta | float | None = None,
    on_predecessor_failure: str = "hold",
    cooldown: timedelta | float | None = None,
    cooldown_key: str | None = None,
    on_cooldown: str = "wait",
    tenant: str | None = None,
    return_created: bool = False,
) -> int | Enqueued:
    """Write one message in the caller's transaction; returns its id.

    A dedupe_key names an event: a repeat for the same channel and recipient
    with the same payload (a replay) returns the existing id and writes
    nothing; with another payload it raises DedupeConflict. The same key for
    another recipient is another message. ``return_created=True`` returns
    ``Enqueued(id, created)`` instead, ``created`` False for a replay.
    Messages sharing an ordering_key are delivered one at a time, in commit
    order (producers of one key take turns: a transaction-scoped lock on the
    key is held from this call to the caller's commit). When an earlier message
    of the key ends failed, dead or expired, this one waits for an operator
    (``on_predecessor_failure="hold"``) or is cancelled (``"cancel"``).
    ``expires_at`` (an aware datetime) or ``ttl`` (from when the message is
    due): not delivered by then, it ends ``expired``; without either, the
    relay's DEFAULT_TTL_SECONDS applies.
    ``cooldown`` (a timedelta or seconds) with ``cooldown_key``: at most one
    message of the channel and key is delivered within the window; a later
    one inside it waits for the window's end (``on_cooldown="wait"``) or ends
    ``suppressed`` (``"suppress"``), decided in the database.
    ``tenant``: the customer the message is for (docs/how-to/tenants.md): its
    dedupe, cooldown and ordering keys are that tenant's own, it may name only
    that tenant's signing secrets, and the claim shares each batch among the
    tenants with due rows. None: no tenant, or the one the producer's database
    role is bound to.
    """
    message = prepare(
        channel,
        payload,
        dedupe_key=dedupe_key,
        ordering_key=ordering_key,
        priority=priority,
        delay=delay,
        max_attempts=max_attempts,
        expires_at=expires_at,
        ttl=ttl,
        on_predecessor_failure=on_predecessor_failure,
        cooldown=cooldown,
        cooldown_key=cooldown_key,
        on_cooldown=on_cooldown,
        tenant=tenant,
    )
    with _redacted_errors():
        connection = _check_connection(conn)
        (result,) = store.insert_messages(connection, [message])
    if result.created:
        wake.arm(connection)  # nudge the dispatcher after the commit, if configured
    return result if return_created else result.id


@overload
def enqueue_many(
    conn: sa.Connection | Session,
    messages: Iterable[Mapping[str, Any]],
    *,
    tenant: str | None = ...,
    return_created: Literal[False] = ...,
) -> list[int]: ...
@overload
def enqueue_many(
    conn: sa.Connection | Session,
    messages: Iterable[Mapping[str, Any]],
    *,
    tenant: str | None = ...,
    return_created: Literal[True],
) -> list[Enqueued]: ...
def enqueue_many(
    conn: sa.Connection | Session,
    messages: Iterable[Mapping[str, Any]],
    *,
    tenant: str | None = None,
    return_created: bool = False,
) -> list[int] | list[Enqueued]:
    """Write many messages in one round trip; ids come back in the same order.

    Each message is a dict with ``enqueue``'s argument names. One bad message
    raises ValidationError (its field prefixed with ``messages[i].``) and none
    is written; so does a DedupeConflict, against the database or within the list.
    ``tenant``: every message's tenant, unless its dict names its own.
    """
    call_tenant = check_tenant(tenant)
    connection = _check_connection(conn)
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Iterable):
        raise ValidationError("messages", "must be a list of dicts")
    prepared = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValidationError(f"messages[{index}]", "must be a dict")
        unknown = set(message) - _FIELDS
        if unknown:
            raise ValidationError(f"messages[{index}].{sorted(unknown)[0]}", "unknown field")
        if "channel" not in message or "payload" not in message:
            missing = "channel" if "channel" not in message else "payload"
            raise ValidationError(f"messages[{index}].{missing}", "is required")
        try:
            if call_tenant is not None and "tenant" not in message:
                message = {**message, "tenant": call_tenant}
            prepared.append(prepare(**message))
        except ValidationError as exc:
            raise ValidationError(f"messages[{index}].{exc.field}", exc.problem) from None
    try:
        with _redacted_errors():
            results = store.insert_messages(connection, prepared)
    except DedupeConflict as exc:
        raise DedupeConflict(
            exc.channel,
            exc.dedupe_key,
            index=exc.index,
            existing_id=exc.existing_id,
            first_index=exc.first_index,
            field=f"messages[{exc.index}].dedupe_key",
        ) from None
    except ValidationError as exc:  # refused by the database's own check
        index = getattr(exc, "index", 0)
        raise ValidationError(f"messages[{index}].{exc.field}", exc.problem) from None
    if any(r.created for r in results):
        wake.arm(connection)  # nudge the dispatcher after the commit, if configured
    return results if return_created else [r.id for r in results]
