"""The grants docs/how-to/database.md documents ("public schema: grants") are enough, and
no more: a producer (a member of ``outbox_producer``) enqueues with either
API, dedupe and ordering keys included, through the producer door, and can
do nothing else with the relay's tables; a relay role (a member of
``outbox_relay``) claims, settles, reaps, prunes and reads the backlog, but
cannot read the HMAC key or write an outcome event. Each runs as that role
(``SET LOCAL ROLE``), so Postgres checks exactly those privileges."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

import outbox
from outbox import store
from support import EMAIL, doc_sql, settings

DENIED = pytest.raises(sa.exc.ProgrammingError, match="permission denied")


def documented(login: str, role: str) -> list[str]:
    """The README's statements that give the login ``login`` its rights, with
    ``role`` standing in for it (roles are cluster-wide: each test has its own)."""
    statements = [
        line.split("--", 1)[0].strip()
        for line in doc_sql("grants").splitlines()
        if not line.startswith("--")
    ]
    mine = [s for s in statements if re.search(rf"\b{login}\b", s)]
    assert mine, f"the README grants nothing to {login}"
    return [re.sub(rf"\b{login}\b", role, s) for s in mine]


PRODUCER = "app"
RELAY = "outbox_relay_app"


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


def grant(engine: sa.Engine, login: str, role: str) -> None:
    """Give ``role`` what the README gives ``login`` (its CREATE ROLE becomes a GRANT)."""
    with engine.begin() as conn:
        for statement in documented(login, role):
            created = re.match(rf"CREATE ROLE {role} LOGIN .* IN ROLE (\w+)", statement)
            if created:
                statement = f"GRANT {created[1]} TO {role}"
            conn.execute(sa.text(statement))


def as_role(conn: sa.Connection, role: str) -> sa.Connection:
    conn.execute(sa.text(f"SET LOCAL ROLE {role}"))
    return conn


def test_a_role_without_the_grants_cannot_enqueue(engine: sa.Engine, role: str) -> None:
    with DENIED, engine.begin() as conn:
        outbox.enqueue(as_role(conn, role), "email", EMAIL)
    with DENIED, engine.begin() as conn:
        as_role(conn, role).execute(
            sa.text("SELECT public.outbox_enqueue('email', CAST(:p AS jsonb))"),
            {"p": json.dumps(EMAIL)},
        )


def test_the_producer_grants_are_enough_to_enqueue(engine: sa.Engine, role: str) -> None:
    grant(engine, PRODUCER, role)
    with engine.begin() as conn:
        as_role(conn, role)
        first = outbox.enqueue(conn, "email", EMAIL, dedupe_key="order-1", ordering_key="c-7")
        repeat = outbox.enqueue(conn, "email", EMAIL, dedupe_key="order-1", ordering_key="c-7")
        many = outbox.enqueue_many(conn, [{"channel": "email", "payload": EMAIL}] * 2)
        by_sql = [
            conn.execute(
                sa.text(
                    "SELECT public.outbox_enqueue('email', CAST(:p AS jsonb), "
                    "dedupe_key => 'order-1', ordering_key => 'c-7')"
                ),
                {"p": json.dumps(EMAIL)},
            ).scalar_one()
            for _ in range(2)
        ]
    assert repeat == first and len(set(many)) == 2
    assert by_sql == [first, first]  # the same key and recipient: a replay
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM outbox_message")).scalar_one() == 3


@pytest.mark.parametrize(
    "statement",
    [
        # another service's payloads, dedupe keys and the HMAC key
        "SELECT payload FROM outbox_message",
        "SELECT * FROM outbox_dedupe",
        "SELECT key FROM outbox_fingerprint_key",
        "SELECT * FROM outbox_attempt",
        # a dedupe key without its message: the victim's enqueue would be a "replay"
        "INSERT INTO outbox_dedupe (channel, dedupe_key, recipient_fingerprint, payload_digest, "
        "message_id) VALUES ('email', 'order-9', '\\x00', '\\x00', 1)",
        "SELECT public.outbox_take_dedupe_key('email', 'order-9', '{}', 1)",
        # an id of its choosing: the next enqueue would fail with a unique violation
        "INSERT INTO outbox_message (id, channel, payload) OVERRIDING SYSTEM VALUE "
        "VALUES (1000, 'email', '{}')",
        "SELECT nextval('outbox_message_id_seq')",
        "UPDATE outbox_message SET priority = 1",
        "SELECT public.outbox_recipient_fingerprints('email', '{\"to\": [\"a@example.net\"]}')",
        "SELECT public.outbox_fingerprint('a@example.net')",
        "INSERT INTO outbox_channel (name) VALUES ('fax')",
    ],
)
def test_a_producer_can_do_nothing_but_enqueue(
    engine: sa.Engine, role: str, statement: str
) -> None:
    grant(engine, PRODUCER, role)
    with DENIED, engine.begin() as conn:
        as_role(conn, role).execute(sa.text(statement))


def test_a_producer_cannot_squat_another_producers_dedupe_key(engine: sa.Engine, role: str) -> None:
    """Through the door, a key is taken only with a message: the victim's
    repeat of it with its own payload is a conflict it sees, never a silent replay."""
    grant(engine, PRODUCER, role)
    with engine.begin() as conn:
        squatter = outbox.enqueue(as_role(conn, role), "email", EMAIL, dedupe_key="order-9")
    with engine.begin() as conn:
        victim = outbox.enqueue(
            as_role(conn, role), "email", EMAIL, dedupe_key="order-9", return_created=True
        )
    assert victim == (squatter, False)  # a real message, the same payload
    with pytest.raises(outbox.DedupeConflict), engine.begin() as conn:
        outbox.enqueue(
            as_role(conn, role), "email", {**EMAIL, "text": "other"}, dedupe_key="order-9"
        )


def test_the_relay_grants_are_enough_to_run_the_state_machine(engine: sa.Engine, role: str) -> None:
    grant(engine, RELAY, role)
    backoff = settings().backoff()
    with engine.begin() as conn:
        ids = outbox.enqueue_many(conn, [{"channel": "email", "payload": EMAIL}] * 3)
    with engine.begin() as conn:
        as_role(conn, role)
        claims = store.claim(conn, 10, 60)
        assert sorted(c.id for c in claims) == ids
        delivered, failed, crashed = claims
        settled = store.settle(
            conn,
            [
                store.Settlement(delivered.id, delivered.claim_token, "delivered"),
                # a permanent failure: the trigger writes its outcome event
                store.Settlement(failed.id, failed.claim_token, "failed", error="Rejected"),
            ],
            backoff,
        )
        assert settled == {delivered.id: "delivered", failed.id: "failed"}
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
        assert store.backlog(conn).pending == 1
        events = conn.execute(sa.text("SELECT message_id, status FROM outbox_outcome_event"))
        assert [tuple(e) for e in events] == [(failed.id, "failed")]
        # `outbox history --recipient` asks the fingerprint of an address
        assert conn.execute(sa.text("SELECT outbox_fingerprint('a@example.net')")).scalar_one()


@pytest.mark.parametrize(
    "statement",
    [
        "SELECT key FROM outbox_fingerprint_key",
        "SELECT inner_pad FROM outbox_fingerprint_key",
        "INSERT INTO outbox_outcome_event (message_id, channel, status, attempts) "
        "VALUES (1, 'email', 'bounced', 1)",
        "INSERT INTO outbox_message (channel, payload) VALUES ('email', '{}')",
        "INSERT INTO outbox_dedupe (channel, dedupe_key, recipient_fingerprint, payload_digest, "
        "message_id) VALUES ('email', 'k', '\\x00', '\\x00', 1)",
        "SELECT public.outbox_recipient_fingerprint('email', '{}')",
        "DROP TABLE outbox_message",
    ],
)
def test_the_relay_cannot_read_the_key_or_forge_an_outcome_event(
    engine: sa.Engine, role: str, statement: str
) -> None:
    grant(engine, RELAY, role)
    refused = pytest.raises(sa.exc.ProgrammingError, match=r"permission denied|must be owner")
    with refused, engine.begin() as conn:
        as_role(conn, role).execute(sa.text(statement))
