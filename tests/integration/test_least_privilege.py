"""Least privilege in the database: the relay runs as a
login user in the relay role the migration grants (DML on the two outbox
tables), and that user can run the whole relay but no DDL and no other table."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

import outbox
from outbox import dispatcher, reaper, sender, store
from outbox.db import create_engine
from outbox.handoff import CallableInvoker
from outbox.relay_settings import DatabaseSettings
from support import ScriptedChannel, expire_leases, install_channel, receive, settings

RELAY_ROLE = "outbox_relay"  # the migration's default (OUTBOX_RELAY_ROLE)


@pytest.fixture
def relay_user(engine: sa.Engine, database_url: str) -> Iterator[sa.Engine]:
    """A login user of this test run, member of the relay role, and its engine
    (built the way the functions build theirs)."""
    name = f"outbox_relay_test_{uuid.uuid4().hex[:10]}"
    password = uuid.uuid4().hex
    with engine.connect() as conn:
        conn.execute(
            sa.text(f"CREATE ROLE {name} LOGIN PASSWORD '{password}' IN ROLE {RELAY_ROLE}")
        )
        conn.execute(sa.text("CREATE TABLE IF NOT EXISTS app_customer (id int, secret text)"))
        conn.commit()
    url = make_url(database_url).set(username=name, password=password)
    relay_engine = create_engine(
        DatabaseSettings(url=url.render_as_string(hide_password=False), sslmode="disable"),
        autocommit=True,
    )
    try:
        yield relay_engine
    finally:
        relay_engine.dispose()
        with engine.connect() as conn:
            conn.execute(sa.text("DROP TABLE IF EXISTS app_customer"))
            conn.execute(sa.text(f"DROP ROLE {name}"))
            conn.commit()


@pytest.mark.parametrize(
    "statement",
    [
        "CREATE TABLE intruder (id int)",
        "ALTER TABLE outbox_message ADD COLUMN intruder int",
        "DROP TABLE outbox_attempt",
        "TRUNCATE outbox_message",
        "CREATE INDEX intruder ON outbox_message (channel)",
        "SELECT * FROM app_customer",
        "INSERT INTO app_customer VALUES (1, 'x')",
        "SELECT * FROM outbox_alembic_version",
    ],
)
def test_the_relay_user_can_run_no_ddl_and_touch_no_other_table(
    relay_user: sa.Engine, statement: str
) -> None:
    with relay_user.connect() as conn, pytest.raises(sa.exc.DBAPIError) as caught:
        conn.execute(sa.text(statement))
    message = str(caught.value.orig)
    assert "permission denied" in message or "must be owner" in message, message


def test_the_relay_user_runs_the_whole_relay(relay_user: sa.Engine) -> None:
    scripted = install_channel(ScriptedChannel())
    relay = settings(retention_days=1, unresolved_retention_days=1)
    with relay_user.begin() as conn:  # a producer may use the same grants
        ids = outbox.enqueue_many(
            conn, [{"channel": "scripted", "payload": {"n": i}} for i in range(6)]
        )
    invoker = CallableInvoker(
        {
            "scripted": lambda e: sender.run(
                relay_user, e, relay, lambda: 30.0, channel_name="scripted"
            )
        }
    )
    assert dispatcher.dispatch_once(relay_user, invoker, relay).claimed == 6
    assert sorted(scripted.sent) == ids
    with relay_user.begin() as conn:
        extra = outbox.enqueue(conn, "scripted", {"n": 99}, max_attempts=1)
        claims = store.claim(conn, 10, 60)
    receive(relay_user, claims)  # a sender took it, then died: the attempt counts
    expire_leases(relay_user)
    report = reaper.run(relay_user, relay, lambda: 30.0)
    assert report.dead == 1 and report.backlog is not None
    with relay_user.begin() as conn:
        assert store.redrive(conn, [extra]) == {extra}
        assert store.cancel(conn, [extra]) == {extra}
        conn.execute(sa.text("UPDATE outbox_message SET settled_at = now() - interval '2 days'"))
    assert reaper.run(relay_user, relay, lambda: 30.0).pruned == 7


def test_the_relay_user_enqueues_with_dedupe_keys_and_prunes_them(relay_user: sa.Engine) -> None:
    """Dedupe (outbox_dedupe, the fingerprint key, ids drawn ahead) and the send
    log's pruning work under the relay role's grants."""
    install_channel(ScriptedChannel())
    with relay_user.begin() as conn:
        first = outbox.enqueue(conn, "scripted", {"n": 1}, dedupe_key="k", return_created=True)
        again = outbox.enqueue(conn, "scripted", {"n": 1}, dedupe_key="k", return_created=True)
        history = store.recipient_history(conn, "+15555550100", ["sms"])
    assert first.created and again == (first.id, False) and history == []
    with relay_user.begin() as conn:
        assert store.prune_dedupe_keys(conn, 0, 10) == 1
        assert store.prune_attempts(conn, 0, 10) == 0


def test_the_relay_user_reads_and_writes_channel_pauses(relay_user: sa.Engine) -> None:
    """Every claim reads outbox_channel_pause; `outbox pause` may run as the relay."""
    install_channel(ScriptedChannel())
    with relay_user.begin() as conn:
        outbox.enqueue(conn, "scripted", {"n": 1})
        assert store.pause_channel(conn, "scripted", "incident") is True
        assert store.claim(conn, 10, 60) == []
        assert [p.channel for p in store.paused_channels(conn)] == ["scripted"]
        assert store.resume_channel(conn, "scripted") is True
        assert len(store.claim(conn, 10, 60)) == 1
