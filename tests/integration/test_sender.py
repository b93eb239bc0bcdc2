"""The sender runtime: the receipt, outcomes, batched fenced settle
(docs/design.md, invariants 2, 4, 6, 7)."""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field

import pytest
import sqlalchemy as sa

from outbox import sender, store
from outbox.channels import Deadline, Message, Outcome
from support import (
    ScriptedChannel,
    attempts,
    claim,
    enqueue,
    insert_raw,
    install_channel,
    receive,
    row,
    send,
    settings,
    wait_after_settle,
)


def test_delivered_records_provider_id_and_one_attempt(engine: sa.Engine) -> None:
    channel = install_channel(ScriptedChannel())
    (mid,) = enqueue(engine, channel="scripted")
    report = send(engine, claim(engine))
    assert report.statuses == {"delivered": 1} and channel.sent == [mid]
    with engine.connect() as conn:
        r, history = row(conn, mid), attempts(conn, mid)
    assert (r.status, r.attempts, r.provider_message_id, r.claim_token) == (
        "delivered",
        1,
        f"p-{mid}",
        None,
    )
    assert r.settled_at is not None
    assert [(a.attempt, a.outcome, a.provider_message_id) for a in history] == [
        (1, "delivered", f"p-{mid}")
    ]


def test_each_outcome_class_in_one_batch(engine: sa.Engine) -> None:
    install_channel(
        ScriptedChannel(
            answers=[
                Outcome.delivered("x"),
                Outcome.retry("503 from provider"),
                Outcome.failed("rejected"),
                Outcome.suppressed("opted out"),
                Outcome.deferred("throttled", 30),
            ]
        )
    )
    ids = enqueue(engine, 5, "scripted")
    # One at a time through the pool so the scripted answers line up with ids.
    report = send(engine, claim(engine), send_concurrency=1)
    assert report.statuses == {
        "delivered": 1,
        "pending": 1,
        "failed": 1,
        "suppressed": 1,
        "deferred": 1,
    }
    with engine.connect() as conn:
        rows = [row(conn, i) for i in ids]
        # Against the settle's own clock, not this later transaction's.
        retry_wait, defer_wait = wait_after_settle(conn, ids[1]), wait_after_settle(conn, ids[4])
        history = {i: [(a.attempt, a.outcome) for a in attempts(conn, i)] for i in ids}
    assert [r.status for r in rows] == ["delivered", "pending", "failed", "suppressed", "pending"]
    assert [r.attempts for r in rows] == [1, 1, 1, 1, 0]  # the deferral counted no attempt
    assert rows[1].last_error == "503 from provider" and rows[4].last_error == "throttled"
    assert 0.5 <= retry_wait <= 1.0  # base 1s, equal jitter
    assert defer_wait == pytest.approx(30)  # the deferral asked for
    assert history[ids[1]] == [(1, "retry")] and history[ids[4]] == [(1, "deferred")]


def test_backoff_grows_and_is_capped_then_dead_at_max_attempts(engine: sa.Engine) -> None:
    install_channel(ScriptedChannel(answers=[Outcome.retry("boom")] * 10))
    (mid,) = enqueue(engine, channel="scripted", max_attempts=4)
    waits = []
    for _ in range(4):
        send(engine, claim(engine), backoff_base_seconds=10, backoff_cap_seconds=25)
        with engine.begin() as conn:
            # Against the settle's own clock: a busy machine must not shorten it.
            waits.append(wait_after_settle(conn, mid))
            conn.execute(
                sa.text("UPDATE outbox_message SET available_at = now() WHERE status = 'pending'")
            )
    with engine.connect() as conn:
        r, history = row(conn, mid), attempts(conn, mid)
    assert 5 <= waits[0] <= 10 and 10 <= waits[1] <= 20 and 12.5 <= waits[2] <= 25
    assert (r.status, r.attempts) == ("dead", 4)
    assert [a.outcome for a in history] == ["retry", "retry", "retry", "dead"]


def test_a_sender_whose_lease_was_taken_changes_nothing_and_says_so(engine: sa.Engine) -> None:
    install_channel(ScriptedChannel())
    (mid,) = enqueue(engine, channel="scripted")
    stale = claim(engine)
    receive(engine, stale)  # a slow sender took it ...
    with engine.begin() as conn:  # ... the reaper released it and another dispatcher re-claimed it
        conn.execute(sa.text("UPDATE outbox_message SET lease_expires_at = now() - interval '1s'"))
        store.reap_expired(conn, 10, store.Backoff(0, 0, 5))
    fresh = claim(engine)
    assert fresh[0].claim_token != stale[0].claim_token
    report = send(engine, stale)
    assert report.lease_lost == [mid] and report.owned == 0
    with engine.connect() as conn:
        r = row(conn, mid)
    assert (r.status, str(r.claim_token), r.attempts) == ("claimed", fresh[0].claim_token, 1)


def test_settle_with_a_stale_token_changes_nothing(engine: sa.Engine) -> None:
    install_channel(ScriptedChannel())
    (mid,) = enqueue(engine, channel="scripted")
    (c,) = claim(engine)
    with engine.begin() as conn:
        result = store.settle(
            conn, [store.Settlement(mid, uuid.uuid4(), "delivered")], store.Backoff(1, 1, 3)
        )
        assert result == {}
        stale = store.Claim(mid, "scripted", uuid.uuid4(), 1)
        assert store.release(conn, [stale], "x") == set()
        r = row(conn, mid)
    assert (r.status, str(r.claim_token)) == ("claimed", c.claim_token)
    with engine.connect() as conn:
        assert attempts(conn, mid) == []


def test_lease_lost_between_send_and_settle_abandons_the_outcome(engine: sa.Engine) -> None:
    class Reaped(ScriptedChannel):
        def send(self, message, deadline):  # type: ignore[no-untyped-def]
            with engine.begin() as conn:  # the reaper strikes while the provider call runs
                conn.execute(
                    sa.text("UPDATE outbox_message SET lease_expires_at = now() - interval '1s'")
                )
                store.reap_expired(conn, 10, store.Backoff(0, 0, 5))
            return super().send(message, deadline)

    install_channel(Reaped())
    (mid,) = enqueue(engine, channel="scripted")
    report = send(engine, claim(engine))
    assert report.lease_lost == [mid] and not report.statuses
    with engine.connect() as conn:
        r, history = row(conn, mid), attempts(conn, mid)
    assert (r.status, r.attempts) == ("pending", 1)  # the reaper's outcome stands, not "delivered"
    assert [a.outcome for a in history] == ["expired"]


def test_rows_past_the_deadline_are_not_started_not_left_to_expire(engine: sa.Engine) -> None:
    install_channel(ScriptedChannel())
    enqueue(engine, 3, "scripted")
    # The Lambda has less time left than the settle margin: nothing may start.
    report = send(engine, claim(engine), remaining=0.4, settle_margin_seconds=0.5)
    assert report.statuses == {"not_started": 3}
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT status, attempts, last_error FROM outbox_message")
        ).all()
    assert {tuple(r) for r in rows} == {("pending", 0, sender.NOT_STARTED)}


def test_no_call_starts_with_too_little_time_left_to_be_answered(engine: sa.Engine) -> None:
    """A call begun a moment before its deadline is given up after the receiver
    got the request, and then sent again: such a row is not started instead."""
    channel = install_channel(ScriptedChannel())
    (mid,) = enqueue(engine, channel="scripted")
    left = sender.MIN_CALL_SECONDS * 0.6  # after the settle margin
    report = send(engine, claim(engine), remaining=0.5 + left, settle_margin_seconds=0.5)
    assert channel.sent == [] and report.statuses == {"not_started": 1}
    with engine.connect() as conn:
        assert (row(conn, mid).status, row(conn, mid).attempts) == ("pending", 0)


def test_a_provider_call_that_hangs_past_its_deadline_is_given_up(engine: sa.Engine) -> None:
    install_channel(ScriptedChannel(answers=[3.0]))
    (mid,) = enqueue(engine, channel="scripted")
    report = send(engine, claim(engine), remaining=1.5, settle_margin_seconds=0.5)
    assert report.statuses == {"pending": 1}
    with engine.connect() as conn:
        r = row(conn, mid)
    assert (r.status, r.attempts, r.last_error) == ("pending", 1, sender.DEADLINE_EXCEEDED)


def test_bad_payload_fails_that_row_and_the_rest_is_delivered(engine: sa.Engine) -> None:
    install_channel(ScriptedChannel())
    good, bad = enqueue(engine, 2, "scripted")
    with engine.begin() as conn:
        conn.execute(
            sa.text('UPDATE outbox_message SET payload = \'{"n": "seven"}\' WHERE id = :id'),
            {"id": bad},
        )
    report = send(engine, claim(engine))
    assert report.statuses == {"delivered": 1, "failed": 1}
    with engine.connect() as conn:
        assert row(conn, good).status == "delivered"
        failed = row(conn, bad)
    assert failed.status == "failed" and failed.last_error.startswith("invalid payload: payload.n")


def test_an_exception_from_the_channel_is_a_retry(engine: sa.Engine) -> None:
    install_channel(ScriptedChannel(answers=[ConnectionResetError("peer said no")]))
    (mid,) = enqueue(engine, channel="scripted")
    send(engine, claim(engine))
    with engine.connect() as conn:
        r = row(conn, mid)
    assert (r.status, r.last_error) == ("pending", "unexpected ConnectionResetError")


def test_replayed_hand_off_after_settle_changes_nothing(engine: sa.Engine) -> None:
    channel = install_channel(ScriptedChannel())
    (mid,) = enqueue(engine, channel="scripted")
    claims = claim(engine)
    send(engine, claims)
    again = send(engine, claims)
    assert again.lease_lost == [mid] and channel.sent == [mid]
    with engine.connect() as conn:
        assert len(attempts(conn, mid)) == 1


def test_settle_is_one_statement_whatever_the_batch_size(engine: sa.Engine) -> None:
    install_channel(ScriptedChannel())
    enqueue(engine, 200, "scripted")
    statements: list[str] = []

    def count(conn, cursor, statement, *args):  # type: ignore[no-untyped-def]
        statements.append(statement)

    claims = claim(engine, batch=200)
    sa.event.listen(engine, "before_cursor_execute", count)
    try:
        report = send(engine, claims)
    finally:
        sa.event.remove(engine, "before_cursor_execute", count)
    assert report.statuses == {"delivered": 200}
    # the receipt (which reads its channel's pause too) and the settle; on
    # this engine's transactions each in a savepoint (store._sql.execute_fenced:
    # the relay's own autocommit connections send none)
    work = [s for s in statements if s.strip() and "SAVEPOINT" not in s]
    assert len(work) == 2, statements


# --- a channel that cannot send fails its rows at once --------


def _claim_raw(engine: sa.Engine, channel: str) -> list[store.Claim]:
    with engine.begin() as conn:
        insert_raw(conn, channel, '{"n": 1}')
        return store.claim(conn, 10, 120)


def test_a_channel_missing_from_the_senders_registry_fails_at_once(engine: sa.Engine) -> None:
    (c,) = _claim_raw(engine, "ghost")
    report = send(engine, [c])
    assert report.statuses == {"failed": 1}
    with engine.connect() as conn:
        r = row(conn, c.id)
        assert (r.status, r.attempts) == ("failed", 1)
        assert r.last_error == "channel 'ghost' is not in this sender's channel registry"


def test_a_channel_without_a_working_send_fails_at_once(engine: sa.Engine) -> None:
    from outbox.channels import SchemaChannel

    class Unfinished(SchemaChannel):  # validate from the schema, send never written
        name = "unfinished"
        schema = {"type": "object"}

    class NoSend:
        name = "nosend"
        schema: dict[str, object] = {}

        def validate(self, payload: object) -> None:
            pass

    class RaisesNotImplemented(ScriptedChannel):
        def send(self, message, deadline):  # type: ignore[no-untyped-def]
            raise NotImplementedError

    install_channel(Unfinished())
    install_channel(NoSend())
    install_channel(RaisesNotImplemented(name="later"))
    expected = {
        "unfinished": "channel 'unfinished' does not implement send",
        "nosend": "channel 'nosend' has no send method",
        "later": "channel 'later' does not implement send",
    }
    for channel, error in expected.items():
        (c,) = _claim_raw(engine, channel)
        assert send(engine, [c]).statuses == {"failed": 1}
        with engine.connect() as conn:
            r = row(conn, c.id)
        assert (r.status, r.last_error) == ("failed", error)


def test_the_worker_fails_a_channel_it_cannot_send_at_once(engine: sa.Engine) -> None:
    from outbox.channels import SchemaChannel
    from outbox.worker import Worker

    class Unfinished(SchemaChannel):
        name = "unfinished"
        schema = {"type": "object"}

    install_channel(Unfinished())
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO outbox_message (channel, payload) "
                "VALUES ('unfinished', '{}'), ('ghost', '{}')"
            )
        )
    Worker(engine, settings(), reap_interval_seconds=3600).run(until_empty=True)
    with engine.connect() as conn:
        got = conn.execute(
            sa.text("SELECT channel, status, attempts, last_error FROM outbox_message ORDER BY id")
        ).all()
    assert [tuple(r) for r in got] == [
        ("unfinished", "failed", 1, "channel 'unfinished' does not implement send"),
        (
            "ghost",
            "failed",
            1,
            # the worker sends what it claims itself: the sender's own reason
            "channel 'ghost' is not in this sender's channel registry",
        ),
    ]


def test_a_forked_process_sends_with_threads_of_its_own(engine: sa.Engine) -> None:
    """A process forked after sending (a pre-fork server, the bench's workers)
    inherits the send threads' records but not the threads: it must start its
    own rather than queue its sends for ever."""
    import multiprocessing as mp

    channel = install_channel(ScriptedChannel())
    enqueue(engine, 2, "scripted")
    # The parent sends first, so it holds send threads of this size.
    assert send(engine, claim(engine, batch=1), send_concurrency=3).statuses == {"delivered": 1}
    with engine.begin() as conn:  # the row the child sends, received here
        rows = store.claim_and_receive(conn, 1, 120, 3)

    def child(out: object) -> None:
        # The child only sends; it settles nothing, so it needs no connection.
        # Without threads of its own the call never starts, and the row is
        # given up as not started when its deadline (4.5 s here) passes.
        sender.send_then_settle(engine, "scripted", rows, settings(send_concurrency=3), lambda: 5.0)
        out.put(channel.sent)  # type: ignore[attr-defined]

    ctx = mp.get_context("fork")
    out = ctx.Queue()
    proc = ctx.Process(target=child, args=(out,))
    proc.start()
    try:
        sent_by_child = out.get(timeout=60)
    finally:
        proc.join(timeout=10)
        if proc.exitcode is None:
            proc.kill()
    assert sent_by_child == [*channel.sent, rows[0].id] and proc.exitcode == 0


class ThreadRecordingChannel(ScriptedChannel):
    """Records which send thread made each call and how many ran at once."""

    def __init__(self, seconds_per_call: float = 0.0) -> None:
        super().__init__()
        self.seconds_per_call = seconds_per_call
        self.threads: list[str] = []
        self.in_flight = self.most_in_flight = 0
        self._lock = threading.Lock()

    def send(self, message: Message, deadline: Deadline) -> Outcome:
        with self._lock:
            self.threads.append(threading.current_thread().name)
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        time.sleep(self.seconds_per_call)
        with self._lock:
            self.in_flight -= 1
        return super().send(message, deadline)


@pytest.mark.parametrize(
    "first_batch",
    [
        [],
        # Calls that return at once, run on every send thread, come back late
        # now and then: a thread the interpreter lock held up mid-call
        # measures its call as long as the wait. A few such calls must not
        # keep the channel on every thread, where its threads then hold each
        # other up again (what the relay did at batch 1000 with a provider
        # that answers in microseconds).
        [0.0] * 4 + [0.15, 0.15],
    ],
    ids=["every call at once", "two calls of twenty held up"],
)
def test_a_channel_whose_calls_come_back_at_once_sends_its_next_batch_on_one_thread(
    engine: sa.Engine, monkeypatch: pytest.MonkeyPatch, first_batch: list[float]
) -> None:
    monkeypatch.setattr(sender, "_calls_were_fast", {})
    # a threshold no call of a busy test machine reaches (the behaviour, not the figure)
    monkeypatch.setattr(sender, "FAST_CALL_SECONDS", 0.1)
    channel = install_channel(ThreadRecordingChannel())
    channel.answers = list(first_batch)
    for _ in range(2):  # the first batch, then the next
        channel.threads.clear()
        enqueue(engine, 20, "scripted")
        # the first batch's calls are not known yet: it runs on every thread
        report = send(engine, claim(engine), send_concurrency=8)
        assert report.statuses == {"delivered": 20}
        assert sender._calls_were_fast == {"scripted": True}
    assert len(set(channel.threads)) == 1  # the next batch, on one thread


def test_a_fast_channel_that_turns_slow_has_every_send_thread_again(
    engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sender, "_calls_were_fast", {"scripted": True})
    monkeypatch.setattr(sender, "FAST_CALL_SECONDS", 0.01)
    channel = install_channel(ThreadRecordingChannel(seconds_per_call=0.05))
    enqueue(engine, 8, "scripted")
    report = send(engine, claim(engine), send_concurrency=8)
    assert report.statuses == {"delivered": 8}
    # the first slow call brought the other threads in
    assert channel.most_in_flight >= 2 and len(set(channel.threads)) >= 2
    assert sender._calls_were_fast == {"scripted": False}
    channel.threads.clear()
    channel.most_in_flight = 0
    enqueue(engine, 8, "scripted")
    send(engine, claim(engine), send_concurrency=8)
    assert len(set(channel.threads)) >= 2  # a slow channel starts on all of them


def test_a_call_stuck_past_its_deadline_does_not_hold_the_next_batch(
    engine: sa.Engine,
) -> None:
    """The call is given up at its deadline, and its thread is still in the
    provider: the next batch must find a thread free all the same."""
    released = threading.Event()

    class StuckOnce(ScriptedChannel):
        calls = 0

        def send(self, message: Message, deadline: Deadline) -> Outcome:
            self.calls += 1
            if self.calls == 1:
                released.wait(60)  # stuck until the test ends
                return Outcome.delivered()
            return super().send(message, deadline)

    channel = install_channel(StuckOnce())
    stuck, then = enqueue(engine, 2, "scripted")
    try:
        first = send(engine, claim(engine, batch=1), 1.5, send_concurrency=1)
        assert first.statuses == {"pending": 1}  # given up at its deadline, 1 s in
        # One send thread, and the one there was is still stuck in the call.
        second = send(engine, claim(engine, batch=1), 10, send_concurrency=1)
    finally:
        released.set()
    assert second.statuses == {"delivered": 1} and channel.sent == [then]
    with engine.connect() as conn:
        assert row(conn, stuck).last_error == sender.DEADLINE_EXCEEDED


# --- an event of several tenants settles its first wave early --------


@dataclass
class _WaitsForTheFirstWave(ScriptedChannel):
    """A channel whose later calls wait (bounded) until ``delivered`` rows of
    the first wave read as delivered from another connection, recording the
    first wave's statuses each saw."""

    engine: sa.Engine | None = None
    first_wave: list[int] = field(default_factory=list)
    delivered: int = 0
    seen: dict[int, list[str]] = field(default_factory=dict)
    calls: int = 0

    def send(self, message: Message, deadline: Deadline) -> Outcome:
        self.calls += 1
        if message.id not in self.first_wave:
            assert self.engine is not None
            waited_until = time.monotonic() + 30
            while True:
                with self.engine.connect() as conn:
                    statuses = [row(conn, i).status for i in self.first_wave]
                if statuses.count("delivered") >= self.delivered:
                    break
                if time.monotonic() > waited_until:
                    break
                time.sleep(0.01)
            self.seen[message.id] = statuses
        return super().send(message, deadline)


def _two_tenants(engine: sa.Engine, a_rows: int) -> list[store.Claim]:
    enqueue(engine, 1, "scripted", tenant="b")
    enqueue(engine, a_rows, "scripted", tenant="a")
    return claim(engine)


def test_an_event_of_several_tenants_settles_its_first_wave_while_the_rest_send(
    engine: sa.Engine,
) -> None:
    channel = install_channel(_WaitsForTheFirstWave(engine=engine))
    claims = _two_tenants(engine, 6)
    # The batch's order is the fair share: b's one row and a's first go first.
    channel.first_wave, channel.delivered = [c.id for c in claims[:2]], 2
    report = send(engine, claims, send_concurrency=2)
    assert report.statuses == {"delivered": 7} and not report.lease_lost
    later = [c.id for c in claims[2:]]
    # Every later call ran with the first wave already delivered, written.
    assert set(channel.seen) == set(later)
    assert all(s == ["delivered", "delivered"] for s in channel.seen.values()), channel.seen
    with engine.connect() as conn:
        rows = [row(conn, c.id) for c in claims]
        history = {c.id: [a.outcome for a in attempts(conn, c.id)] for c in claims}
    assert {r.status for r in rows} == {"delivered"} and {r.attempts for r in rows} == {1}
    assert all(h == ["delivered"] for h in history.values())  # each settled once


def test_the_early_settle_takes_only_final_outcomes(engine: sa.Engine) -> None:
    channel = install_channel(
        _WaitsForTheFirstWave(engine=engine, answers=[Outcome.retry("503"), Outcome.delivered()])
    )
    claims = _two_tenants(engine, 4)
    channel.first_wave, channel.delivered = [c.id for c in claims[:2]], 1
    report = send(engine, claims, send_concurrency=2)
    assert report.statuses == {"delivered": 4, "pending": 1} and not report.lease_lost
    # The later calls ran with the first wave's delivered row written and
    # its retry still claimed: a row going back waits for the event's settle.
    assert len(channel.seen) == 3
    assert all(sorted(s) == ["claimed", "delivered"] for s in channel.seen.values()), channel.seen
    with engine.connect() as conn:
        first_wave = [row(conn, i) for i in channel.first_wave]
        (retried,) = [r for r in first_wave if r.status == "pending"]
        assert [a.outcome for a in attempts(conn, retried.id)] == ["retry"]
    assert (retried.attempts, retried.last_error) == (1, "503")


def test_an_event_of_one_tenant_settles_once(engine: sa.Engine) -> None:
    install_channel(ScriptedChannel())
    enqueue(engine, 6, "scripted", tenant="a")
    statements: list[str] = []

    def count(conn, cursor, statement, *args):  # type: ignore[no-untyped-def]
        statements.append(statement)

    claims = claim(engine)
    sa.event.listen(engine, "before_cursor_execute", count)
    try:
        report = send(engine, claims, send_concurrency=2)
    finally:
        sa.event.remove(engine, "before_cursor_execute", count)
    assert report.statuses == {"delivered": 6}
    work = [s for s in statements if s.strip() and "SAVEPOINT" not in s]
    assert len(work) == 2, statements  # the receipt and one settle


def test_a_failed_early_settle_leaves_its_rows_to_the_events_settle(
    engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_channel(ScriptedChannel())
    claims = _two_tenants(engine, 6)
    real = store.settle_with_outcomes
    calls: list[int] = []

    def first_one_fails(conn, settlements, backoff):  # type: ignore[no-untyped-def]
        calls.append(len(settlements))
        if len(calls) == 1:
            raise sa.exc.OperationalError("settle", {}, Exception("connection reset"))
        return real(conn, settlements, backoff)

    monkeypatch.setattr(store, "settle_with_outcomes", first_one_fails)
    report = send(engine, claims, send_concurrency=2)
    assert calls == [2, 7]  # the first wave's, refused; then every row with the event
    assert report.statuses == {"delivered": 7} and not report.lease_lost
    with engine.connect() as conn:
        assert {row(conn, c.id).status for c in claims} == {"delivered"}
