"""outbox_enqueue(), the SQL enqueue for producers in any language, called
from raw SQL: it writes in the caller's transaction, answers a repeated dedupe
key with the same id, and refuses bad input (SQLSTATE 22023, the field named)
without writing anything. Its built-in field rules match the channels' own
schemas, so SQL and Python refuse the same payloads."""

from __future__ import annotations

import json
import shutil
import subprocess
from typing import Any

import pytest
import sqlalchemy as sa

import outbox
from outbox import channels
from outbox.migrations import revision_module
from support import DOCS, doc_blocks

VALID = {
    "email": {
        "from": "shop@example.com",
        "to": ["ada@example.net"],
        "subject": "Shipped",
        "text": "On its way.",
    },
    "sms": {"to": "+15555550100", "message": "Your code is 424242"},
    "push": {"endpoint_arn": "arn:aws:sns:us-east-1:123456789012:endpoint/GCM/a/b", "body": "Hi"},
    "webhook": {"url": "https://hooks.example.com/a", "event_type": "order.shipped", "body": {}},
    "eventbridge": {"source": "shop.orders", "detail_type": "OrderShipped", "detail": {"id": 1}},
    "sqs": {"queue_url": "https://sqs.us-east-1.amazonaws.com/123456789012/q", "body": "x"},
}


def sql_enqueue(conn: sa.Connection, channel: Any, payload: Any, **options: Any) -> int:
    named = "".join(f", {name} => :{name}" for name in options)
    return conn.execute(
        sa.text(f"SELECT outbox_enqueue(:channel, CAST(:payload AS jsonb){named})"),
        {"channel": channel, "payload": None if payload is None else json.dumps(payload)} | options,
    ).scalar_one()


def refusal(engine: sa.Engine, channel: Any, payload: Any, **options: Any) -> tuple[str, str]:
    """(field, message) of the refusal; asserts the SQLSTATE and that nothing was written."""
    with pytest.raises(sa.exc.DatabaseError) as caught, engine.begin() as conn:
        sql_enqueue(conn, channel, payload, **options)
    fields = caught.value.orig.args[0]  # pg8000: the server's error fields
    assert fields["C"] == "22023", fields
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM outbox_message")).scalar_one() == 0
    return fields["c"], fields["M"]


def row(engine: sa.Engine, message_id: int) -> Any:
    with engine.connect() as conn:
        return conn.execute(
            sa.text(
                "SELECT *, EXTRACT(EPOCH FROM available_at - created_at) AS delay_s "
                "FROM outbox_message WHERE id = :id"
            ),
            {"id": message_id},
        ).one()


def test_writes_in_the_callers_transaction_with_every_option(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        message_id = sql_enqueue(
            conn,
            "email",
            VALID["email"],
            dedupe_key="order-42",
            ordering_key="customer-7",
            priority=5,
            delay="10 minutes",
            max_attempts=3,
        )
    r = row(engine, message_id)
    assert (r.channel, r.status, r.payload, r.dedupe_key, r.ordering_key) == (
        "email",
        "pending",
        VALID["email"],
        "order-42",
        "customer-7",
    )
    assert (r.priority, r.max_attempts, round(float(r.delay_s))) == (5, 3, 600)
    with pytest.raises(RuntimeError), engine.begin() as conn:
        sql_enqueue(conn, "sms", VALID["sms"])
        raise RuntimeError("the caller's transaction rolls back")
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM outbox_message")).scalar_one() == 1


def test_deliver_by_and_the_ordering_policy_are_stored_as_outbox_enqueue_stores_them(
    engine: sa.Engine,
) -> None:
    with engine.begin() as conn:
        by_ttl = sql_enqueue(conn, "sms", VALID["sms"], delay="1 minute", ttl="2 hours")
        by_time = sql_enqueue(
            conn, "sms", VALID["sms"], expires_at="2030-01-01T00:00:00Z", ordering_key="k"
        )
        cancelling = sql_enqueue(
            conn, "sms", VALID["sms"], ordering_key="k", on_predecessor_failure="cancel"
        )
        rows = {
            r.id: r
            for r in conn.execute(
                sa.text(
                    "SELECT id, on_predecessor_failure, expires_at, "
                    "EXTRACT(EPOCH FROM expires_at - created_at) AS deliver_by_s "
                    "FROM outbox_message"
                )
            )
        }
    assert round(float(rows[by_ttl].deliver_by_s)) == 60 + 7200  # from when it is due
    assert rows[by_time].expires_at.year == 2030
    assert rows[by_ttl].on_predecessor_failure == rows[by_time].on_predecessor_failure == "hold"
    assert rows[cancelling].on_predecessor_failure == "cancel"


def test_an_ordering_key_is_locked_to_the_commit_as_by_outbox_enqueue(
    engine: sa.Engine,
) -> None:
    """Producers of one ordering key take turns, whichever API they use: while
    a Python producer's transaction holds the key, the SQL function waits."""
    with engine.begin() as python_producer:
        outbox.enqueue(python_producer, "sms", VALID["sms"], ordering_key="customer-7")
        with pytest.raises(sa.exc.DatabaseError) as waited, engine.begin() as sql_producer:
            sql_producer.execute(sa.text("SET LOCAL lock_timeout = '200ms'"))
            sql_enqueue(sql_producer, "sms", VALID["sms"], ordering_key="customer-7")
        assert waited.value.orig.args[0]["C"] == "55P03"  # lock_not_available
        with engine.begin() as other_key:  # another key does not wait
            other_key.execute(sa.text("SET LOCAL lock_timeout = '200ms'"))
            sql_enqueue(other_key, "sms", VALID["sms"], ordering_key="customer-8")


def test_a_repeated_dedupe_key_returns_the_same_id(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        first = sql_enqueue(conn, "email", VALID["email"], dedupe_key="order-42")
        again = sql_enqueue(conn, "email", VALID["email"], dedupe_key="order-42")
        other_channel = sql_enqueue(conn, "sms", VALID["sms"], dedupe_key="order-42")
    with engine.begin() as conn:  # a later transaction, and the Python API, agree
        assert sql_enqueue(conn, "email", VALID["email"], dedupe_key="order-42") == first
        assert outbox.enqueue(conn, "email", VALID["email"], dedupe_key="order-42") == first
    assert again == first and other_channel != first


def test_dedupe_is_per_recipient_and_a_changed_payload_is_a_conflict(engine: sa.Engine) -> None:
    """The same rules and keys as outbox.enqueue: one key fans out to many
    recipients; a replay writes nothing; another payload for the same key and
    recipient is refused (23505) and writes nothing."""
    to_bob = {**VALID["email"], "to": ["bob@example.net"]}
    with engine.begin() as conn:
        ada = sql_enqueue(conn, "email", VALID["email"], dedupe_key="order-42")
        bob = sql_enqueue(conn, "email", to_bob, dedupe_key="order-42")
        python_bob = outbox.enqueue(conn, "email", to_bob, dedupe_key="order-42")
    assert ada != bob and python_bob == bob
    changed = {**VALID["email"], "subject": "Another subject"}
    with pytest.raises(sa.exc.DatabaseError) as caught, engine.begin() as conn:
        sql_enqueue(conn, "email", changed, dedupe_key="order-42")
    assert caught.value.orig.args[0]["C"] == "23505"
    assert "order-42" in caught.value.orig.args[0]["M"]
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM outbox_message")).scalar_one() == 2


def register_channel(engine: sa.Engine, name: str) -> None:
    """What an operator does, as the migrator, for a custom channel SQL producers use."""
    with engine.begin() as conn:
        conn.execute(
            sa.text("INSERT INTO outbox_channel (name) VALUES (:n) ON CONFLICT DO NOTHING"),
            {"n": name},
        )


@pytest.fixture(autouse=True)
def _custom_channels(engine: sa.Engine) -> None:
    for name in ("slack", "custom"):
        register_channel(engine, name)


def test_every_built_in_channel_accepts_its_valid_payload_and_registered_custom_channels_any(
    engine: sa.Engine,
) -> None:
    with engine.begin() as conn:
        for channel, payload in VALID.items():
            sql_enqueue(conn, channel, payload)
        sql_enqueue(conn, "slack", {"anything": ["goes", 1]})  # its sender checks it
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM outbox_message")).scalar_one() == 7


@pytest.mark.parametrize(
    ("channel", "payload", "options", "field", "problem"),
    [
        (None, VALID["sms"], {}, "channel", "is required"),
        ("Email", VALID["email"], {}, "channel", "lower-case"),
        ("x" * 65, VALID["email"], {}, "channel", "1 to 64"),
        ("email", None, {}, "payload", "is required"),
        ("email", [VALID["email"]], {}, "payload", "must be an object"),
        ("email", {**VALID["email"], "to": "ada@example.net"}, {}, "payload.to", "an array"),
        (
            "email",
            {k: v for k, v in VALID["email"].items() if k != "subject"},
            {},
            "payload.subject",
            "is required",
        ),
        (
            "email",
            {k: v for k, v in VALID["email"].items() if k != "text"},
            {},
            "payload.text",
            "text or html",
        ),
        ("email", {**VALID["email"], "bogus": 1}, {}, "payload.bogus", "not a field"),
        ("sqs", {**VALID["sqs"], "delay_seconds": 1.5}, {}, "payload.delay_seconds", "an integer"),
        ("webhook", {**VALID["webhook"], "body": "text"}, {}, "payload.body", "an object"),
        ("custom", {"blob": "x" * 262_200}, {}, "payload", "the limit is 262144"),
        ("sms", VALID["sms"], {"dedupe_key": ""}, "dedupe_key", "1 to 255"),
        ("sms", VALID["sms"], {"ordering_key": "k" * 256}, "ordering_key", "1 to 255"),
        ("sms", VALID["sms"], {"priority": 40_000}, "priority", "-32768 and 32767"),
        ("sms", VALID["sms"], {"delay": "-1 second"}, "delay", "between 0 and 365 days"),
        ("sms", VALID["sms"], {"delay": "400 days"}, "delay", "between 0 and 365 days"),
        ("sms", VALID["sms"], {"max_attempts": 0}, "max_attempts", "between 1 and 1000"),
        ("sms", VALID["sms"], {"ttl": "0 seconds"}, "ttl", "more than 0 seconds"),
        (
            "sms",
            VALID["sms"],
            {"ttl": "1 hour", "expires_at": "2030-01-01T00:00:00Z"},
            "ttl",
            "not both",
        ),
        (
            "sms",
            VALID["sms"],
            {"on_predecessor_failure": "drop"},
            "on_predecessor_failure",
            "'hold', 'cancel'",
        ),
    ],
)
def test_bad_input_is_refused_naming_the_field_and_writes_nothing(
    engine: sa.Engine, channel: Any, payload: Any, options: Any, field: str, problem: str
) -> None:
    got_field, message = refusal(engine, channel, payload, **options)
    assert got_field == field
    assert message.startswith(f"{field}: ") and problem in message


def migration_fields() -> dict[str, dict[str, tuple[str | None, bool]]]:
    return revision_module("0004").BUILTIN_FIELDS  # type: ignore[no-any-return]


def test_the_sql_field_rules_are_the_channels_schemas() -> None:
    """What the migration installed for each built-in channel equals the
    channel's JSON schema: its properties, their types, the required ones."""
    expected = {}
    for name in ("email", "sms", "push", "webhook", "eventbridge", "sqs"):
        schema = channels.get(name).schema
        assert schema.get("additionalProperties") is False
        expected[name] = {
            field: (spec.get("type"), field in schema["required"])
            for field, spec in schema["properties"].items()
        }
    assert migration_fields() == expected


@pytest.mark.parametrize("channel", sorted(VALID))
def test_sql_and_python_refuse_a_missing_required_field_alike(
    engine: sa.Engine, channel: str
) -> None:
    for field in channels.get(channel).schema["required"]:
        payload = {k: v for k, v in VALID[channel].items() if k != field}
        with pytest.raises(outbox.ValidationError), engine.begin() as conn:
            outbox.enqueue(conn, channel, payload)
        assert refusal(engine, channel, payload)[0] == f"payload.{field}"


def test_the_docs_psql_example_runs(engine: sa.Engine, database_url: str) -> None:
    """The psql snippet of docs/how-to/producing.md, run by psql against the test database."""
    psql = shutil.which("psql")
    if psql is None:
        pytest.skip("psql is not installed")
    snippet = doc_blocks(DOCS / "how-to" / "producing.md")["psql-enqueue"].code
    url = sa.engine.make_url(database_url)
    if "unix_sock" in url.query:
        pytest.skip("the test database is an embedded server on a socket file")
    out = subprocess.run(
        [
            psql,
            "-X",
            "-v",
            "ON_ERROR_STOP=1",
            "-At",
            "-h",
            url.host or "127.0.0.1",
            "-p",
            str(url.port or 5432),
            "-U",
            url.username or "postgres",
            url.database or "",
        ],
        input=snippet,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PGPASSWORD": url.password or "", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT channel, dedupe_key FROM outbox_message")).all()
    assert [tuple(r) for r in rows] == [("email", "order-42-shipped")]
