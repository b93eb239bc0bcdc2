"""Cooldown per key (docs/design.md, invariant 11): at most one message per
(channel, cooldown_key) delivered within a window, decided in the database,
whoever claims."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

import outbox
from outbox import ValidationError, store
from support import DOCS, EMAIL, claim, doc_blocks, enqueue, expire_leases, make_due, row

BACKOFF = store.Backoff(1, 60, 5)
HOUR = timedelta(hours=1)


def settle(engine: sa.Engine, claims: list[store.Claim], outcome: str = "delivered") -> None:
    with engine.begin() as conn:
        store.settle(
            conn, [store.Settlement(c.id, c.claim_token, outcome) for c in claims], BACKOFF
        )


def cooldown_row(engine: sa.Engine, key: str) -> sa.Row[Any]:
    with engine.connect() as conn:
        return conn.execute(
            sa.text(
                "SELECT message_id, until, until - now() AS left FROM outbox_cooldown "
                "WHERE channel = 'email' AND cooldown_key = :key"
            ),
            {"key": key},
        ).one()


def by_status(engine: sa.Engine) -> dict[str, list[int]]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT status, id FROM outbox_message ORDER BY id")).all()
    out: dict[str, list[int]] = {}
    for status, message_id in rows:
        out.setdefault(status, []).append(message_id)
    return out


def test_concurrent_claimers_deliver_one_message_per_key_and_window(engine: sa.Engine) -> None:
    keys = ["user-1:digest", "user-2:digest", "user-3:digest"]
    with engine.begin() as conn:
        outbox.enqueue_many(
            conn,
            [
                {"channel": "email", "payload": EMAIL, "cooldown": HOUR, "cooldown_key": key}
                for _ in range(60)
                for key in keys
            ]
            + [{"channel": "email", "payload": EMAIL} for _ in range(60)],
        )
    claimers, start = 6, threading.Barrier(6)
    errors: list[BaseException] = []

    def claimer() -> None:
        try:
            start.wait()
            while True:
                with engine.begin() as conn:
                    batch = store.claim(conn, 7, 120)
                    # a claim whose batch held only waiting rows claims nothing
                    due = conn.execute(
                        sa.text(
                            "SELECT count(*) FROM outbox_message "
                            "WHERE status = 'pending' AND available_at <= now()"
                        )
                    ).scalar_one()
                if not batch and not due:
                    return
                settle(engine, batch)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=claimer) for _ in range(claimers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with engine.connect() as conn:
        delivered = dict(
            conn.execute(
                sa.text(
                    "SELECT COALESCE(cooldown_key, ''), count(*) FROM outbox_message "
                    "WHERE status = 'delivered' GROUP BY 1"
                )
            ).all()
        )
        waiting = conn.execute(
            sa.text(
                "SELECT count(*) FROM outbox_message "
                "WHERE status = 'pending' AND available_at > now() AND attempts = 0"
            )
        ).scalar_one()
    assert delivered == {"": 60, **dict.fromkeys(keys, 1)}
    # every other message of a key waits, none was claimed or sent
    assert waiting == 3 * 59
    assert by_status(engine).keys() == {"delivered", "pending"}


def test_the_workers_claim_and_receive_passes_one_message_per_key(engine: sa.Engine) -> None:
    keyed = enqueue(engine, 3, cooldown=HOUR, cooldown_key="k")
    plain = enqueue(engine, 2)
    with engine.begin() as conn:
        received = store.claim_and_receive(conn, 10, 120, 5)
    assert [m.id for m in received] == [keyed[0], *plain]
    with engine.begin() as conn:
        store.settle(
            conn, [store.Settlement(m.id, m.claim_token, "delivered") for m in received], BACKOFF
        )
    assert cooldown_row(engine, "k").until is not None
    assert by_status(engine) == {"delivered": [keyed[0], *plain], "pending": keyed[1:]}


@pytest.mark.parametrize("limited", ["", "*"])  # the account's bucket, the channel's
def test_a_limited_destination_or_channel_pays_only_for_what_passes(
    engine: sa.Engine, limited: str
) -> None:
    with engine.begin() as conn:
        store.set_limit(conn, "email", limited, 0.001, 10)
    keyed = enqueue(engine, 3, cooldown=HOUR, cooldown_key="k")
    plain = enqueue(engine, 2)
    assert sorted(c.id for c in claim(engine)) == [keyed[0], *plain]
    with engine.connect() as conn:
        tokens = conn.execute(
            sa.text(
                "SELECT tokens FROM outbox_destination WHERE channel = 'email' AND destination = :d"
            ),
            {"d": limited},
        ).scalar_one()
    assert round(tokens) == 7


def test_a_later_message_waits_for_the_window_or_is_suppressed(engine: sa.Engine) -> None:
    (first,) = enqueue(engine, cooldown=HOUR, cooldown_key="k")
    settle(engine, claim(engine))
    held = cooldown_row(engine, "k")
    assert held.message_id == first
    assert timedelta(minutes=59) < held.left <= HOUR

    waits = enqueue(engine, 2, cooldown=3600, cooldown_key="k")
    suppressed = enqueue(engine, 2, cooldown=HOUR, cooldown_key="k", on_cooldown="suppress")
    other_key = enqueue(engine, cooldown=HOUR, cooldown_key="other")
    claimed = claim(engine)
    assert [c.id for c in claimed] == other_key
    with engine.connect() as conn:
        for message_id in waits:
            r = row(conn, message_id)
            assert (r.status, r.available_at, r.attempts) == ("pending", held.until, 0)
        for message_id in suppressed:
            r = row(conn, message_id)
            assert r.status == "suppressed" and r.settled_at is not None
            assert r.last_error == (
                f"cooldown: message {first} of this key was delivered within the window"
            )
    # the waiting rows left the due index: the next claim reads nothing
    assert claim(engine) == []

    # when the window has passed, the next one goes (and takes the key)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE outbox_cooldown SET until = now() - interval '1 second'"))
    make_due(engine)
    (passed,) = claim(engine)
    assert passed.id == waits[0]
    assert cooldown_row(engine, "k").message_id == waits[0]


def test_the_holders_own_retry_passes_and_the_others_wait_behind_it(engine: sa.Engine) -> None:
    (holder,) = enqueue(engine, cooldown=HOUR, cooldown_key="k")
    (first,) = claim(engine)
    settle(engine, [first], "retry")
    # a later message of the key, claimed first (higher priority)
    (later,) = enqueue(engine, cooldown=HOUR, cooldown_key="k", priority=9)
    make_due(engine)
    (retried,) = claim(engine)
    assert retried.id == holder and retried.attempt == 2
    with engine.connect() as conn:
        r, h = row(conn, later), row(conn, holder)
    # behind a holder not delivered yet: it looks again after the lease (shorter
    # than the window), both counted from the same claim's clock
    assert r.status == "pending" and r.available_at == h.lease_expires_at
    assert cooldown_row(engine, "k").until is None


@pytest.mark.parametrize("outcome", ["failed", "suppressed"])
def test_a_holder_that_ends_undelivered_holds_nothing(engine: sa.Engine, outcome: str) -> None:
    enqueue(engine, cooldown=HOUR, cooldown_key="k")
    settle(engine, claim(engine), outcome)
    (later,) = enqueue(engine, cooldown=HOUR, cooldown_key="k", on_cooldown="suppress")
    (claimed,) = claim(engine)
    assert claimed.id == later
    assert cooldown_row(engine, "k").message_id == later


def test_a_key_taken_after_a_claim_began_is_held_for_that_claim(engine: sa.Engine) -> None:
    """A claim's snapshot may predate the holder another claimer just took the
    key for (a message committed since): whatever it reads of that holder, a
    key taken after its statement began is held for it."""
    (waiting,) = enqueue(engine, cooldown=HOUR, cooldown_key="k", delay=3600)
    with engine.connect() as late:
        tx = late.begin()
        late.execute(sa.text("SELECT now()"))  # this transaction's clock starts here
        enqueue(engine, cooldown=HOUR, cooldown_key="k")
        settle(engine, claim(engine), "failed")  # took the key, then held nothing
        with engine.begin() as conn:  # due on the late transaction's clock too
            conn.execute(
                sa.text("UPDATE outbox_message SET available_at = now() - interval '1 hour'")
            )
        assert store.claim(late, 10, 120) == []
        tx.commit()
    with engine.begin() as conn:
        assert row(conn, waiting).available_at > conn.execute(sa.text("SELECT now()")).scalar()
    make_due(engine)
    (claimed,) = claim(engine)  # a claim that began after it sees the key free
    assert claimed.id == waiting


def test_a_sender_whose_lease_was_taken_opens_no_window(engine: sa.Engine) -> None:
    (holder,) = enqueue(engine, cooldown=HOUR, cooldown_key="k")
    (stale,) = claim(engine)
    expire_leases(engine)
    with engine.begin() as conn:
        store.reap_expired(conn, 100, BACKOFF)
    (fresh,) = claim(engine)
    assert fresh.id == holder and fresh.claim_token != stale.claim_token
    settle(engine, [stale])  # fenced: changes nothing
    assert cooldown_row(engine, "k").until is None
    with engine.connect() as conn:
        assert row(conn, holder).status == "claimed"
    settle(engine, [fresh])
    held = cooldown_row(engine, "k")
    assert held.message_id == holder and held.until is not None


def test_a_sleeping_relay_wakes_at_the_end_of_the_window(engine: sa.Engine) -> None:
    enqueue(engine, cooldown=timedelta(minutes=10), cooldown_key="k")
    settle(engine, claim(engine))
    enqueue(engine, cooldown=timedelta(minutes=10), cooldown_key="k")
    assert claim(engine) == []
    with engine.connect() as conn:
        wake = store.next_wake(conn)
    assert wake.next_due == cooldown_row(engine, "k").until
    assert wake.earliest == wake.next_due


def test_the_guides_example_waits_for_the_window(engine: sa.Engine) -> None:
    code = doc_blocks(DOCS / "how-to" / "producing.md")["producer-cooldown"].code
    for _ in range(2):
        exec(compile(code, "producing.md", "exec"), {"engine": engine})  # noqa: S102
    (first,) = claim(engine)
    settle(engine, [first])
    assert claim(engine) == []
    with engine.connect() as conn:
        keys = conn.execute(
            sa.text(
                "SELECT status, cooldown_key, EXTRACT(EPOCH FROM cooldown) AS s, on_cooldown "
                "FROM outbox_message ORDER BY id"
            )
        ).all()
    assert [tuple(k) for k in keys] == [
        ("delivered", "user-7:digest", 3600, "wait"),
        ("pending", "user-7:digest", 3600, "wait"),
    ]


def test_rows_without_a_cooldown_are_claimed_as_before(engine: sa.Engine) -> None:
    plain = enqueue(engine, 5)
    keyed = enqueue(engine, 3, cooldown=HOUR, cooldown_key="k")
    claimed = {c.id for c in claim(engine)}
    assert claimed == {*plain, keyed[0]}
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM outbox_cooldown")).scalar_one() == 1


def test_the_reaper_removes_cooldowns_that_hold_nothing(engine: sa.Engine) -> None:
    enqueue(engine, cooldown=HOUR, cooldown_key="ended")
    enqueue(engine, cooldown=HOUR, cooldown_key="failed")
    enqueue(engine, cooldown=HOUR, cooldown_key="open")
    enqueue(engine, cooldown=HOUR, cooldown_key="in-flight")
    claims = {c.id: c for c in claim(engine)}
    settle(engine, [claims[1], claims[3]])
    settle(engine, [claims[2]], "failed")
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE outbox_cooldown SET until = now() - interval '1 second' "
                "WHERE cooldown_key = 'ended'"
            )
        )
        assert store.prune_cooldowns(conn, 100) == 2
        kept = conn.execute(
            sa.text("SELECT cooldown_key FROM outbox_cooldown ORDER BY 1")
        ).scalars()
        assert list(kept) == ["in-flight", "open"]


BAD = [
    ({"cooldown": HOUR}, "cooldown_key", "is required with cooldown"),
    ({"cooldown_key": "k"}, "cooldown", "is required with cooldown_key"),
    ({"cooldown": 0, "cooldown_key": "k"}, "cooldown", "must be more than 0 seconds"),
    ({"cooldown": -5, "cooldown_key": "k"}, "cooldown", "must be between 0 and 31622400 seconds"),
    (
        {"cooldown": float("nan"), "cooldown_key": "k"},
        "cooldown",
        "must be between 0 and 31622400 seconds",
    ),
    (
        {"cooldown": timedelta(days=367), "cooldown_key": "k"},
        "cooldown",
        "must be between 0 and 31622400 seconds",
    ),
    ({"cooldown": "1h", "cooldown_key": "k"}, "cooldown", "must be a timedelta or a number"),
    ({"cooldown": HOUR, "cooldown_key": ""}, "cooldown_key", "must be 1 to 255 characters"),
    ({"cooldown": HOUR, "cooldown_key": "k" * 256}, "cooldown_key", "must be 1 to 255"),
    ({"cooldown": HOUR, "cooldown_key": 7}, "cooldown_key", "must be a string"),
    (
        {"cooldown": HOUR, "cooldown_key": "a\nb"},
        "cooldown_key",
        "must not contain control characters",
    ),
    (
        {"cooldown": HOUR, "cooldown_key": "a\x85b"},
        "cooldown_key",
        "must not contain control characters",
    ),
    ({"cooldown": HOUR, "cooldown_key": "k", "on_cooldown": "drop"}, "on_cooldown", "must be"),
    ({"on_cooldown": "suppress"}, "on_cooldown", "only with cooldown and cooldown_key"),
]


@pytest.mark.parametrize(("options", "field", "problem"), BAD)
def test_bad_cooldown_options_are_refused_and_nothing_is_written(
    engine: sa.Engine, options: dict[str, Any], field: str, problem: str
) -> None:
    with engine.begin() as conn:
        with pytest.raises(ValidationError) as refused:
            outbox.enqueue(conn, "email", EMAIL, **options)
        assert (refused.value.field, refused.value.problem[: len(problem)]) == (field, problem)
        with pytest.raises(ValidationError) as refused:
            outbox.enqueue_many(
                conn,
                [
                    {"channel": "email", "payload": EMAIL},
                    {"channel": "email", "payload": EMAIL, **options},
                ],
            )
        assert refused.value.field == f"messages[1].{field}"
    assert by_status(engine) == {}


# --- the SQL door ----------------------------------------------------------------


def sql_enqueue(conn: sa.Connection, arguments: str, **params: Any) -> int:
    return conn.execute(
        sa.text(f"SELECT public.outbox_enqueue('email', CAST(:payload AS jsonb){arguments})"),
        {"payload": store.payload_json(EMAIL), **params},
    ).scalar_one()


def test_the_sql_door_takes_the_cooldown_options(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        plain = sql_enqueue(conn, ", dedupe_key => 'd'")
        keyed = sql_enqueue(
            conn,
            ", cooldown => interval '1 day', cooldown_key => 'user-7:digest', "
            "on_cooldown => 'suppress'",
        )
        waiting = sql_enqueue(conn, ", cooldown => interval '90 seconds', cooldown_key => 'x'")
        # a replay with a cooldown changes nothing of the message it names
        replay = sql_enqueue(
            conn, ", dedupe_key => 'd', cooldown => interval '1 hour', cooldown_key => 'x'"
        )
        rows = {
            r.id: r
            for r in conn.execute(
                sa.text(
                    "SELECT id, cooldown_key, EXTRACT(EPOCH FROM cooldown) AS seconds, "
                    "on_cooldown FROM outbox_message"
                )
            )
        }
    assert replay == plain
    assert (rows[plain].cooldown_key, rows[plain].seconds, rows[plain].on_cooldown) == (
        None,
        None,
        None,
    )
    assert (rows[keyed].cooldown_key, rows[keyed].seconds, rows[keyed].on_cooldown) == (
        "user-7:digest",
        86400,
        "suppress",
    )
    assert (rows[waiting].seconds, rows[waiting].on_cooldown) == (90, "wait")


@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        (", cooldown => interval '1 hour'", "cooldown_key"),
        (", cooldown_key => 'k'", "cooldown"),
        (", cooldown => interval '0', cooldown_key => 'k'", "cooldown"),
        (", cooldown => interval '-1 hour', cooldown_key => 'k'", "cooldown"),
        (", cooldown => interval '400 days', cooldown_key => 'k'", "cooldown"),
        (", cooldown => interval '1 hour', cooldown_key => ''", "cooldown_key"),
        (", cooldown => interval '1 hour', cooldown_key => E'a\\tb'", "cooldown_key"),
        (", cooldown => interval '1 hour', cooldown_key => 'k', on_cooldown => 'x'", "on_cooldown"),
        (", on_cooldown => 'suppress'", "on_cooldown"),
    ],
)
def test_the_sql_door_refuses_bad_cooldown_options(
    engine: sa.Engine, arguments: str, field: str
) -> None:
    with engine.connect() as conn:
        with pytest.raises(sa.exc.DBAPIError) as refused:
            sql_enqueue(conn, arguments)
        assert str(refused.value.orig).count(f"{field}:") >= 1
        assert "22023" in str(refused.value.orig)
    assert by_status(engine) == {}


def test_enqueue_many_in_sql_takes_and_checks_the_cooldown_arrays(engine: sa.Engine) -> None:
    call = (
        "SELECT * FROM public.outbox_enqueue_many('{email,email}', CAST(:payloads AS jsonb), "
        "'{NULL,NULL}', '{NULL,NULL}', '{0,0}', '{0,0}', '{NULL,NULL}', '{NULL,NULL}', "
        "'{NULL,NULL}', '{hold,hold}'EXTRA)"
    )
    payloads = "[" + ",".join([store.payload_json(EMAIL)] * 2) + "]"
    with engine.begin() as conn:
        refused = conn.execute(
            sa.text(
                call.replace(
                    "EXTRA",
                    ", p_cooldowns => '{60,0}', p_cooldown_keys => '{a,b}', "
                    "p_on_cooldown => '{wait,wait}'",
                )
            ),
            {"payloads": payloads},
        ).all()
        assert [(r.ord, r.refused_field) for r in refused] == [(2, "cooldown")]
        assert by_status(engine) == {}
        written = conn.execute(
            sa.text(
                call.replace(
                    "EXTRA",
                    ", p_cooldowns => '{60,NULL}', p_cooldown_keys => '{a,NULL}', "
                    "p_on_cooldown => '{suppress,NULL}'",
                )
            ),
            {"payloads": payloads},
        ).all()
        plain = conn.execute(sa.text(call.replace("EXTRA", "")), {"payloads": payloads}).all()
        keys = conn.execute(
            sa.text("SELECT id, cooldown_key, on_cooldown FROM outbox_message ORDER BY id")
        ).all()
    assert [r.created for r in written + plain] == [True] * 4
    assert [tuple(k)[1:] for k in keys] == [
        ("a", "suppress"),
        (None, None),
        (None, None),
        (None, None),
    ]


def test_a_suppressed_message_is_in_the_send_log(engine: sa.Engine) -> None:
    # Issue 31, item 10: "did someone@example.net get it?" must show the
    # message the cooldown suppressed, not leave it out.
    (first,) = enqueue(engine, cooldown=HOUR, cooldown_key="k")
    settle(engine, claim(engine))
    (later,) = enqueue(engine, cooldown=HOUR, cooldown_key="k", on_cooldown="suppress")
    assert claim(engine) == []
    with engine.connect() as conn:
        history = store.recipient_history(conn, EMAIL["to"][0], ["email"])
    by_message = {(h.message_id, h.outcome) for h in history}
    assert (first, "delivered") in by_message
    assert (later, "suppressed") in by_message
