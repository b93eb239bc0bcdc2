"""SQL injection is impossible by construction: every value is a bound
parameter (arrays included) and identifiers come from closed maps. Hostile
strings are stored and compared literally, and the tables survive."""

from __future__ import annotations

import re

import pytest
import sqlalchemy as sa

import outbox
from outbox import store
from support import ScriptedChannel, install_channel

HOSTILE = [
    "'; DROP TABLE outbox_message; --",
    "x'); DROP TABLE outbox_attempt; --",
    "' OR '1'='1",
    '" OR ""="',
    "\\",
    "\\'",
    "'\\''",
    "%",
    "_",
    "$1",
    ":ids",
    "NULL",
    "null",  # regression: pg8000 sent these unquoted in arrays, i.e. as NULL
    "Null",
    "nUlL",
    "{1,2}",
    "a,b",
    '{"a": 1}',
    "}",
    "\u02bc; DROP TABLE outbox_message; --",  # a quote look-alike
    "\u2019 OR 1=1",
    "😀'; SELECT pg_sleep(10); --",
    "\t\n\r",
    "E'\\x41'",
]


def tables_intact(engine: sa.Engine) -> None:
    with engine.connect() as conn:
        names = set(
            conn.execute(
                sa.text("SELECT tablename FROM pg_tables WHERE schemaname = current_schema()")
            ).scalars()
        )
    assert {"outbox_message", "outbox_attempt"} <= names


def test_hostile_strings_are_stored_and_compared_literally(engine: sa.Engine) -> None:
    install_channel(ScriptedChannel())
    with engine.begin() as conn:
        ids = outbox.enqueue_many(
            conn,
            [
                {
                    "channel": "scripted",
                    "payload": {"n": i, "text": s, s: s},
                    "dedupe_key": s,
                    "ordering_key": s,
                }
                for i, s in enumerate(HOSTILE)
            ],
        )
    assert len(set(ids)) == len(HOSTILE)
    tables_intact(engine)
    with engine.connect() as conn:
        rows = {
            r.id: r
            for r in conn.execute(
                sa.text("SELECT id, payload, dedupe_key, ordering_key FROM outbox_message")
            ).all()
        }
    assert len(rows) == len(HOSTILE)
    for message_id, s in zip(ids, HOSTILE, strict=True):
        r = rows[message_id]
        assert (r.dedupe_key, r.ordering_key) == (s, s)
        assert r.payload["text"] == s and r.payload[s] == s

    # Dedupe compares literally: every hostile key finds exactly its own row
    # (a replay repeats its payload), and near-misses (another quote, a
    # different case) are new messages.
    with engine.begin() as conn:
        again = outbox.enqueue_many(
            conn,
            [
                {"channel": "scripted", "payload": {"n": i, "text": s, s: s}, "dedupe_key": s}
                for i, s in enumerate(HOSTILE)
            ],
        )
        assert again == ids
        near = outbox.enqueue(
            conn, "scripted", {"n": 0}, dedupe_key="'; drop table outbox_message; --"
        )
        assert near not in ids
    tables_intact(engine)


def test_hostile_channel_filters_and_ordering_keys_match_literally(engine: sa.Engine) -> None:
    install_channel(ScriptedChannel())
    with engine.begin() as conn:
        first = outbox.enqueue_many(
            conn,
            [{"channel": "scripted", "payload": {"n": 1}, "ordering_key": s} for s in HOSTILE],
        )
        second = outbox.enqueue_many(
            conn,
            [{"channel": "scripted", "payload": {"n": 2}, "ordering_key": s} for s in HOSTILE],
        )
    with engine.begin() as conn:
        # A hostile channel filter matches nothing and drops nothing.
        assert store.claim(conn, 1000, 60, channels=[*HOSTILE, "' OR 1=1 --"]) == []
        assert store.claim(conn, 1000, 60, channels=["scripted' OR 'x'='x"]) == []
    tables_intact(engine)
    with engine.begin() as conn:
        claims = store.claim(conn, 1000, 60, channels=["scripted", *HOSTILE])
    # Each hostile ordering key is its own key: exactly its head is claimed,
    # not rows of a key that merely looks similar.
    assert sorted(c.id for c in claims) == sorted(first)
    with engine.begin() as conn:
        settled = store.settle(
            conn,
            [store.Settlement(c.id, c.claim_token, "delivered") for c in claims],
            store.Backoff(1, 60, 3),
        )
        assert set(settled) == set(first)
        assert sorted(c.id for c in store.claim(conn, 1000, 60)) == sorted(second)
        # Hostile reasons are stored as text.
        assert store.cancel(conn, [], reason=HOSTILE[0]) == set()
    tables_intact(engine)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM outbox_message")).scalar_one() == 2 * len(
            HOSTILE
        )


def test_operator_filters_refuse_hostile_channel_names_and_match_literally(
    engine: sa.Engine,
) -> None:
    install_channel(ScriptedChannel(name="null"))  # a legal name that pg8000 once sent as NULL
    install_channel(ScriptedChannel())
    with engine.begin() as conn:
        (null_id,) = outbox.enqueue_many(conn, [{"channel": "null", "payload": {"n": 1}}])
        outbox.enqueue(conn, "scripted", {"n": 2}, dedupe_key=HOSTILE[0])
    for hostile in [h for h in HOSTILE if not re.fullmatch(r"[a-z][a-z0-9_-]{0,63}", h)]:
        with pytest.raises(ValueError), engine.begin() as conn:
            store.list_messages(conn, channels=[hostile])
        with pytest.raises(ValueError), engine.begin() as conn:
            store.redrive_matching(conn, ["dead"], channels=[hostile])
    with engine.begin() as conn:
        assert store.list_messages(conn, channels=["nul", "nulll", "null_"]) == []
        assert [r.id for r in store.list_messages(conn, channels=["null"])] == [null_id]
        assert [c.id for c in store.claim(conn, 10, 60, channels=["null"])] == [null_id]
    tables_intact(engine)
