"""Retention: rows that never reached their recipient
(failed, dead) wait for an operator; the routine retention never prunes them,
a message reaped to dead is still there (and counted) after the same run, and
a retention of 0 days is refused."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

import outbox
from outbox import reaper, store
from outbox.errors import ConfigError
from outbox.relay_settings import RelaySettings
from support import ScriptedChannel, expire_leases, install_channel, receive, settings


def age_all_settled_rows(engine: sa.Engine, days: int) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE outbox_message SET settled_at = now() - make_interval(days => :d) "
                "WHERE settled_at IS NOT NULL"
            ),
            {"d": days},
        )


def one_row_per_final_status(engine: sa.Engine) -> dict[str, int]:
    install_channel(ScriptedChannel())
    with engine.begin() as conn:
        ids = outbox.enqueue_many(
            conn, [{"channel": "scripted", "payload": {"n": i}} for i in range(4)]
        )
        conn.execute(
            sa.text(
                "UPDATE outbox_message SET status = s.status, settled_at = now() "
                "FROM unnest(CAST(:ids AS bigint[]), CAST(:statuses AS text[])) AS s(id, status) "
                "WHERE outbox_message.id = s.id"
            ),
            {"ids": ids, "statuses": ["delivered", "failed", "dead", "cancelled"]},
        )
    return dict(zip(["delivered", "failed", "dead", "cancelled"], ids, strict=True))


def remaining(engine: sa.Engine) -> set[str]:
    with engine.connect() as conn:
        return set(conn.execute(sa.text("SELECT status FROM outbox_message")).scalars())


def test_failed_and_dead_rows_are_never_pruned_by_default(engine: sa.Engine) -> None:
    one_row_per_final_status(engine)
    age_all_settled_rows(engine, 3000)
    report = reaper.run(engine, settings(retention_days=1), lambda: 30.0)
    assert report.pruned == 2
    assert remaining(engine) == {"failed", "dead"}
    assert report.backlog is not None and report.backlog.dead == 1  # the alarm's figure stays


def test_unresolved_rows_have_their_own_longer_retention_when_set(engine: sa.Engine) -> None:
    one_row_per_final_status(engine)
    age_all_settled_rows(engine, 20)
    relay = settings(retention_days=1, unresolved_retention_days=30)
    assert reaper.run(engine, relay, lambda: 30.0).pruned == 2
    assert remaining(engine) == {"failed", "dead"}
    age_all_settled_rows(engine, 31)
    assert reaper.run(engine, relay, lambda: 30.0).pruned == 2
    assert remaining(engine) == set()


def test_a_message_reaped_to_dead_survives_the_same_run(engine: sa.Engine) -> None:
    install_channel(ScriptedChannel())
    with engine.begin() as conn:
        message_id = outbox.enqueue(conn, "scripted", {"n": 1}, max_attempts=1)
        claims = store.claim(conn, 10, 60)
    receive(engine, claims)  # a sender took it, then died: the attempt counts
    expire_leases(engine)
    report = reaper.run(engine, settings(retention_days=1), lambda: 30.0)
    assert (report.dead, report.pruned) == (1, 0)
    with engine.connect() as conn:
        assert store.statuses_of(conn, [message_id]) == {message_id: "dead"}
    assert report.backlog is not None and report.backlog.dead == 1


@pytest.mark.parametrize(
    ("env", "setting"),
    [
        ({"RETENTION_DAYS": "0"}, "RETENTION_DAYS"),
        ({"UNRESOLVED_RETENTION_DAYS": "0"}, "UNRESOLVED_RETENTION_DAYS"),
        ({"UNRESOLVED_RETENTION_DAYS": "soon"}, "UNRESOLVED_RETENTION_DAYS"),
    ],
)
def test_a_retention_under_one_day_is_refused(env: dict[str, str], setting: str) -> None:
    with pytest.raises(ConfigError) as caught:
        RelaySettings.from_env(env)
    assert caught.value.setting == setting


def test_unresolved_retention_defaults_to_never() -> None:
    assert RelaySettings.from_env({}).unresolved_retention_days is None
    assert (
        RelaySettings.from_env({"UNRESOLVED_RETENTION_DAYS": "never"}).unresolved_retention_days
        is None
    )
    assert (
        RelaySettings.from_env({"UNRESOLVED_RETENTION_DAYS": "90"}).unresolved_retention_days == 90
    )
