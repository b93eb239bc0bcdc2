"""`outbox status` shows the oldest snapshot holding back vacuum (issue 30)."""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa


def test_status_shows_the_oldest_snapshot(run: Any, engine: sa.Engine) -> None:
    idle = json.loads(run("status", "--json").stdout)
    assert "pending" in idle and idle["oldest_snapshot"]["sessions"] == 0
    with engine.connect() as conn:
        conn.execute(sa.text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"))
        began = conn.execute(sa.text("SELECT now()")).scalar_one()
        conn.execute(sa.text("SELECT txid_current(), pg_sleep(0.1)"))
        with engine.connect() as other:
            elapsed = (other.execute(sa.text("SELECT now()")).scalar_one() - began).total_seconds()
        held = json.loads(run("status", "--json").stdout)["oldest_snapshot"]
        text = run("status").stdout
        conn.rollback()
    assert held["age_seconds"] >= round(elapsed, 3) and held["sessions"] == 1
    assert held["xid_age"] >= 1 and held["hidden_sessions"] == 0
    assert "oldest snapshot " in text and "1 sessions" in text
