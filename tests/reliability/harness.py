"""Pieces of the fault campaign shared by the orchestrator and its child processes.

Everything the campaign records lives in ``rel_*`` tables of the campaign's own
database, written through a separate autocommit connection (application_name
``rel-aux``) so that a killed or disconnected relay process cannot lose it:

* ``rel_calls``     every provider call started (drives the per-message script);
* ``rel_accepts``   every send the fake provider ACCEPTED, committed before the
                    provider answers "delivered" (the durable record of what a
                    receiver saw);
* ``rel_events``    what the processes did that explains a duplicate: a kill
                    (with the claim tokens in flight), a crash of a sender run,
                    a lease lost at settle, a call abandoned at its deadline;
* ``rel_queue``     the hand-off queue between dispatcher and sender processes
                    (the stand-in for Lambda's asynchronous invoke queue, with
                    retries off: a sender that dies after taking an event loses it);
* ``rel_transitions`` filled by a trigger on ``outbox_message``: every move out
                    of ``claimed`` with the row's token and the token the writer
                    held (``rel.writer``, set in the writer's transaction), so a
                    write that landed with a stale token would show.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa

from outbox import store
from outbox.channels import Deadline, Message, Outcome, SchemaChannel
from outbox.handoff import HandOff, Invoker
from outbox.sender import DEADLINE_EXCEEDED

CHANNEL = "fake"
AUX_APP = "rel-aux"

# Kill points: where a process SIGKILLs itself (the dispatcher's two, the sender's three).
DISPATCHER_POINTS = ("after_claim", "after_handoff")
SENDER_POINTS = ("after_load", "after_send", "mid_settle")
# Not a kill: the sender sleeps past its lease before settling (the reaper takes the row).
STALL = "stall_before_settle"
ALL_POINTS = (*DISPATCHER_POINTS, *SENDER_POINTS, STALL)
# Hand-offs waiting for a sender before the invoke is refused (claims released).
MAX_QUEUED_EVENTS = 4
# Hand-offs whose Invoke answer is lost after Lambda queued the event (the
# dispatcher sees a timeout and releases): they must send nothing twice.
INVOKE_TIMEOUT = "invoke_timeout"
RELEASED = "released"
INVOKE_TIMEOUT_RATE = 0.05
# Every sender also stalls now and then, whatever its kill point.
STALL_RATE = 0.06
# Settles that first run a statement longer than the statement_timeout the
# campaign database sets (campaign.STATEMENT_TIMEOUT_MS = 1000).
SLOW_STATEMENT_RATE = 0.08
SLOW_STATEMENT_SECONDS = 1.5
# Events that may leave an accepted send unsettled, hence a duplicate later.
EXPLAINS_DUPLICATE = (
    "kill:after_send",
    "kill:mid_settle",
    "crash",
    "lease_lost",
    "abandoned",
    "stall",
)

SCHEMA_SQL = [
    """CREATE TABLE IF NOT EXISTS rel_calls (
        id bigserial PRIMARY KEY, message_id bigint NOT NULL, token uuid, pid int,
        at timestamptz NOT NULL DEFAULT clock_timestamp())""",
    """CREATE TABLE IF NOT EXISTS rel_accepts (
        id bigserial PRIMARY KEY, message_id bigint NOT NULL, token uuid, attempt int,
        pid int, late boolean NOT NULL DEFAULT false,
        at timestamptz NOT NULL DEFAULT clock_timestamp())""",
    """CREATE TABLE IF NOT EXISTS rel_events (
        id bigserial PRIMARY KEY, kind text NOT NULL, message_id bigint, token uuid,
        pid int, batch uuid, at timestamptz NOT NULL DEFAULT clock_timestamp())""",
    """CREATE TABLE IF NOT EXISTS rel_queue (id bigserial PRIMARY KEY, event jsonb NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS rel_transitions (
        id bigserial PRIMARY KEY, message_id bigint NOT NULL, old_token uuid,
        writer_token uuid, new_status text NOT NULL, lease_expired boolean,
        at timestamptz NOT NULL DEFAULT clock_timestamp())""",
    """CREATE OR REPLACE FUNCTION rel_audit() RETURNS trigger AS $$
    DECLARE
        writer jsonb := NULLIF(current_setting('rel.writer', true), '')::jsonb;
    BEGIN
        IF OLD.status = 'claimed' AND (NEW.status <> 'claimed'
                OR NEW.claim_token IS DISTINCT FROM OLD.claim_token) THEN
            INSERT INTO rel_transitions
                (message_id, old_token, writer_token, new_status, lease_expired)
            VALUES (OLD.id, OLD.claim_token, (writer ->> OLD.id::text)::uuid, NEW.status,
                    OLD.lease_expires_at < now());
        END IF;
        RETURN NEW;
    END $$ LANGUAGE plpgsql""",
    "DROP TRIGGER IF EXISTS rel_audit ON outbox_message",
    # BEFORE: a settle moves its row to the history's partitions, which
    # Postgres runs as a delete and an insert, firing no AFTER UPDATE trigger
    """CREATE TRIGGER rel_audit BEFORE UPDATE ON outbox_message
       FOR EACH ROW EXECUTE FUNCTION rel_audit()""",
]

RESET_SQL = (
    "TRUNCATE outbox_attempt, outbox_message, outbox_dedupe, rel_calls, rel_accepts, rel_events, rel_queue, "
    "rel_transitions RESTART IDENTITY"
)


def aux_engine(url: str) -> sa.Engine:
    """Autocommit engine for the campaign's own records (never a chaos target)."""
    return sa.create_engine(
        url,
        isolation_level="AUTOCOMMIT",
        connect_args={"application_name": AUX_APP},
        pool_size=2,
        pool_pre_ping=True,
    )


class Recorder:
    """Durable records: each call commits before it returns."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.pid = os.getpid()

    def _exec(self, sql: str, params: Any) -> Any:
        # The aux connection is never terminated on purpose; retry a blip anyway.
        for attempt in range(5):
            try:
                with self.engine.connect() as conn:
                    return conn.execute(sa.text(sql), params).all()
            except sa.exc.DBAPIError:
                if attempt == 4:
                    raise
                time.sleep(0.05)
        return None

    def events(self, kind: str, pairs: Sequence[tuple[int, Any]]) -> None:
        rows = [{"k": kind, "m": i, "t": str(t), "p": self.pid} for i, t in pairs] or [
            {"k": kind, "m": None, "t": None, "p": self.pid}
        ]
        self._exec(
            "INSERT INTO rel_events (kind, message_id, token, pid, batch) "
            "SELECT *, CAST(:b AS uuid) FROM unnest(CAST(:k AS text[]), CAST(:m AS bigint[]), "
            "CAST(:t AS uuid[]), CAST(:p AS int[])) RETURNING id",
            {
                "b": str(uuid.uuid4()),
                "k": [r["k"] for r in rows],
                "m": [r["m"] for r in rows],
                "t": [r["t"] for r in rows],
                "p": [r["p"] for r in rows],
            },
        )

    def call(self, message_id: int, token: Any) -> int:
        """Record a provider call; returns how many calls this message had before."""
        rows = self._exec(
            "WITH c AS (INSERT INTO rel_calls (message_id, token, pid) VALUES (:m, :t, :p)) "
            "SELECT count(*) AS n FROM rel_calls WHERE message_id = :m",
            {"m": message_id, "t": None if token is None else str(token), "p": self.pid},
        )
        return int(rows[0].n)

    def accept(self, message_id: int, token: Any, attempt: int, late: bool) -> None:
        self._exec(
            "INSERT INTO rel_accepts (message_id, token, attempt, pid, late) "
            "VALUES (:m, :t, :a, :p, :l) RETURNING id",
            {
                "m": message_id,
                "t": None if token is None else str(token),
                "a": attempt,
                "p": self.pid,
                "l": late,
            },
        )


class Killer:
    """Kills this process at one named point, with a probability per pass."""

    def __init__(self, recorder: Recorder, point: str | None, probability: float, seed: int):
        import random

        self.recorder = recorder
        self.point = point
        self.probability = probability
        self.rng = random.Random(seed)
        self._lock = threading.Lock()

    def chance(self, probability: float) -> bool:
        with self._lock:
            return self.rng.random() < probability

    def hit(self, point: str, pairs: Sequence[tuple[int, Any]]) -> bool:
        """True when the point fires (for STALL the caller stalls; kills never return)."""
        if point != self.point:
            return False
        with self._lock:
            fire = self.rng.random() < self.probability
        if not fire:
            return False
        if point == STALL:
            self.recorder.events("stall", pairs)
            return True
        self.recorder.events(f"kill:{point}", pairs)
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10)  # never reached
        return True


class FakeProvider(SchemaChannel):
    """The provider: a per-message script picks each call's behaviour; every
    send it accepts is committed to ``rel_accepts`` before it answers."""

    name = CHANNEL
    schema = {
        "type": "object",
        "required": ["n"],
        "properties": {"n": {"type": "integer"}, "script": {"type": "array"}},
    }

    def __init__(self, recorder: Recorder, killer: Killer | None = None) -> None:
        self.recorder = recorder
        self.killer = killer
        self.tokens: dict[int, Any] = {}  # message id -> claim token of the current hand-off
        self.in_flight: list[tuple[int, Any]] = []
        self.hanging = 0
        self._lock = threading.Lock()

    def send(self, message: Message, deadline: Deadline) -> Outcome:
        token = self.tokens.get(message.id)
        if (message.id, token) not in set(self.in_flight):
            # A row this sender's hand-off never named (a shifted read, a
            # replay): a send for another's claim.
            self.recorder.events("foreign_send", [(message.id, token)])
        calls_before = self.recorder.call(message.id, token)
        script = message.payload.get("script") or []
        behaviour = script[calls_before] if calls_before < len(script) else "ok"
        if behaviour == "drip":
            return self.drip(deadline)
        if behaviour == "transient":
            return Outcome.retry("provider: transient failure")
        if behaviour == "permanent":
            return Outcome.failed("provider: permanent failure")
        if behaviour == "throttle":
            return Outcome.deferred("provider: throttled", 0.1)
        if behaviour == "error":
            raise ConnectionError("provider: connection reset")
        late = False
        if behaviour == "hang":
            # Hang past the deadline, then accept anyway: the sender has given up.
            with self._lock:
                self.hanging += 1
            try:
                time.sleep(deadline.remaining() + 0.3)
            finally:
                with self._lock:
                    self.hanging -= 1
            late = True
        self.recorder.accept(message.id, token, message.attempt, late)
        if self.killer is not None:
            self.killer.hit("after_send", self.in_flight)
        return Outcome.delivered(f"fake-{message.id}-{calls_before}")

    def drip(self, deadline: Deadline) -> Outcome:
        """A real webhook POST to the campaign's dripping receiver (REL_DRIP_URL),
        through the webhook channel's own HTTP client and its deadline."""
        from outbox import netguard
        from outbox.channels.webhook import WebhookChannel

        target = netguard.resolve(os.environ["REL_DRIP_URL"], allow_insecure=True)
        channel = WebhookChannel(allow_insecure=True, default_secret_id="unused")
        headers = {"Host": target.host_header, "Content-Type": "application/json"}
        return channel._post(target, headers, b"{}", deadline)


def install_wrappers(
    recorder: Recorder, killer: Killer | None, lease_seconds: float
) -> Callable[[], None]:
    """Wrap the store's fenced writes: tell the audit trigger which token each
    writer holds, record lost leases and abandoned calls, and host the kill
    points inside the settle. Returns a function that undoes the wrapping."""
    # The sender settles through settle_with_outcomes, the dispatcher (its
    # unroutable rows) through settle: both go through the faults below.
    original_settle, original_release = store.settle_with_outcomes, store.release
    original_statuses_only = store.settle
    original_receive = store.receive_claimed

    def writer(conn: sa.Connection, pairs: Sequence[tuple[int, Any]]) -> None:
        # Transaction-local when there is a transaction; in autocommit (how the
        # relay's functions run) each statement is its own transaction, so the
        # setting must live on the session until this writer's next write.
        autocommit = bool(getattr(conn.connection.dbapi_connection, "autocommit", False))
        conn.execute(
            sa.text("SELECT set_config('rel.writer', :w, :local)"),
            {"w": json.dumps({str(i): str(t) for i, t in pairs}), "local": not autocommit},
        )

    def settle_with_outcomes(
        conn: sa.Connection, settlements: Sequence[store.Settlement], backoff: Any
    ) -> Any:
        pairs = [(s.id, s.claim_token) for s in settlements]
        stall = killer is not None and killer.hit(STALL, pairs)
        if killer is not None and not stall and killer.chance(STALL_RATE):
            recorder.events("stall", pairs)
            stall = True
        if stall:
            time.sleep(lease_seconds + 1.0)  # a slow sender: the reaper takes its rows
        writer(conn, pairs)
        if killer is not None and killer.chance(SLOW_STATEMENT_RATE):
            # A statement slower than the database's statement_timeout: Postgres
            # cancels it and the settle's transaction is lost with it.
            conn.execute(sa.text("SELECT pg_sleep(:s)"), {"s": SLOW_STATEMENT_SECONDS})
        result = original_settle(conn, settlements, backoff)
        abandoned = [(s.id, s.claim_token) for s in settlements if s.error == DEADLINE_EXCEEDED]
        if abandoned:
            recorder.events("abandoned", abandoned)
        lost = [(s.id, s.claim_token) for s in settlements if s.id not in result]
        if lost:
            recorder.events("lease_lost", lost)
        if killer is not None:
            killer.hit("mid_settle", pairs)  # the UPDATE ran, the COMMIT never comes
        return result

    def settle(conn: sa.Connection, settlements: Sequence[store.Settlement], backoff: Any) -> Any:
        settled = settle_with_outcomes(conn, settlements, backoff)
        return {i: row.status for i, row in settled.items()}

    def release(
        conn: sa.Connection, claims: Any, reason: str, delay_seconds: float = 0, **kwargs: Any
    ) -> Any:
        held = list(claims)
        writer(conn, [(c.id, c.claim_token) for c in held])
        released = original_release(conn, held, reason, delay_seconds, **kwargs)
        # A claim released and also sent under the same token is a release
        # that took back a started claim (campaign.check counts them).
        taken_back = [(c.id, c.claim_token) for c in held if c.id in released]
        if taken_back:
            recorder.events(RELEASED, taken_back)
        return released

    def receive_claimed(conn: sa.Connection, channel: str, claims: Any, default_max: int) -> Any:
        held = list(claims)
        pairs = [(c.id, c.claim_token) for c in held]
        rows = original_receive(conn, channel, held, default_max)
        if killer is not None:
            killer.hit("after_load", pairs)
        return rows

    store.settle, store.release, store.receive_claimed = settle, release, receive_claimed  # type: ignore[assignment]
    store.settle_with_outcomes = settle_with_outcomes  # type: ignore[assignment]

    def undo() -> None:
        store.settle, store.release, store.receive_claimed = (  # type: ignore[assignment]
            original_statuses_only,
            original_release,
            original_receive,
        )
        store.settle_with_outcomes = original_settle  # type: ignore[assignment]

    return undo


class QueueInvoker(Invoker):
    """Hand-off through ``rel_queue``; fails now and then, like a throttled
    invoke; and (outside calm runs) now and then queues the event and then
    raises, like an Invoke call whose answer timed out after Lambda accepted
    the event: it waits for the sender's receipt first, so the dispatcher's
    release meets a claim its sender already started."""

    def __init__(
        self,
        aux: sa.Engine,
        killer: Killer | None,
        fail_rate: float,
        seed: int,
        timeout_rate: float = INVOKE_TIMEOUT_RATE,
    ) -> None:
        import random

        self.aux = aux
        self.killer = killer
        self.fail_rate = fail_rate
        self.timeout_rate = timeout_rate if killer is not None else 0.0
        self.rng = random.Random(seed)

    def can_route(self, channel: str) -> bool:
        return channel == CHANNEL

    def hand_off(self, handoff: HandOff) -> None:
        pairs = [(c.id, c.claim_token) for c in handoff.claims]
        if self.killer is not None:
            self.killer.hit("after_claim", pairs)
        if self.rng.random() < self.fail_rate:
            raise RuntimeError("invoke throttled (injected)")
        with self.aux.connect() as conn:
            # Backpressure, as Lambda's throttling of a function at its reserved
            # concurrency would give: without it the dispatchers outrun the
            # senders and every lease expires in the queue.
            queued = conn.execute(sa.text("SELECT count(*) FROM rel_queue")).scalar_one()
            if queued >= MAX_QUEUED_EVENTS:
                raise RuntimeError("invoke throttled: the senders are busy")
            conn.execute(
                sa.text("INSERT INTO rel_queue (event) VALUES (CAST(:e AS jsonb))"),
                {"e": json.dumps(handoff.to_event())},
            )
        if self.killer is not None:
            self.killer.hit("after_handoff", pairs)
        if self.rng.random() < self.timeout_rate:
            self._wait_for_receipt(pairs)
            Recorder(self.aux).events(INVOKE_TIMEOUT, pairs)
            raise TimeoutError("Read timeout on endpoint URL (injected: the event was queued)")

    def _wait_for_receipt(self, pairs: list[tuple[int, Any]], seconds: float = 1.0) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            with self.aux.connect() as conn:
                received = conn.execute(
                    sa.text(
                        "SELECT count(*) FROM outbox_message WHERE id = ANY(CAST(:ids AS bigint[])) "
                        "AND received_at IS NOT NULL"
                    ),
                    {"ids": [i for i, _ in pairs]},
                ).scalar_one()
            if received:
                return
            time.sleep(0.02)


def pop_event(aux: sa.Engine) -> dict[str, Any] | None:
    with aux.connect() as conn:
        row = conn.execute(
            sa.text(
                "DELETE FROM rel_queue WHERE id = (SELECT id FROM rel_queue ORDER BY id "
                "LIMIT 1 FOR UPDATE SKIP LOCKED) RETURNING event"
            )
        ).first()
    return None if row is None else dict(row.event)


def event_pairs(event: dict[str, Any]) -> list[tuple[int, uuid.UUID]]:
    return [(int(m["id"]), uuid.UUID(m["claim_token"])) for m in event.get("messages", [])]


class FakeProviderRegistered:
    """Context manager: the fake channel registered (for enqueue-time validation)."""

    def __enter__(self) -> None:
        from outbox import channels

        self._saved = dict(channels._registry)
        channels.register(CHANNEL, lambda: FakeProvider(Recorder(sa.create_engine("sqlite://"))))

    def __exit__(self, *exc: object) -> None:
        from outbox import channels

        channels._registry.clear()
        channels._registry.update(self._saved)
        channels._instances.clear()
