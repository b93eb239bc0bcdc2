"""Bad input everywhere: the producer API, rows corrupted in the database,
malformed function events, and configuration. Each is refused with the one
documented exception naming the culprit, and changes nothing it should not."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import outbox
from outbox import ConfigError, ValidationError, channels, dispatcher, sender, store
from outbox.channels import SchemaChannel
from outbox.handoff import CallableInvoker, HandOff
from outbox.producer import MAX_KEY_LENGTH, MAX_PAYLOAD_BYTES
from outbox.runtime import Runtime
from support import (
    EMAIL,
    LambdaContext,
    ScriptedChannel,
    expire_leases,
    insert_raw,
    install_channel,
)


def snapshot(engine: sa.Engine) -> tuple[list[Any], list[Any]]:
    """Every column of every row of both tables: what "changes nothing" compares."""
    with engine.connect() as conn:
        messages = conn.execute(sa.text("SELECT * FROM outbox_message ORDER BY id")).all()
        tries = conn.execute(sa.text("SELECT * FROM outbox_attempt ORDER BY id")).all()
    return [tuple(r) for r in messages], [tuple(r) for r in tries]


@pytest.fixture
def runtime(relay_env: dict[str, str]) -> Iterator[Runtime]:
    rt = Runtime(relay_env)
    yield rt
    if rt._engine is not None:
        rt._engine.dispose()


FUZZ = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


class AnyJson(SchemaChannel):
    name = "anyjson"
    schema = {"type": "object"}


# Text Postgres can store: no NUL, no lone surrogates.
TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"))
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63)
    # Floats where JSON and Python agree on the value: jsonb writes 1e16 as
    # 10000000000000000, which reads back as an int (equal below 2**53 only).
    | st.floats(allow_nan=False, allow_infinity=False, min_value=-(2.0**53), max_value=2.0**53)
    | TEXT,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(TEXT, children, max_size=4),
    max_leaves=20,
)
KEY = st.none() | st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
    min_size=1,
    max_size=MAX_KEY_LENGTH,
)


def count_rows(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM outbox_message")).scalar_one())


# --- valid input round-trips exactly -----------------------------------------


@FUZZ
@given(
    payload=st.dictionaries(TEXT, JSON, max_size=5),
    dedupe_key=KEY,
    ordering_key=KEY,
    priority=st.integers(-32768, 32767),
    max_attempts=st.none() | st.integers(1, 1000),
)
def test_valid_messages_round_trip_exactly(
    engine: sa.Engine,
    payload: dict[str, Any],
    dedupe_key: str | None,
    ordering_key: str | None,
    priority: int,
    max_attempts: int | None,
) -> None:
    channels.register("anyjson", AnyJson)
    with engine.begin() as conn:
        conn.execute(sa.text("TRUNCATE outbox_attempt, outbox_message, outbox_dedupe"))
        message_id = outbox.enqueue(
            conn,
            "anyjson",
            payload,
            dedupe_key=dedupe_key,
            ordering_key=ordering_key,
            priority=priority,
            max_attempts=max_attempts,
        )
    with engine.connect() as conn:
        row = conn.execute(
            sa.text("SELECT * FROM outbox_message WHERE id = :id"), {"id": message_id}
        ).one()
    assert row.payload == payload
    assert (row.channel, row.dedupe_key, row.ordering_key, row.priority, row.max_attempts) == (
        "anyjson",
        dedupe_key,
        ordering_key,
        priority,
        max_attempts,
    )


@FUZZ
# (one header line: CR and LF are refused, see test_smaller_gaps)
@given(
    subject=TEXT.filter(lambda s: 1 <= len(s) <= 998 and "\r" not in s and "\n" not in s),
    text=TEXT.filter(bool),
)
def test_email_with_any_unicode_subject_and_text_round_trips(
    engine: sa.Engine, subject: str, text: str
) -> None:
    payload = {**EMAIL, "subject": subject, "text": text}
    with engine.begin() as conn:
        message_id = outbox.enqueue(conn, "email", payload)
    with engine.connect() as conn:
        stored = conn.execute(
            sa.text("SELECT payload FROM outbox_message WHERE id = :id"), {"id": message_id}
        ).scalar_one()
    assert stored == payload


def test_payload_at_the_size_limit_is_kept_and_one_byte_more_is_refused(engine: sa.Engine) -> None:
    channels.register("anyjson", AnyJson)
    overhead = len(json.dumps({"blob": ""}, separators=(",", ":")).encode())
    # Multibyte characters count in bytes: 'é' is two.
    fits = {"blob": "é" * ((MAX_PAYLOAD_BYTES - overhead) // 2)}
    with engine.begin() as conn:
        message_id = outbox.enqueue(conn, "anyjson", fits)
    with engine.connect() as conn:
        assert (
            conn.execute(
                sa.text("SELECT payload FROM outbox_message WHERE id = :id"), {"id": message_id}
            ).scalar_one()
            == fits
        )
    too_big = {"blob": "é" * ((MAX_PAYLOAD_BYTES - overhead) // 2) + "xx"}
    with pytest.raises(ValidationError) as info, engine.begin() as conn:
        outbox.enqueue(conn, "anyjson", too_big)
    assert info.value.field == "payload" and "limit" in str(info.value)
    assert count_rows(engine) == 1


def test_literal_backslash_u0000_text_is_not_mistaken_for_nul(engine: sa.Engine) -> None:
    """Regression: the NUL check matched the JSON text of a literal backslash."""
    channels.register("anyjson", AnyJson)
    payload = {"path": "C:\\u0000\\dir", "twice": "\\\\u0000"}
    with engine.begin() as conn:
        message_id = outbox.enqueue(conn, "anyjson", payload)
    with engine.connect() as conn:
        assert support_payload(conn, message_id) == payload
    with pytest.raises(ValidationError, match="NUL"), engine.begin() as conn:
        outbox.enqueue(conn, "anyjson", {"nul": "a\\\x00"})


def support_payload(conn: sa.Connection, message_id: int) -> Any:
    return conn.execute(
        sa.text("SELECT payload FROM outbox_message WHERE id = :id"), {"id": message_id}
    ).scalar_one()


# --- invalid input: one exception, a field-naming message, nothing written ---

# (keyword overrides for enqueue, the field the error must name)
INVALID: list[tuple[dict[str, Any], str]] = [
    ({"channel": 7}, "channel"),
    ({"channel": None}, "channel"),
    ({"channel": "no-such-channel"}, "channel"),
    ({"channel": "EMAIL"}, "channel"),
    ({"payload": None}, "payload"),
    ({"payload": "a string"}, "payload"),
    ({"payload": ["a", "list"]}, "payload"),
    ({"payload": {**EMAIL, "to": []}}, "payload.to"),
    ({"payload": {**EMAIL, "to": "someone@example.net"}}, "payload.to"),
    ({"payload": {**EMAIL, "subject": 5}}, "payload.subject"),
    ({"payload": {**EMAIL, "subject": ""}}, "payload.subject"),
    ({"payload": {k: v for k, v in EMAIL.items() if k != "from"}}, "payload"),
    ({"payload": {**EMAIL, "text": None}}, "payload.text"),
    ({"payload": {**EMAIL, "unknown": 1}}, "payload"),
    ({"payload": {**EMAIL, "text": "nul \x00 inside"}}, "payload"),
    ({"payload": {**EMAIL, "subject": "surrogate \ud800"}}, "payload"),
    ({"payload": {**EMAIL, "text": "x" * (MAX_PAYLOAD_BYTES + 1)}}, "payload"),
    ({"dedupe_key": ""}, "dedupe_key"),
    ({"dedupe_key": 42}, "dedupe_key"),
    ({"dedupe_key": "k" * (MAX_KEY_LENGTH + 1)}, "dedupe_key"),
    ({"dedupe_key": "nul\x00"}, "dedupe_key"),
    ({"dedupe_key": "surrogate\udfff"}, "dedupe_key"),
    ({"ordering_key": b"bytes"}, "ordering_key"),
    ({"ordering_key": "\ud83d"}, "ordering_key"),
    ({"priority": 1.5}, "priority"),
    ({"priority": True}, "priority"),
    ({"priority": 40000}, "priority"),
    ({"priority": "1"}, "priority"),
    ({"delay": -1}, "delay"),
    ({"delay": float("nan")}, "delay"),
    ({"delay": float("inf")}, "delay"),
    ({"delay": "5"}, "delay"),
    ({"delay": 10**12}, "delay"),
    ({"max_attempts": 0}, "max_attempts"),
    ({"max_attempts": 1001}, "max_attempts"),
    ({"max_attempts": False}, "max_attempts"),
    ({"max_attempts": "3"}, "max_attempts"),
]


@pytest.mark.parametrize(("overrides", "field"), INVALID, ids=[f for _, f in INVALID])
def test_invalid_enqueue_names_the_field_and_writes_nothing(
    engine: sa.Engine, overrides: dict[str, Any], field: str
) -> None:
    kwargs: dict[str, Any] = {"channel": "email", "payload": EMAIL, **overrides}
    with pytest.raises(ValidationError) as info, engine.begin() as conn:
        outbox.enqueue(conn, kwargs.pop("channel"), kwargs.pop("payload"), **kwargs)
    assert info.value.field.startswith(field), info.value.field
    assert str(info.value).startswith(f"{info.value.field}: ")
    # enqueue_many: the same error, prefixed with the message's index, and the
    # valid message before it is not written either.
    good = {"channel": "email", "payload": EMAIL}
    bad = {"channel": "email", "payload": EMAIL, **overrides}
    with pytest.raises(ValidationError) as many, engine.begin() as conn:
        outbox.enqueue_many(conn, [good, bad])
    assert many.value.field.startswith(f"messages[1].{field}"), many.value.field
    assert count_rows(engine) == 0


NOT_A_NUMBER = st.one_of(
    st.binary(max_size=5), st.lists(st.integers(), max_size=2), TEXT, st.none(), st.booleans()
)
NOT_A_STRING = st.one_of(
    st.integers(), st.floats(), st.binary(max_size=5), st.lists(TEXT, max_size=2), st.booleans()
)
BAD_OPTIONS = st.one_of(
    st.tuples(
        st.sampled_from(["dedupe_key", "ordering_key"]),
        NOT_A_STRING
        | st.just("")
        | TEXT.map(lambda t: t + "\x00")
        | st.text(min_size=MAX_KEY_LENGTH + 1, max_size=MAX_KEY_LENGTH + 40),
    ),
    st.tuples(
        st.just("priority"),
        NOT_A_NUMBER.filter(lambda v: v is not None)
        | st.floats()
        | st.integers(max_value=-32769)
        | st.integers(min_value=32768),
    ),
    st.tuples(
        st.just("delay"),
        NOT_A_NUMBER.filter(lambda v: v is not None and not isinstance(v, bool)).filter(
            lambda v: True
        )
        | st.floats(max_value=-1e-6)
        | st.floats(min_value=365 * 24 * 3600 + 1)
        | st.just(float("nan")),
    ),
    st.tuples(
        st.just("max_attempts"),
        NOT_A_NUMBER.filter(lambda v: v is not None)
        | st.floats()
        | st.integers(max_value=0)
        | st.integers(min_value=1001),
    ),
)


@FUZZ
@given(option=BAD_OPTIONS)
def test_fuzzed_bad_options_raise_validation_error_naming_them(
    engine: sa.Engine, option: tuple[str, Any]
) -> None:
    field, value = option
    with pytest.raises(ValidationError) as info, engine.begin() as conn:
        outbox.enqueue(conn, "email", EMAIL, **{field: value})
    assert info.value.field == field
    assert count_rows(engine) == 0


@FUZZ
@given(payload=JSON)
def test_arbitrary_json_is_refused_as_an_email_payload_naming_it(
    engine: sa.Engine, payload: Any
) -> None:
    with pytest.raises(ValidationError) as info, engine.begin() as conn:
        outbox.enqueue(conn, "email", payload)
    assert info.value.field.startswith("payload")
    assert count_rows(engine) == 0


# --- rows corrupted in the database ------------------------------------------


def test_corrupt_rows_fail_alone_and_the_rest_of_the_batch_is_delivered(
    engine: sa.Engine, aws: None
) -> None:
    scripted = install_channel(ScriptedChannel())
    relay = _settings()
    with engine.begin() as conn:
        good = outbox.enqueue_many(
            conn, [{"channel": "scripted", "payload": {"n": i}} for i in range(5)]
        )
        corrupt = {
            insert_raw(conn, "scripted", "{}"): "payload: must contain ['n']",
            insert_raw(conn, "scripted", '{"n": "seven"}'): "payload.n",
            insert_raw(conn, "scripted", "[1, 2]"): "payload: must be object",
            insert_raw(conn, "scripted", "null"): "payload: must be object",
            insert_raw(conn, "email", '{"to": "x"}'): "payload",
            insert_raw(conn, "email", '{"from": 1, "to": [], "subject": "s"}'): "payload",
            insert_raw(conn, "ghost", '{"n": 1}'): "no function is configured for channel 'ghost'",
        }
        good += outbox.enqueue_many(
            conn, [{"channel": "scripted", "payload": {"n": i}} for i in range(5, 10)]
        )

    def target(name: str) -> Any:
        return lambda event: sender.run(engine, event, relay, lambda: 30.0, channel_name=name)

    invoker = CallableInvoker({"scripted": target("scripted"), "email": target("email")})
    report = dispatcher.dispatch_once(engine, invoker, relay)
    assert report.claimed == len(good) + len(corrupt)

    with engine.connect() as conn:
        rows = {
            r.id: r
            for r in conn.execute(
                sa.text("SELECT id, status, last_error FROM outbox_message")
            ).all()
        }
    assert sorted(scripted.sent) == sorted(good)
    assert all(rows[i].status == "delivered" for i in good)
    for message_id, expected in corrupt.items():
        assert rows[message_id].status == "failed", (message_id, rows[message_id])
        assert expected in rows[message_id].last_error, rows[message_id].last_error
        if expected.startswith("payload"):
            assert rows[message_id].last_error.startswith("invalid payload: payload")


def _settings() -> Any:
    import support

    return support.settings(max_attempts=3)


# --- malformed events for every function ------------------------------------

BAD_HANDOFFS: list[tuple[Any, str]] = [
    (None, "event"),
    ([], "event"),
    ("email", "event"),
    ({}, "event.version"),
    ({"version": 2, "channel": "email", "messages": []}, "event.version"),
    ({"version": 1, "channel": "", "messages": [{}]}, "event.channel"),
    ({"version": 1, "channel": 5, "messages": [{}]}, "event.channel"),
    ({"version": 1, "channel": "email"}, "event.messages"),
    ({"version": 1, "channel": "email", "messages": []}, "event.messages"),
    ({"version": 1, "channel": "email", "messages": {"id": 1}}, "event.messages"),
    ({"version": 1, "channel": "email", "messages": [1]}, "event.messages[0]"),
    (
        {
            "version": 1,
            "channel": "email",
            "messages": [{"attempt": 1, "claim_token": str(uuid.uuid4())}],
        },
        "event.messages[0].id",
    ),
    (
        {
            "version": 1,
            "channel": "email",
            "messages": [{"id": "1", "attempt": 1, "claim_token": str(uuid.uuid4())}],
        },
        "event.messages[0].id",
    ),
    (
        {
            "version": 1,
            "channel": "email",
            "messages": [{"id": True, "attempt": 1, "claim_token": str(uuid.uuid4())}],
        },
        "event.messages[0].id",
    ),
    (
        {
            "version": 1,
            "channel": "email",
            "messages": [{"id": -3, "attempt": 1, "claim_token": str(uuid.uuid4())}],
        },
        "event.messages[0].id",
    ),
    (
        {
            "version": 1,
            "channel": "email",
            "messages": [{"id": 1.0, "attempt": 1, "claim_token": str(uuid.uuid4())}],
        },
        "event.messages[0].id",
    ),
    (
        {
            "version": 1,
            "channel": "email",
            "messages": [{"id": 1, "claim_token": str(uuid.uuid4())}],
        },
        "event.messages[0].attempt",
    ),
    (
        {
            "version": 1,
            "channel": "email",
            "messages": [{"id": 1, "attempt": 0, "claim_token": str(uuid.uuid4())}],
        },
        "event.messages[0].attempt",
    ),
    (
        {"version": 1, "channel": "email", "messages": [{"id": 1, "attempt": 1}]},
        "event.messages[0].claim_token",
    ),
    (
        {
            "version": 1,
            "channel": "email",
            "messages": [{"id": 1, "attempt": 1, "claim_token": "not-a-uuid"}],
        },
        "event.messages[0].claim_token",
    ),
    (
        {
            "version": 1,
            "channel": "email",
            "messages": [{"id": 1, "attempt": 1, "claim_token": 12}],
        },
        "event.messages[0].claim_token",
    ),
    (
        {
            "version": 1,
            "channel": "email",
            "messages": [
                {"id": i + 1, "attempt": 1, "claim_token": str(uuid.uuid4())} for i in range(5000)
            ],
        },
        "event.messages",
    ),
    (
        {
            "version": 1,
            "channel": "sms",
            "messages": [{"id": 1, "attempt": 1, "claim_token": str(uuid.uuid4())}],
        },
        "event.channel",
    ),
]


@pytest.fixture
def claimed_world(engine: sa.Engine) -> list[store.Claim]:
    """Some pending, some claimed rows: what a malformed event must not touch."""
    with engine.begin() as conn:
        outbox.enqueue_many(conn, [{"channel": "email", "payload": EMAIL} for _ in range(6)])
    with engine.begin() as conn:
        return store.claim(conn, 3, 120)


@pytest.mark.parametrize(("event", "field"), BAD_HANDOFFS, ids=[f for _, f in BAD_HANDOFFS])
def test_malformed_handoff_is_refused_and_changes_nothing(
    engine: sa.Engine,
    runtime: Runtime,
    claimed_world: list[store.Claim],
    event: Any,
    field: str,
) -> None:
    before = snapshot(engine)
    if field != "event.channel" or not (isinstance(event, dict) and event.get("channel") == "sms"):
        with pytest.raises(ValidationError) as parsed:
            HandOff.from_event(event)
        assert parsed.value.field == field
    with pytest.raises(ValidationError) as info:
        runtime.send("email", event, LambdaContext())
    assert info.value.field == field
    assert snapshot(engine) == before


def test_unknown_tokens_and_ids_change_nothing(
    engine: sa.Engine, runtime: Runtime, claimed_world: list[store.Claim]
) -> None:
    before = snapshot(engine)
    event = {
        "version": 1,
        "channel": "email",
        "messages": [
            *(
                {"id": c.id, "claim_token": str(uuid.uuid4()), "attempt": c.attempt}
                for c in claimed_world
            ),
            {"id": 999_999, "claim_token": str(uuid.uuid4()), "attempt": 1},
            {"id": 2**62, "claim_token": str(claimed_world[0].claim_token), "attempt": 1},
        ],
    }
    result = runtime.send("email", event, LambdaContext())
    assert result["owned"] == 0 and len(result["lease_lost"]) == len(claimed_world)
    assert result["unknown"] == [999_999, 2**62]  # no message has these ids
    assert snapshot(engine) == before


def test_replayed_handoff_after_its_rows_settled_changes_nothing(engine: sa.Engine) -> None:
    scripted = install_channel(ScriptedChannel())
    relay = _settings()
    with engine.begin() as conn:
        outbox.enqueue_many(conn, [{"channel": "scripted", "payload": {"n": i}} for i in range(3)])
    events: list[dict[str, Any]] = []

    def send(event: dict[str, Any]) -> None:
        events.append(event)
        sender.run(engine, event, relay, lambda: 30.0, channel_name="scripted")

    dispatcher.dispatch_once(engine, CallableInvoker({"scripted": send}), relay)
    assert len(scripted.sent) == 3
    before = snapshot(engine)
    for event in events:  # Lambda delivered the async event twice
        report = sender.run(engine, event, relay, lambda: 30.0, channel_name="scripted")
        assert report.owned == 0
    assert len(scripted.sent) == 3
    assert snapshot(engine) == before


def test_handoff_replayed_after_its_lease_was_reaped_changes_nothing(
    engine: sa.Engine, runtime: Runtime, claimed_world: list[store.Claim]
) -> None:
    expire_leases(engine)
    with engine.begin() as conn:
        store.reap_expired(conn, 100, store.Backoff(1, 60, 3))
    before = snapshot(engine)
    event = HandOff("email", tuple(claimed_world)).to_event()
    result = runtime.send("email", event, LambdaContext())
    assert result["owned"] == 0
    assert snapshot(engine) == before


BAD_SCHEDULES: list[tuple[Any, str]] = [
    (None, "event"),
    ("tick", "event"),
    ([{"execution_id": "x"}], "event"),
    ({"execution_id": 12}, "event.execution_id"),
    ({"execution_id": ["a"]}, "event.execution_id"),
]


@pytest.mark.parametrize(("event", "field"), BAD_SCHEDULES, ids=[f for _, f in BAD_SCHEDULES])
@pytest.mark.parametrize("function", ["dispatch", "reap"])
def test_malformed_schedule_events_are_refused_and_change_nothing(
    engine: sa.Engine,
    runtime: Runtime,
    claimed_world: list[store.Claim],
    function: str,
    event: Any,
    field: str,
) -> None:
    expire_leases(engine)  # the reaper would act on these, were the event accepted
    before = snapshot(engine)
    with pytest.raises(ValidationError) as info:
        getattr(runtime, function)(event, LambdaContext())
    assert info.value.field == field
    assert snapshot(engine) == before


# --- configuration -------------------------------------------------------------

BAD_CONFIG: list[tuple[dict[str, str], str]] = [
    ({"DATABASE_URL": ""}, "DATABASE_URL"),
    ({"BATCH_SIZE": "many"}, "BATCH_SIZE"),
    ({"BATCH_SIZE": "0"}, "BATCH_SIZE"),
    ({"LEASE_SECONDS": "1.5"}, "LEASE_SECONDS"),
    ({"MAX_ATTEMPTS": "-1"}, "MAX_ATTEMPTS"),
    ({"BACKOFF_BASE_SECONDS": "fast"}, "BACKOFF_BASE_SECONDS"),
    ({"BACKOFF_BASE_SECONDS": "10", "BACKOFF_CAP_SECONDS": "5"}, "BACKOFF_CAP_SECONDS"),
    ({"POLL_INTERVAL_SECONDS": "nan"}, "POLL_INTERVAL_SECONDS"),
    ({"CHANNEL_FUNCTIONS": "not json"}, "CHANNEL_FUNCTIONS"),
    ({"CHANNEL_FUNCTIONS": '["email"]'}, "CHANNEL_FUNCTIONS"),
    ({"CHANNEL_FUNCTIONS": '{"email": ""}'}, "CHANNEL_FUNCTIONS"),
    # docs/design.md, invariant 4: the lease must outlive the sender's run and the event's queue time.
    (
        {"LEASE_SECONDS": "60", "SENDER_TIMEOUT_SECONDS": "30", "MAX_EVENT_AGE_SECONDS": "60"},
        "LEASE_SECONDS",
    ),
    (
        {"LEASE_SECONDS": "90", "SENDER_TIMEOUT_SECONDS": "30", "MAX_EVENT_AGE_SECONDS": "60"},
        "LEASE_SECONDS",
    ),
    ({"DB_SECRET_ARN": "arn:aws:secretsmanager:us-east-1:123456789012:secret:x"}, "DB_SECRET_ARN"),
    ({"DATABASE_URL": "", "DB_IAM_USER": "relay"}, "DB_HOST"),
    ({"DB_SSLMODE": "prefer"}, "DB_SSLMODE"),
    ({"DATABASE_URL": "", "DB_SECRET_ARN": "arn:x", "DB_SSLMODE": "disable"}, "DB_SSLMODE"),
    ({"DB_PORT": "70000"}, "DB_PORT"),
]


@pytest.mark.parametrize(("overrides", "setting"), BAD_CONFIG, ids=[s for _, s in BAD_CONFIG])
def test_bad_configuration_fails_at_cold_start_naming_the_setting(
    relay_env: dict[str, str], overrides: dict[str, str], setting: str
) -> None:
    env = {**relay_env, **overrides}
    with pytest.raises(ConfigError) as info:
        Runtime(env)
    assert info.value.setting == setting
    assert setting in str(info.value)


def test_missing_environment_fails_naming_the_database_setting() -> None:
    with pytest.raises(ConfigError) as info:
        Runtime({})
    assert info.value.setting == "DATABASE_URL"


@pytest.mark.parametrize(
    "event",
    [
        {"RequestType": "Create", "ResponseURL": "http://127.0.0.1:9/plaintext"},
        {"RequestType": "Delete", "ResponseURL": "file:///etc/passwd"},
        {"RequestType": "Bogus", "ResponseURL": 42},
    ],
)
def test_malformed_migrate_events_are_refused_and_change_nothing(
    engine: sa.Engine, claimed_world: list[store.Claim], event: dict[str, Any]
) -> None:
    from outbox.migrate import handle

    before = snapshot(engine)
    with pytest.raises(ValidationError) as info:
        handle(event, LambdaContext(), lambda: engine)
    assert info.value.field == "ResponseURL"
    assert snapshot(engine) == before
