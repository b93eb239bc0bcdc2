"""`outbox prune` deletes no more than it counted and confirmed, and reports
what it deleted (issue 23, item 8: it counted 3 rows and deleted 4 when a
row changed status in between)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

import outbox
from outbox import store
from outbox_cli.cli import cli
from support import EMAIL


def test_prune_deletes_what_it_counted(
    engine: sa.Engine, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with engine.begin() as conn:
        delivered = outbox.enqueue_many(conn, [{"channel": "email", "payload": EMAIL}] * 3)
        (late,) = outbox.enqueue_many(conn, [{"channel": "email", "payload": EMAIL}])
        conn.execute(
            sa.text(
                "UPDATE outbox_message SET status = CASE WHEN id = :late THEN 'dead' "
                "ELSE 'delivered' END, settled_at = now() - interval '30 days'"
            ),
            {"late": late},
        )
    counted = store.count_prunable

    def count_then_a_row_changes(*args: Any, **kwargs: Any) -> int:
        n = counted(*args, **kwargs)
        with engine.begin() as conn:  # e.g. an operator's change, after the count
            conn.execute(
                sa.text("UPDATE outbox_message SET status = 'cancelled' WHERE id = :id"),
                {"id": late},
            )
        return n

    monkeypatch.setattr(store, "count_prunable", count_then_a_row_changes)
    result = CliRunner().invoke(
        cli,
        ["prune", "--older-than", "7d", "--yes", "--json"],
        env={"DATABASE_URL": database_url},
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"action": "prune", "dry_run": False, "count": 3}
    # Three rows deleted, as reported (any three that met the filter when the
    # DELETE ran); the fourth waits for the next prune.
    with engine.connect() as conn:
        left = conn.execute(sa.text("SELECT id FROM outbox_message")).scalars().all()
    assert len(left) == 1 and set(left) <= {late, *delivered}
