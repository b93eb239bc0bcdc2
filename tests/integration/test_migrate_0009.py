"""Revision 0009 on a database in use: `outbox migrate` applies it without
losing a row, channels with messages stay enqueueable from SQL, the key and
the fingerprints are the same, and the downgrade gives the earlier grants
and functions back."""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa

import outbox
from outbox import migrate
from support import EMAIL

BEFORE = "0005"  # the head before 0009


@pytest.fixture
def database(empty_database: tuple[str, sa.Engine]) -> sa.Engine:
    return empty_database[1]


def snapshot(conn: sa.Connection) -> list[tuple[object, ...]]:
    return [
        tuple(r)
        for r in conn.execute(
            sa.text(
                "SELECT id, channel, payload, status, recipient_fingerprints FROM outbox_message "
                "ORDER BY id"
            )
        )
    ]


def relay_privileges(conn: sa.Connection, table: str) -> set[str]:
    return set(
        conn.execute(
            sa.text(
                "SELECT privilege_type FROM information_schema.role_table_grants "
                "WHERE grantee = 'outbox_relay' AND table_name = :t"
            ),
            {"t": table},
        ).scalars()
    )


def test_0009_upgrades_a_database_in_use_and_downgrades(database: sa.Engine) -> None:
    migrate.upgrade(database, BEFORE)
    with database.begin() as conn:
        conn.execute(
            sa.text("SELECT outbox_enqueue('email', CAST(:e AS jsonb), dedupe_key => 'order-1')"),
            {"e": json.dumps(EMAIL)},
        )
        conn.execute(sa.text("SELECT outbox_enqueue('fax', CAST(:p AS jsonb))"), {"p": '{"n": 1}'})
        before = snapshot(conn)
        key = conn.execute(sa.text("SELECT key FROM outbox_fingerprint_key")).scalar_one()
        assert relay_privileges(conn, "outbox_fingerprint_key") == {"SELECT"}

    assert migrate.upgrade(database) == migrate.current(database)
    with database.begin() as conn:
        assert snapshot(conn) == before
        assert conn.execute(sa.text("SELECT key FROM outbox_fingerprint_key")).scalar_one() == key
        channels = set(conn.execute(sa.text("SELECT name FROM outbox_channel")).scalars())
        assert {"email", "sms", "webhook", "fax"} <= channels  # fax had messages
        # a replay of the old key, through the new door
        again = outbox.enqueue(conn, "email", EMAIL, dedupe_key="order-1", return_created=True)
        assert again == (before[0][0], False)
        conn.execute(sa.text("SELECT public.outbox_enqueue('fax', '{\"n\": 2}')"))
        assert relay_privileges(conn, "outbox_fingerprint_key") == set()
        assert "INSERT" not in relay_privileges(conn, "outbox_outcome_event")

    migrate.downgrade(database, BEFORE)
    with database.begin() as conn:
        assert len(snapshot(conn)) == len(before) + 1
        assert relay_privileges(conn, "outbox_fingerprint_key") == {"SELECT"}
        assert "INSERT" in relay_privileges(conn, "outbox_outcome_event")
        security = conn.execute(
            sa.text(
                "SELECT bool_or(prosecdef) FROM pg_proc WHERE proname LIKE 'outbox%' "
                "AND pronamespace = 'public'::regnamespace"
            )
        ).scalar_one()
        assert security is False
        conn.execute(
            sa.text("SELECT outbox_enqueue('email', CAST(:e AS jsonb))"), {"e": json.dumps(EMAIL)}
        )
    assert migrate.upgrade(database) == migrate.current(database)
