"""Destinations and their limits (docs/design.md, invariant 10): a throttling
answer pauses its destination, never counting an attempt or a deferral, while
other destinations keep going; the claim draws a throttled destination's rows
from its token bucket, in bulk, however many claimers; a quota answer pauses
the channel until its reset or an operator's resume."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import sqlalchemy as sa

import outbox
from outbox import sender, store
from outbox.channels import Outcome
from outbox.handoff import HandOff
from outbox.store.delivery import BUCKETS_PER_CLAIM
from outbox.worker import Worker
from support import (
    ScriptedChannel,
    attempts,
    claim,
    db_now,
    enqueue,
    install_channel,
    settings,
    wait_until,
)


def hook(host: str, n: int = 0) -> dict[str, Any]:
    return {"url": f"https://{host}/hooks/{n}", "event_type": "t", "body": {"n": n}}


def enqueue_hooks(engine: sa.Engine, host: str, n: int) -> list[int]:
    with engine.begin() as conn:
        return outbox.enqueue_many(
            conn, [{"channel": "webhook", "payload": hook(host, i)} for i in range(n)]
        )


def destinations_of(engine: sa.Engine, ids: list[int]) -> set[str]:
    with engine.connect() as conn:
        return set(
            conn.execute(
                sa.text("SELECT destination FROM outbox_message WHERE id = ANY(:ids)"),
                {"ids": ids},
            ).scalars()
        )


def counts(engine: sa.Engine, ids: list[int]) -> dict[int, tuple[str, int, int]]:
    """id -> (status, attempts, deferrals)."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT id, status, attempts, deferrals FROM outbox_message WHERE id = ANY(:ids)"
            ),
            {"ids": ids},
        ).all()
    return {r.id: (r.status, r.attempts, r.deferrals) for r in rows}


def run_sender(engine: sa.Engine, claims: list[store.Claim], **overrides: Any) -> Any:
    event = HandOff(claims[0].channel, tuple(claims)).to_event()
    return sender.run(engine, event, settings(**{"send_concurrency": 1, **overrides}), lambda: 30.0)


# --- the destination -----------------------------------------------------------


@pytest.mark.parametrize(
    ("channel", "payload", "destination"),
    [
        ("webhook", {"url": "https://Hooks.Example.COM/a?b=c"}, "hooks.example.com"),
        ("webhook", {"url": "https://hooks.example.com:8443/a"}, "hooks.example.com:8443"),
        ("webhook", {"url": "https://user:pw@hooks.example.com/a"}, "hooks.example.com"),
        ("webhook", {"url": "http://[2001:db8::1]:9000/p"}, "[2001:db8::1]:9000"),
        ("webhook", {"url": "not a url"}, ""),
        ("sqs", {"queue_url": "https://sqs.x/123456789012/q"}, "https://sqs.x/123456789012/q"),
        ("eventbridge", {"event_bus": "orders"}, "orders"),
        ("eventbridge", {}, ""),
        ("email", {"to": ["a@example.com"]}, ""),
        ("sms", {"to": "+15555550100"}, ""),
        ("custom", {"anything": 1}, ""),
    ],
)
def test_the_destination_is_a_function_of_channel_and_payload(
    engine: sa.Engine, channel: str, payload: dict[str, Any], destination: str
) -> None:
    with engine.connect() as conn:
        got = conn.execute(
            sa.text("SELECT outbox_destination_of(:channel, CAST(:payload AS jsonb))"),
            {"channel": channel, "payload": outbox.store.payload_json(payload)},
        ).scalar_one()
    assert got == destination


def test_every_insert_gets_its_destination(engine: sa.Engine) -> None:
    ids = enqueue_hooks(engine, "a.example", 2) + enqueue_hooks(engine, "b.example:8443", 1)
    with engine.begin() as conn:  # raw SQL, past the producer, too
        raw = conn.execute(
            sa.text(
                "INSERT INTO outbox_message (channel, payload) VALUES "
                """('webhook', '{"url": "https://c.example/x"}') RETURNING id"""
            )
        ).scalar_one()
    assert destinations_of(engine, ids) == {"a.example", "b.example:8443"}
    assert destinations_of(engine, [raw]) == {"c.example"}


# --- the claim -----------------------------------------------------------------


def test_a_paused_destination_is_skipped_and_the_others_claimed(engine: sa.Engine) -> None:
    slow = enqueue_hooks(engine, "slow.example", 5)
    fast = enqueue_hooks(engine, "fast.example", 5)
    with engine.begin() as conn:
        store.record_throttling(conn, "webhook", {"slow.example": store.Throttled(30, 1, 10)})
    assert sorted(c.id for c in claim(engine)) == fast
    assert claim(engine) == []
    assert {counts(engine, slow)[i] for i in slow} == {("pending", 0, 0)}
    [figures] = _figures(engine)
    assert (figures.destination, figures.throttled_last_minute, figures.throttled_total) == (
        "slow.example",
        1,
        1,
    )
    assert figures.paused_until is not None and figures.rate == pytest.approx(8.0, rel=0.2)


def test_fair_share_lets_every_destination_take_turns(engine: sa.Engine) -> None:
    busy = enqueue_hooks(engine, "busy.example", 8)
    quiet = enqueue_hooks(engine, "quiet.example", 3)
    claimed = [c.id for c in claim(engine, batch=6)]
    # one of each, then the second of each, ...: the quiet one is not behind the busy one
    assert sorted(claimed) == sorted(busy[:3] + quiet[:3])


def set_bucket(
    engine: sa.Engine, destination: str, rate: float, tokens: float, burst: float | None = None
) -> Any:
    """A destination that throttled and whose pause is over, its bucket holding
    ``tokens`` (at most ``burst``, when given) and refilling at ``rate``, from
    now (returned, the database's)."""
    with engine.begin() as conn:
        store.record_throttling(conn, "webhook", {destination: store.Throttled(1, 1, 1)})
        return conn.execute(
            sa.text(
                "UPDATE outbox_destination SET paused_until = now(), rate = :rate, "
                "rate_at = now(), tokens = :tokens, tokens_at = now(), limit_burst = :burst "
                "WHERE destination = :d RETURNING now()"
            ),
            {"rate": rate, "tokens": tokens, "burst": burst, "d": destination},
        ).scalar_one()


def test_a_throttled_destination_takes_no_more_than_its_bucket(engine: sa.Engine) -> None:
    limited = enqueue_hooks(engine, "limited.example", 20)
    free = enqueue_hooks(engine, "free.example", 20)
    # A bucket of 4 that refills one token in 100 s: the second claim below
    # finds it empty however long a busy machine takes to get there.
    set_bucket(engine, "limited.example", rate=0.01, tokens=4, burst=4)
    claimed = [c.id for c in claim(engine)]
    assert len(set(claimed) & set(limited)) == 4  # the bucket: 4
    assert set(free) <= set(claimed)  # the others at full speed
    with engine.connect() as conn:
        tokens = conn.execute(
            sa.text("SELECT tokens FROM outbox_destination WHERE destination = 'limited.example'")
        ).scalar_one()
    assert tokens < 1  # drawn, in the same statement
    assert not set(c.id for c in claim(engine)) & set(limited)


def test_the_pause_runs_from_the_answer_not_from_the_write(engine: sa.Engine) -> None:
    # The provider's bucket refills from the moment it refused: a pause that
    # starts only when the sender writes it (after its other calls answered)
    # wastes that much of what the provider admits, every throttle.
    with engine.begin() as conn:  # one transaction: now() stands still
        store.record_throttling(
            conn, "webhook", {"late.example": store.Throttled(30, 1, 10, heard_seconds_ago=12)}
        )
        paused_for = conn.execute(
            sa.text(
                "SELECT EXTRACT(EPOCH FROM paused_until - now()) FROM outbox_destination"
                " WHERE destination = 'late.example'"
            )
        ).scalar_one()
    assert float(paused_for) == pytest.approx(18.0)
    # An answer whose pause was over before it was written pauses nothing;
    # the rate is cut all the same.
    over = enqueue_hooks(engine, "over.example", 1)
    with engine.begin() as conn:  # the rate read at the cut: now() stands still
        store.record_throttling(
            conn, "webhook", {"over.example": store.Throttled(1, 1, 10, heard_seconds_ago=5)}
        )
        [figures] = [f for f in store.destination_figures(conn) if f.destination == "over.example"]
    assert figures.rate == pytest.approx(9.0)
    assert [c.id for c in claim(engine)] == over


@pytest.mark.parametrize("throttled_before", [False, True], ids=["first", "again"])
def test_a_throttled_destination_calls_once_the_moment_its_pause_ends(
    engine: sa.Engine, throttled_before: bool
) -> None:
    # The bucket holds one token from the pause's end, not none: the first call
    # goes when the provider said it may, not one token's refill later (a tenth
    # of a second at 10 a second; ten seconds at the slowest learned rate).
    limited = enqueue_hooks(engine, "resumed.example", 5)
    # The slowest rate: the next token after that one is ten seconds away.
    answer = {"resumed.example": store.Throttled(1, 1, 0.01, heard_seconds_ago=1)}
    if throttled_before:
        with engine.begin() as conn:
            store.record_throttling(conn, "webhook", answer)
            conn.execute(sa.text("UPDATE outbox_destination SET tokens = 0"))
    with engine.begin() as conn:
        store.record_throttling(conn, "webhook", answer)
        written = conn.execute(sa.text("SELECT now()")).scalar_one()
    claimed = [c.id for c in claim(engine)]
    elapsed = (db_now(engine) - written).total_seconds()
    refilled = int(store.rates.MIN_RATE * elapsed)  # 0 unless the machine stalled 10 s
    assert claimed == limited[: 1 + refilled]


def test_many_claimers_never_take_more_than_the_bucket_holds(engine: sa.Engine) -> None:
    limited = enqueue_hooks(engine, "limited.example", 200)
    since = set_bucket(engine, "limited.example", rate=5, tokens=5)
    start = threading.Barrier(8)
    taken: list[int] = []
    lock = threading.Lock()

    def claimer() -> None:
        start.wait()
        for _ in range(5):
            got = [c.id for c in claim(engine, batch=50)]
            with lock:
                taken.extend(got)

    threads = [threading.Thread(target=claimer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(taken) == len(set(taken)) and set(taken) <= set(limited)
    # What the bucket held, plus its refill over the claims' span by the
    # database's clock: 5 tokens, then 5 a second (grown by 5 % a second).
    with engine.connect() as conn:
        last = conn.execute(
            sa.text("SELECT max(claimed_at) FROM outbox_message WHERE status = 'claimed'")
        ).scalar_one()
    span = (last - since).total_seconds()
    assert 5 <= len(taken) <= 5 + 5 * (1 + 0.05 * span) * span + 1e-9


def _figures(engine: sa.Engine) -> list[store.DestinationFigures]:
    with engine.connect() as conn:
        return store.destination_figures(conn)


# --- the sender: throttling ------------------------------------------------------


class DestinationChannel(ScriptedChannel):
    """The scripted channel, counting every call it answers."""

    calls: int = 0

    def send(self, message: Any, deadline: Any) -> Outcome:
        self.calls += 1
        return super().send(message, deadline)


def test_a_throttling_answer_pauses_the_destination_and_counts_nothing(
    engine: sa.Engine,
) -> None:
    channel = install_channel(
        DestinationChannel(answers=[Outcome.delivered(), Outcome.throttled("HTTP 429", 60)])
    )
    ids = enqueue(engine, 6, "scripted")
    report = run_sender(engine, claim(engine))
    assert channel.calls == 2  # one refused call; the other rows were not started
    assert report.statuses == {"delivered": 1, "not_started": 5}
    after = counts(engine, ids)
    assert after[ids[0]] == ("delivered", 1, 0)
    assert {after[i] for i in ids[1:]} == {("pending", 0, 0)}  # no attempt, no deferral
    with engine.connect() as conn:
        last_error = conn.execute(
            sa.text("SELECT last_error FROM outbox_message WHERE id = :id"), {"id": ids[1]}
        ).scalar_one()
        paused_for = conn.execute(
            sa.text(
                "SELECT EXTRACT(EPOCH FROM paused_until - now()) FROM outbox_destination"
                " WHERE channel = 'scripted' AND destination = ''"
            )
        ).scalar_one()
    assert last_error == "HTTP 429"
    assert 50 < float(paused_for) <= 60  # the pause asked for
    assert claim(engine) == []  # paused: nothing claimed, nothing counted

    # the pause over, the rows go, one attempt each (none was counted before)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE outbox_destination SET paused_until = now(), rate = 100, rate_at = now(),"
                " tokens = 100, tokens_at = now()"
            )
        )
    report = run_sender(engine, claim(engine))
    assert report.statuses == {"delivered": 5}
    assert {counts(engine, ids)[i] for i in ids} == {("delivered", 1, 0)}


def test_a_throttled_answer_in_flight_while_paused_does_not_cut_the_rate_again(
    engine: sa.Engine,
) -> None:
    with engine.begin() as conn:  # one transaction: now() stands still
        learned_after(conn, cut_ago=60, pause_ended_ago=59, rate=90.0)
        store.record_throttling(conn, "webhook", {"a.example": store.Throttled(30, 1, 100)})
        cut = rate_now(conn)
        store.record_throttling(conn, "webhook", {"a.example": store.Throttled(30, 3, 100)})
        assert rate_now(conn) == cut  # cut once
        [figures] = store.destination_figures(conn)
    assert figures.throttled_total == 1 + 1 + 3


def test_the_first_estimates_of_senders_throttled_at_once_add_up(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        store.record_throttling(conn, "webhook", {"a.example": store.Throttled(30, 1, 100)})
        store.record_throttling(conn, "webhook", {"a.example": store.Throttled(30, 2, 50)})
        assert rate_now(conn) == pytest.approx(DECREASE * 150, rel=1e-9)
        store.set_limit(conn, "webhook", "a.example", 120)
        store.record_throttling(conn, "webhook", {"a.example": store.Throttled(30, 1, 50)})
        assert rate_now(conn) == pytest.approx(DECREASE * 120, rel=1e-9)  # held to the limit


# --- the learned rate (store/rates.py): each test runs in one transaction,
# where now() stands still, and sets the times a throttle happened by hand.

DECREASE = store.rates.RATE_DECREASE
PLATEAU = store.rates.PLATEAU_SECONDS


def learned_after(
    conn: sa.Connection, cut_ago: float, pause_ended_ago: float, rate: float = 90.0
) -> None:
    """``a.example`` as if cut to ``rate`` (so its plateau is rate /
    RATE_DECREASE) ``cut_ago`` seconds ago, its pause over for ``pause_ended_ago``."""
    store.record_throttling(conn, "webhook", {"a.example": store.Throttled(1, 1, 1)})
    conn.execute(
        sa.text(
            "UPDATE outbox_destination SET rate = :rate,"
            " rate_at = now() - make_interval(secs => :cut_ago),"
            " minute_start = now() - make_interval(secs => :cut_ago),"
            " paused_until = now() - make_interval(secs => :ended_ago),"
            " tokens_at = now() - make_interval(secs => :ended_ago)"
        ),
        {"rate": rate, "cut_ago": cut_ago, "ended_ago": pause_ended_ago},
    )


def rate_now(conn: sa.Connection) -> float:
    [figures] = store.destination_figures(conn)
    assert figures.rate is not None
    return figures.rate


@pytest.mark.parametrize(
    ("seconds", "share"),
    [
        (0, DECREASE),  # the cut
        (PLATEAU / 3, 1 - (1 - DECREASE) * (2 / 3) ** 3),  # fast while far below
        (PLATEAU * 2 / 3, 1 - (1 - DECREASE) / 27),  # slow near the plateau
        (PLATEAU, 1.0),  # at the plateau
        (PLATEAU * 4 / 3, 1 + (1 - DECREASE) / 27),  # just above it, slowly
        (PLATEAU * 3, 1 + (1 - DECREASE) * 8),  # then probing faster
    ],
)
def test_the_learned_rate_climbs_back_to_the_plateau_and_lingers_there(
    engine: sa.Engine, seconds: float, share: float
) -> None:
    with engine.begin() as conn:
        learned_after(conn, cut_ago=seconds, pause_ended_ago=seconds, rate=90.0)
        assert rate_now(conn) == pytest.approx(90.0 / DECREASE * share, rel=1e-9)


def test_a_fresh_throttle_cuts_the_rate_then_to_a_share_of_it(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        # two plateau lengths after the last cut, long after its pause ended
        learned_after(conn, cut_ago=2 * PLATEAU, pause_ended_ago=2 * PLATEAU - 1, rate=90.0)
        before = rate_now(conn)
        store.record_throttling(conn, "webhook", {"a.example": store.Throttled(1, 1, 1000)})
        after = rate_now(conn)  # the moment of the cut (now() stands still)
    assert before == pytest.approx(100 * (1 + (1 - DECREASE)), rel=1e-9)
    assert after == pytest.approx(DECREASE * before, rel=1e-9)


def test_a_throttle_soon_after_the_pause_ended_halves_the_rate(engine: sa.Engine) -> None:
    resumed = store.rates.RESUMED_SECONDS
    with engine.begin() as conn:
        learned_after(conn, cut_ago=resumed + 0.5, pause_ended_ago=resumed / 2, rate=90.0)
        before = rate_now(conn)
        store.record_throttling(conn, "webhook", {"a.example": store.Throttled(1, 1, 1000)})
        after = rate_now(conn)
    assert after == pytest.approx(DECREASE * store.rates.FAST_DECREASE * before, rel=1e-9)


def test_a_throttle_soon_after_the_pause_ended_estimates_what_the_provider_admitted(
    engine: sa.Engine,
) -> None:
    # The provider's bucket refilled during the pause (1 s) and was spent
    # again 1.8 s after it: since the pause began it admitted about what the
    # relay called since the pause ended (one call at the end, then the rate),
    # over 2.8 s. That, not half the rate, is the plateau.
    paused, resumed_for = 1.0, 1.8
    with engine.begin() as conn:
        learned_after(conn, cut_ago=paused + resumed_for, pause_ended_ago=resumed_for, rate=13.5)
        before = rate_now(conn)
        store.record_throttling(conn, "webhook", {"a.example": store.Throttled(1, 1, 1)})
        after = rate_now(conn)
    admitted = (1 + before * resumed_for) / (paused + resumed_for)
    assert before * store.rates.FAST_DECREASE < admitted < before  # between halving and no cut
    assert after == pytest.approx(DECREASE * admitted, rel=1e-9)


def test_after_a_quiet_spell_the_plateau_is_what_was_seen_not_the_grown_curve(
    engine: sa.Engine,
) -> None:
    with engine.begin() as conn:
        learned_after(conn, cut_ago=3600, pause_ended_ago=3600, rate=90.0)
        assert rate_now(conn) > 1e5  # an hour on the curve
        # the sender saw 50 a second: the last plateau (100) is the higher
        store.record_throttling(conn, "webhook", {"a.example": store.Throttled(1, 1, 50)})
        assert rate_now(conn) == pytest.approx(DECREASE * 100, rel=1e-9)
        conn.execute(
            sa.text(
                "UPDATE outbox_destination SET rate_at = now() - interval '1 hour',"
                " paused_until = now() - interval '1 hour'"
            )
        )
        # the sender saw 500 a second: that is the higher
        store.record_throttling(conn, "webhook", {"a.example": store.Throttled(1, 1, 500)})
        assert rate_now(conn) == pytest.approx(DECREASE * 500, rel=1e-9)


def test_a_throttle_while_a_limit_is_set_cuts_from_the_limit_at_most(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        store.set_limit(conn, "webhook", "a.example", 50)
        learned_after(conn, cut_ago=3 * PLATEAU, pause_ended_ago=3 * PLATEAU, rate=90.0)
        store.record_throttling(conn, "webhook", {"a.example": store.Throttled(1, 1, 1000)})
        assert rate_now(conn) == pytest.approx(DECREASE * 50, rel=1e-9)


@pytest.mark.parametrize("bad", [float("nan"), -5.0, 0.0, None, float("inf"), 1e12])
def test_a_bad_pause_is_bounded(engine: sa.Engine, bad: Any) -> None:
    with engine.begin() as conn:
        store.record_throttling(conn, "webhook", {"a.example": store.Throttled(bad, 1, 1)})
        seconds = conn.execute(
            sa.text("SELECT EXTRACT(EPOCH FROM paused_until - now()) FROM outbox_destination")
        ).scalar_one()
    assert 0 < float(seconds) <= store.rates.MAX_PAUSE_SECONDS


# --- the sender: quotas ----------------------------------------------------------


def test_a_quota_answer_pauses_the_channel_until_resumed(engine: sa.Engine) -> None:
    quota = Outcome.quota("ThrottlingException: daily quota exceeded", 3600)
    channel = install_channel(
        DestinationChannel(answers=[Outcome.delivered(), quota, quota, quota, quota])
    )
    ids = enqueue(engine, 8, "scripted")
    first, second = claim(engine, batch=4), claim(engine, batch=4)  # two events in flight
    run_sender(engine, first)
    assert channel.calls == 2  # the refused call, then nothing more
    with engine.connect() as conn:
        [paused] = store.paused_channels(conn)
    assert (paused.channel, paused.reason) == (
        "scripted",
        "quota: ThrottlingException: daily quota exceeded",
    )
    assert paused.paused_until is not None
    # the other event, claimed before the pause: its receipt sends nothing
    report = run_sender(engine, second)
    assert channel.calls == 2
    assert report.statuses == {"not_started": 4}
    assert claim(engine) == []
    after = counts(engine, ids)
    assert {after[i] for i in ids if i != ids[0]} == {("pending", 0, 0)}

    # an operator's resume (the quota was raised): delivered, one attempt each
    channel.answers.clear()
    with engine.begin() as conn:
        assert store.resume_channel(conn, "scripted")
    run_sender(engine, claim(engine))
    assert {counts(engine, ids)[i] for i in ids} == {("delivered", 1, 0)}


@pytest.mark.parametrize("pause", ["quota", "operator", "destination"])
def test_the_receipt_of_a_paused_channel_or_destination_sends_nothing_and_counts_nothing(
    engine: sa.Engine, pause: str
) -> None:
    # Paused since the claim: the rows were already handed off. On Lambda the
    # dispatcher hands off many chunks at once, and each execution
    # environment hears a throttle only from its own calls: a chunk received
    # after another sender paused its destination must not find that out
    # again, call by call, from the receiver.
    channel = install_channel(DestinationChannel())
    ids = enqueue(engine, 3, "scripted")
    claims = claim(engine)  # claimed and handed off before the pause
    with engine.begin() as conn:
        if pause == "quota":
            store.record_throttling(conn, "scripted", {}, ("quota: daily", 3600))
        elif pause == "operator":
            store.pause_channel(conn, "scripted", "incident")
        else:
            store.record_throttling(conn, "scripted", {"": store.Throttled(60, 1, 10)})
    report = run_sender(engine, claims)
    assert channel.calls == 0
    assert report.owned == 3 and report.lease_lost == []
    assert report.statuses == {"not_started": 3}
    assert {counts(engine, ids)[i] for i in ids} == {("pending", 0, 0)}
    with engine.connect() as conn:
        assert {a.outcome for i in ids for a in attempts(conn, i)} == {"not_started"}
    assert claim(engine) == []  # still paused
    with engine.begin() as conn:
        if pause == "destination":  # its pause over, its bucket refilled
            conn.execute(sa.text("UPDATE outbox_destination SET paused_until = now(), tokens = 3"))
        else:
            assert store.resume_channel(conn, "scripted")
    run_sender(engine, claim(engine))
    assert channel.calls == 3
    assert {counts(engine, ids)[i] for i in ids} == {("delivered", 1, 0)}


def test_the_worker_claims_a_paused_destination_again_when_its_pause_ends(
    engine: sa.Engine,
) -> None:
    channel = install_channel(DestinationChannel(answers=[Outcome.throttled("HTTP 429", 0.3)]))
    ids = enqueue(engine, 1, "scripted")
    assert worker_delivers_within_a_poll(engine, ids)
    assert channel.calls == 2  # the refused call counted no attempt
    assert {counts(engine, ids)[i] for i in ids} == {("delivered", 1, 0)}


@contextmanager
def a_worker_running(engine: sa.Engine) -> Iterator[Worker]:
    """``outbox worker`` with a 60 s poll interval, in a thread for the block."""
    worker = Worker(
        engine,
        settings(batch_size=10, send_concurrency=1, poll_interval_seconds=60.0),
        reap_interval_seconds=3600,
    )
    loop = threading.Thread(target=worker.run)
    loop.start()
    try:
        yield worker
    finally:
        worker.stop.set()
        loop.join(60)


def worker_delivers_within_a_poll(engine: sa.Engine, ids: list[int]) -> bool:
    """Whether ``outbox worker`` with a 60 s poll interval delivers ``ids[0]``
    well within it (45 s: a bound, not a timing): a worker that waited out
    its poll after a pause would leave the resumed rows for 60 s."""
    with a_worker_running(engine):
        return wait_until(lambda: counts(engine, ids)[ids[0]][0] == "delivered", 45)


def test_the_worker_claims_at_once_only_once_when_nothing_waits(
    engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim at once after a pause's end is one claim: when it finds
    nothing either (the rows are held by something else), the worker waits
    its poll interval, it does not spin."""
    claims: list[int] = []
    claim = store.claim_and_receive

    def claim_nothing_after_the_first(*args: Any, **kwargs: Any) -> Any:
        claims.append(1)
        return claim(*args, **kwargs) if len(claims) == 1 else []

    monkeypatch.setattr(store, "claim_and_receive", claim_nothing_after_the_first)
    monkeypatch.setattr(store, "seconds_to_resume", lambda conn: None)
    install_channel(DestinationChannel(answers=[Outcome.throttled("HTTP 429", 0.3)]))
    enqueue(engine, 1, "scripted")
    with a_worker_running(engine):
        # the first claim, the one at the pause's end, the one at once after it
        assert wait_until(lambda: len(claims) >= 3, 45)
        time.sleep(1.0)  # a spinning loop would claim again and again meanwhile
        assert len(claims) == 3


@pytest.mark.parametrize("asked_late", [False, True], ids=["asked-before", "asked-after"])
def test_the_worker_claims_again_when_the_pause_the_database_holds_ends(
    engine: sa.Engine, monkeypatch: pytest.MonkeyPatch, asked_late: bool
) -> None:
    """The pause is written by the settle, on the database's clock; a settle
    that comes late (a busy machine) makes it end later than the sender
    reckoned. The worker's wake-up at its own reckoning then claims nothing,
    and it asks the database when the destination resumes rather than
    sleep a poll interval. ``asked_late``: the question comes after the
    pause's end, so the database says nothing waits though the row is due;
    the worker waited a whole poll interval then (one run in eight of the
    test above), and now claims once more at once."""
    record, resume = store.record_throttling, store.seconds_to_resume

    def late_record(conn: sa.Connection, *args: Any, **kwargs: Any) -> set[str]:
        # Before the transaction's first statement: its now() is later by as much.
        time.sleep(0.5)
        return record(conn, *args, **kwargs)

    def question(conn: sa.Connection) -> float | None:
        if asked_late:
            time.sleep(1.0)  # after the pause's end
        return resume(conn)

    monkeypatch.setattr(store, "record_throttling", late_record)
    monkeypatch.setattr(store, "seconds_to_resume", question)
    channel = install_channel(DestinationChannel(answers=[Outcome.throttled("HTTP 429", 0.3)]))
    ids = enqueue(engine, 1, "scripted")
    assert worker_delivers_within_a_poll(engine, ids)
    assert channel.calls == 2
    assert {counts(engine, ids)[i] for i in ids} == {("delivered", 1, 0)}


class QuotaSpentChannel(ScriptedChannel):
    """A provider whose quota is spent: every call is refused. The first call
    answers at once; any other call started meanwhile waits until the sender
    has taken note of that answer, so every thread is busy when it hears it."""

    def __init__(self, noted: threading.Event) -> None:
        super().__init__()
        self.noted = noted
        self.calls = 0
        self._lock = threading.Lock()

    def send(self, message: Any, deadline: Any) -> Outcome:
        with self._lock:
            self.calls += 1
            first = self.calls == 1
        if not first:
            self.noted.wait(10)  # a bound, not a timing: set by the first answer's note
        return Outcome.quota("daily quota exceeded", 3600)


def noting_quota(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """An event set once a sender has taken note of a quota answer."""
    noted = threading.Event()
    note = sender.Limits.note

    def note_then_tell(self: Any, row: Any, outcome: Outcome) -> None:
        note(self, row, outcome)
        if outcome.pause is not None:
            noted.set()

    monkeypatch.setattr(sender.Limits, "note", note_then_tell)
    return noted


def test_after_a_quota_answer_no_new_call_starts(
    engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    channel = install_channel(QuotaSpentChannel(noting_quota(monkeypatch)))
    ids = enqueue(engine, 20, "scripted")
    report = run_sender(engine, claim(engine), send_concurrency=4)
    # the first refused call, and at most the other threads' calls under way
    assert 1 <= channel.calls <= 4
    assert report.statuses == {"not_started": 20}
    assert {counts(engine, ids)[i] for i in ids} == {("pending", 0, 0)}
    with engine.connect() as conn:
        [paused] = store.paused_channels(conn)
    assert paused.channel == "scripted"


def test_a_quota_pause_ends_by_itself_and_an_operator_pause_outlasts_it(
    engine: sa.Engine,
) -> None:
    install_channel(ScriptedChannel())
    ids = enqueue(engine, 2, "scripted")
    with engine.begin() as conn:
        store.record_throttling(conn, "scripted", {}, ("quota: daily", 3600))
    assert claim(engine) == []
    with engine.begin() as conn:  # the reset time comes
        conn.execute(sa.text("UPDATE outbox_channel_pause SET paused_until = now()"))
        assert store.paused_channels(conn) == []
    assert sorted(c.id for c in claim(engine)) == ids

    with engine.begin() as conn:  # an operator's pause is not ended by a quota's
        store.pause_channel(conn, "scripted", "incident")
        store.record_throttling(conn, "scripted", {}, ("quota: daily", 60))
        [paused] = store.paused_channels(conn)
    assert (paused.reason, paused.paused_until) == ("incident", None)


# --- the operator's limits -------------------------------------------------------


def test_an_operator_limit_holds_the_claim_to_its_burst_then_its_rate(engine: sa.Engine) -> None:
    limited = enqueue_hooks(engine, "limited.example", 10)
    free = enqueue_hooks(engine, "free.example", 10)
    with engine.begin() as conn:  # a rate so low that no token comes back during the test
        assert store.set_limit(conn, "webhook", "limited.example", 0.001, 3) == (0.001, 3)
    first = {c.id for c in claim(engine)}
    assert len(first & set(limited)) == 3 and set(free) <= first
    assert claim(engine) == []  # the bucket is empty: the rest waits, pending
    with engine.connect() as conn:
        [figures] = store.destination_figures(conn)
    assert (figures.limit_rate, figures.limit_burst, figures.rate) == (0.001, 3, None)


def test_a_learned_rate_never_exceeds_the_limit(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        store.set_limit(conn, "webhook", "a.example", 10)
        store.record_throttling(conn, "webhook", {"a.example": store.Throttled(1, 1, 100)})
        [figures] = store.destination_figures(conn)
    assert (figures.limit_rate, figures.limit_burst) == (10, 10)
    # cut from the limit, not from 100
    assert figures.rate == pytest.approx(10 * store.rates.RATE_DECREASE, rel=0.01)


def test_with_a_limit_the_first_throttle_cuts_from_the_limit_not_one_senders_share(
    engine: sa.Engine,
) -> None:
    # Four workers drawing 100 a second from one bucket deliver some 25 each:
    # the one that heard the first throttle saw a quarter of the rate. Its
    # share as the plateau would run the destination at a quarter of what
    # the operator said it admits, climbing back for a minute or more.
    with engine.begin() as conn:
        store.set_limit(conn, "webhook", "a.example", 100)
        store.record_throttling(conn, "webhook", {"a.example": store.Throttled(1, 1, 25)})
        assert rate_now(conn) == pytest.approx(DECREASE * 100, rel=1e-9)


def test_clearing_a_limit_keeps_what_was_learned(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        store.set_limit(conn, "webhook", "a.example", 10)
        store.set_limit(conn, "webhook", "b.example", 10)
        store.record_throttling(conn, "webhook", {"b.example": store.Throttled(1, 1, 5)})
        assert store.clear_limit(conn, "webhook", "a.example") is True
        assert store.clear_limit(conn, "webhook", "a.example") is False
        assert store.clear_limit(conn, "webhook", "b.example") is True
        [left] = store.destination_figures(conn)
    assert (left.destination, left.limit_rate, left.rate is not None) == ("b.example", None, True)


@pytest.mark.parametrize(
    ("rate", "burst", "problem"),
    [
        (0, None, "rate must be above 0"),
        (-1, None, "rate must be above 0"),
        (float("nan"), None, "rate must be a finite number"),
        (float("inf"), None, "rate must be a finite number"),
        (1e9, None, "rate must be above 0 and at most 100000"),
        ("5", None, "rate must be a number"),
        (5, 0, "burst must be between 1"),
        (5, float("nan"), "burst must be a finite number"),
        (5, 1e12, "burst must be between 1"),
    ],
)
def test_a_bad_limit_is_refused_and_changes_nothing(
    engine: sa.Engine, rate: Any, burst: Any, problem: str
) -> None:
    with pytest.raises(ValueError, match=problem), engine.begin() as conn:
        store.set_limit(conn, "webhook", "a.example", rate, burst)
    assert _figures(engine) == []


@pytest.mark.parametrize(
    ("channel", "destination", "expected"),
    [
        ("webhook", "Hooks.Example.com", "hooks.example.com"),
        ("webhook", "hooks.example.com:8443", "hooks.example.com:8443"),
        ("webhook", "[2001:db8::1]:443", "[2001:db8::1]"),  # https's own port
        ("webhook", "Hooks.Example.com.:0443", "hooks.example.com"),
        ("webhook", "10.0.0.1", "10.0.0.1"),
        ("webhook", "https://hooks.example.com/x", None),
        ("webhook", "hooks example", None),
        ("webhook", "", "*"),  # the channel as a whole
        ("webhook", " * ", "*"),
        ("webhook", "*.example.com", None),
        ("webhook", "hooks.example.com:99999", None),
        ("webhook", "hooks.example.com:0", None),
        ("email", "", ""),
        ("email", "example.com", None),
        ("email", "*", None),  # the account is the channel already
        ("sqs", "", "*"),
        ("eventbridge", "*", "*"),
        ("sqs", "https://sqs.x/123456789012/q", "https://sqs.x/123456789012/q"),
        ("eventbridge", "", ""),
        ("eventbridge", "bus\x1b[2J", None),
    ],
)
def test_destination_keys_are_checked(channel: str, destination: str, expected: str | None) -> None:
    if expected is None:
        with pytest.raises(ValueError):
            store.check_destination(channel, destination)
    else:
        assert store.check_destination(channel, destination) == expected


def test_a_limited_destination_behind_a_long_backlog_still_gets_its_share(
    engine: sa.Engine,
) -> None:
    """Its rows are found by a probe of their own index, not by walking the
    claim order: 300 rows of another destination ahead do not hide them, and
    their few tokens do not shrink the batch of the others."""
    free = enqueue_hooks(engine, "free.example", 300)
    limited = enqueue_hooks(engine, "limited.example", 5)
    with engine.begin() as conn:
        store.set_limit(conn, "webhook", "limited.example", 0.001, 3)
    claimed = {c.id for c in claim(engine, batch=10)}
    assert len(claimed) == 10
    assert len(claimed & set(limited)) == 3 and len(claimed & set(free)) == 7
    claimed = {c.id for c in claim(engine, batch=10)}  # the bucket is empty now
    assert claimed <= set(free) and len(claimed) == 10


def test_next_resume_is_when_a_pause_ends_or_a_token_comes(engine: sa.Engine) -> None:
    """What a relay that sleeps until its next event must wake for: the end
    of a pause or an empty bucket's next token, of a destination or channel
    with rows due by then."""
    with engine.begin() as conn:
        assert store.next_resume(conn) is None
        store.record_throttling(conn, "webhook", {"a.example": store.Throttled(30, 1, 10)})
        store.record_throttling(conn, "email", {}, ("quota: daily", 10))
        store.set_limit(conn, "webhook", "b.example", 2, 1)
        conn.execute(
            sa.text(
                "UPDATE outbox_destination SET tokens = 0, tokens_at = now()"
                " WHERE destination = 'b.example'"
            )
        )
        assert store.next_resume(conn) is None  # nothing waits for any of them
    enqueue_hooks(engine, "a.example", 1)
    enqueue(engine)
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM outbox_destination WHERE destination = 'b.example'"))
        seconds = conn.execute(
            sa.text("SELECT EXTRACT(EPOCH FROM CAST(:t AS timestamptz) - now())"),
            {"t": store.next_resume(conn)},
        ).scalar_one()
        assert 9 < float(seconds) <= 10  # the channel's pause ends first
        conn.execute(sa.text("DELETE FROM outbox_channel_pause"))
        conn.execute(sa.text("DELETE FROM outbox_destination"))
        store.set_limit(conn, "webhook", "b.example", 2, 1)
        conn.execute(sa.text("UPDATE outbox_destination SET tokens = 0, tokens_at = now()"))
        assert store.next_resume(conn) is None  # no row of b.example yet
    enqueue_hooks(engine, "b.example", 1)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE outbox_destination SET tokens = 0, tokens_at = now()"))
        seconds = conn.execute(
            sa.text("SELECT EXTRACT(EPOCH FROM CAST(:t AS timestamptz) - now())"),
            {"t": store.next_resume(conn)},
        ).scalar_one()
        assert float(seconds) == pytest.approx(0.5)  # one token at 2 a second


def test_a_sleeping_relay_wakes_when_a_paused_destination_resumes(engine: sa.Engine) -> None:
    """Its due rows are no future event of their own (they are due), so the
    next wake-up must include the pause's end, or they would wait for the
    safety net."""
    enqueue_hooks(engine, "slow.example", 3)
    with engine.begin() as conn:
        store.record_throttling(conn, "webhook", {"slow.example": store.Throttled(30, 1, 10)})
        wake = store.next_wake(conn)
    assert wake.next_due is None  # the rows are due already
    assert wake.next_resume is not None and wake.earliest == wake.next_resume
    assert 25 < (wake.next_resume - wake.now).total_seconds() <= 30


# --- idle buckets never keep the claim from the others (issue 31, item 1) ------


def quiet_buckets(engine: sa.Engine, n: int, age_seconds: float = 3600) -> None:
    """``n`` destinations that each answered 429 once, long ago, and then went
    quiet: learned rates, full buckets, the oldest draw times, no rows due."""
    with engine.begin() as conn:
        store.record_throttling(
            conn, "webhook", {f"quiet{i}.example": store.Throttled(1, 1, 1) for i in range(n)}
        )
        conn.execute(
            sa.text(
                "UPDATE outbox_destination SET paused_until = now() - make_interval(secs => :age),"
                " rate_at = now() - make_interval(secs => :age), tokens = 1,"
                " tokens_at = now() - make_interval(secs => :age)"
                " WHERE destination LIKE 'quiet%'"
            ),
            {"age": age_seconds},
        )


def test_idle_learned_buckets_never_keep_due_destinations_from_the_claim(
    engine: sa.Engine,
) -> None:
    # Eight quiet destinations hold the oldest draw times: before, they took
    # every one of the claim's bucket slots for ever, and a destination that
    # throttled later, a limited one and the email channel's account (an SES
    # limit) were never claimed again.
    quiet_buckets(engine, BUCKETS_PER_CLAIM)
    throttled = enqueue_hooks(engine, "throttled-later.example", 5)
    limited = enqueue_hooks(engine, "limited.example", 5)
    emails = enqueue(engine, 5, "email")
    set_bucket(engine, "throttled-later.example", rate=50, tokens=10, burst=10)
    with engine.begin() as conn:
        store.set_limit(conn, "webhook", "limited.example", 50, 10)
        store.set_limit(conn, "email", "", 50, 10)
    claimed = {c.id for c in claim(engine)}
    assert set(throttled) <= claimed
    assert set(limited) <= claimed
    assert set(emails) <= claimed


def test_a_per_channel_claim_draws_only_its_channels_buckets(engine: sa.Engine) -> None:
    # Other channels' buckets with due rows must not take a channel's slots.
    for i in range(BUCKETS_PER_CLAIM):
        enqueue_hooks(engine, f"busy{i}.example", 1)
        set_bucket(engine, f"busy{i}.example", rate=50, tokens=10)
    emails = enqueue(engine, 3, "email")
    with engine.begin() as conn:
        store.set_limit(conn, "email", "", 50, 10)
    claimed = {c.id for c in claim(engine, channels=["email"])}
    assert claimed == set(emails)


def test_the_reaper_forgets_destinations_that_throttled_long_ago(engine: sa.Engine) -> None:
    from outbox import reaper

    quiet_buckets(engine, 3, age_seconds=3600)  # long ago: forgotten
    with engine.begin() as conn:
        store.record_throttling(conn, "webhook", {"recent.example": store.Throttled(1, 1, 1)})
        store.set_limit(conn, "webhook", "quiet0.example", 5)  # a limit: kept
    report = reaper.run(engine, settings(), lambda: 30.0)
    with engine.connect() as conn:
        left = {f.destination: f for f in store.destination_figures(conn)}
    assert report.forgotten_destinations == 2
    assert set(left) == {"quiet0.example", "recent.example"}
    assert left["quiet0.example"].limit_rate == 5


def test_an_operator_can_forget_what_was_learned(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        store.set_limit(conn, "webhook", "a.example", 10)
        store.record_throttling(conn, "webhook", {"a.example": store.Throttled(1, 1, 5)})
        store.record_throttling(conn, "webhook", {"b.example": store.Throttled(1, 1, 5)})
        assert store.forget_learned(conn, "webhook", "b.example") is True
        assert store.forget_learned(conn, "webhook", "b.example") is False
        assert store.forget_learned(conn, "webhook", "a.example") is True
        [left] = store.destination_figures(conn)
    # the limit stays; what was learned (rate, pause, bucket) is gone
    assert (left.destination, left.limit_rate, left.rate) == ("a.example", 10, None)
    assert left.paused_until is None


# --- a receiver that never stops refusing (issue 31, item 3) ------------------


class AlwaysRefusing(DestinationChannel):
    """A receiver that answers every call with 503 and no Retry-After."""

    def send(self, message: Any, deadline: Any) -> Outcome:
        self.calls += 1
        return Outcome.throttled("HTTP 503")


def jump(engine: sa.Engine, seconds: float) -> None:
    """Simulated time: every time the relay reads moves ``seconds`` into the past."""
    from bench.refusing import jump as shift

    with engine.begin() as conn:
        shift(conn, seconds)


def test_a_receiver_that_always_refuses_backs_off_and_ends_dead(engine: sa.Engine) -> None:
    """Before: a 503 without Retry-After paused the destination 1 s and gave one
    token at its end, whatever the learned rate, counting nothing: about a
    request a second for ever, never dead."""
    channel = install_channel(AlwaysRefusing())
    (message_id,) = enqueue(engine, 1, "scripted")
    simulated, calls_in_first_hour, steps, idle_wakes = 0.0, None, 0, 0
    while simulated < 6 * 3600 and steps < 200:  # (before: a step a second)
        steps += 1
        claims = claim(engine)
        if claims:
            run_sender(engine, claims)
        elif steps > 1:
            idle_wakes += 1
        with engine.connect() as conn:
            status = conn.execute(
                sa.text("SELECT status FROM outbox_message WHERE id = :id"), {"id": message_id}
            ).scalar_one()
            if status != "pending":
                break
            # the sleeping dispatcher's wake-up: claimable once both its
            # destination's pause ended and it is due, not at either alone
            wake = store.next_wake(conn)
        assert wake.earliest is not None
        step = max((wake.earliest - wake.now).total_seconds(), 0.0) + 0.01
        if calls_in_first_hour is None and simulated + step > 3600:
            calls_in_first_hour = channel.calls
        jump(engine, step)
        simulated += step
    with engine.connect() as conn:
        row = conn.execute(
            sa.text("SELECT status, attempts, last_error FROM outbox_message WHERE id = :id"),
            {"id": message_id},
        ).one()
        pauses = conn.execute(
            sa.text("SELECT EXTRACT(EPOCH FROM paused_until - rate_at) FROM outbox_destination")
        ).scalar_one()
    if calls_in_first_hour is None and simulated <= 3600:
        calls_in_first_hour = channel.calls  # (it ended within the hour)
    assert calls_in_first_hour is not None and calls_in_first_hour <= 24, (
        row,
        simulated,
        channel.calls,
    )
    assert row.status == "dead", (row, simulated, channel.calls)
    assert idle_wakes == 0  # every wake-up the database named could claim the row
    assert row.attempts == settings().max_attempts
    print(
        f"simulated {simulated:.0f} s, {channel.calls} calls, {calls_in_first_hour} in the first hour"
    )
    assert "HTTP 503" in row.last_error and "refused every call" in row.last_error
    assert float(pauses) <= store.MAX_BACKOFF_SECONDS
