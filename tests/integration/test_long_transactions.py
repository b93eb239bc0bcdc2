"""Long transactions made visible (issue 30): a snapshot held elsewhere in the
relay's database keeps vacuum from removing the dead rows at the head of the
claim's index, and the claim slows many times over. The reaper reports the
oldest one (``store.oldest_snapshot``), in seconds where Postgres shows its
start and in transaction ids always."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from outbox import observability, reaper, store
from outbox.db import create_engine
from outbox.relay_settings import DatabaseSettings
from support import settings

RELAY_ROLE = "outbox_relay"


def db_now(engine: sa.Engine) -> datetime:
    with engine.connect() as conn:
        value: datetime = conn.execute(sa.text("SELECT now()")).scalar_one()
    return value


@pytest.fixture
def holder(engine: sa.Engine) -> Iterator[tuple[sa.Connection, datetime]]:
    """Another session of the database, idle in a transaction that holds a
    snapshot and a transaction id (as an application's forgotten BEGIN
    does), and the database's time it began."""
    with engine.connect() as conn:
        conn.execute(sa.text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"))
        began: datetime = conn.execute(sa.text("SELECT now()")).scalar_one()
        conn.execute(sa.text("SELECT txid_current()"))
        conn.execute(sa.text("SELECT pg_sleep(0.2)"))  # an age that is not zero
        yield conn, began
        conn.rollback()


def test_a_session_holding_a_snapshot_is_reported_with_its_age(
    engine: sa.Engine, holder: tuple[sa.Connection, datetime]
) -> None:
    conn, began = holder
    elapsed = (db_now(engine) - began).total_seconds()
    with engine.begin() as reader:
        s = store.oldest_snapshot(reader)
    assert s.age_seconds >= elapsed > 0
    assert s.xid_age >= 1
    assert (s.sessions, s.hidden_sessions, s.prepared, s.slots) == (1, 0, 0, 0)
    conn.rollback()  # the transaction ends: nothing holds the horizon
    with engine.begin() as reader:
        after = store.oldest_snapshot(reader)
    assert (after.age_seconds, after.xid_age, after.sessions) == (0.0, 0, 0)


def test_the_reading_session_itself_is_not_counted(engine: sa.Engine) -> None:
    with engine.connect() as conn:
        conn.execute(sa.text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"))
        conn.execute(sa.text("SELECT txid_current(), pg_sleep(0.1)"))
        s = store.oldest_snapshot(conn)
        conn.rollback()
    assert (s.age_seconds, s.xid_age, s.sessions) == (0.0, 0, 0)


@pytest.fixture
def relay_user(engine: sa.Engine, database_url: str) -> Iterator[tuple[str, sa.Engine]]:
    """A login user in the relay role and nothing more, and its engine."""
    name = f"outbox_relay_xmin_{uuid.uuid4().hex[:10]}"
    password = uuid.uuid4().hex
    with engine.connect() as conn:
        conn.execute(
            sa.text(f"CREATE ROLE {name} LOGIN PASSWORD '{password}' IN ROLE {RELAY_ROLE}")
        )
        conn.commit()
    url = make_url(database_url).set(username=name, password=password)
    relay_engine = create_engine(
        DatabaseSettings(url=url.render_as_string(hide_password=False), sslmode="disable")
    )
    try:
        yield name, relay_engine
    finally:
        relay_engine.dispose()
        with engine.connect() as conn:
            conn.execute(sa.text(f"DROP ROLE {name}"))
            conn.commit()


def test_the_relay_role_sees_the_transaction_ids_and_with_pg_read_all_stats_the_age(
    engine: sa.Engine,
    holder: tuple[sa.Connection, datetime],
    relay_user: tuple[str, sa.Engine],
) -> None:
    """Postgres hides another role's transaction start from a role without
    pg_read_all_stats (pg_monitor has it), not its backend_xmin: the figure
    in ids stays, the session counts as hidden, and nothing fails."""
    name, relay_engine = relay_user
    _, began = holder
    with relay_engine.begin() as conn:
        hidden = store.oldest_snapshot(conn)
    assert (hidden.age_seconds, hidden.sessions, hidden.hidden_sessions) == (0.0, 1, 1)
    assert hidden.xid_age >= 1
    with engine.connect() as conn:
        conn.execute(sa.text(f"GRANT pg_read_all_stats TO {name}"))
        conn.commit()
    elapsed = (db_now(engine) - began).total_seconds()
    with relay_engine.begin() as conn:
        shown = store.oldest_snapshot(conn)
    assert shown.age_seconds >= elapsed and shown.hidden_sessions == 0


def test_a_prepared_transaction_counts_from_when_it_was_prepared(engine: sa.Engine) -> None:
    with engine.connect() as conn:
        if int(conn.execute(sa.text("SHOW max_prepared_transactions")).scalar_one()) == 0:
            pytest.skip("the server allows no prepared transactions (max_prepared_transactions)")
    gid = f"outbox-test-{uuid.uuid4().hex[:8]}"
    with engine.connect() as conn:
        conn.execute(sa.text("SELECT txid_current()"))
        conn.execute(sa.text(f"PREPARE TRANSACTION '{gid}'"))
    try:
        with engine.connect() as conn:
            prepared_at = conn.execute(
                sa.text("SELECT prepared FROM pg_prepared_xacts WHERE gid = :g"), {"g": gid}
            ).scalar_one()
        elapsed = (db_now(engine) - prepared_at).total_seconds()
        with engine.begin() as conn:
            s = store.oldest_snapshot(conn)
        assert s.prepared == 1 and s.age_seconds >= elapsed and s.xid_age >= 1
    finally:
        with engine.connect() as conn:
            conn.execute(sa.text(f"ROLLBACK PREPARED '{gid}'"))
            conn.commit()


def emf_records(text: str) -> list[dict[str, Any]]:
    return [
        json.loads(line) for line in text.splitlines() if line.startswith("{") and '"_aws"' in line
    ]


def reap_and_read_metrics(
    engine: sa.Engine, capsys: pytest.CaptureFixture[str], *, quiet_when_idle: bool = False
) -> dict[str, Any]:
    observability.flush_metrics()
    capsys.readouterr()
    observability.log_metrics(
        lambda e, c: reaper.run(engine, settings(), lambda: 30.0, quiet_when_idle=quiet_when_idle)
    )({}, None)
    relay_wide = [r for r in emf_records(capsys.readouterr().out) if "channel" not in r]
    return {k: v for r in relay_wide for k, v in r.items()}


def test_the_reaper_publishes_the_oldest_snapshot_age(
    engine: sa.Engine, holder: tuple[sa.Connection, datetime], capsys: pytest.CaptureFixture[str]
) -> None:
    _, began = holder
    elapsed = (db_now(engine) - began).total_seconds()
    metrics = reap_and_read_metrics(engine, capsys, quiet_when_idle=True)
    assert metrics["OldestSnapshotAgeSeconds"][0] >= elapsed
    assert metrics["OldestSnapshotXidAge"][0] >= 1


def test_quiet_when_nothing_holds_a_snapshot(
    engine: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    quiet = reap_and_read_metrics(engine, capsys, quiet_when_idle=True)
    assert "OldestSnapshotAgeSeconds" not in quiet and "OldestSnapshotXidAge" not in quiet
    polling = reap_and_read_metrics(engine, capsys)
    assert polling["OldestSnapshotAgeSeconds"] == [0.0]
    assert polling["OldestSnapshotXidAge"] == [0.0]


def test_the_reaper_runs_on_when_the_figure_cannot_be_read(
    engine: sa.Engine, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A database that refuses the statistics views (a managed Postgres of its
    own kind) costs the figure, never the reaper's run."""

    def refused(conn: sa.Connection) -> store.OldestSnapshot:
        conn.execute(sa.text("SELECT * FROM pg_no_such_view"))
        raise AssertionError("unreachable")

    monkeypatch.setattr(store, "oldest_snapshot", refused)
    metrics = reap_and_read_metrics(engine, capsys)
    assert "OldestSnapshotAgeSeconds" not in metrics
    assert "PendingMessages" in metrics
