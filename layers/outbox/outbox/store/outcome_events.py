"""Outcome events: the transitions applications react to, published at
least once with a stable id."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from ._sql import array_literal, json_document, statement

__all__ = [
    "OutcomeEvent",
    "drop_outcome_events",
    "finish_outcome_events",
    "outcome_event_backlog",
    "set_delivered_outcome_events",
    "set_retrying_outcome_events",
    "take_outcome_events",
]

# A trigger (migration 0007) writes one outbox_outcome_event row per transition
# in the transition's own statement. The publisher takes due rows under a lease
# (SKIP LOCKED, so publishers never share a row), puts them on EventBridge, and
# deletes what was published. A publisher that dies between PutEvents and the
# delete leaves its rows leased: they are published again, with the same event
# id, once the lease ends (at least once).

_DELIVERED_EVENT_TRIGGER = "outbox_message_delivered_event"
_RETRYING_EVENT_TRIGGER = "outbox_message_retrying_event"  # on the live rows (0020)


@dataclass(frozen=True)
class OutcomeEvent:
    id: int
    message_id: int
    channel: str
    status: str
    attempts: int
    last_error: str | None
    provider_message_id: str | None
    dedupe_key: str | None
    ordering_key: str | None
    occurred_at: Any  # datetime, from the database clock
    retry_at: Any = None  # a ``retrying`` event's next try (datetime)
    tenant: str | None = None  # the message's tenant (None: none)


_TAKE_OUTCOME_EVENTS = statement(
    """
    WITH due AS (
        SELECT id FROM outbox_outcome_event
        WHERE publish_after <= now()
        ORDER BY publish_after, id
        LIMIT :batch_size
        FOR UPDATE SKIP LOCKED
    )
    UPDATE outbox_outcome_event AS e
    SET publish_after = now() + make_interval(secs => :lease_seconds),
        publish_attempts = e.publish_attempts + 1
    FROM due
    WHERE e.id = due.id
    RETURNING e.id, e.message_id, e.channel, e.status, e.attempts, e.last_error,
              e.provider_message_id, e.dedupe_key, e.ordering_key, e.occurred_at,
              e.retry_at, NULLIF(e.tenant, '') AS tenant
    """
)


def take_outcome_events(
    conn: sa.Connection, batch_size: int, lease_seconds: float
) -> list[OutcomeEvent]:
    """Lease up to ``batch_size`` due events to this publisher, oldest first.

    No cursor: every row not yet deleted is found, whatever order the
    transactions that wrote them committed in."""
    rows = conn.execute(
        _TAKE_OUTCOME_EVENTS, {"batch_size": batch_size, "lease_seconds": float(lease_seconds)}
    ).all()
    events = [
        OutcomeEvent(
            id=r.id,
            message_id=r.message_id,
            channel=r.channel,
            status=r.status,
            attempts=r.attempts,
            last_error=r.last_error,
            provider_message_id=r.provider_message_id,
            dedupe_key=r.dedupe_key,
            ordering_key=r.ordering_key,
            occurred_at=r.occurred_at,
            retry_at=r.retry_at,
            tenant=r.tenant,
        )
        for r in rows
    ]
    events.sort(key=lambda e: e.id)
    return events


_FINISH_OUTCOME_EVENTS = statement(
    """
    WITH published AS (
        DELETE FROM outbox_outcome_event WHERE id = ANY(CAST(:published AS bigint[]))
        RETURNING id
    ),
    refused AS (
        -- kept, and tried again when the lease taken with them ends
        UPDATE outbox_outcome_event AS e SET publish_error = f.error
        FROM jsonb_to_recordset(CAST(:failures AS jsonb)) AS f(id bigint, error text)
        WHERE e.id = f.id
        RETURNING e.id
    )
    SELECT (SELECT count(*) FROM published) AS published, (SELECT count(*) FROM refused) AS refused
    """
)


def finish_outcome_events(
    conn: sa.Connection, published: Sequence[int], failures: dict[int, str]
) -> int:
    """Delete the published events and note why the others were refused (they
    stay leased until their lease ends, which is their back-off). Returns how
    many were deleted."""
    if not published and not failures:
        return 0
    row = conn.execute(
        _FINISH_OUTCOME_EVENTS,
        {
            "published": array_literal(published),
            "failures": json_document([{"id": i, "error": e} for i, e in failures.items()]),
        },
    ).one()
    return int(row.published)


_DROP_OUTCOME_EVENTS = statement(
    """
    WITH doomed AS (
        SELECT id FROM outbox_outcome_event
        WHERE occurred_at < now() - make_interval(secs => :older_than_seconds)
        LIMIT :batch_size
        FOR UPDATE SKIP LOCKED
    )
    DELETE FROM outbox_outcome_event AS e USING doomed WHERE e.id = doomed.id
    """
)


def drop_outcome_events(conn: sa.Connection, older_than_seconds: float, batch_size: int) -> int:
    """Delete up to ``batch_size`` unpublished events older than the window
    (when no bus is configured, nothing else ever removes them)."""
    result = conn.execute(
        _DROP_OUTCOME_EVENTS,
        {"older_than_seconds": float(older_than_seconds), "batch_size": batch_size},
    )
    return result.rowcount


_OUTCOME_EVENT_BACKLOG = statement(
    """
    SELECT count(*) AS waiting,
           COALESCE(EXTRACT(EPOCH FROM now() - min(occurred_at)), 0)::float8 AS oldest_age
    FROM outbox_outcome_event
    """
)


def outcome_event_backlog(conn: sa.Connection) -> tuple[int, float]:
    """(events not yet published, age in seconds of the oldest)."""
    row = conn.execute(_OUTCOME_EVENT_BACKLOG).one()
    return int(row.waiting), float(row.oldest_age)


_EVENT_TRIGGER_ENABLED = statement(
    """
    SELECT tgrelid::regclass::text AS table_name, tgenabled <> 'D' AS enabled FROM pg_trigger
    WHERE tgname = :name AND tgrelid = ANY(CAST(:tables AS regclass[]))
    """
)
# Where each switchable event's trigger is: "delivered" on the history since
# 0018 (on the one table before), "retrying" on the live rows.
_SWITCHABLE = {
    _DELIVERED_EVENT_TRIGGER: ("outbox_message_resolved", "outbox_message"),
    _RETRYING_EVENT_TRIGGER: ("outbox_message_live",),
}


def _switch_event_trigger(conn: sa.Connection, trigger: str, enabled: bool) -> bool:
    tables = [
        t
        for t in _SWITCHABLE[trigger]
        if conn.execute(sa.text("SELECT to_regclass(:t) IS NOT NULL"), {"t": t}).scalar_one()
    ]
    current = conn.execute(
        _EVENT_TRIGGER_ENABLED, {"name": trigger, "tables": "{" + ",".join(tables) + "}"}
    ).first()
    if current is None or bool(current.enabled) == enabled:
        return False
    if current.table_name not in _SWITCHABLE[trigger]:
        raise RuntimeError(f"the trigger {trigger} is on {current.table_name!r}")
    action = "ENABLE" if enabled else "DISABLE"  # a closed choice, never input
    conn.execute(statement(f"ALTER TABLE {current.table_name} {action} TRIGGER {trigger}"))
    return True


def set_delivered_outcome_events(conn: sa.Connection, enabled: bool) -> bool:
    """Turn the ``delivered`` outcome event on or off (the trigger that writes
    it); off, a delivery costs nothing extra. Needs the table's owner (the
    migrate function). Returns whether anything changed."""
    return _switch_event_trigger(conn, _DELIVERED_EVENT_TRIGGER, enabled)


def set_retrying_outcome_events(conn: sa.Connection, enabled: bool) -> bool:
    """Turn the ``retrying`` outcome event on or off (a schema before 0020
    has none: nothing changes). As ``set_delivered_outcome_events``."""
    return _switch_event_trigger(conn, _RETRYING_EVENT_TRIGGER, enabled)
