"""A simulator of sleep mode (docs/how-to/pacing.md) over simulated time,
driving the real dispatcher handler (``Runtime.dispatch``) and the real sender
against the real Postgres.

Every time the relay uses comes from the database clock, so simulated time
moves by shifting every stored time of the outbox back by the step
(``advance``): to the relay, the clock moved on. Nothing sleeps for the
simulated minutes; a run's linger is real but short.

What wakes the dispatcher, each with its faults:

* nudges, one per committed enqueue: lost, duplicated, sent before the
  commit, or sent for a transaction that rolled back;
* the wake schedule: a fake of Scheduler's GetSchedule/UpdateSchedule holding
  the one-time time the dispatcher writes, which fires late or twice;
* the safety-net schedule, every ``safety_net`` simulated seconds;
* its successor (a run out of budget with work left);
* hand-offs that Lambda accepted and never ran (their leases expire, and the
  run woken at the expiry releases them).

``PacingReport`` says what was lost, what was sent twice, and for each
message how long after its due time (simulated) it was delivered.
"""

from __future__ import annotations

import datetime as dt
import heapq
import itertools
import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

import outbox
from outbox import pacing, sender
from outbox.handoff import CallableInvoker
from outbox.runtime import Runtime
from support import LambdaContext, ScriptedChannel, install_channel

CHANNEL = "paced"
WAKE = "sim-dispatcher-wake"
_SHIFT = """
    UPDATE outbox_message SET
        available_at = available_at - make_interval(secs => :s),
        created_at = created_at - make_interval(secs => :s),
        claimed_at = claimed_at - make_interval(secs => :s),
        lease_expires_at = lease_expires_at - make_interval(secs => :s),
        received_at = received_at - make_interval(secs => :s),
        expires_at = expires_at - make_interval(secs => :s),
        settled_at = settled_at - make_interval(secs => :s);
    UPDATE outbox_outcome_event SET
        publish_after = publish_after - make_interval(secs => :s),
        occurred_at = occurred_at - make_interval(secs => :s)
"""


@dataclass
class Faults:
    lose_nudges: float = 0.0  # probability a nudge never arrives
    duplicate_nudges: float = 0.0  # probability a nudge arrives twice
    nudge_before_commit: float = 0.0  # probability the nudge comes before the row is visible
    rolled_back: float = 0.0  # probability a producer's transaction rolls back (nudged anyway)
    wake_late_seconds: float = 0.0  # the wake schedule fires this late
    wake_twice: bool = False  # and fires a second time
    lose_handoffs: float = 0.0  # probability Lambda accepts a hand-off and never runs it


@dataclass
class PacingReport:
    committed: int = 0
    rolled_back: int = 0
    delivered: int = 0
    lost: list[int] = field(default_factory=list)
    sent_twice: list[int] = field(default_factory=list)
    sent_rolled_back: int = 0
    # message id -> simulated seconds from its due time to its delivery
    lateness: dict[int, float] = field(default_factory=dict)
    runs: Counter[str] = field(default_factory=Counter)
    max_concurrent_runs: int = 0


class FakeScheduler:
    """GetSchedule and UpdateSchedule of the one wake schedule, as Scheduler
    answers them; the simulator fires it."""

    def __init__(self) -> None:
        self.expression = "at(2099-12-31T23:59:59)"
        self.updates = 0
        self.fired = False  # a one-time schedule fires once per time it is given
        self._exact: dt.datetime | None = None

    def get_schedule(self, Name: str, GroupName: str) -> dict[str, Any]:
        assert Name == WAKE
        return {
            "Name": Name,
            "ScheduleExpression": self.expression,
            "ScheduleExpressionTimezone": "UTC",
            "State": "ENABLED",
            "FlexibleTimeWindow": {"Mode": "OFF"},
            "Target": {"Arn": "arn:aws:lambda:us-east-1:123456789012:function:d", "RoleArn": "r"},
        }

    def update_schedule(self, **kwargs: Any) -> dict[str, Any]:
        assert kwargs["Name"] == WAKE and kwargs["Target"]["RoleArn"] == "r"
        self.expression = kwargs["ScheduleExpression"]
        self._exact = None
        self.updates += 1
        self.fired = False
        return {}

    def held(self) -> dt.datetime | None:
        return self._exact if self._exact is not None else pacing.held_time(self.expression)

    def shift(self, seconds: float) -> None:
        """Simulated time moved on: the held time moves back with the stored ones
        (exactly; the expression shows it to the second)."""
        held = self.held()
        if held is not None and held.year < 2099:
            self._exact = held - dt.timedelta(seconds=seconds)
            self.expression = f"at({self._exact.strftime('%Y-%m-%dT%H:%M:%S')})"


class PacingSim:
    def __init__(
        self,
        engine: sa.Engine,
        database_url: str,
        faults: Faults,
        *,
        safety_net: float = 600.0,
        seed: int = 1,
        concurrency: int = 2,
        budget_seconds: float = 5.0,
    ) -> None:
        self.engine = engine
        self.faults = faults
        self.safety_net = safety_net
        self.random = random.Random(seed)
        self.channel = install_channel(ScriptedChannel(name=CHANNEL))
        self.scheduler = FakeScheduler()
        # Simulated time: the seconds shifted so far plus the real time the
        # run took (the database clock moves on meanwhile too).
        self._shifted = 0.0
        self._started = time.monotonic()
        self.due: dict[int, float] = {}  # message id -> simulated due time
        self.delivered_at: dict[int, float] = {}
        self.report = PacingReport()
        self.slots = threading.BoundedSemaphore(concurrency)
        self._running = 0
        self._lock = threading.Lock()
        self.runtime = Runtime.for_dispatcher(
            {
                "DATABASE_URL": database_url,
                "PACING_MODE": "sleep",
                "IDLE_LINGER_SECONDS": "0.05",
                "DISPATCH_BUDGET_SECONDS": str(budget_seconds),
                "POLL_INTERVAL_SECONDS": "0.01",
                "LEASE_SECONDS": "120",
                "BATCH_SIZE": "20",
                "CHANNEL_FUNCTIONS": json.dumps({CHANNEL: "sim"}),
                "WAKE_SCHEDULE_NAME": WAKE,
            }
        )
        self.runtime.wake_schedule = pacing.WakeSchedule(WAKE, self.scheduler)
        self.runtime._invoker = CallableInvoker({CHANNEL: self._send})
        self.successors: list[float] = []
        self.runtime._lambda_client = self  # the dispatcher's own invokes land in invoke()

    # --- Lambda, as the dispatcher sees it ----------------------------------------

    def invoke(self, FunctionName: str, InvocationType: str, Payload: bytes) -> dict[str, Any]:
        event = json.loads(Payload)
        if event["source"] == "outbox.successor":
            self.successors.append(self.now)
        return {"StatusCode": 202}

    def _send(self, event: dict[str, Any]) -> None:
        if self.random.random() < self.faults.lose_handoffs:
            return  # accepted, never run: the lease expires
        before = len(self.channel.sent)
        context = LambdaContext(30)
        sender.run(
            self.runtime.engine,
            event,
            self.runtime.settings,
            lambda: context.get_remaining_time_in_millis() / 1000,
            channel_name=CHANNEL,
        )
        for message_id in self.channel.sent[before:]:
            self.delivered_at.setdefault(message_id, self.now)

    def dispatch(self, source: str, **extra: Any) -> None:
        """One dispatcher invocation; throttled (dropped) when the reserved
        concurrency is taken."""
        if not self.slots.acquire(blocking=False):
            self.report.runs["throttled"] += 1
            return
        try:
            with self._lock:
                self._running += 1
                self.report.max_concurrent_runs = max(
                    self.report.max_concurrent_runs, self._running
                )
            self.report.runs[source] += 1
            self.runtime.dispatch({"version": 1, "source": source, **extra}, LambdaContext(60))
        finally:
            with self._lock:
                self._running -= 1
            self.slots.release()

    # --- time ---------------------------------------------------------------------

    @property
    def now(self) -> float:
        """Simulated seconds since the start."""
        return self._shifted + time.monotonic() - self._started

    def advance(self, seconds: float) -> None:
        if seconds <= 0:
            return
        with self.engine.begin() as conn:
            for part in _SHIFT.split(";"):
                conn.execute(sa.text(part), {"s": seconds})
        self.scheduler.shift(seconds)
        # What the dispatcher remembers of the schedule moves with it.
        wake = self.runtime.wake_schedule
        if wake is not None and wake.known is not None:
            wake.known -= dt.timedelta(seconds=seconds)
        self._shifted += seconds

    def wake_in(self) -> float | None:
        """Simulated seconds until the wake schedule fires (None: not set)."""
        held = self.scheduler.held()
        if held is None or held.year >= 2099:
            return None
        with self.engine.connect() as conn:
            db_now = conn.execute(sa.text("SELECT now()")).scalar_one()
        return (held - db_now).total_seconds()

    # --- producers ----------------------------------------------------------------

    def enqueue(self, delay: float) -> None:
        nudge_first = self.random.random() < self.faults.nudge_before_commit
        rolled_back = self.random.random() < self.faults.rolled_back
        if nudge_first:
            # The nudge arrives while the producer's transaction is still open:
            # the row commits during the run's linger.
            timer = threading.Timer(0.01, self._commit, (delay, rolled_back))
            timer.start()
            self._nudge()
            timer.join()
            return
        self._commit(delay, rolled_back)
        self._nudge()

    def _commit(self, delay: float, rolled_back: bool) -> None:
        conn = self.engine.connect()
        try:
            transaction = conn.begin()
            message_id = outbox.enqueue(conn, CHANNEL, {"n": 1}, delay=delay or None)
            if rolled_back:
                transaction.rollback()
                self.report.rolled_back += 1
                self.rolled_back_ids.add(message_id)
            else:
                transaction.commit()
                self.report.committed += 1
                self.due[message_id] = self.now + delay
        finally:
            conn.close()

    rolled_back_ids: set[int]

    def _nudge(self) -> None:
        if self.random.random() < self.faults.lose_nudges:
            return
        copies = 2 if self.random.random() < self.faults.duplicate_nudges else 1
        for _ in range(copies):
            self.dispatch("outbox.nudge")

    # --- the whole run ------------------------------------------------------------

    def run(self, arrivals: list[tuple[float, float]], horizon: float) -> PacingReport:
        """``arrivals``: (simulated enqueue time, delay) pairs; then runs to ``horizon``."""
        self.rolled_back_ids = set()
        counter = itertools.count()
        events: list[tuple[float, int, str, float]] = [
            (at, next(counter), "enqueue", delay) for at, delay in arrivals
        ]
        t = self.safety_net
        while t <= horizon:
            events.append((t, next(counter), "safety-net", 0.0))
            t += self.safety_net
        heapq.heapify(events)
        while events:
            wake = self.wake_in()
            if self.successors:
                self.successors.clear()
                self.dispatch("outbox.successor")
                continue
            if wake is not None:
                late = self.faults.wake_late_seconds
                if not self.scheduler.fired and self.now + max(0.0, wake) + late <= events[0][0]:
                    self.advance(max(0.0, wake) + late)
                    self.scheduler.fired = True
                    scheduled = self.scheduler.held()
                    assert scheduled is not None
                    time_of = {"scheduled_time": scheduled.strftime("%Y-%m-%dT%H:%M:%SZ")}
                    self.dispatch("outbox.wake", **time_of)
                    if self.faults.wake_twice:
                        self.dispatch("outbox.wake", **time_of)
                    continue
            at, _, kind, delay = heapq.heappop(events)
            self.advance(at - self.now)
            if kind == "enqueue":
                self.enqueue(delay)
            else:
                self.dispatch("schedule")
        return self._finish()

    def _finish(self) -> PacingReport:
        report = self.report
        sends = Counter(self.channel.sent)
        report.sent_twice = sorted(i for i, n in sends.items() if n > 1)
        report.sent_rolled_back = sum(1 for i in sends if i in self.rolled_back_ids)
        report.lost = sorted(set(self.due) - set(sends))
        report.delivered = len(set(self.due) & set(sends))
        report.lateness = {
            i: self.delivered_at[i] - self.due[i] for i in self.due if i in self.delivered_at
        }
        return report


def arrivals(
    rng: random.Random, n: int, span: float, max_delay: float
) -> list[tuple[float, float]]:
    """``n`` enqueues spread over ``span`` simulated seconds, a third due at once,
    the rest delayed up to ``max_delay``."""
    out = []
    for _ in range(n):
        delay = 0.0 if rng.random() < 1 / 3 else round(rng.uniform(1, max_delay), 3)
        out.append((round(rng.uniform(0, span), 3), delay))
    return sorted(out)
