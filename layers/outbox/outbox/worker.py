"""The relay in one long-running process: dispatcher, senders and reaper.

For local development and for running on a container service instead of
Lambda. It claims with the receipt taken in the same statement (it sends what
it claims, so no hand-off event can be duplicated), then sends and settles
through the same sender runtime as the channel functions; every fence and
settle is the same SQL as in Lambda, so several workers (and Lambda
dispatchers) may run against one database at once.

When ``stop`` is set (by SIGTERM, for example), the batch in hand finishes.
Its provider calls already started are settled, and its rows not yet started
are released at once with no attempt counted, so no claim is left to expire.
Calls still running ``WORKER_STOP_GRACE_SECONDS`` after the stop are given up
and settled as retries, with an attempt counted because the receiver may have
had the request. Waiting for them up to their full deadline
(``SENDER_TIMEOUT_SECONDS``) would leave a container's stop grace no time to
settle.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import sqlalchemy as sa

from . import aws, coldstart_limits, reaper, sender, store
from .observability import count
from .relay_settings import OutcomeEventSettings, RelaySettings
from .settings import WORKER_STOP_GRACE_SECONDS

log = logging.getLogger(__name__)


@dataclass
class BatchReport:
    """One batch: the rows claimed, and how many of them the senders owned
    (their receipt taken) once the batch was settled."""

    claimed: int = 0
    owned: int = 0
    # When (time.monotonic()) a destination this batch paused resumes, if it paused one.
    resumes_at: float | None = None


def idle_wait(poll: float, resumes_at: float | None, now: float) -> tuple[float, float | None]:
    """How long an idle loop waits, and the pause end it still waits for: the
    poll interval, or until ``resumes_at`` (a pause's end, on the monotonic
    clock) when that comes first."""
    if resumes_at is not None and resumes_at - now <= poll:
        return max(resumes_at - now, 0.0), None
    return poll, resumes_at


@dataclass
class WorkerReport:
    claimed: int = 0
    released: int = 0
    reaped: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    batches: int = 0


class Worker:
    """Claim, send and settle in a loop until ``stop`` is set (or the backlog is empty)."""

    def __init__(
        self,
        engine: sa.Engine,
        settings: RelaySettings,
        *,
        channels: Sequence[str] | None = None,
        stop: threading.Event | None = None,
        reap_interval_seconds: float = 30.0,
        on_batch: Callable[[WorkerReport], None] | None = None,
        outcome_events: OutcomeEventSettings | None = None,
        stop_grace_seconds: float | None = None,
    ) -> None:
        self.engine = engine
        if stop_grace_seconds is None:
            stop_grace_seconds = WORKER_STOP_GRACE_SECONDS.read(os.environ)
        self.stop_grace_seconds = stop_grace_seconds
        self.settings = settings
        # Outcome events are off unless a bus is named; then the reaper step
        # publishes them too.
        self.outcome_events = outcome_events or OutcomeEventSettings()
        self._events = aws.client_on_first_use("events")
        self.channels = list(channels) if channels else None
        self.stop = stop or threading.Event()
        self.reap_interval_seconds = reap_interval_seconds
        self.on_batch = on_batch
        self.report = WorkerReport()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        # Written once per worker (docs/how-to/rate-limits.md): the configured
        # limits before its first claim, a provider's own rate before its
        # first send to that provider.
        self._limits_applied = False
        self._provider_limits_asked: set[str] = set()

    def _send(
        self, channel: str, rows: list[store.ClaimedMessage]
    ) -> Callable[[], sender.SendReport]:
        """Send the rows now; returns their settle."""
        if self.stop.is_set():
            # Nothing was started: give the rows back now rather than leave
            # them claimed.
            with self.engine.begin() as conn:
                released = store.release(conn, rows, reason=sender.STOPPING, own_receipt=True)
            with self._lock:
                self.report.released += len(released)
            report = sender.SendReport(received=len(rows))
            return lambda: report
        with self._lock:
            ask = channel not in self._provider_limits_asked
            self._provider_limits_asked.add(channel)
        if ask:
            coldstart_limits.refresh_provider_limit(self.engine, channel)
        # A worker has no Lambda timeout, so it gives each batch the time a
        # channel function has (SENDER_TIMEOUT_SECONDS): a provider that hangs
        # holds a batch no longer here than in Lambda. A row's deadline is
        # the sooner of that and its lease end, less the settle margin.
        return sender.send_then_settle(
            self.engine,
            channel,
            rows,
            self.settings,
            lambda: float(self.settings.sender_timeout_seconds),
            stop=self.stop,
            stop_grace=self.stop_grace_seconds,
        )

    def _channel_pool(self) -> ThreadPoolExecutor:
        """The threads that send a batch's channels side by side, kept for the
        worker's life rather than started for every batch."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="channel")
        return self._pool

    def reap(self) -> reaper.ReapReport:
        deadline = time.monotonic() + 30.0
        result = reaper.run(
            self.engine,
            self.settings,
            lambda: deadline - time.monotonic(),
            self.outcome_events,
            self._events,
        )
        self.report.reaped += result.reclaimed + result.not_started + result.dead + result.expired
        return result

    def run_once(self) -> BatchReport:
        """One claim of up to a batch, sent and settled before it returns.

        This process sends what it claims, so there is no hand-off to protect:
        the claim takes the receipt and returns the payloads in one statement,
        and one settle per channel follows (two statements a batch)."""
        result, settle = self._claim_and_send()
        settle()
        return result

    def _claim_and_send(self) -> tuple[BatchReport, Callable[[], None]]:
        """Claim a batch and send it; returns the batch's settle, not yet run."""
        settings = self.settings
        if not self._limits_applied:
            coldstart_limits.apply_configured_limits(self.engine, settings, self.channels)
            self._limits_applied = True
        with self.engine.begin() as conn:
            rows = store.claim_and_receive(
                conn,
                settings.batch_size,
                settings.lease_seconds,
                settings.max_attempts,
                self.channels,
                default_ttl_seconds=settings.default_ttl_seconds or None,
            )
        result = BatchReport(claimed=len(rows))
        settles: list[Callable[[], sender.SendReport]] = []
        if rows:
            count("Claimed", len(rows))
            by_channel: dict[str, list[store.ClaimedMessage]] = {}
            for row in rows:
                by_channel.setdefault(row.channel, []).append(row)
            groups = sorted(by_channel.items())
            if len(groups) == 1:
                settles = [self._send(*groups[0])]
            else:  # one channel does not wait for another channel's provider
                settles = list(self._channel_pool().map(lambda group: self._send(*group), groups))

        def settle() -> None:
            reports = [s() for s in settles]
            result.owned = sum(r.owned for r in reports)
            result.resumes_at = min(
                (r.resumes_at for r in reports if r.resumes_at is not None), default=None
            )
            with self._lock:
                for report in reports:
                    for status, n in report.statuses.items():
                        self.report.statuses[status] = self.report.statuses.get(status, 0) + n
                self.report.claimed += result.claimed
                self.report.batches += 1
            if self.on_batch is not None:
                self.on_batch(self.report)

        return result, settle

    def run(self, *, once: bool = False, until_empty: bool = False) -> WorkerReport:
        """The loop. ``once``: one batch; ``until_empty``: stop when nothing is due.

        A batch's settle runs on a thread of its own (and a connection of its
        own, when the engine's pool has two) while the next batch is claimed
        and sent: the database writes one while this process works on the
        other. At most one settle is in flight, and the loop never ends with
        one pending. Every statement is the same, fenced as ever."""
        next_reap = time.monotonic()
        # The earliest end of a pause this loop's batches wrote: the loop
        # claims again then rather than up to a poll interval later (every
        # moment a resumed destination's rows wait is capacity its provider
        # had and nobody used).
        resumes_at: float | None = None
        in_flight: list[Future[None]] = []  # at most one
        settler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="settle")

        def settled() -> None:
            while in_flight:
                in_flight.pop().result()  # raises what the settle raised

        try:
            while not self.stop.is_set():
                if time.monotonic() >= next_reap:
                    self.reap()
                    next_reap = time.monotonic() + self.reap_interval_seconds
                result, settle = self._claim_and_send()
                settled()
                in_flight.append(settler.submit(settle))
                if once or (until_empty and result.claimed == 0):
                    break
                if result.claimed < self.settings.batch_size:
                    settled()  # before an idle wait, not after it
                    if result.resumes_at is not None:
                        resumes_at = min(resumes_at or math.inf, result.resumes_at)
                    wait, resumes_at = idle_wait(
                        self.settings.poll_interval_seconds, resumes_at, time.monotonic()
                    )
                    self.stop.wait(wait)
            settled()
        finally:
            settler.shutdown()  # waits for a settle still running
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None
        return self.report
