"""Nothing the relay sends pins an RDS Proxy connection: no session SET, no
LISTEN, no session advisory lock, no prepared statement kept across transactions."""

from __future__ import annotations

import re
import time
from typing import Any

import pg8000.core
import pytest
import sqlalchemy as sa

import outbox
from outbox import dispatcher, reaper, sender
from outbox.channels.email import EmailChannel
from outbox.db import create_engine
from outbox.handoff import CallableInvoker
from outbox.relay_settings import DatabaseSettings
from support import EMAIL, LambdaContext, ScriptedChannel, install_channel, settings

PINNING = re.compile(
    r"^\s*(SET\s|RESET|LISTEN|PREPARE|DECLARE|SELECT\s+pg_advisory_lock)", re.IGNORECASE
)
# What autocommit saves: the relay's single-statement operations need no BEGIN/COMMIT.
TRANSACTION_CONTROL = re.compile(r"^\s*(BEGIN|COMMIT|ROLLBACK)", re.IGNORECASE)


def test_a_full_cycle_sends_no_pinning_statement(
    engine: sa.Engine, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Record every statement pg8000 sends, including the BEGIN and COMMIT it
    # issues by itself: each one, whichever path sends it (the simple query,
    # pg8000's extended exchanges, the relay's one-round-trip train), makes a
    # Context with its text.
    sent: list[str] = []
    real_init = pg8000.core.Context.__init__

    def record(self: Any, statement: str | None, *args: Any, **kwargs: Any) -> None:
        if statement is not None:  # pg8000's own bookkeeping contexts carry none
            sent.append(statement)
        real_init(self, statement, *args, **kwargs)

    monkeypatch.setattr(pg8000.core.Context, "__init__", record)

    class FakeEmail(ScriptedChannel):
        schema = EmailChannel.schema

    install_channel(FakeEmail(name="email"))
    # A fresh pool, configured as the Lambda runtime configures it.
    relay = create_engine(DatabaseSettings(url=database_url, sslmode="disable"), autocommit=True)
    with relay.begin() as conn:
        outbox.enqueue_many(conn, [{"channel": "email", "payload": EMAIL}] * 5)

    def send(event: dict[str, Any]) -> None:
        ctx = LambdaContext()
        sender.run(relay, event, settings(), lambda: ctx.get_remaining_time_in_millis() / 1000)

    dispatcher.run(
        relay, CallableInvoker({"email": send}), settings(), lambda: 1.0, until_empty=True
    )
    reaper.run(relay, settings(), lambda: 10.0)
    relay.dispose()
    assert len(sent) > 5
    # the relay's own parametrised statements were seen (the claim, the settle)
    assert any("SET status = 'claimed'" in s for s in sent)
    assert any("INSERT INTO outbox_attempt" in s for s in sent)
    assert [s for s in sent if PINNING.match(s)] == []
    assert [s for s in sent if TRANSACTION_CONTROL.match(s)] == []


def test_a_statement_with_parameters_is_one_round_trip(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The relay's engine sends Parse, Bind, Describe, Execute, Flush and Sync as one
    train (one flush), where pg8000 alone waits on three exchanges; an error in
    the train leaves the connection answering the next statement."""
    relay = create_engine(DatabaseSettings(url=database_url, sslmode="disable"), autocommit=True)
    flushes: list[int] = []
    real_flush = pg8000.core._flush
    monkeypatch.setattr(pg8000.core, "_flush", lambda sock: (flushes.append(1), real_flush(sock)))
    with relay.connect() as conn:
        conn.execute(sa.text("SELECT 1"))  # the pool's first use (its checks) out of the count
        flushes.clear()
        assert conn.execute(sa.text("SELECT CAST(:n AS int) + 1"), {"n": 41}).scalar_one() == 42
    assert len(flushes) == 1
    with relay.connect() as conn, pytest.raises(sa.exc.DBAPIError):
        conn.execute(sa.text("SELECT CAST(:n AS int)"), {"n": "not a number"})
    with relay.connect() as conn:
        assert conn.execute(sa.text("SELECT CAST(:n AS text)"), {"n": "ok"}).scalar_one() == "ok"
    relay.dispose()


def test_the_rows_of_a_statement_arrive_before_its_commit(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The train asks the server to flush after Execute: the rows and the
    command's completion go out before the commit (and its WAL flush) at Sync,
    so the client decodes them while the server commits, as it does under
    pg8000's own exchanges. Without it the last rows wait for the commit."""
    admin = sa.create_engine(database_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        # A deferred constraint trigger runs at commit: a commit that takes 2 s.
        conn.execute(sa.text("CREATE TABLE slow_commit (id int)"))
        conn.execute(
            sa.text(
                "CREATE FUNCTION slow_commit_wait() RETURNS trigger LANGUAGE plpgsql AS "
                "$$ BEGIN PERFORM pg_sleep(2); RETURN NULL; END $$"
            )
        )
        conn.execute(
            sa.text(
                "CREATE CONSTRAINT TRIGGER slow_commit_wait AFTER INSERT ON slow_commit "
                "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_commit_wait()"
            )
        )
    arrived: dict[str, float] = {}
    for name in ("handle_COMMAND_COMPLETE", "handle_READY_FOR_QUERY"):
        real = getattr(pg8000.core.CoreConnection, name)

        def timed(self: Any, data: Any, context: Any, real: Any = real, name: str = name) -> Any:
            arrived[name] = time.monotonic()
            return real(self, data, context)

        monkeypatch.setattr(pg8000.core.CoreConnection, name, timed)
    relay = create_engine(DatabaseSettings(url=database_url, sslmode="disable"), autocommit=True)
    try:
        with relay.connect() as conn:
            ids = conn.execute(
                sa.text("INSERT INTO slow_commit SELECT CAST(:n AS int) RETURNING id"), {"n": 7}
            ).scalars()
            assert list(ids) == [7]
    finally:
        relay.dispose()
        with admin.connect() as conn:
            conn.execute(sa.text("DROP TABLE slow_commit"))
            conn.execute(sa.text("DROP FUNCTION slow_commit_wait()"))
        admin.dispose()
    waited_for_commit = arrived["handle_READY_FOR_QUERY"] - arrived["handle_COMMAND_COMPLETE"]
    # Decoded while the server still committed: most of the 2 s lay between
    # them (half of it, so that a busy machine slow to read the first has room).
    assert waited_for_commit > 1.0


def test_a_connection_dropped_while_idle_is_replaced_before_use(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a thawed Lambda meets: its pooled connection died while it was frozen."""
    from outbox import db

    monkeypatch.setattr(db, "PING_AFTER_IDLE_SECONDS", 0.0)
    relay = create_engine(DatabaseSettings(url=database_url, sslmode="disable"))
    with relay.connect() as conn:
        first_pid = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
    admin = sa.create_engine(database_url)
    with admin.connect() as conn:
        conn.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": first_pid})
    admin.dispose()
    with relay.connect() as conn:  # no error: the idle check found the dead socket
        second_pid = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
    assert second_pid != first_pid
    relay.dispose()
