"""The dispatcher: claim due rows in bounded batches and hand them off.

One scheduled invocation keeps claiming until its time budget is spent,
polling briefly when the backlog is empty, so a message enqueued while it
runs goes out within about one poll interval. Several dispatchers may run at
once: the claim's SKIP LOCKED compare-and-set keeps them apart.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import sqlalchemy as sa

from . import store
from .config import RelaySettings
from .handoff import HandOff, Invoker, chunk
from .observability import count

log = logging.getLogger(__name__)

# A failed hand-off gives its rows back at once; this delay keeps a broken
# target from turning the loop into a hot spin of claim/release.
HANDOFF_RETRY_DELAY_SECONDS = 5.0
_HANDOFF_THREADS = 8


@dataclass
class DispatchReport:
    claimed: int = 0
    handed_off: int = 0
    released: int = 0
    unroutable: int = 0
    batches: int = 0

    def add(self, other: DispatchReport) -> None:
        for name in ("claimed", "handed_off", "released", "unroutable", "batches"):
            setattr(self, name, getattr(self, name) + getattr(other, name))


def backoff_of(settings: RelaySettings) -> store.Backoff:
    """The retry policy the settings describe."""
    return store.Backoff(
        settings.backoff_base_seconds,
        settings.backoff_cap_seconds,
        settings.max_attempts,
        max_deferrals=settings.max_deferrals,
        min_deferral_seconds=settings.min_deferral_seconds,
        default_ttl_seconds=settings.default_ttl_seconds or None,
    )


def dispatch_once(
    engine: sa.Engine,
    invoker: Invoker,
    settings: RelaySettings,
    channels: Sequence[str] | None = None,
) -> DispatchReport:
    """One claim and its hand-offs."""
    report = DispatchReport(batches=1)
    with engine.begin() as conn:
        claims = store.claim(
            conn,
            settings.batch_size,
            settings.lease_seconds,
            channels,
            default_ttl_seconds=settings.default_ttl_seconds or None,
        )
    report.claimed = len(claims)
    if not claims:
        return report
    count_by_channel("Claimed", claims)

    routable = [c for c in claims if invoker.can_route(c.channel)]
    unroutable = [c for c in claims if not invoker.can_route(c.channel)]
    if unroutable:
        # Bad data in one row fails that row, not the batch (invariant 6).
        with engine.begin() as conn:
            settled = store.settle(
                conn,
                [
                    store.Settlement(
                        c.id,
                        c.claim_token,
                        "failed",
                        error=unroutable_reason(invoker, c.channel),
                    )
                    for c in unroutable
                ],
                backoff_of(settings),
            )
        report.unroutable = len(settled)
        count_by_channel("Failed", [c for c in unroutable if c.id in settled])
        log.error(
            "claimed rows of unroutable channels failed",
            extra={
                "message_ids": sorted(settled),
                "channels": sorted({c.channel for c in unroutable}),
            },
        )

    handoffs = chunk(routable, settings.handoff_chunk_size)
    failed = _hand_off_all(invoker, handoffs)
    report.handed_off = sum(len(h.claims) for h in handoffs) - sum(len(h.claims) for h in failed)
    failed_ids = {c.id for h in failed for c in h.claims}
    count_by_channel("HandedOff", [c for c in routable if c.id not in failed_ids])
    if failed:
        with engine.begin() as conn:
            released = store.release(
                conn,
                [(c.id, c.claim_token) for h in failed for c in h.claims],
                reason="hand-off to the channel function failed",
                delay_seconds=HANDOFF_RETRY_DELAY_SECONDS,
            )
        report.released = len(released)
        count_by_channel("HandOffFailed", [c for h in failed for c in h.claims if c.id in released])
    return report


def count_by_channel(name: str, claims: Iterable[store.Claim]) -> None:
    for channel, n in Counter(c.channel for c in claims).items():
        count(name, n, channel=channel)


def unroutable_reason(invoker: Invoker, channel: str) -> str:
    """What is missing for ``channel``, in the invoker's words when it has them."""
    explain = getattr(invoker, "missing_route", None)
    if callable(explain):
        return str(explain(channel))
    return f"no function is configured for channel {channel!r}"


def _hand_off_all(invoker: Invoker, handoffs: list[HandOff]) -> list[HandOff]:
    """Invoke every hand-off (concurrently when there are several); return the failed ones."""

    def attempt(handoff: HandOff) -> HandOff | None:
        try:
            invoker.hand_off(handoff)
            return None
        except Exception as exc:
            log.error(
                "hand-off failed; releasing its claims",
                extra={
                    "channel": handoff.channel,
                    "message_ids": [c.id for c in handoff.claims],
                    "error": type(exc).__name__,
                },
            )
            return handoff

    if len(handoffs) <= 1:
        results = [attempt(h) for h in handoffs]
    else:
        with ThreadPoolExecutor(max_workers=min(_HANDOFF_THREADS, len(handoffs))) as pool:
            results = list(pool.map(attempt, handoffs))
    return [h for h in results if h is not None]


def run(
    engine: sa.Engine,
    invoker: Invoker,
    settings: RelaySettings,
    time_left: Callable[[], float],
    *,
    channels: Sequence[str] | None = None,
    until_empty: bool = False,
    sleep: Callable[[float], None] = time.sleep,
) -> DispatchReport:
    """Claim and hand off until the budget is spent (or, with until_empty, the backlog is).

    ``time_left()`` gives the seconds this run may still use.
    """
    total = DispatchReport()
    margin = settings.poll_interval_seconds
    while True:  # at least one pass, even with no budget to spare
        report = dispatch_once(engine, invoker, settings, channels)
        total.add(report)
        if time_left() <= margin or (until_empty and report.claimed == 0):
            return total
        if report.claimed < settings.batch_size:  # caught up: poll briefly
            sleep(min(settings.poll_interval_seconds, max(0.0, time_left() - margin)))
