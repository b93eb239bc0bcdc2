"""The reaper: the one recovery path (docs/design.md, invariant 5).

Each scheduled run releases claims whose lease expired (after a sender's
receipt the attempt counts, and a row out of attempts goes to ``dead``; with
no receipt no sender ever started it, so none is counted and the row is due
again at once: ``LeaseExpiredNotStarted``, alarmed), expires pending rows past
their deliver-by time, cancels rows held behind a failed row of their ordering
key whose producer asked for that, prunes terminal rows past the retention
window, attempt rows past theirs (the send log outlives its messages) and
dedupe keys past the dedupe window, publishes the outcome events waiting
(``outcomes.py``; a bus that fails only delays them), and publishes backlog
metrics. Every step works in bounded batches.

Rows that ended without reaching their recipient (``failed``, ``dead``,
``expired``) are not routine history: they wait for an operator, and the
dead-messages alarm with them (and they hold their ordering key's later rows).
They are pruned only after their own retention (``UNRESOLVED_RETENTION_DAYS``),
never by default.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from . import outcomes, store
from .observability import count, gauge
from .relay_settings import OutcomeEventSettings, RelaySettings
from .states import TERMINAL_STATUSES, UNRESOLVED_STATUSES, Status

log = logging.getLogger(__name__)

PRUNE_BATCH_SIZE = 5000
_MIN_TIME_FOR_A_BATCH = 2.0


@dataclass
class ReapReport:
    reclaimed: int = 0  # back to pending: attempt counted
    not_started: int = 0  # back to pending: no receipt, no attempt counted
    dead: int = 0
    expired: int = 0  # past their deliver-by time (leases and pending rows)
    cancelled: int = 0  # held rows cancelled as their producer asked
    pruned: int = 0
    pruned_attempts: int = 0
    released_dedupe_keys: int = 0
    released_cooldowns: int = 0
    forgotten_destinations: int = 0
    history_partitions_made: int = 0
    events_published: int = 0
    events_refused: int = 0
    events_dropped: int = 0
    events_waiting: int = 0
    backlog: store.Backlog | None = None
    channels: list[store.ChannelBacklog] = field(default_factory=list)
    # The busiest tenants' due rows, the others as one (store.tenant_backlog).
    tenants: list[store.TenantBacklog] = field(default_factory=list)
    oldest_snapshot: store.OldestSnapshot | None = None


def _make_history_partitions(engine: sa.Engine) -> int:
    """Today's and the next days' history partitions, made before they are
    needed. Failing costs nothing lost (settles of a day without its partition
    land in the default one, moved into the day once it is made): logged and
    counted, and the run goes on."""
    try:
        with engine.begin() as conn:
            return store.make_history_partitions(conn)
    except sa.exc.DBAPIError:
        log.warning("the history partitions could not be made", exc_info=True)
        count("HistoryPartitionsFailed")
        return 0


def _oldest_snapshot(engine: sa.Engine) -> store.OldestSnapshot | None:
    """The oldest snapshot holding back vacuum (a long transaction elsewhere
    slows the claim many times over). A database that refuses the statistics
    views costs this figure, never the run."""
    try:
        with engine.begin() as conn:
            return store.oldest_snapshot(conn)
    except sa.exc.DBAPIError:
        log.warning("the oldest snapshot could not be read", exc_info=True)
        return None


def _prune(
    engine: sa.Engine,
    prune: Callable[[sa.Connection, float, int], int],
    days: int,
    time_left: Callable[[], float],
) -> int:
    """Bounded batches, each its own short transaction, until done or out of time."""
    total = 0
    while time_left() > _MIN_TIME_FOR_A_BATCH:
        with engine.begin() as conn:
            deleted = prune(conn, days * 86400, PRUNE_BATCH_SIZE)
        total += deleted
        if deleted < PRUNE_BATCH_SIZE:
            break
    return total


def run(
    engine: sa.Engine,
    settings: RelaySettings,
    time_left: Callable[[], float],
    outcome_events: OutcomeEventSettings | None = None,
    events_client: Callable[[], Any] | None = None,
    *,
    quiet_when_idle: bool = False,
) -> ReapReport:
    """``events_client`` makes the EventBridge client, on first need.
    ``quiet_when_idle`` (sleep mode): publish only the backlog levels that are
    not zero."""
    report = ReapReport()
    outcome_events = outcome_events or OutcomeEventSettings()
    release_expired_leases(engine, settings, time_left, report)

    expire_overdue_rows(engine, settings, time_left, report)

    while time_left() > _MIN_TIME_FOR_A_BATCH:
        with engine.begin() as conn:
            cancelled = store.cancel_held(conn, settings.batch_size)
        report.cancelled += len(cancelled)
        if cancelled:
            log.warning(
                "held messages cancelled (on_predecessor_failure=cancel)",
                extra={"message_ids": sorted(cancelled)},
            )
        if len(cancelled) < settings.batch_size:
            break

    count_released(report)
    count("HeldCancelled", report.cancelled)

    if outcome_events.bus and events_client is not None:
        published = outcomes.publish(engine, events_client(), outcome_events, time_left)
        report.events_published, report.events_refused = published.published, published.refused
    count("OutcomeEventsPublished", report.events_published)
    count("OutcomeEventsRefused", report.events_refused)

    report.history_partitions_made = _make_history_partitions(engine)
    routine = [s for s in TERMINAL_STATUSES if s not in UNRESOLVED_STATUSES]
    unresolved = list(UNRESOLVED_STATUSES)
    report.pruned += _prune_messages(engine, routine, settings.retention_days, time_left)
    if settings.unresolved_retention_days is not None:
        report.pruned += _prune_messages(
            engine, unresolved, settings.unresolved_retention_days, time_left
        )
    count("Pruned", report.pruned)
    report.pruned_attempts = _prune(
        engine, store.prune_attempts, settings.attempt_retention_days, time_left
    )
    count("PrunedAttempts", report.pruned_attempts)
    report.released_dedupe_keys = _prune(
        engine, store.prune_dedupe_keys, settings.dedupe_window_days, time_left
    )
    count("ReleasedDedupeKeys", report.released_dedupe_keys)
    # Cooldown rows that hold nothing any more (a window ended, a holder that
    # ended undelivered): kept exactly as long as they hold something.
    report.released_cooldowns = _prune(
        engine, lambda conn, _seconds, batch: store.prune_cooldowns(conn, batch), 0, time_left
    )
    # Destinations that throttled long ago and hold no limit: what was
    # learned of them paces nothing any more (store.FORGET_AFTER_SECONDS).
    report.forgotten_destinations = _prune(
        engine,
        lambda conn, _seconds, batch: store.forget_idle_destinations(conn, batch),
        0,
        time_left,
    )
    if not outcome_events.bus:
        # Publishing is off: nothing else removes the events the trigger writes.
        with engine.begin() as conn:
            report.events_dropped = store.drop_outcome_events(
                conn, settings.retention_days * 86400, PRUNE_BATCH_SIZE
            )

    with engine.begin() as conn:
        report.backlog = store.backlog(conn)
        report.events_waiting, oldest_event_age = store.outcome_event_backlog(conn)
    b = report.backlog

    def level(
        name: str,
        value: float,
        *,
        seconds: bool = False,
        channel: str | None = None,
        tenant: str | None = None,
    ) -> None:
        # Polling, gauges go out even at zero, so alarms see data rather than
        # "missing". Sleeping, only a level that is not zero goes out: a
        # custom metric costs by the hour it has data, and an idle stack's
        # alarms read missing data as not breaching (docs/how-to/pacing.md).
        if value or not quiet_when_idle:
            gauge(name, value, seconds=seconds, channel=channel, tenant=tenant)

    level("PendingMessages", b.pending)
    level("DeadMessages", b.dead)
    level("ExpiredClaims", b.expired_claims)
    level("HeldMessages", b.held)
    level("OldestPendingAgeSeconds", b.oldest_due_age_seconds, seconds=True)
    level("UnpublishedOutcomeEvents", report.events_waiting)
    level("OldestUnpublishedOutcomeEventAgeSeconds", oldest_event_age, seconds=True)
    report.oldest_snapshot = _oldest_snapshot(engine)
    if report.oldest_snapshot is not None:
        level("OldestSnapshotAgeSeconds", report.oldest_snapshot.age_seconds, seconds=True)
        level("OldestSnapshotXidAge", report.oldest_snapshot.xid_age)
    with engine.begin() as conn:
        report.channels = store.channel_backlog(conn)
    level("PausedChannels", sum(c.paused for c in report.channels))
    for c in report.channels:
        level("PendingMessages", c.pending, channel=c.channel)
        level("OldestPendingAgeSeconds", c.oldest_due_age_seconds, seconds=True, channel=c.channel)
        level("ExpiredClaims", c.expired_claims, channel=c.channel)
        level("DeadMessages", c.dead, channel=c.channel)
        level("Paused", int(c.paused), channel=c.channel)
    # The busiest tenants' backlogs by name, the rest as one series (a
    # bounded number, whatever the number of customers): which customer waits.
    with engine.begin() as conn:
        report.tenants = store.tenant_backlog(conn)
    for t in report.tenants:
        level("PendingMessages", t.due, tenant=t.tenant)
        level("OldestPendingAgeSeconds", t.oldest_due_age_seconds, seconds=True, tenant=t.tenant)
    log.info(
        "reaper run",
        extra={
            "reclaimed": report.reclaimed,
            "not_started": report.not_started,
            "dead": report.dead,
            "expired": report.expired,
            "cancelled": report.cancelled,
            "held": b.held,
            "pruned": report.pruned,
            "pruned_attempts": report.pruned_attempts,
            "released_dedupe_keys": report.released_dedupe_keys,
            "outcome_events_published": report.events_published,
            "outcome_events_refused": report.events_refused,
            "outcome_events_dropped": report.events_dropped,
            "outcome_events_waiting": report.events_waiting,
            "pending": b.pending,
            "oldest_due_age_seconds": round(b.oldest_due_age_seconds, 3),
            "dead_total": b.dead,
            "oldest_snapshot": None
            if report.oldest_snapshot is None
            else {
                "age_seconds": round(report.oldest_snapshot.age_seconds, 3),
                "xid_age": report.oldest_snapshot.xid_age,
                "hidden_sessions": report.oldest_snapshot.hidden_sessions,
            },
        },
    )
    return report


def release_expired_leases(
    engine: sa.Engine,
    settings: RelaySettings,
    time_left: Callable[[], float],
    report: ReapReport,
) -> ReapReport:
    """The reaping step proper: release the claims whose lease ran out, in
    bounded batches, into ``report``. The reaper runs it, and in sleep mode
    so does every dispatcher run (woken at the next lease expiry), so a lost
    hand-off is recovered at its lease's end, not at the reaper's next run."""
    backoff = settings.backoff()
    while time_left() > _MIN_TIME_FOR_A_BATCH:
        with engine.begin() as conn:
            released = store.reap_expired(conn, settings.batch_size, backoff)
        by_status: dict[str, list[int]] = {}
        for message_id, r in released.items():
            key = r.status if r.status != "pending" else "reclaimed" if r.started else "not_started"
            by_status.setdefault(key, []).append(message_id)
        report.dead += len(by_status.get("dead", ()))
        report.expired += len(by_status.get("expired", ()))
        report.reclaimed += len(by_status.get("reclaimed", ()))
        report.not_started += len(by_status.get("not_started", ()))
        if released:
            log.warning("expired claims released", extra={"message_ids": _sorted_ids(by_status)})
        if len(released) < settings.batch_size:
            break
    return report


def expire_overdue_rows(
    engine: sa.Engine,
    settings: RelaySettings,
    time_left: Callable[[], float],
    report: ReapReport,
) -> ReapReport:
    """Pending rows past their deliver-by time end ``expired``, in bounded
    batches, into ``report``. The reaper runs it, and in sleep mode so does
    every dispatcher run (it may be woken at a deliver-by time)."""
    backoff = settings.backoff()
    while time_left() > _MIN_TIME_FOR_A_BATCH:
        with engine.begin() as conn:
            expired = store.expire_overdue(conn, settings.batch_size, backoff)
        report.expired += len(expired)
        if expired:
            log.warning(
                "messages past their deliver-by time expired",
                extra={"message_ids": sorted(expired)},
            )
        if len(expired) < settings.batch_size:
            break
    return report


def count_released(report: ReapReport) -> None:
    count("Reclaimed", report.reclaimed)
    # Leases that ended before any sender started them: the channel's
    # senders cannot keep up (or crash at start). Alarmed in the template.
    count("LeaseExpiredNotStarted", report.not_started)
    count("Dead", report.dead)
    count("Expired", report.expired)


def _sorted_ids(by_status: dict[str, list[int]]) -> dict[str, list[int]]:
    return {status: sorted(ids) for status, ids in sorted(by_status.items())}


def _prune_messages(
    engine: sa.Engine, statuses: Sequence[Status], days: int, time_left: Callable[[], float]
) -> int:
    if not statuses:
        return 0
    return _prune(
        engine,
        lambda conn, seconds, batch: store.prune(conn, seconds, batch, statuses),
        days,
        time_left,
    )
