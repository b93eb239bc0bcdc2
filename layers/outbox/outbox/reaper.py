"""The reaper: the one recovery path (invariant 5).

Each scheduled run releases claims whose lease expired (the attempt counts;
a row out of attempts goes to ``dead``), prunes terminal rows past the
retention window in bounded batches, and publishes backlog metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import sqlalchemy as sa

from . import store
from .config import RelaySettings
from .dispatcher import backoff_of
from .observability import count, gauge

log = logging.getLogger(__name__)

PRUNE_BATCH_SIZE = 5000
_MIN_TIME_FOR_A_BATCH = 2.0


@dataclass
class ReapReport:
    reclaimed: int = 0
    dead: int = 0
    pruned: int = 0
    backlog: store.Backlog | None = None
    channels: list[store.ChannelBacklog] = field(default_factory=list)


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

    while time_left() > _MIN_TIME_FOR_A_BATCH:
        with engine.begin() as conn:
            pruned = store.prune(conn, settings.retention_days * 86400, PRUNE_BATCH_SIZE)
        report.pruned += pruned
        if pruned < PRUNE_BATCH_SIZE:
            break
    count("Pruned", report.pruned)

    with engine.begin() as conn:
        report.backlog = store.backlog(conn)
    b = report.backlog
    # Gauges go out even at zero, so alarms see data rather than "missing".
    gauge("PendingMessages", b.pending)
    gauge("DeadMessages", b.dead)
    gauge("ExpiredClaims", b.expired_claims)
    gauge("OldestPendingAgeSeconds", b.oldest_due_age_seconds, seconds=True)
    with engine.begin() as conn:
        report.channels = store.channel_backlog(conn)
    gauge("PausedChannels", sum(c.paused for c in report.channels))
    for c in report.channels:
        gauge("PendingMessages", c.pending, channel=c.channel)
        gauge("OldestPendingAgeSeconds", c.oldest_due_age_seconds, seconds=True, channel=c.channel)
        gauge("ExpiredClaims", c.expired_claims, channel=c.channel)
        gauge("DeadMessages", c.dead, channel=c.channel)
        gauge("Paused", int(c.paused), channel=c.channel)
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
