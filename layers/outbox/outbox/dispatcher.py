"""The dispatcher: claim due rows in bounded batches and hand them off.

One invocation keeps claiming until its time budget is spent, polling briefly
when the backlog is empty, so a message enqueued while it runs goes out
within about one poll interval. In sleep mode (``PACING_MODE``, the default)
it also ends once nothing was due for ``IDLE_LINGER_SECONDS``: the linger
covers a nudge that arrives before its producer's row is visible, and a run
that keeps finding work keeps its whole budget. What the run arranges before
it ends (its successor, the wake schedule) is ``outbox.pacing``'s part.
Several dispatchers may run at once: the claim's SKIP LOCKED compare-and-set
keeps them apart.

A channel with an in-flight budget (RelaySettings.in_flight_budgets) is never
given more claimed rows than its function can start within the lease: a row
claimed beyond that would only wait in Lambda's queue until it was dropped
for age. Each pass first counts the claimed rows per budgeted channel and
lists the channels with pending rows (one small statement, served by the
indexes of claimed rows and of pending rows by channel), then claims for the
channels with room for a whole batch, leaving out the others and those Lambda
just throttled. Dispatchers running at once each see the same room, so with N
of them a channel may go over its budget by up to N - 1 batches. A run whose
channel sat out for want of room looks again after ROOM_POLL_SECONDS, not
the idle poll.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import sqlalchemy as sa

from . import store
from .handoff import HandOff, HandOffThrottled, Invoker, chunk
from .observability import count
from .relay_settings import RelaySettings

log = logging.getLogger(__name__)

# A failed hand-off gives its rows back at once; this delay keeps a broken
# target from turning the loop into a hot spin of claim/release.
HANDOFF_RETRY_DELAY_SECONDS = 5.0
# Lambda throttled the invoke: the function is busy, not broken. Its rows come
# back soon, and the channel is left out of the claims for as long.
THROTTLE_RETRY_DELAY_SECONDS = 1.0
# A channel at its in-flight budget with rows due gets room back at its
# senders' rate (a few rows every few milliseconds): the run looks again this
# soon rather than after the idle poll, which left environments without an
# event. A pass that finds no room is one small statement.
ROOM_POLL_SECONDS = 0.02
HANDOFF_FAILED = "hand-off to the channel function failed"
HANDOFF_THROTTLED = "hand-off throttled by Lambda (TooManyRequestsException)"
_HANDOFF_THREADS = 8


@dataclass
class DispatchReport:
    claimed: int = 0
    handed_off: int = 0
    released: int = 0
    unroutable: int = 0
    batches: int = 0
    throttled: int = 0
    # Whether the claim took all it asked for (more may be due at once).
    full: bool = False
    # A channel with rows due sat the pass out for want of room in its budget.
    waiting_for_room: bool = False
    # How the run ended (run() only): "idle" after the linger with nothing
    # due, "budget" when its time was spent.
    ended: str = ""
    # The run's time ran out while it was still finding work: a successor
    # should start at once rather than wait for a schedule.
    work_left: bool = False

    def add(self, other: DispatchReport) -> None:
        for name in ("claimed", "handed_off", "released", "unroutable", "batches", "throttled"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.full = other.full
        self.waiting_for_room = other.waiting_for_room


@dataclass(frozen=True)
class ClaimPlan:
    """What one pass claims: how many rows (0: none), and of which channels
    (None: all); and whether a channel with rows pending sits it out for want
    of room in its budget."""

    batch_size: int
    channels: Sequence[str] | None
    waiting_for_room: bool = False


def plan_claim(
    conn: sa.Connection,
    settings: RelaySettings,
    channels: Sequence[str] | None,
    cooling: Collection[str] = (),
) -> ClaimPlan:
    """The claim of one pass under the channels' in-flight budgets (a batch
    size of 0 when there is nothing this pass may claim).

    A budgeted channel takes part only with room for a whole quantum of rows
    (the batch size, or the smallest budget in scope when that is smaller, in
    whole events),
    and the claim asks for no more than the least room among the channels
    taking part: so no channel ever goes over its budget, and a channel with
    little room left sits the pass out rather than shrinking everyone's
    batch. When a channel sits out (or rests after a throttle), the claim
    names the channels that have pending rows and may take them, so that a
    full channel's backlog neither holds up the others nor has to be walked
    past (the per-channel index of migration 0008 serves both)."""
    budgets = settings.in_flight_budgets()
    budgeted = [c for c in budgets if channels is None or c in channels]
    if not budgeted and not cooling:
        return ClaimPlan(whole_events(settings.batch_size, settings.handoff_chunk_size), channels)
    load = store.channel_load(conn, budgeted)
    taking_part = [c for c in budgeted if c not in cooling]
    room = {c: budgets[c] - load.claimed.get(c, 0) for c in taking_part}
    quantum = whole_events(
        min([settings.batch_size, *(budgets[c] for c in taking_part)]), settings.handoff_chunk_size
    )
    full = {c for c in taking_part if room[c] < quantum}
    left_out = set(cooling) | full
    waiting_for_room = any(c in full for c in load.pending_channels)
    batch = min([settings.batch_size, *(room[c] for c in taking_part if c not in left_out)])
    wanted = [
        c
        for c in load.pending_channels
        if c not in left_out and (channels is None or c in channels)
    ]
    if not wanted:  # nothing pending, or only for channels sitting out
        return ClaimPlan(0, channels, waiting_for_room)
    return ClaimPlan(
        whole_events(batch, settings.handoff_chunk_size),
        channels if not left_out else wanted,
        waiting_for_room,
    )


def whole_events(batch_size: int, chunk_size: int) -> int:
    """``batch_size`` rounded down to whole hand-off events, when it holds at
    least one. A part-filled event costs an execution environment a wave of
    calls (and its receipt and settle) for a few rows while its other send
    threads idle: BATCH_SIZE 100 in events of 32 ended every pass with an
    event of 4, and the drain read 0.87 of its ideal (0.90 with whole events;
    bench/README.md). The rows left over are claimed by the next pass, and a
    backlog's last rows still go in a part-filled event."""
    if batch_size < chunk_size:
        return batch_size
    return batch_size - batch_size % chunk_size


def dispatch_once(
    engine: sa.Engine,
    invoker: Invoker,
    settings: RelaySettings,
    channels: Sequence[str] | None = None,
    cooling: dict[str, float] | None = None,
) -> DispatchReport:
    """One claim and its hand-offs.

    ``cooling`` maps channels Lambda throttled to the monotonic time until
    which they are left out; a throttle in this pass adds to it."""
    cooling = {} if cooling is None else cooling
    now = time.monotonic()
    for channel in [c for c, until in cooling.items() if until <= now]:
        del cooling[channel]
    report = DispatchReport(batches=1)
    with engine.begin() as conn:
        plan = plan_claim(conn, settings, channels, list(cooling))
        report.waiting_for_room = plan.waiting_for_room
        if plan.batch_size == 0:
            return report
        claims = store.claim(
            conn,
            plan.batch_size,
            settings.lease_seconds,
            plan.channels,
            default_ttl_seconds=settings.default_ttl_seconds or None,
        )
    report.claimed = len(claims)
    report.full = len(claims) >= plan.batch_size
    if not claims:
        return report
    count_by_channel("Claimed", claims)

    routes = {channel: invoker.can_route(channel) for channel in {c.channel for c in claims}}
    routable = [c for c in claims if routes[c.channel]]
    unroutable = [c for c in claims if not routes[c.channel]]
    if unroutable:
        # Bad data in one row fails that row, not the batch (docs/design.md, invariant 6).
        with engine.begin() as conn:
            settled = store.settle(
                conn,
                [
                    store.Settlement(
                        c.id,
                        c.claim_token,
                        "failed",
                        error=invoker.missing_route(c.channel),
                    )
                    for c in unroutable
                ],
                settings.backoff(),
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
    failed, throttled = _hand_off_all(invoker, handoffs)
    report.handed_off = sum(len(h.claims) for h in handoffs) - sum(
        len(h.claims) for h in (*failed, *throttled)
    )
    returned_ids = {c.id for h in (*failed, *throttled) for c in h.claims}
    count_by_channel("HandedOff", [c for c in routable if c.id not in returned_ids])
    for channel in {h.channel for h in throttled}:
        cooling[channel] = time.monotonic() + THROTTLE_RETRY_DELAY_SECONDS
    for returned, reason, delay, metric in (
        (failed, HANDOFF_FAILED, HANDOFF_RETRY_DELAY_SECONDS, "HandOffFailed"),
        (throttled, HANDOFF_THROTTLED, THROTTLE_RETRY_DELAY_SECONDS, "HandOffThrottled"),
    ):
        if not returned:
            continue
        with engine.begin() as conn:
            released = store.release(
                conn,
                [c for h in returned for c in h.claims],
                reason=reason,
                delay_seconds=delay,
            )
        report.released += len(released)
        if returned is throttled:
            report.throttled = len(released)
        count_by_channel(metric, [c for h in returned for c in h.claims if c.id in released])
    return report


def count_by_channel(name: str, claims: Iterable[store.Claim]) -> None:
    for channel, n in Counter(c.channel for c in claims).items():
        count(name, n, channel=channel)


def _hand_off_all(invoker: Invoker, handoffs: list[HandOff]) -> tuple[list[HandOff], list[HandOff]]:
    """Invoke every hand-off (concurrently when there are several); return the
    failed ones, and the throttled ones with those of a throttled channel that
    were then not tried."""
    throttled_channels: set[str] = set()

    def attempt(handoff: HandOff) -> tuple[HandOff, str] | None:
        if handoff.channel in throttled_channels:
            return handoff, "throttled"
        try:
            invoker.hand_off(handoff)
            return None
        except HandOffThrottled:
            throttled_channels.add(handoff.channel)
            log.warning(
                "hand-off throttled; releasing its claims for a short while",
                extra={"channel": handoff.channel, "message_ids": [c.id for c in handoff.claims]},
            )
            return handoff, "throttled"
        except Exception as exc:
            log.error(
                "hand-off failed; releasing its claims",
                extra={
                    "channel": handoff.channel,
                    "message_ids": [c.id for c in handoff.claims],
                    "error": type(exc).__name__,
                },
            )
            return handoff, "failed"

    if len(handoffs) <= 1:
        results = [attempt(h) for h in handoffs]
    else:
        with ThreadPoolExecutor(max_workers=min(_HANDOFF_THREADS, len(handoffs))) as pool:
            results = list(pool.map(attempt, handoffs))
    returned = [r for r in results if r is not None]
    return (
        [h for h, kind in returned if kind == "failed"],
        [h for h, kind in returned if kind == "throttled"],
    )


def run(
    engine: sa.Engine,
    invoker: Invoker,
    settings: RelaySettings,
    time_left: Callable[[], float],
    *,
    channels: Sequence[str] | None = None,
    until_empty: bool = False,
    linger: float | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> DispatchReport:
    """Claim and hand off until the budget is spent (or, with until_empty, the
    backlog is; or, with ``linger``, nothing was claimed for that many seconds).

    ``time_left()`` gives the seconds this run may still use.
    """
    total = DispatchReport()
    margin = settings.poll_interval_seconds
    cooling: dict[str, float] = {}
    started = clock()
    last_claim: float | None = None  # when a pass last claimed anything
    while True:  # at least one pass, even with no budget to spare
        report = dispatch_once(engine, invoker, settings, channels, cooling)
        total.add(report)
        if report.claimed:
            last_claim = clock()
        idle_for = clock() - (started if last_claim is None else last_claim)
        if time_left() <= margin or (until_empty and report.claimed == 0):
            total.ended = "budget"
            # A run that found work within its last linger most likely leaves
            # some: in sleep mode its caller starts a successor at once.
            total.work_left = (
                linger is not None and last_claim is not None and (report.full or idle_for < linger)
            )
            return total
        if linger is not None and idle_for >= linger:
            total.ended = "idle"
            return total
        if not report.full:  # caught up, or the channels are full: poll briefly
            poll = settings.poll_interval_seconds
            if report.waiting_for_room:
                poll = min(poll, ROOM_POLL_SECONDS)
            sleep(min(poll, max(0.0, time_left() - margin)))
