"""The sender runtime shared by every channel function.

receipt (a compare-and-set: each claim is taken, and so sent, once) ->
concurrent provider calls, each within its deadline -> one fenced settle
statement that also writes the attempt rows.

The deadline of a row is the sooner of its lease end (from the database
clock) and the Lambda's end, less a margin for the settle. A row whose
deadline is near is not started: it goes back to pending, due at once, with
no attempt and no deferral counted (a slow provider ahead of it, or a short
invocation, is not the message's fault), rather than left to expire
(docs/design.md, invariant 4).
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from . import channels, payloads, store
from .channels import CHANNEL, DESTINATION, Channel, Deadline, Message, Outcome
from .config import RelaySettings
from .errors import ValidationError
from .handoff import HandOff
from .observability import count, timings
from .redact import scrub_optional
from .states import SEND_OUTCOMES, AttemptOutcome

# Outcomes that leave a row pending without counting an attempt.
_NOT_COUNTED = (AttemptOutcome.DEFERRED, AttemptOutcome.NOT_STARTED)

log = logging.getLogger(__name__)

NOT_STARTED = "deadline near: not started"
DEADLINE_EXCEEDED = "provider call exceeded its deadline"
STOPPING = "stopping: not started"
STOP_GRACE_EXCEEDED = "stopping: provider call cut at the stop grace"
# A channel's send must return an Outcome; anything else is a bug in the
# channel, retried (an attempt counted, so it ends dead) like an exception.
RETURNED_NONE = "channel returned None, not an Outcome"
_NOT_STARTED = Outcome(AttemptOutcome.NOT_STARTED, error=NOT_STARTED)
_STOPPED = Outcome(AttemptOutcome.NOT_STARTED, error=STOPPING)
DESTINATION_THROTTLED = "destination throttled: not started"
CHANNEL_QUOTA = "channel quota spent: not started"
_DESTINATION_THROTTLED = Outcome(AttemptOutcome.NOT_STARTED, error=DESTINATION_THROTTLED)
_CHANNEL_QUOTA = Outcome(AttemptOutcome.NOT_STARTED, error=CHANNEL_QUOTA)
# A call is started only with time left to be answered: one started with less
# is all but sure to be given up after the receiver got the request, and then
# sent again. "Enough" is the slowest call of the event answered so far, and
# before any was answered (or when every one hangs) this, or a twentieth of the
# function's timeout when that is shorter (a short-lived test deployment).
MIN_CALL_SECONDS = 0.5
# A channel whose every call of its last batch came back within this starts
# the next on one send thread: waking SEND_CONCURRENCY threads for calls of
# microseconds cost more than the calls did (bench/README.md). The other
# threads join as soon as a call has run this long, so a provider that turns
# slow costs the batch at most this much.
FAST_CALL_SECONDS = 0.001
_calls_were_fast: dict[str, bool] = {}  # by channel name
_FOREVER = float("inf")
# While calls run after a stop was asked for, how often the sender looks at it.
STOP_POLL_SECONDS = 0.05
# Metric name per settled status or outcome.
_METRIC = {
    "delivered": "Delivered",
    "pending": "Retried",
    "failed": "Failed",
    "dead": "Dead",
    "suppressed": "Suppressed",
    "deferred": "Deferred",
    "not_started": "NotStarted",
    "expired": "Expired",
}


class _Limits:
    """What one batch learned of its provider's limits while sending: after a
    destination's throttling answer no further call to it starts, after a
    quota answer no further call at all (docs/design.md, invariant 10). The
    rows not started go back pending, no attempt and no deferral counted."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.began = time.monotonic()
        self.throttled: dict[str, list[float | None]] = {}  # destination -> pauses asked
        self.quota: Outcome | None = None
        self.calls: Counter[str] = Counter()  # answered, by destination
        self.delivered: Counter[str] = Counter()  # by destination
        # By destination: the rate it was called at until its first throttling
        # answer. The first estimate of what a destination admits is the rate
        # the batch delivered to it (low rather than high: each cut from a rate
        # too high costs a refused call and the pause the provider asks for);
        # this one only when nothing was delivered (another sender had spent
        # what it admits), which would make the estimate nil.
        self.called_rate: dict[str, float] = {}

    def blocked(self, row: store.ClaimedMessage) -> Outcome | None:
        """The outcome of a row that must not be started, else None."""
        if self.quota is not None:
            return _CHANNEL_QUOTA
        if row.destination in self.throttled:
            return _DESTINATION_THROTTLED
        return None

    def note(self, row: store.ClaimedMessage, outcome: Outcome) -> None:
        with self._lock:
            self.calls[row.destination] += 1
            if outcome.kind == AttemptOutcome.DELIVERED:
                self.delivered[row.destination] += 1
            if outcome.pause == CHANNEL:
                if self.quota is None:
                    self.quota = outcome
            elif outcome.pause == DESTINATION:
                if row.destination not in self.called_rate:
                    seconds = max(time.monotonic() - self.began, 0.001)
                    self.called_rate[row.destination] = self.calls[row.destination] / seconds
                self.throttled.setdefault(row.destination, []).append(outcome.delay_seconds)

    def records(self) -> tuple[dict[str, store.Throttled], tuple[str, float | None] | None]:
        """What to write: each throttled destination, and the channel's quota pause."""
        seconds = max(time.monotonic() - self.began, 0.001)
        throttled = {
            destination: store.Throttled(
                # the longest pause asked for (None: the relay's own)
                max((p for p in pauses if p is not None), default=None),
                len(pauses),
                self.delivered[destination] / seconds or self.called_rate[destination],
            )
            for destination, pauses in self.throttled.items()
        }
        quota = None
        if self.quota is not None:
            quota = (f"quota: {self.quota.error}", self.quota.delay_seconds)
        return throttled, quota


@dataclass
class SendReport:
    received: int = 0
    owned: int = 0
    lease_lost: list[int] = field(default_factory=list)
    # claims another sender took under the same claim: a duplicated event
    duplicates: list[int] = field(default_factory=list)
    # claims naming no message of the channel: never live (a sample event)
    unknown: list[int] = field(default_factory=list)
    statuses: Counter[str] = field(default_factory=Counter)


def _send_one(
    channel: Channel,
    row: store.ClaimedMessage,
    deadline: Deadline,
    stop: threading.Event | None = None,
    enough: float = MIN_CALL_SECONDS,
    limits: _Limits | None = None,
) -> tuple[Outcome, int | None]:
    """One row's call and how long it took in milliseconds (None: no provider
    call was made). ``enough``: the time a call needs left to be started;
    ``limits``: what the batch learned of the provider's limits so far."""
    started = time.monotonic()
    if stop is not None and stop.is_set():
        return _STOPPED, None
    if limits is not None:
        blocked = limits.blocked(row)
        if blocked is not None:
            return blocked, None
    if deadline.remaining() < enough:
        return _NOT_STARTED, None
    try:
        payload = payloads.decode(row.payload)
        channel.validate(payload)
    except ValidationError as exc:
        return Outcome.failed(f"invalid payload: {exc}"), None
    except NotImplementedError:
        return Outcome.failed(f"channel {row.channel!r} does not implement validate"), None
    except Exception as exc:  # a bug in a custom channel's validate
        return Outcome.retry(f"unexpected {type(exc).__name__} in validate"), None
    message = Message(row.id, row.channel, payload, row.attempt, row.dedupe_key, row.ordering_key)
    try:
        outcome = channel.send(message, deadline)
    except NotImplementedError:
        return Outcome.failed(f"channel {row.channel!r} does not implement send"), None
    except Exception as exc:  # a channel bug or an unclassified provider error
        outcome = Outcome.retry(f"unexpected {type(exc).__name__}")
    if not isinstance(outcome, Outcome):
        error = (
            RETURNED_NONE
            if outcome is None
            else f"channel returned {type(outcome).__name__}, not an Outcome"
        )
        outcome = Outcome.retry(error)
    elif outcome.kind not in SEND_OUTCOMES:
        outcome = Outcome.retry(f"channel returned unknown outcome {outcome.kind!r}")
    elif limits is not None:
        limits.note(row, outcome)
    return outcome, int((time.monotonic() - started) * 1000)


def run(
    engine: sa.Engine,
    event: Any,
    settings: RelaySettings,
    remaining_seconds: Callable[[], float],
    *,
    channel_name: str | None = None,
    channel: Channel | None = None,
) -> SendReport:
    """Handle one hand-off event for ``channel_name`` (the function's own channel)."""
    handoff = HandOff.from_event(event)
    if channel_name is not None and handoff.channel != channel_name:
        raise ValidationError(
            "event.channel", f"this function sends {channel_name!r}, not {handoff.channel!r}"
        )
    report = SendReport(received=len(handoff.claims))
    with engine.begin() as conn:
        rows = store.receive_claimed(
            conn,
            handoff.channel,
            handoff.claims,
            settings.max_attempts,
        )
    report.owned = len(rows)
    owned = {r.id for r in rows}
    not_owned = [c for c in handoff.claims if c.id not in owned]
    if not_owned:
        # Not ours to send; touch nothing. Either another sender took them
        # under this very claim (the event came twice: expected, now and then),
        # or no message has the id (never a live claim: a sample event), or
        # the claim is over (settled, reaped, claimed again): say which.
        with engine.begin() as conn:
            why = store.unowned_claims(conn, handoff.channel, not_owned)
        report.duplicates.extend(c.id for c in not_owned if c.id in why.duplicates)
        report.unknown.extend(c.id for c in not_owned if c.id in why.unknown)
        report.lease_lost.extend(
            c.id for c in not_owned if c.id not in why.duplicates and c.id not in why.unknown
        )
        if report.unknown:
            log.info(
                "no such claim: this event's claims were never live here (events/ samples "
                "carry placeholder claim tokens; get a live event with `outbox invoke "
                "<Function> --claim N`); skipped",
                extra={"message_ids": report.unknown},
            )
        if report.duplicates:
            count("DuplicateHandOff", len(report.duplicates), channel=handoff.channel)
            log.info(
                "claims already taken by another delivery of this hand-off; skipped",
                extra={"message_ids": report.duplicates},
            )
        if report.lease_lost:
            count("LeaseLost", len(report.lease_lost), channel=handoff.channel)
            log.warning(
                "claims no longer held (settled, reaped or claimed again); skipped",
                extra={"message_ids": report.lease_lost},
            )
    if not rows:
        return report
    return send_then_settle(
        engine, handoff.channel, rows, settings, remaining_seconds, channel=channel, report=report
    )()


def send_then_settle(
    engine: sa.Engine,
    channel_name: str,
    rows: list[store.ClaimedMessage],
    settings: RelaySettings,
    remaining_seconds: Callable[[], float],
    *,
    channel: Channel | None = None,
    report: SendReport | None = None,
    stop: threading.Event | None = None,
    stop_grace: float | None = None,
) -> Callable[[], SendReport]:
    """Send rows whose receipt this process holds, now; returns their settle
    (one fenced statement, the log line and the metrics) to run when the caller
    chooses: ``run`` at once, ``outbox worker`` while it claims its next batch.
    ``stop`` set (the worker's SIGTERM): no further call starts; the rows not
    begun go back to pending, no attempt counted; with ``stop_grace``, calls
    still running that long after the stop are given up as retries (their
    outcome is unknown), so the process can settle and exit within a
    container's stop grace instead of waiting out their deadlines."""
    if report is None:
        report = SendReport(received=len(rows), owned=len(rows))
    if channel is None:
        channel, missing = channels.load(channel_name)
    else:
        missing = channels.missing_piece(channel)
    backoff = settings.backoff()
    owned = {r.id for r in rows}
    throttled: dict[str, store.Throttled] = {}
    quota: tuple[str, float | None] | None = None
    if missing is not None or channel is None:
        # Nothing here can send this channel: fail the rows at once with the
        # reason, rather than let them come back until dead.
        reason = missing or f"channel {channel_name!r} is unavailable"
        log.error("channel cannot send; rows failed", extra={"channel": channel_name})
        results: dict[int, tuple[Outcome, int | None]] = {
            r.id: (Outcome.failed(reason), None) for r in rows
        }
    else:
        margin = settings.settle_margin_seconds
        lambda_left = remaining_seconds()
        # One Deadline per distinct lease end: the rows of one claim share one.
        shared: dict[float, Deadline] = {}
        deadlines = {}
        for r in rows:
            seconds = min(r.lease_left_seconds, lambda_left) - margin
            deadline = shared.get(seconds)
            if deadline is None:
                deadline = shared[seconds] = Deadline(seconds)
            deadlines[r.id] = deadline
        floor = min(MIN_CALL_SECONDS, settings.sender_timeout_seconds / 20)
        limits = _Limits()
        results = _send_all(
            channel, rows, deadlines, settings.send_concurrency, stop, floor, stop_grace, limits
        )
        throttled, quota = limits.records()

    settlements = [
        # Settlement's fields in order: id, claim_token, outcome, error,
        # provider_message_id, delay_seconds, duration_ms (by position: a
        # NamedTuple built by keyword costs twice as much, once a row). The
        # error is a channel's text, maybe a remote server's: scrubbed and
        # bounded before it is stored, logged or published.
        store.Settlement(
            row.id,
            row.claim_token,
            outcome.kind,
            scrub_optional(outcome.error),
            outcome.provider_message_id,
            outcome.delay_seconds,
            duration_ms,
        )
        if outcome.pause is None
        # Throttled, or a quota spent: the pause (written with the settle) holds
        # the destination or channel back; the row itself counts nothing.
        else store.Settlement(
            row.id,
            row.claim_token,
            AttemptOutcome.NOT_STARTED,
            outcome.error,
            None,
            None,
            duration_ms,
        )
        for row in rows
        for outcome, duration_ms in [results[row.id]]
    ]
    return functools.partial(
        _settle, engine, channel_name, settlements, backoff, owned, report, throttled, quota
    )


def _settle(
    engine: sa.Engine,
    channel_name: str,
    settlements: list[store.Settlement],
    backoff: store.Backoff,
    owned: set[int],
    report: SendReport,
    throttled: dict[str, store.Throttled] | None = None,
    quota: tuple[str, float | None] | None = None,
) -> SendReport:
    with engine.begin() as conn:
        if throttled or quota:
            # First, in the same transaction: no claim may take the rows the
            # settle gives back before their destination or channel is paused.
            store.record_throttling(conn, channel_name, throttled or {}, quota)
        settled = store.settle_with_outcomes(conn, settlements, backoff)
    if throttled:
        count("Throttled", sum(t.answers for t in throttled.values()), channel=channel_name)
        log.warning(
            "destination asked to slow down; paused",
            extra={"channel": channel_name, "destinations": len(throttled)},
        )
    if quota:
        count("QuotaPaused", 1, channel=channel_name)
        log.error(
            "quota spent; channel paused", extra={"channel": channel_name, "reason": quota[0]}
        )

    lost = sorted(owned - set(settled))
    if lost:
        report.lease_lost.extend(lost)
        count("LeaseLost", len(lost), channel=channel_name)
        log.warning("lease lost before settle; outcome abandoned", extra={"message_ids": lost})
    # One line per batch, not per message: ids by status, errors by id.
    ids_by_status: dict[str, list[int]] = {}
    errors: dict[int, str] = {}
    for s in settlements:
        row = settled.get(s.id)
        if row is None:
            continue
        # pending after a deferral or a row not started: say which (a deferral
        # past the limit was counted as a retry: pending, like one)
        key = row.outcome if row.status == "pending" and row.outcome in _NOT_COUNTED else row.status
        ids_by_status.setdefault(key, []).append(s.id)
        if s.error:
            errors[s.id] = s.error
    for key, ids in ids_by_status.items():
        report.statuses[key] += len(ids)
    if ids_by_status:
        log.info(
            "settled",
            extra={
                "channel": channel_name,
                "message_ids": ids_by_status,
                "errors": errors,
                "max_duration_ms": max((s.duration_ms or 0) for s in settlements),
            },
        )
    for key, n in report.statuses.items():
        count(_METRIC[key], n, channel=channel_name)
    timings(  # the provider calls made (a row not started or refused took none)
        "SendMilliseconds",
        [s.duration_ms for s in settlements if s.duration_ms is not None and s.id in settled],
        channel=channel_name,
    )
    return report


def _send_all(
    channel: Channel,
    rows: list[store.ClaimedMessage],
    deadlines: dict[int, Deadline],
    concurrency: int,
    stop: threading.Event | None = None,
    floor: float = MIN_CALL_SECONDS,
    stop_grace: float | None = None,
    limits: _Limits | None = None,
) -> dict[int, tuple[Outcome, int | None]]:
    """Send every row, up to ``concurrency`` at once; a call still running at its
    deadline is given up (its outcome is unknown, so it counts as a retry), and a
    row no thread reached by then is not started. Once ``stop`` is set, that
    deadline is at most ``stop_grace`` seconds away.

    Each send thread takes rows one after another from a shared queue: one task
    per thread rather than one future per row, which cost a lock, a condition
    and a queue hand-over per message. A channel whose calls all came back
    within ``FAST_CALL_SECONDS`` last time starts on one thread, and the others
    join as soon as a call runs that long."""
    # Even one row goes through the pool: only a waiting caller can give up
    # on a provider call that hangs past its deadline.
    pool = _pool(concurrency)
    queue = deque(rows)
    results: dict[int, tuple[Outcome, int | None]] = {}
    running: dict[int, float] = {}  # row id -> when its call began
    lock = threading.Lock()
    closed = False

    slowest: float | None = None  # of the calls answered so far, in seconds

    def take() -> store.ClaimedMessage | None:
        # under the lock: the next row, marked as running, or None when done
        if closed or not queue:
            return None
        row = queue.popleft()
        running[row.id] = time.monotonic()
        return row

    def drain() -> None:
        nonlocal slowest
        with lock:
            row = take()
        while row is not None:
            enough = floor if slowest is None else slowest
            result = _send_one(channel, row, deadlines[row.id], stop, enough, limits)
            with lock:  # the row's result and the next row, in one hold of the lock
                del running[row.id]
                # A row given up at its deadline keeps that outcome.
                answered = results.setdefault(row.id, result) is result
                if answered and result[1] is not None:  # a provider call was made
                    seconds = result[1] / 1000
                    if slowest is None or seconds > slowest:
                        slowest = seconds
                row = take()

    wanted = min(concurrency, len(rows))
    narrow = wanted > 1 and _calls_were_fast.get(channel.name, False)
    tasks = pool.start(drain, 1 if narrow else wanted)
    ends = time.monotonic() + max(d.remaining() for d in set(deadlines.values()))
    grace = _FOREVER if stop is None or stop_grace is None else stop_grace
    unseen_stop = stop if grace < _FOREVER else None  # looked at until it is set
    cut_by_stop = False
    while not tasks.wait(
        min(
            ends - time.monotonic(),
            FAST_CALL_SECONDS if narrow else _FOREVER,
            _FOREVER if unseen_stop is None else STOP_POLL_SECONDS,
        )
    ):
        now = time.monotonic()
        if unseen_stop is not None and unseen_stop.is_set():
            unseen_stop = None  # the grace runs from the first look that sees the stop
            if now + grace < ends:
                ends, cut_by_stop = now + grace, True
        if now >= ends:
            break
        if not narrow:
            continue  # woken only to look at the stop: every thread is sending already
        with lock:
            slow = bool(queue) and any(
                now - began >= FAST_CALL_SECONDS for began in running.values()
            )
        if slow:
            pool.add(tasks, drain, wanted - 1)
            narrow = False
    with lock:
        closed = True  # a thread still sending takes no further row
        stuck = bool(running)
        now = time.monotonic()
        for row in rows:
            if row.id not in results:
                began = running.get(row.id)
                results[row.id] = (
                    (_STOPPED if cut_by_stop else _NOT_STARTED, None)
                    if began is None
                    else (
                        Outcome.retry(STOP_GRACE_EXCEEDED if cut_by_stop else DEADLINE_EXCEEDED),
                        int((now - began) * 1000),
                    )
                )
        outcome = dict(results)
        _calls_were_fast[channel.name] = slowest is not None and slowest < FAST_CALL_SECONDS
    if stuck:
        # Do not wait for calls stuck past their deadline (they hold no claim
        # now), and do not let them occupy the threads of the next batch.
        _retire_pool(concurrency, pool)
    return outcome


class _SendThreads:
    """A fixed set of daemon threads that run send tasks.

    Not a ThreadPoolExecutor: the interpreter joins those at exit, so a call
    stuck in a provider's read timeout past its deadline (already given up
    and settled as a retry) would keep ``outbox worker`` from exiting after
    SIGTERM. Daemon threads never hold the process."""

    def __init__(self, size: int, name_prefix: str = "send") -> None:
        self.size = size
        self.retired = False
        self._tasks: queue.SimpleQueue[tuple[Callable[[], None], _Countdown] | None] = (
            queue.SimpleQueue()
        )
        for n in range(size):
            threading.Thread(target=self._serve, name=f"{name_prefix}_{n}", daemon=True).start()

    def _serve(self) -> None:
        while (item := self._tasks.get()) is not None:
            task, tasks = item
            try:
                task()
            except BaseException:  # a task's own failure must not kill the thread
                log.exception("send task failed")
            finally:
                tasks.task_done()

    def start(self, task: Callable[[], None], copies: int) -> _Countdown:
        """Run ``copies`` of ``task`` side by side; the countdown says when all ended."""
        tasks = _Countdown(copies)
        for _ in range(copies):
            self._tasks.put((task, tasks))
        return tasks

    def add(self, tasks: _Countdown, task: Callable[[], None], copies: int) -> None:
        """``copies`` more of ``task`` under the same countdown, unless all of
        its tasks have ended already (then there is nothing left to share)."""
        if tasks.add(copies):
            for _ in range(copies):
                self._tasks.put((task, tasks))

    def run(self, task: Callable[[], None], copies: int, timeout: float) -> bool:
        """``start``, then wait at most ``timeout`` seconds for all the copies.
        False: some were still running."""
        return self.start(task, copies).wait(timeout)

    def retire(self) -> None:
        """Each thread ends once it is done with what it runs now."""
        self.retired = True
        for _ in range(self.size):
            self._tasks.put(None)


class _Countdown:
    """The tasks of one batch: done when the last of them has ended. Its caller
    waits on one lock, where a Semaphore woke it once for every task."""

    def __init__(self, tasks: int) -> None:
        self._left = tasks
        self._count = threading.Lock()
        self._ended = threading.Lock()
        if tasks > 0:
            self._ended.acquire()

    def add(self, tasks: int) -> bool:
        """Count ``tasks`` more; False (nothing counted) once all have ended."""
        with self._count:
            if self._left == 0:
                return False
            self._left += tasks
            return True

    def task_done(self) -> None:
        with self._count:
            self._left -= 1
            if self._left == 0:
                self._ended.release()

    def wait(self, timeout: float) -> bool:
        """True once every task has ended; False after ``timeout`` seconds."""
        if self._ended.acquire(timeout=max(0.0, timeout)):
            self._ended.release()  # any later wait sees it ended too
            return True
        return False


# The send threads outlive a batch: a warm Lambda (or a worker) reuses them
# instead of starting new ones for every hand-off.
_pools: dict[int, _SendThreads] = {}
_pools_lock = threading.Lock()


def _forget_pools_in_child() -> None:
    """A forked process inherits the pools but none of their threads: its sends
    would queue for ever. It starts pools of its own."""
    global _pools_lock
    _pools.clear()
    _pools_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_pools_in_child)


def _pool(size: int) -> _SendThreads:
    with _pools_lock:
        pool = _pools.get(size)
        if pool is None:
            pool = _pools[size] = _SendThreads(size)
        return pool


def _retire_pool(size: int, pool: _SendThreads) -> None:
    with _pools_lock:
        if _pools.get(size) is pool:
            del _pools[size]
    pool.retire()  # tasks other callers queued before this still run
