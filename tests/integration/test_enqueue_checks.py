"""The enqueue checks that SQL and Python make alike (issue 23, item 8): an
unregistered channel, a payload that is not an object, a deliver-by time of
'infinity', the 256 KiB limit measured one way (the jsonb's text) on both
paths, and a hostile payload key that never reaches an error message raw."""

from __future__ import annotations

import json
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import outbox
from outbox import channels, payloads
from outbox.channels import SchemaChannel
from outbox.payloads import MAX_PAYLOAD_BYTES

LIMIT = MAX_PAYLOAD_BYTES


class AnyObject(SchemaChannel):
    name = "anyobject"
    schema = {"type": "object"}


@pytest.fixture(autouse=True)
def _anyobject(engine: sa.Engine) -> None:
    channels.register("anyobject", AnyObject)
    with engine.begin() as conn:
        conn.execute(
            sa.text("INSERT INTO outbox_channel (name) VALUES ('anyobject') ON CONFLICT DO NOTHING")
        )


def sql_refusal(engine: sa.Engine, channel: str, payload_text: str, **options: Any) -> str:
    """The message of the SQL enqueue's refusal (SQLSTATE 22023)."""
    named = "".join(f", {name} => :{name}" for name in options)
    with pytest.raises(sa.exc.DatabaseError) as caught, engine.begin() as conn:
        conn.execute(
            sa.text(f"SELECT outbox_enqueue(:c, CAST(:p AS jsonb){named})"),
            {"c": channel, "p": payload_text} | options,
        )
    fields = caught.value.orig.args[0]
    assert fields["C"] == "22023", fields
    return str(fields["M"])


def sql_accepts(engine: sa.Engine, channel: str, payload_text: str) -> bool:
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.text("SELECT outbox_enqueue(:c, CAST(:p AS jsonb))"),
                {"c": channel, "p": payload_text},
            )
    except sa.exc.DatabaseError as exc:
        assert exc.orig.args[0]["C"] == "22023"
        return False
    return True


def python_accepts(engine: sa.Engine, channel: str, payload: Any) -> bool:
    try:
        with engine.begin() as conn:
            outbox.enqueue(conn, channel, payload)
    except outbox.ValidationError:
        return False
    return True


def test_an_unregistered_channel_is_refused(engine: sa.Engine) -> None:
    message = sql_refusal(engine, "emial", json.dumps({"to": "x"}))
    assert message == "channel: is not a registered channel (outbox_channel)"


def test_a_custom_channels_payload_must_be_an_object(engine: sa.Engine) -> None:
    for payload in ("[1, 2]", '"text"', "42", "true"):
        assert sql_refusal(engine, "anyobject", payload) == "payload: must be an object"


def test_an_infinite_deliver_by_time_is_refused(engine: sa.Engine) -> None:
    message = sql_refusal(engine, "anyobject", "{}", expires_at="infinity")
    assert message == "expires_at: must be a finite time"


def test_a_hostile_payload_key_is_not_echoed(engine: sa.Engine) -> None:
    email = {"from": "a@example.com", "to": ["b@example.net"], "subject": "s", "text": "t"}
    key = "evil\n\x1b]52;c;cm0gLXJmIH4=\x07\x1b[2J" + "x" * 100_000
    message = sql_refusal(engine, "email", json.dumps({**email, key: 1}))
    assert message == "payload[…]: is not a field of this channel"
    # A short plain key is still named, as outbox.payloads names it.
    assert sql_refusal(engine, "email", json.dumps({**email, "bogus": 1})) == (
        "payload.bogus: is not a field of this channel"
    )
    hostile = "hold\n\x1b[31m" + "y" * 1000
    assert sql_refusal(engine, "anyobject", "{}", on_predecessor_failure=hostile) == (
        "on_predecessor_failure: must be one of 'hold', 'cancel', got a value that cannot be shown"
    )


def test_the_262109_byte_payload_gets_one_verdict(engine: sa.Engine) -> None:
    """262,109 bytes of compact JSON, more than 256 KiB as jsonb stores it
    (", " between the array's elements): Python once accepted it, SQL refused."""
    pad = [0] * 100
    overhead = len(json.dumps({"pad": pad, "blob": ""}, separators=(",", ":")))
    payload = {"pad": pad, "blob": "x" * (262_109 - overhead)}
    compact = json.dumps(payload, separators=(",", ":"))
    assert len(compact) == 262_109 and payloads.stored_size(payload) > LIMIT
    assert python_accepts(engine, "anyobject", payload) is False
    assert sql_accepts(engine, "anyobject", compact) is False


def _at_size(size: int, numbers: list[Any]) -> dict[str, Any]:
    """A payload whose stored text is exactly ``size`` bytes."""
    base = {"numbers": numbers, "blob": ""}
    return {"numbers": numbers, "blob": "x" * (size - payloads.stored_size(base))}


@pytest.mark.parametrize(
    "numbers",
    [[], [1e-07, 1.2345678901234568e16, -0.0, 5e-324, 1e300, 3, -2.5], [0.1] * 50],
)
def test_python_and_sql_agree_at_the_limit(engine: sa.Engine, numbers: list[Any]) -> None:
    for size, accepted in ((LIMIT, True), (LIMIT + 1, False)):
        payload = _at_size(size, numbers)
        text = json.dumps(payload, separators=(",", ":"))
        with engine.connect() as conn:
            stored = conn.execute(
                sa.text("SELECT octet_length(CAST(CAST(:p AS jsonb) AS text))"), {"p": text}
            ).scalar_one()
        assert stored == size
        assert python_accepts(engine, "anyobject", payload) is accepted
        assert sql_accepts(engine, "anyobject", text) is accepted


# Postgres's jsonb holds no NUL character (the producer refuses one).
keys = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=8)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00")),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(keys, children, max_size=5),
    max_leaves=30,
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.dictionaries(keys, json_values, max_size=6))
def test_stored_size_is_the_databases_measure(engine: sa.Engine, payload: dict[str, Any]) -> None:
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    with engine.connect() as conn:
        stored = conn.execute(
            sa.text("SELECT octet_length(CAST(CAST(:p AS jsonb) AS text))"), {"p": text}
        ).scalar_one()
    assert payloads.stored_size(payload) == stored


@pytest.mark.parametrize(
    ("payloads", "expires_at", "field", "problem"),
    [
        ("[{}, [1, 2]]", "{NULL,NULL}", "payload", "must be an object"),
        ("[{}, {}]", "{NULL,infinity}", "expires_at", "must be a finite time"),
        (json.dumps([{}, {"blob": "x" * LIMIT}]), "{NULL,NULL}", "payload", "the limit is 262144"),
    ],
)
def test_the_batch_door_checks_what_it_is_given(
    engine: sa.Engine, payloads: str, expires_at: str, field: str, problem: str
) -> None:
    """outbox_enqueue_many is a door too: a caller other than outbox.enqueue
    gets the same refusals, and nothing is written."""
    with engine.begin() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT * FROM public.outbox_enqueue_many('{anyobject,anyobject}', "
                "CAST(:p AS jsonb), '{NULL,NULL}', '{NULL,NULL}', '{0,0}', '{0,0}', "
                "'{NULL,NULL}', CAST(:e AS timestamptz[]), '{NULL,NULL}', '{hold,hold}')"
            ),
            {"p": payloads, "e": expires_at},
        ).all()
    assert [(r.ord, r.refused_field) for r in rows] == [(2, field)]
    assert problem in rows[0].refused_problem
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM outbox_message")).scalar_one() == 0


def _many(conn: sa.Connection, channels: str, payloads: str, delays: str, ttls: str) -> Any:
    return conn.execute(
        sa.text(
            "SELECT * FROM public.outbox_enqueue_many(CAST(:c AS text[]), CAST(:p AS jsonb), "
            "'{NULL}', '{NULL}', '{0}', CAST(:d AS float8[]), '{NULL}', '{NULL}', "
            "CAST(:t AS float8[]), '{hold}')"
        ),
        {"c": channels, "p": payloads, "d": delays, "t": ttls},
    ).all()


def test_the_batch_door_keeps_a_ttl_without_delays(engine: sa.Engine) -> None:
    # Issue 31, item 6: a NULL delay made now() + delay + ttl NULL: the ttl
    # was dropped and the message had no deliver-by time at all.
    with engine.begin() as conn:
        [r] = _many(
            conn,
            "{webhook}",
            '[{"url": "https://a.example/", "event_type": "t", "body": {}}]',
            "{NULL}",
            "{60}",
        )
        left = conn.execute(
            sa.text(
                "SELECT EXTRACT(EPOCH FROM expires_at - now()) FROM outbox_message WHERE id = :i"
            ),
            {"i": r.id},
        ).scalar_one()
    assert left is not None and 0 < float(left) <= 60


_VALID_EMAIL = {"from": "a@example.com", "to": ["b@example.com"], "subject": "s", "text": "t"}


def _bulk_refusal(engine: sa.Engine, channels_: list[str], payloads_: list[Any]) -> Any:
    n = len(channels_)
    nulls = "{" + ",".join(["NULL"] * n) + "}"
    with engine.begin() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT * FROM public.outbox_enqueue_many(CAST(:c AS text[]), CAST(:p AS jsonb), "
                f"'{nulls}', '{nulls}', NULL, NULL, '{nulls}', NULL, NULL, NULL)"
            ),
            {"c": "{" + ",".join(channels_) + "}", "p": json.dumps(payloads_)},
        ).all()
    return rows


@pytest.mark.parametrize(
    ("channel", "payload"),
    [
        ("email", {"to": ["b@example.com"], "subject": "s", "text": "t"}),
        ("email", {"from": "a@example.com", "to": ["b@example.com"], "subject": "s"}),
        ("email", {**_VALID_EMAIL, "to": "b@example.com"}),
        ("email", {**_VALID_EMAIL, "x_mailer": "planted"}),
        ("sms", {"to": "+15550100", "message": 7}),
        ("webhook", {"url": "https://a.example/", "event_type": "t"}),
        ("sqs", {"queue_url": "https://q.example/1/q", "body": "b", "delay_seconds": 1.5}),
    ],
)
def test_the_batch_door_checks_built_in_fields_as_the_single_door_does(
    engine: sa.Engine, channel: str, payload: dict[str, Any]
) -> None:
    # Issue 31, item 6: called by hand, the bulk door stored an email without
    # its `from` (the Python checks it trusted never ran).
    single = sql_refusal(engine, channel, json.dumps(payload))
    rows = _bulk_refusal(engine, ["email", channel], [_VALID_EMAIL, payload])
    assert [(r.ord, f"{r.refused_field}: {r.refused_problem}") for r in rows] == [(2, single)]
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM outbox_message")).scalar_one() == 0


def test_the_batch_door_takes_a_built_in_message_the_single_door_takes(engine: sa.Engine) -> None:
    rows = _bulk_refusal(engine, ["email"], [_VALID_EMAIL])
    assert [(r.refused_field, r.created) for r in rows] == [(None, True)]


def test_the_batch_door_registers_no_flood_of_invented_channels(engine: sa.Engine) -> None:
    # Issue 31, item 6: one call by hand registered 2,000 invented channels.
    with engine.connect() as conn:
        before = conn.execute(sa.text("SELECT count(*) FROM outbox_channel")).scalar_one()
    invented = [f"invented-{n}" for n in range(300)]
    rows = _bulk_refusal(engine, invented, [{}] * len(invented))
    assert [(r.ord, r.refused_field) for r in rows] == [(1, "channel")]
    assert "INSERT INTO outbox_channel" in rows[0].refused_problem
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM outbox_channel")).scalar_one() == before
        assert conn.execute(sa.text("SELECT count(*) FROM outbox_message")).scalar_one() == 0
    # a few new ones, as a Python producer's custom channels, are registered as before
    rows = _bulk_refusal(engine, ["fax", "pager"], [{}, {}])
    assert [r.created for r in rows] == [True, True]
    with engine.connect() as conn:
        names = conn.execute(
            sa.text("SELECT name FROM outbox_channel WHERE name IN ('fax', 'pager') ORDER BY name")
        ).scalars()
        assert list(names) == ["fax", "pager"]
