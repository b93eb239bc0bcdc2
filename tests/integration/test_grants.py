"""The grants docs/how-to/database.md documents are enough: a producer role (USAGE on the
schema; SELECT, INSERT on outbox_message and outbox_dedupe; SELECT on the
fingerprint key; USAGE on the id sequence) enqueues with either API, dedupe
and ordering keys included; a relay role with SELECT, INSERT, UPDATE, DELETE on the two
tables claims, settles, reaps, prunes and reads the backlog. Each runs as
that role (``SET LOCAL ROLE``), so Postgres checks exactly those privileges."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

import outbox
from outbox import store
from support import DOCS, EMAIL, doc_blocks, settings


def documented_producer_grants() -> list[str]:
    """The GRANT statements the page gives an application (``app``), for any role."""
    recipe = doc_blocks(DOCS / "how-to" / "database.md")["grants"].code
    return [
        line.split(";")[0].replace(" TO app", " TO {role}")
        for line in recipe.splitlines()
        if line.startswith("GRANT ") and " TO app;" in line
    ]


PRODUCER_GRANTS = documented_producer_grants()
RELAY_GRANTS = [
    "GRANT USAGE ON SCHEMA public TO {role}",
    "GRANT SELECT, INSERT, UPDATE, DELETE ON outbox_message, outbox_attempt TO {role}",
    # the claim skips paused channels
    "GRANT SELECT ON outbox_channel_pause TO {role}",
    # the claim draws from (and locks) the throttled destinations' buckets
    "GRANT SELECT, UPDATE ON outbox_destination TO {role}",
]


@pytest.fixture
def role(engine: sa.Engine) -> Iterator[str]:
    """A role with no privileges of its own (dropped afterwards)."""
    name = f"outbox_grants_{uuid.uuid4().hex[:8]}"
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE ROLE {name} NOLOGIN"))
    yield name
    with engine.begin() as conn:
        conn.execute(sa.text(f"DROP OWNED BY {name}"))
        conn.execute(sa.text(f"DROP ROLE {name}"))


def grant(engine: sa.Engine, statements: list[str], role: str) -> None:
    with engine.begin() as conn:
        for statement in statements:
            conn.execute(sa.text(statement.format(role=role)))


def test_a_role_without_the_grants_cannot_enqueue(engine: sa.Engine, role: str) -> None:
    with pytest.raises(sa.exc.ProgrammingError, match="permission denied"), engine.begin() as conn:
        conn.execute(sa.text(f"SET LOCAL ROLE {role}"))
        outbox.enqueue(conn, "email", EMAIL)


def test_the_producer_grants_are_enough_to_enqueue(engine: sa.Engine, role: str) -> None:
    grant(engine, PRODUCER_GRANTS, role)
    with engine.begin() as conn:
        conn.execute(sa.text(f"SET LOCAL ROLE {role}"))
        first = outbox.enqueue(conn, "email", EMAIL, dedupe_key="order-1", ordering_key="c-7")
        repeat = outbox.enqueue(conn, "email", EMAIL, dedupe_key="order-1", ordering_key="c-7")
        many = outbox.enqueue_many(conn, [{"channel": "email", "payload": EMAIL}] * 2)
        by_sql = [
            conn.execute(
                sa.text(
                    "SELECT outbox_enqueue('email', CAST(:p AS jsonb), dedupe_key => 'order-1', "
                    "ordering_key => 'c-7')"
                ),
                {"p": json.dumps(EMAIL)},
            ).scalar_one()
            for _ in range(2)
        ]
    assert repeat == first and len(set(many)) == 2
    assert by_sql == [first, first]  # the same key and recipient: a replay
    denied = pytest.raises(sa.exc.ProgrammingError, match="permission denied")
    with denied, engine.begin() as conn:  # and nothing more: it cannot change a row
        conn.execute(sa.text(f"SET LOCAL ROLE {role}"))
        conn.execute(sa.text("UPDATE outbox_message SET priority = 1"))


def test_the_relay_grants_are_enough_to_run_the_state_machine(engine: sa.Engine, role: str) -> None:
    grant(engine, RELAY_GRANTS, role)
    backoff = settings().backoff()
    with engine.begin() as conn:
        ids = outbox.enqueue_many(conn, [{"channel": "email", "payload": EMAIL}] * 3)
    with engine.begin() as conn:
        conn.execute(sa.text(f"SET LOCAL ROLE {role}"))
        claims = store.claim(conn, 10, 60)
        assert sorted(c.id for c in claims) == ids
        delivered, retried, crashed = claims
        settled = store.settle(
            conn,
            [
                store.Settlement(delivered.id, delivered.claim_token, "delivered"),
                store.Settlement(retried.id, retried.claim_token, "retry", error="Throttling"),
            ],
            backoff,
        )
        assert settled[delivered.id] == "delivered"
        conn.execute(
            sa.text(
                "UPDATE outbox_message SET lease_expires_at = now() - interval '1 s' WHERE id = :id"
            ),
            {"id": crashed.id},
        )
        assert crashed.id in store.reap_expired(conn, 10, backoff)
        conn.execute(
            sa.text(
                "UPDATE outbox_message SET settled_at = now() - interval '30 days' WHERE id = :id"
            ),
            {"id": delivered.id},
        )
        assert store.prune(conn, 7 * 86400, 100) == 1
        assert store.backlog(conn).pending == 2
