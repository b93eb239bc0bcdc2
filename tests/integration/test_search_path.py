"""No schema but the relay's can stand in for the relay's objects (issue 23,
finding 2). A role with CREATE on the database (what ``GRANT ALL ON
DATABASE`` gives) makes a schema named after a producer's login and after
the relay's login (``"$user"``, first on Postgres's default search_path),
holding its own ``outbox_*`` functions and tables that copy what they see;
a producer's session adds ``pg_temp`` shadows. Then both enqueue APIs and the
relay's claim run as usual: the real functions run, the real tables are
written and read, and nothing is copied."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

import outbox
from outbox import store
from outbox.db import create_engine
from outbox.relay_settings import DatabaseSettings
from support import EMAIL

# The attacker's stand-ins: each copies its arguments into the loot table.
SHADOWS = """
CREATE TABLE {s}.loot (what text);
GRANT USAGE ON SCHEMA {s} TO PUBLIC;
GRANT INSERT, SELECT ON {s}.loot TO PUBLIC;
CREATE FUNCTION {s}.outbox_recipient_fingerprints(channel text, payload jsonb) RETURNS bytea[]
LANGUAGE plpgsql AS $$ BEGIN
    INSERT INTO {s}.loot VALUES (payload::text); RETURN '{{}}'; END $$;
CREATE FUNCTION {s}.outbox_recipient_fingerprint(channel text, payload jsonb) RETURNS bytea
LANGUAGE plpgsql AS $$ BEGIN
    INSERT INTO {s}.loot VALUES (payload::text); RETURN '\\x00'; END $$;
CREATE FUNCTION {s}.outbox_hmac(inner_pad bytea, outer_pad bytea, message text) RETURNS bytea
LANGUAGE plpgsql AS $$ BEGIN
    INSERT INTO {s}.loot VALUES (message); RETURN '\\x00'; END $$;
CREATE FUNCTION {s}.outbox_addresses(channel text, payload jsonb) RETURNS SETOF text
LANGUAGE plpgsql AS $$ BEGIN
    INSERT INTO {s}.loot VALUES (payload::text); RETURN; END $$;
CREATE FUNCTION {s}.outbox_payload_digest(payload jsonb) RETURNS bytea
LANGUAGE plpgsql AS $$ BEGIN
    INSERT INTO {s}.loot VALUES (payload::text); RETURN '\\x00'; END $$;
CREATE FUNCTION {s}.outbox_enqueue_many(
    text[], jsonb, text[], text[], integer[], float8[], integer[], timestamptz[], float8[],
    text[])
RETURNS TABLE (ord bigint, conflict boolean, id bigint, created boolean, first_ord bigint,
               held_id bigint, refused_field text, refused_problem text)
LANGUAGE plpgsql AS $$ BEGIN
    INSERT INTO {s}.loot VALUES ($2::text); RETURN; END $$;
CREATE TABLE {s}.outbox_fingerprint_key (singleton boolean, key bytea, inner_pad bytea,
                                         outer_pad bytea);
INSERT INTO {s}.outbox_fingerprint_key VALUES (true, '\\x00', '\\x00', '\\x00');
CREATE TABLE {s}.outbox_channel_pause (channel text, reason text, paused_at timestamptz);
INSERT INTO {s}.outbox_channel_pause VALUES ('email', 'shadowed', now());
CREATE TABLE {s}.outbox_dedupe (channel text, dedupe_key text, recipient_fingerprint bytea,
                                payload_digest bytea, message_id bigint, created_at timestamptz);
GRANT SELECT, INSERT ON ALL TABLES IN SCHEMA {s} TO PUBLIC;
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA {s} TO PUBLIC;
"""

# The producer's own session: temporary tables and functions of the same names.
TEMP_SHADOWS = """
CREATE TEMP TABLE outbox_fingerprint_key (singleton boolean, key bytea, inner_pad bytea,
                                          outer_pad bytea);
INSERT INTO outbox_fingerprint_key VALUES (true, '\\x00', '\\x00', '\\x00');
CREATE TEMP TABLE outbox_dedupe (channel text, dedupe_key text, recipient_fingerprint bytea,
                                 payload_digest bytea, message_id bigint, created_at timestamptz);
CREATE TEMP TABLE outbox_channel (name text);
CREATE FUNCTION pg_temp.outbox_recipient_fingerprints(channel text, payload jsonb)
RETURNS bytea[] LANGUAGE sql AS $$ SELECT '{}'::bytea[] $$;
"""


@dataclass
class Logins:
    producer: str
    relay: str
    attacker: str


def login_engine(database_url: str, user: str) -> sa.Engine:
    """An application's own engine: Postgres's default search_path."""
    return sa.create_engine(make_url(database_url).set(username=user, password="x"))


@pytest.fixture
def logins(engine: sa.Engine, database_url: str) -> Iterator[Logins]:
    suffix = uuid.uuid4().hex[:8]
    names = Logins(f"producer_{suffix}", f"relay_{suffix}", f"attacker_{suffix}")
    database = make_url(database_url).database
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE ROLE {names.producer} LOGIN IN ROLE outbox_producer"))
        conn.execute(sa.text(f"CREATE ROLE {names.relay} LOGIN IN ROLE outbox_relay"))
        conn.execute(sa.text(f"CREATE ROLE {names.attacker} LOGIN"))
        conn.execute(sa.text(f'GRANT CREATE ON DATABASE "{database}" TO {names.attacker}'))
    attacker = login_engine(database_url, names.attacker)
    try:
        with attacker.begin() as conn:
            for schema in (names.producer, names.relay):
                conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
                conn.execute(sa.text(SHADOWS.format(s=schema)))
        yield names
    finally:
        attacker.dispose()
        with engine.begin() as conn:
            for schema in (names.producer, names.relay):
                conn.execute(sa.text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))
            conn.execute(sa.text(f'REVOKE CREATE ON DATABASE "{database}" FROM {names.attacker}'))
            for role in (names.producer, names.relay, names.attacker):
                conn.execute(sa.text(f"DROP ROLE {role}"))


def loot(engine: sa.Engine, names: Logins) -> list[str]:
    with engine.connect() as conn:
        return [
            what
            for schema in (names.producer, names.relay)
            for what in conn.execute(sa.text(f"SELECT what FROM {schema}.loot")).scalars()
        ]


def test_a_hostile_user_schema_and_pg_temp_change_nothing(
    engine: sa.Engine, database_url: str, logins: Logins
) -> None:
    producer = login_engine(database_url, logins.producer)
    try:
        with producer.begin() as conn:
            # the producer's path does reach the attacker's schema
            assert conn.execute(sa.text("SELECT (current_schemas(false))[1]")).scalar_one() == (
                logins.producer
            )
            conn.execute(sa.text(TEMP_SHADOWS))
            first = outbox.enqueue(conn, "email", EMAIL, dedupe_key="order-1")
            many = outbox.enqueue_many(
                conn, [{"channel": "sms", "payload": {"to": "+15555550100", "message": "hi"}}]
            )
            by_sql = conn.execute(
                sa.text(
                    "SELECT public.outbox_enqueue('email', CAST(:p AS jsonb), "
                    "dedupe_key => 'order-1')"
                ),
                {"p": json.dumps(EMAIL)},
            ).scalar_one()
            shadow_keys = conn.execute(sa.text("SELECT count(*) FROM pg_temp.outbox_dedupe"))
            assert shadow_keys.scalar_one() == 0
    finally:
        producer.dispose()
    assert by_sql == first  # a replay, found in the real outbox_dedupe
    assert loot(engine, logins) == []
    with engine.connect() as conn:
        stored = conn.execute(
            sa.text(
                "SELECT m.id FROM outbox_message AS m WHERE m.recipient_fingerprints = "
                "public.outbox_recipient_fingerprints(m.channel, m.payload) "
                "AND cardinality(m.recipient_fingerprints) = 1 ORDER BY m.id"
            )
        ).scalars()
        assert list(stored) == [first, *many]
        keys = conn.execute(sa.text("SELECT message_id FROM outbox_dedupe")).scalars()
        assert list(keys) == [first]

    # The relay's login user, through the relay's own engine: the shadow pause
    # table in its "$user" schema does not hold the email rows back.
    relay = create_engine(
        DatabaseSettings(
            url=make_url(database_url)
            .set(username=logins.relay, password="x")
            .render_as_string(hide_password=False),
            sslmode="disable",
        ),
        autocommit=True,
    )
    try:
        with relay.connect() as conn:
            claimed = store.claim(conn, 10, 60)
    finally:
        relay.dispose()
    assert sorted(c.id for c in claimed) == sorted([first, *many])
    assert loot(engine, logins) == []


def test_every_relay_function_is_pinned_or_an_inlined_helper_naming_the_schema(
    engine: sa.Engine,
) -> None:
    """Functions pin ``search_path`` to the install schema; the few the planner
    must inline (a SET clause would stop it) name every relay object by its schema."""
    import re

    from outbox.migrations import revision_module

    revision = revision_module("0009")
    inlined = {f.split("(")[0] for f in revision.INLINED} | {
        "outbox_addresses",
        "outbox_recipients",
    }
    with engine.connect() as conn:
        functions = conn.execute(
            sa.text(
                "SELECT proname, proconfig, prosrc FROM pg_proc "
                "WHERE proname LIKE 'outbox\\_%' AND pronamespace = 'public'::regnamespace"
            )
        ).all()
    assert len(functions) > 15
    unpinned = set()
    for name, config, source in functions:
        if config is None:
            unpinned.add(name)
            unqualified = re.findall(r"(?<!public\.)\boutbox_\w+\s*\(", source)
            assert not unqualified, (name, unqualified)
        else:
            assert 'search_path="public", pg_temp' in config or (
                "search_path=public, pg_temp" in config
            ), (name, config)
    assert unpinned == inlined
    assert revision.MAX_PAYLOAD_BYTES == outbox.payloads.MAX_PAYLOAD_BYTES
