"""A simulator of Lambda's asynchronous invoke, driving the real relay.

``LambdaSim`` is an ``outbox.handoff.Invoker``: the real dispatcher hands its
events to it, and it delivers them to the real sender (``outbox.sender.run``)
the way Lambda's asynchronous invoke does, faults included:

* one queue per function, served by as many worker threads as the function's
  reserved concurrency (each worker is one execution environment, with its own
  send threads, as in Lambda);
* an event that waited longer than the maximum event age is dropped and
  recorded, as Lambda sends it to the on-failure destination;
* ``Invoke`` answers TooManyRequestsException (the dispatcher's
  ``HandOffThrottled``) at random;
* events delivered twice, the two copies started at the same moment by two
  workers (Lambda's documented at-least-once delivery);
* events held back a random while, so that later ones overtake them;
* invocations killed at random: before they touch the database (an init crash
  or a kill), after the receipt but before the provider call, and between the
  provider's answer and the settle.

The dispatcher and the reaper run in their own threads, on their schedules,
against the real Postgres; a fake provider records every send it accepts.
Time is real and every time the relay uses comes from the database clock, so
the durations are scaled down (``SCALE`` below says how) and a run takes
seconds. ``SimReport`` says per run: what was lost, what ended ``dead``
without reaching the provider, each duplicate at the provider and the kill
that explains it, and the largest attempt count against the maximum.
"""

from __future__ import annotations

import heapq
import itertools
import json
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from outbox import channels, dispatcher, reaper, sender, sendpool, store
from outbox.channels import Deadline, Message, Outcome, SchemaChannel
from outbox.handoff import HandOff, HandOffThrottled, Invoker
from outbox.relay_settings import RelaySettings

CHANNEL = "sim"

# The scale: production durations divided by about 75 for the retry window and
# an outage (15 s backoff base -> 0.2 s, 30 min cap -> 24 s, 10 min -> 8 s),
# while the lease, the sender timeout and the event age stay at a few seconds,
# so that a database round trip on a busy test machine stays small beside them.
SCALE = 75
LEASE_SECONDS = 4
SENDER_TIMEOUT_SECONDS = 1
MAX_EVENT_AGE_SECONDS = 2
REAPER_INTERVAL_SECONDS = 0.5  # the reaper's one-minute schedule, scaled


def sim_settings(**overrides: Any) -> RelaySettings:
    """Relay settings at the simulator's scale (the retry window: 8 attempts,
    base 0.2 s, cap 24 s: about 12 to 25 s from the first failure to dead)."""
    values: dict[str, Any] = {
        "batch_size": 100,
        "lease_seconds": LEASE_SECONDS,
        "sender_timeout_seconds": SENDER_TIMEOUT_SECONDS,
        "max_event_age_seconds": MAX_EVENT_AGE_SECONDS,
        "max_attempts": 8,
        "backoff_base_seconds": 15 / SCALE,
        "backoff_cap_seconds": 1800 / SCALE,
        "handoff_chunk_size": 20,
        "send_concurrency": 8,
        "settle_margin_seconds": 0.3,
        "poll_interval_seconds": 0.05,
        "channel_functions": {CHANNEL: "sim-sender"},
        "channel_concurrency": {CHANNEL: 10},
    }
    values.update(overrides)
    settings = RelaySettings(**values)
    settings.check_lease()
    return settings


class SimulatedKill(BaseException):
    """The execution environment died here (not an Exception: nothing in the
    relay catches it, as nothing survives a SIGKILL)."""

    def __init__(self, point: str) -> None:
        super().__init__(point)
        self.point = point


@dataclass
class Faults:
    """Probabilities of each fault (per event, per invocation or per row)."""

    throttle: float = 0.0  # an Invoke call answers 429
    duplicate: float = 0.0  # an event delivered twice, the copies at once
    delay: float = 0.0  # an event held back up to max_delay_seconds
    max_delay_seconds: float = 0.5
    kill_before_receipt: float = 0.0  # per invocation
    kill_before_send: float = 0.0  # per row, after the receipt
    kill_after_send: float = 0.0  # per row, the provider accepted it
    init_crash: bool = False  # every invocation fails at init (a broken deploy)


@dataclass(frozen=True)
class Send:
    message_id: int
    attempt: int
    at: float


class SimProvider(SchemaChannel):
    """The fake provider behind the ``sim`` channel: accepts every send (after
    ``latency_seconds``), unless an outage is on; records what it accepted."""

    name = CHANNEL
    schema = {"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}}

    def __init__(self, faults: Faults, seed: int, latency_seconds: float = 0.0) -> None:
        self.faults = faults
        self.latency_seconds = latency_seconds
        self.armed = False  # kills only once the run starts, never at enqueue
        self.outage_until = 0.0
        self.sends: list[Send] = []
        self.refused = 0
        # Environments killed mid-invocation (by worker thread name): they send
        # nothing more, and die at their settle.
        self.killed: dict[str, str] = {}
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def _chance(self, probability: float) -> bool:
        with self._lock:
            return probability > 0 and self._rng.random() < probability

    @staticmethod
    def environment() -> str:
        """The simulated environment a send thread belongs to (see EnvironmentPools)."""
        return threading.current_thread().name.rsplit("-send_", 1)[0]

    def _kill(self, point: str) -> None:
        with self._lock:
            self.killed.setdefault(self.environment(), point)

    def validate(self, payload: Any) -> None:
        super().validate(payload)
        if self.armed and self._chance(self.faults.kill_before_send):
            self._kill("before_send")

    def send(self, message: Message, deadline: Deadline) -> Outcome:
        if self.latency_seconds:
            time.sleep(min(self.latency_seconds, deadline.remaining()))
        with self._lock:
            dead = self.environment() in self.killed
        if dead:  # a killed process sends nothing more
            return Outcome.retry("killed")
        if time.monotonic() < self.outage_until:
            with self._lock:
                self.refused += 1
            return Outcome.retry("provider unavailable (simulated outage)")
        with self._lock:
            self.sends.append(Send(message.id, message.attempt, time.monotonic()))
            n = len(self.sends)
        if self.armed and self._chance(self.faults.kill_after_send):
            self._kill("after_send")
        return Outcome.delivered(f"sim-{n}")


@dataclass(order=True)
class _Queued:
    visible_at: float
    seq: int
    enqueued_at: float = field(compare=False)
    event: dict[str, Any] = field(compare=False)
    # Shared by the two copies of a duplicated event, so that they start together.
    pair: threading.Barrier | None = field(compare=False, default=None)


@dataclass
class SimRecord:
    """What the simulated Lambda service did (its on-failure destination included)."""

    invocations: int = 0
    throttled: int = 0
    duplicated: int = 0
    delayed: int = 0
    dropped_for_age: list[dict[str, Any]] = field(default_factory=list)
    function_errors: list[str] = field(default_factory=list)
    kills: Counter[str] = field(default_factory=Counter)
    # (message id, attempt) of every row in an invocation that died after its
    # receipt, or lost its lease: a send of these may never have been settled.
    unsettled: set[tuple[int, int]] = field(default_factory=set)
    max_queue_depth: int = 0


class SimFunction:
    """One channel function: a queue and ``concurrency`` execution environments."""

    def __init__(self, sim: LambdaSim, channel: str, concurrency: int) -> None:
        self.sim = sim
        self.channel = channel
        self._queue: list[_Queued] = []
        self._cond = threading.Condition()
        self._seq = itertools.count()
        self._busy = 0
        self._workers = [
            threading.Thread(target=self._serve, name=f"sim-{channel}-{i}", daemon=True)
            for i in range(concurrency)
        ]

    def start(self) -> None:
        for worker in self._workers:
            worker.start()

    def join(self) -> None:
        with self._cond:
            self._cond.notify_all()
        for worker in self._workers:
            worker.join(timeout=30)

    def put(self, event: dict[str, Any], copies: int, delay: float) -> None:
        now = time.monotonic()
        pair = threading.Barrier(copies) if copies > 1 else None
        with self._cond:
            for _ in range(copies):
                heapq.heappush(self._queue, _Queued(now + delay, next(self._seq), now, event, pair))
            depth = len(self._queue)
            self._cond.notify_all()
        record = self.sim.record
        with self.sim.lock:
            record.max_queue_depth = max(record.max_queue_depth, depth)

    def idle(self) -> bool:
        with self._cond:
            return not self._queue and self._busy == 0

    def _take(self) -> _Queued | None:
        with self._cond:
            while not self.sim.stopping.is_set():
                if self._queue:
                    wait = self._queue[0].visible_at - time.monotonic()
                    if wait <= 0:
                        self._busy += 1
                        return heapq.heappop(self._queue)
                    self._cond.wait(timeout=wait)
                else:
                    self._cond.wait(timeout=0.1)
            return None

    def _serve(self) -> None:
        with self.sim.pools.own_send_threads():
            while (item := self._take()) is not None:
                try:
                    self._invoke(item)
                finally:
                    with self._cond:
                        self._busy -= 1

    def _invoke(self, item: _Queued) -> None:
        sim, record = self.sim, self.sim.record
        age = time.monotonic() - item.enqueued_at
        if age > sim.settings.max_event_age_seconds:
            with sim.lock:
                record.dropped_for_age.append(item.event)
            return
        if item.pair is not None:  # both copies start at once, in two environments
            with suppress(threading.BrokenBarrierError):
                item.pair.wait(timeout=1.0)
        with sim.lock:
            record.invocations += 1
        rows = [(m["id"], m["attempt"]) for m in item.event["messages"]]
        if sim.faults.init_crash:
            with sim.lock:
                record.function_errors.append("init crash")
            return
        if sim.chance(sim.faults.kill_before_receipt):
            with sim.lock:
                record.kills["before_receipt"] += 1
            return
        deadline = time.monotonic() + sim.settings.sender_timeout_seconds
        try:
            report = sender.run(
                sim.engine,
                item.event,
                sim.settings,
                lambda: deadline - time.monotonic(),
                channel_name=self.channel,
            )
        except SimulatedKill as kill:
            with sim.lock:
                record.kills[kill.point] += 1
                record.unsettled.update(rows)
            return
        except Exception as exc:
            with sim.lock:
                record.function_errors.append(type(exc).__name__)
            return
        if report.lease_lost:
            lost = set(report.lease_lost)
            with sim.lock:
                record.unsettled.update(r for r in rows if r[0] in lost)


class LambdaSim(Invoker):
    """The Invoker the dispatcher hands off to, and the run around it."""

    def __init__(
        self,
        engine: sa.Engine,
        settings: RelaySettings,
        provider: SimProvider,
        faults: Faults,
        *,
        concurrency: dict[str, int],
        seed: int = 0,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.provider = provider
        self.faults = faults
        self.record = SimRecord()
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self._rng = random.Random(seed)
        self.pools = EnvironmentPools(sendpool.pools)
        self.functions = {c: SimFunction(self, c, n) for c, n in concurrency.items()}

    # --- the Invoker protocol ---------------------------------------------

    def can_route(self, channel: str) -> bool:
        return channel in self.functions

    def hand_off(self, handoff: HandOff) -> None:
        if self.chance(self.faults.throttle):
            with self.lock:
                self.record.throttled += 1
            raise HandOffThrottled(handoff.channel)
        # The payload travels as JSON, as Lambda's does.
        event = json.loads(json.dumps(handoff.to_event()))
        copies = 2 if self.chance(self.faults.duplicate) else 1
        delay = 0.0
        if self.chance(self.faults.delay):
            with self.lock:
                delay = self._rng.uniform(0, self.faults.max_delay_seconds)
                self.record.delayed += 1
        if copies > 1:
            with self.lock:
                self.record.duplicated += 1
        self.functions[handoff.channel].put(event, copies, delay)

    # --- helpers ------------------------------------------------------------

    def chance(self, probability: float) -> bool:
        with self.lock:
            return probability > 0 and self._rng.random() < probability

    def idle(self) -> bool:
        return all(f.idle() for f in self.functions.values())


class EnvironmentPools(sendpool.Pools):
    """Stands in for ``outbox.sendpool.pools`` during a run: each simulated
    execution environment (a function's worker thread) has send threads of its
    own, as in Lambda. Other threads use the process's own pools."""

    def __init__(self, original: sendpool.Pools) -> None:
        super().__init__()
        self.original = original
        self._local = threading.local()

    @contextmanager
    def own_send_threads(self) -> Iterator[None]:
        """The calling thread is one execution environment until the block ends."""
        self._local.prefix = f"{threading.current_thread().name}-send"
        self._local.threads = None
        try:
            yield
        finally:
            threads = self._local.threads
            self._local.prefix = self._local.threads = None
            if threads is not None:
                threads.retire()

    def get(self, size: int) -> sendpool.SendThreads:
        prefix: str | None = getattr(self._local, "prefix", None)
        if prefix is None:  # not a simulated environment's thread
            return self.original.get(size)
        threads: sendpool.SendThreads | None = self._local.threads
        if threads is None:  # the first send, or its threads were retired
            threads = self._local.threads = sendpool.SendThreads(size, prefix)
        return threads

    def retire(self, threads: sendpool.SendThreads) -> None:
        if getattr(self._local, "threads", None) is threads:
            self._local.threads = None  # the environment's next send starts new threads
            threads.retire()
        else:
            self.original.retire(threads)


@dataclass
class SimReport:
    """The figures of one run, and the violations of the relay's promises."""

    messages: int
    seconds: float
    statuses: dict[str, int]
    record: SimRecord
    sends: int
    duplicates: int
    unexplained_duplicates: list[tuple[int, int]]
    sent_twice_in_one_attempt: list[tuple[int, int]]
    lost: list[int]
    dead_never_sent: list[int]
    max_attempts_seen: int
    max_attempts_allowed: int
    attempts_over_max: list[int]
    attempt_counts: Counter[int]
    refused_by_outage: int
    first_send_after_seconds: float | None

    @property
    def violations(self) -> list[str]:
        found = []
        if self.lost:
            found.append(f"{len(self.lost)} lost: {self.lost[:10]}")
        if self.dead_never_sent:
            found.append(
                f"{len(self.dead_never_sent)} dead, never sent: {self.dead_never_sent[:10]}"
            )
        if self.sent_twice_in_one_attempt:
            found.append(
                f"sent twice in one attempt (id, attempt): {self.sent_twice_in_one_attempt[:10]}"
            )
        if self.unexplained_duplicates:
            found.append(f"duplicates no kill explains: {self.unexplained_duplicates[:10]}")
        if self.attempts_over_max:
            found.append(f"attempts over the maximum: {self.attempts_over_max[:10]}")
        return found

    def line(self) -> str:
        r = self.record
        return (
            f"{self.messages} messages in {self.seconds:.1f} s ({self.messages / self.seconds:.0f}/s):"
            f" {dict(sorted(self.statuses.items()))}; sends {self.sends}, duplicates"
            f" {self.duplicates} ({len(self.unexplained_duplicates)} unexplained);"
            f" invocations {r.invocations}, dropped for age {len(r.dropped_for_age)},"
            f" throttled {r.throttled}, duplicated events {r.duplicated}, delayed {r.delayed},"
            f" kills {dict(r.kills)}, function errors {len(r.function_errors)},"
            f" deepest queue {r.max_queue_depth}; attempts per row {dict(sorted(self.attempt_counts.items()))}"
            f" (max {self.max_attempts_seen} of {self.max_attempts_allowed})"
        )


def enqueue(engine: sa.Engine, n: int, chunk: int = 5000) -> list[int]:
    """n messages for the sim channel, in one statement per ``chunk``."""
    import outbox

    ids: list[int] = []
    for start in range(0, n, chunk):
        with engine.begin() as conn:
            ids += outbox.enqueue_many(
                conn,
                [
                    {"channel": CHANNEL, "payload": {"n": i}}
                    for i in range(start, min(n, start + chunk))
                ],
            )
    return ids


@contextmanager
def _running(sim: LambdaSim) -> Iterator[None]:
    """The simulated service running for the block: every function's
    environments, the dispatcher and the reaper, with the senders' send
    threads taken from the simulator's pools; all stopped and joined, and
    the pools given back, when the block ends."""
    sendpool.pools = sim.pools
    threads = [
        threading.Thread(target=_dispatch_loop, args=(sim,), name="sim-dispatcher", daemon=True),
        threading.Thread(target=_reap_loop, args=(sim,), name="sim-reaper", daemon=True),
    ]
    try:
        for function in sim.functions.values():
            function.start()
        for thread in threads:
            thread.start()
        yield
    finally:
        sim.stopping.set()
        for thread in threads:
            thread.join(timeout=30)
        for function in sim.functions.values():
            function.join()
        sendpool.pools = sim.pools.original


def run(
    engine: sa.Engine,
    settings: RelaySettings,
    faults: Faults,
    *,
    messages: int | None = None,
    ids: list[int] | None = None,
    concurrency: int = 10,
    seed: int = 0,
    latency_seconds: float = 0.0,
    timeout_seconds: float = 60.0,
    outage_seconds: float = 0.0,
    on_start: Callable[[LambdaSim], None] | None = None,
) -> SimReport:
    """Enqueue ``messages`` (or take ``ids`` already enqueued), run the
    dispatcher, the reaper and the simulated functions until every row is
    final (or ``timeout_seconds``), and check the run."""
    provider = SimProvider(faults, seed, latency_seconds)
    channels.register(CHANNEL, lambda: provider)
    if ids is None:
        ids = enqueue(engine, messages or 0)
    sim = LambdaSim(
        engine, settings, provider, faults, concurrency={CHANNEL: concurrency}, seed=seed + 1
    )
    started = time.monotonic()
    provider.armed = True
    provider.outage_until = started + outage_seconds
    real_settle = store.settle_with_outcomes  # the sender's settle

    def settle_unless_killed(*args: Any, **kwargs: Any) -> Any:
        """A process killed during its sends dies here, before its settle."""
        with provider._lock:
            point = provider.killed.pop(threading.current_thread().name, None)
        if point is not None:
            raise SimulatedKill(point)
        return real_settle(*args, **kwargs)

    store.settle_with_outcomes = settle_unless_killed  # type: ignore[assignment]
    try:
        with _running(sim):
            if on_start is not None:
                on_start(sim)
            deadline = started + timeout_seconds
            while time.monotonic() < deadline and not _all_final(engine, ids):
                time.sleep(0.2)
    finally:
        store.settle_with_outcomes = real_settle  # type: ignore[assignment]
    return check(engine, sim, ids, started)


@contextmanager
def serving(
    engine: sa.Engine, settings: RelaySettings, concurrency: dict[str, int], seed: int = 0
) -> Iterator[LambdaSim]:
    """The simulated service with no faults, for channels registered by the
    caller (``settings.channel_functions`` must route them): the dispatcher,
    the reaper and ``concurrency`` execution environments per channel run
    until the block ends. For benchmarks of real channels (bench/ratelimit.py)."""
    faults = Faults()
    sim = LambdaSim(
        engine, settings, SimProvider(faults, seed), faults, concurrency=concurrency, seed=seed
    )
    with _running(sim):
        yield sim


def _dispatch_loop(sim: LambdaSim) -> None:
    while not sim.stopping.is_set():
        dispatcher.run(
            sim.engine,
            sim,
            sim.settings,
            time_left=lambda: 0.0 if sim.stopping.is_set() else 60.0,
        )


def _reap_loop(sim: LambdaSim) -> None:
    while not sim.stopping.wait(REAPER_INTERVAL_SECONDS):
        reaper.run(sim.engine, sim.settings, time_left=lambda: 10.0)


_FINAL = "('pending', 'claimed')"


def _all_final(engine: sa.Engine, ids: list[int]) -> bool:
    with engine.connect() as conn:
        return not conn.execute(
            sa.text(
                f"SELECT EXISTS (SELECT 1 FROM outbox_message WHERE status IN {_FINAL} "
                "AND id BETWEEN :lo AND :hi)"
            ),
            {"lo": min(ids), "hi": max(ids)},
        ).scalar_one()


def check(engine: sa.Engine, sim: LambdaSim, ids: list[int], started: float) -> SimReport:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT id, status, attempts, COALESCE(max_attempts, :default_max) AS max_attempts "
                "FROM outbox_message WHERE id BETWEEN :lo AND :hi"
            ),
            {"lo": min(ids), "hi": max(ids), "default_max": sim.settings.max_attempts},
        ).all()
        delivered_attempt = dict(
            conn.execute(  # type: ignore[arg-type]
                sa.text(
                    "SELECT message_id, attempt FROM outbox_attempt "
                    "WHERE outcome = 'delivered' AND message_id BETWEEN :lo AND :hi"
                ),
                {"lo": min(ids), "hi": max(ids)},
            ).all()
        )
        # Calls the sender gave up at their deadline (counted as a retry) that
        # the provider still completed: the third duplicate case of docs/explanation/guarantees.md.
        abandoned = {
            (r.message_id, r.attempt)
            for r in conn.execute(
                sa.text(
                    "SELECT message_id, attempt FROM outbox_attempt "
                    "WHERE error = :error AND message_id BETWEEN :lo AND :hi"
                ),
                {"error": sender.DEADLINE_EXCEEDED, "lo": min(ids), "hi": max(ids)},
            )
        }
    by_id = {r.id: r for r in rows}
    sends = sim.provider.sends
    per_attempt = Counter((s.message_id, s.attempt) for s in sends)
    sent_ids = Counter(s.message_id for s in sends)
    unsettled = sim.record.unsettled | abandoned
    # A send is explained when its attempt was settled delivered, or its
    # invocation died (or lost its lease) after the receipt, or the sender
    # gave the call up at its deadline.
    unexplained = sorted(
        key
        for key in per_attempt
        if delivered_attempt.get(key[0]) != key[1] and key not in unsettled
    )
    wanted = set(ids)
    lost = sorted(
        i
        for i in wanted
        if i not in by_id
        or by_id[i].status in ("pending", "claimed")
        or (by_id[i].status == "delivered" and sent_ids[i] == 0)
    )
    return SimReport(
        messages=len(ids),
        seconds=time.monotonic() - started,
        statuses=dict(Counter(r.status for r in rows)),
        record=sim.record,
        sends=len(sends),
        duplicates=sum(n - 1 for n in sent_ids.values() if n > 1),
        unexplained_duplicates=unexplained,
        sent_twice_in_one_attempt=sorted(k for k, n in per_attempt.items() if n > 1),
        lost=lost,
        dead_never_sent=sorted(r.id for r in rows if r.status == "dead" and sent_ids[r.id] == 0),
        max_attempts_seen=max((r.attempts for r in rows), default=0),
        max_attempts_allowed=max((r.max_attempts for r in rows), default=0),
        attempts_over_max=sorted(r.id for r in rows if r.attempts > r.max_attempts),
        attempt_counts=Counter(r.attempts for r in rows),
        refused_by_outage=sim.provider.refused,
        first_send_after_seconds=min((s.at for s in sends), default=None)
        and (min(s.at for s in sends) - started),
    )


def attempts_without_a_send(engine: sa.Engine, ids: list[int], sim_sends: list[Send]) -> int:
    """Attempts counted beyond the provider calls that could explain them: an
    attempt a row spent with no send started (rows of a run without kills)."""
    sent = Counter(s.message_id for s in sim_sends)
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT id, attempts FROM outbox_message WHERE id BETWEEN :lo AND :hi"),
            {"lo": min(ids), "hi": max(ids)},
        ).all()
    return sum(max(0, r.attempts - sent[r.id]) for r in rows)
