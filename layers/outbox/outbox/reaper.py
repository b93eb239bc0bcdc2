"""The reaper: the one recovery path (docs/design.md, invariant 5).

Each scheduled run releases claims whose lease expired (the attempt counts;
a row out of attempts goes to ``dead``), prunes terminal rows past the
retention window in bounded batches, and publishes backlog metrics.

Rows that ended without reaching their recipient (``failed``, ``dead``,
``expired``) are not routine history: they wait for an operator, and the
dead-messages alarm with them. They are pruned only after their own
retention (``UNRESOLVED_RETENTION_DAYS``), never by default.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import sqlalchemy as sa

from . import store
from .config import RelaySettings
from .dispatcher import backoff_of
from .observability import count, gauge

log = logging.getLogger(__name__)

PRUNE_BATCH_SIZE = 5000
UNRESOLVED_STATUSES = frozenset({"failed", "dead", "expired"})
_MIN_TIME_FOR_A_BATCH = 2.0


@dataclass
class ReapReport:
    reclaimed: int = 0
    dead: int = 0
    pruned: int = 0
    backlog: store.Backlog | None = None


def run(engine: sa.Engine, settings: RelaySettings, time_left: Callable[[], float]) -> ReapReport:
    report = ReapReport()
    backoff = backoff_of(settings)
    while time_left() > _MIN_TIME_FOR_A_BATCH:
        with engine.begin() as conn:
            released = store.reap_expired(conn, settings.batch_size, backoff)
        dead = [i for i, status in released.items() if status == "dead"]
        report.dead += len(dead)
        report.reclaimed += len(released) - len(dead)
        if released:
            log.warning(
                "expired claims released",
                extra={"message_ids": sorted(released), "dead_ids": sorted(dead)},
            )
        if len(released) < settings.batch_size:
            break
    count("Reclaimed", report.reclaimed)
    count("Dead", report.dead)

    routine = [s for s in store.TERMINAL_STATUSES if s not in UNRESOLVED_STATUSES]
    unresolved = [s for s in store.TERMINAL_STATUSES if s in UNRESOLVED_STATUSES]
    report.pruned += _prune(engine, routine, settings.retention_days, time_left)
    if settings.unresolved_retention_days is not None:
        report.pruned += _prune(engine, unresolved, settings.unresolved_retention_days, time_left)
    count("Pruned", report.pruned)

    with engine.begin() as conn:
        report.backlog = store.backlog(conn)
    b = report.backlog
    # Gauges go out even at zero, so alarms see data rather than "missing".
    gauge("PendingMessages", b.pending)
    gauge("DeadMessages", b.dead)
    gauge("ExpiredClaims", b.expired_claims)
    gauge("OldestPendingAgeSeconds", b.oldest_due_age_seconds, seconds=True)
    log.info(
        "reaper run",
        extra={
            "reclaimed": report.reclaimed,
            "dead": report.dead,
            "pruned": report.pruned,
            "pending": b.pending,
            "oldest_due_age_seconds": round(b.oldest_due_age_seconds, 3),
            "dead_total": b.dead,
        },
    )
    return report


def _prune(
    engine: sa.Engine, statuses: list[str], days: int, time_left: Callable[[], float]
) -> int:
    pruned_total = 0
    while statuses and time_left() > _MIN_TIME_FOR_A_BATCH:
        with engine.begin() as conn:
            pruned = store.prune(conn, days * 86400, PRUNE_BATCH_SIZE, statuses)
        pruned_total += pruned
        if pruned < PRUNE_BATCH_SIZE:
            break
    return pruned_total
