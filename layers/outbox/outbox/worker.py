"""The relay in one long-running process: dispatcher, senders and reaper.

For local development and for running on a container service instead of
Lambda. It claims with the receipt taken in the same statement (it sends what
it claims, so no hand-off event can be duplicated), then sends and settles
through the same sender runtime as the channel functions; every fence and
settle is the same SQL as in Lambda, so several workers (and Lambda
dispatchers) may run against one database at once.

When ``stop`` is set (by SIGTERM, for example), the batches in hand (up to
two: the next is claimed while the last one's final calls run) finish.
Their provider calls already started are settled, and their rows not yet
started are released at once with no attempt counted, so no claim is left
to expire.
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
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import sqlalchemy as sa

from . import aws, coldstart_limits, db, reaper, sender, store
from .observability import count
from .relay_settings import OutcomeEventSettings, RelaySettings
from .settings import WORKER_PREPARED_CLAIM, WORKER_STOP_GRACE_SECONDS

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
        prepared_claim: bool | None = None,
    ) -> None:
        self.engine = engine
        if stop_grace_seconds is None:
            stop_grace_seconds = WORKER_STOP_GRACE_SECONDS.read(os.environ)
        self.stop_grace_seconds = stop_grace_seconds
        if prepared_claim is None:
            prepared_claim = WORKER_PREPARED_CLAIM.read(os.environ)
        self.prepared_claim = prepared_claim
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
        self._on_batch_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._batches: ThreadPoolExecutor | None = None
        # Written once per worker (docs/how-to/rate-limits.md): the configured
        # limits before its first claim, a provider's own rate before its
        # first send to that provider.
        self._limits_applied = False
        self._provider_limits_asked: set[str] = set()

    def _send(
        self,
        channel: str,
        rows: list[store.ClaimedMessage],
        limits: sender.Limits,
        last_round: threading.Event,
        settle_after: Callable[[], object],
    ) -> sender.SendReport:
        """Send the rows now, then settle them once the batch before has settled."""
        if self.stop.is_set():
            # Nothing was started: give the rows back now rather than leave
            # them claimed.
            with self.engine.begin() as conn:
                released = store.release(conn, rows, reason=sender.STOPPING, own_receipt=True)
            with self._lock:
                self.report.released += len(released)
            return sender.SendReport(received=len(rows))
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
            limits=limits,
            last_round=last_round,
            settle_after=settle_after,
        )()

    def _channel_pool(self) -> ThreadPoolExecutor:
        """The threads that send a batch's channels side by side, kept for the
        worker's life rather than started for every batch."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="channel")
        return self._pool

    def _batch_threads(self) -> ThreadPoolExecutor:
        """Two threads, one per batch in flight: each sends its batch, then
        settles it."""
        if self._batches is None:
            self._batches = ThreadPoolExecutor(max_workers=2, thread_name_prefix="batch")
        return self._batches

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

    def _resume_from_database(self) -> float | None:
        """When (time.monotonic()) the next pause ends or token comes, by the
        database; None when nothing waits for one."""
        with self.engine.connect() as conn:
            seconds = store.seconds_to_resume(conn)
        return None if seconds is None else time.monotonic() + max(seconds, 0.0)

    def run_once(self) -> BatchReport:
        """One claim of up to a batch, sent and settled before it returns.

        This process sends what it claims, so there is no hand-off to protect:
        the claim takes the receipt and returns the payloads in one statement,
        and one settle per channel follows (two statements a batch)."""
        batch = self._start_batch(None)
        batch.done.result()
        return batch.report

    def _start_batch(self, before: _InFlight | None) -> _InFlight:
        """Claim a batch and start sending it on a batch thread; ``before`` is
        the batch whose last calls may still be running."""
        settings = self.settings
        if not self._limits_applied:
            coldstart_limits.apply_configured_limits(self.engine, settings, self.channels)
            self._limits_applied = True
            if self.prepared_claim:
                # This process holds its sessions: its settle, too, is parsed
                # once a session and, once Postgres settles on a generic plan,
                # planned once.
                db.keep_statements_prepared(self.engine)
        with self.engine.begin() as conn:
            rows = store.claim_and_receive(
                conn,
                settings.batch_size,
                settings.lease_seconds,
                settings.max_attempts,
                self.channels,
                default_ttl_seconds=settings.default_ttl_seconds or None,
                prepare=self.prepared_claim,
            )
        report = BatchReport(claimed=len(rows))
        if not rows:
            self._tally(report, [])
            nothing: Future[None] = Future()
            nothing.set_result(None)
            return _InFlight(report, {}, [], nothing)
        count("Claimed", len(rows))
        by_channel: dict[str, list[store.ClaimedMessage]] = {}
        for row in rows:
            by_channel.setdefault(row.channel, []).append(row)
        groups = sorted(by_channel.items())
        # What the batch before hears while it still sends blocks this one's calls.
        heeded = before.limits if before is not None and not before.done.done() else {}
        limits = {channel: sender.Limits(heeded.get(channel)) for channel, _ in groups}
        last_round = {channel: threading.Event() for channel, _ in groups}

        def settle_after() -> None:
            # The batch before settles first (its pauses are written before
            # this batch's rows go back); its failure is the loop's to raise.
            if before is not None:
                wait([before.done])

        def send(group: tuple[str, list[store.ClaimedMessage]]) -> sender.SendReport:
            channel, channel_rows = group
            try:
                return self._send(
                    channel, channel_rows, limits[channel], last_round[channel], settle_after
                )
            finally:
                last_round[channel].set()

        def send_and_settle() -> None:
            if len(groups) == 1:
                reports = [send(groups[0])]
            else:  # one channel does not wait for another channel's provider
                reports = list(self._channel_pool().map(send, groups))
            self._tally(report, reports)

        def ended(_: Future[None]) -> None:
            for event in last_round.values():  # a batch that failed starts nothing more
                event.set()

        done = self._batch_threads().submit(send_and_settle)
        done.add_done_callback(ended)
        return _InFlight(report, limits, list(last_round.values()), done)

    def _tally(self, batch: BatchReport, reports: list[sender.SendReport]) -> None:
        """Add a settled batch's figures to the worker's."""
        batch.owned = sum(r.owned for r in reports)
        batch.resumes_at = min(
            (r.resumes_at for r in reports if r.resumes_at is not None), default=None
        )
        with self._lock:
            for sent in reports:
                for status, n in sent.statuses.items():
                    self.report.statuses[status] = self.report.statuses.get(status, 0) + n
            self.report.claimed += batch.claimed
            self.report.batches += 1
        if self.on_batch is not None:
            with self._on_batch_lock:  # one call at a time, whichever thread settled
                self.on_batch(self.report)

    def run(self, *, once: bool = False, until_empty: bool = False) -> WorkerReport:
        """The loop. ``once``: one batch; ``until_empty``: stop when nothing is due.

        The next batch is claimed as soon as no more of the last one's rows
        wait than it has send threads (its last round of calls is next), so
        the claim is done by the time threads come free, and they take the
        next batch's rows at once rather than wait for it: the provider sees
        a steady stream, not a pause every batch. At most two
        batches are in flight, and the settles keep their order. A batch's
        throttle or quota blocks the calls of the batch claimed after it not
        yet started, and its settle (which writes the pause) comes before the
        claim after that (docs/design.md, invariant 10). The loop never ends
        with a batch in flight. Every statement is the same, fenced as ever."""
        next_reap = time.monotonic()
        # The earliest end of a pause this loop's batches wrote: the loop
        # claims again then rather than up to a poll interval later (every
        # moment a resumed destination's rows wait is capacity its provider
        # had and nobody used).
        resumes_at: float | None = None
        in_flight: deque[_InFlight] = deque()  # the batch before the last, and the last
        woke_for_resume = False  # the last idle wait ended at a pause's end
        claimed_again = False  # the last idle wait was the claim at once below

        def finish_oldest() -> None:
            nonlocal resumes_at
            batch = in_flight.popleft()
            batch.done.result()  # raises what its send or settle raised
            if batch.report.resumes_at is not None:
                resumes_at = min(
                    math.inf if resumes_at is None else resumes_at, batch.report.resumes_at
                )

        try:
            while not self.stop.is_set():
                if time.monotonic() >= next_reap:
                    self.reap()
                    next_reap = time.monotonic() + self.reap_interval_seconds
                if len(in_flight) == 2:
                    finish_oldest()  # settled before this claim
                batch = self._start_batch(in_flight[-1] if in_flight else None)
                in_flight.append(batch)
                if once or (until_empty and batch.report.claimed == 0):
                    break
                if batch.report.claimed < self.settings.batch_size:
                    while in_flight:  # settled before an idle wait, not after it
                        finish_oldest()
                    at_once = False
                    if resumes_at is None and woke_for_resume:
                        # The pause is the database's, written by the settle:
                        # a settle that came late ends it later than the
                        # sender reckoned, and the cut rate may want a token
                        # first. Wait for what the database says, not a poll.
                        resumes_at = self._resume_from_database()
                        if resumes_at is None and not claimed_again:
                            # Nothing waits, it says, yet the claim just found
                            # the pause on: it ended in between. Claim once
                            # more at once, not a poll interval later.
                            resumes_at, at_once = time.monotonic(), True
                    claimed_again = at_once
                    wait_seconds, resumes_at = idle_wait(
                        self.settings.poll_interval_seconds, resumes_at, time.monotonic()
                    )
                    woke_for_resume = wait_seconds < self.settings.poll_interval_seconds
                    self.stop.wait(wait_seconds)
                else:
                    batch.wait_last_round()
            while in_flight:
                finish_oldest()
        finally:
            # A batch still in flight (the loop raised) finishes first: its
            # pool's shutdown waits for it, and only then the channel pool's.
            for pool in (self._batches, self._pool):
                if pool is not None:
                    pool.shutdown()
            self._batches = self._pool = None
        return self.report


@dataclass
class _InFlight:
    """A batch claimed and being sent, then settled, on a batch thread."""

    report: BatchReport
    limits: dict[str, sender.Limits]  # by channel: what its sends have heard
    last_round: list[threading.Event]  # by channel: its last round of calls begun
    done: Future[None]  # sent and settled

    def wait_last_round(self) -> None:
        for event in self.last_round:
            event.wait()
