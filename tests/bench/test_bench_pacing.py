"""The pacing bench cell runs end to end (quick mode) and what it counts holds:
an idle stack holds no connection between its runs, and sends no statement
but the runs' own (counts, not times)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
bench_pacing = importlib.import_module("bench.pacing")


def test_quick_pacing_cells(
    database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DATABASE_URL", database_url)
    output = tmp_path / "pacing.json"
    assert bench_pacing.main(["--quick", "--output", str(output)]) == 0
    cells = {
        c["name"]: c for c in json.loads(output.read_text()) if c["name"] != "pacing under load"
    }
    idle = cells["pacing idle"]
    assert idle["drained"] == {"delivered": idle["backlog"]}
    assert idle["connections_held_after_drain"] == 0
    assert idle["connections_held_between_runs"] == [0] * 6
    assert idle["idle_hour_runs"] == {"dispatcher": 6, "reaper": 6}
    # A run's statements are its own handful, nothing like polling's.
    assert max(w["statements"] for w in idle["statements_per_run_window"]) < 60
    assert idle["poll_connections_held_after_run"] == 1
    cost = idle["cost"]
    assert set(cost["items"]) >= {"lambda_compute", "alarms", "dashboard"}
    assert cost["total"] == pytest.approx(cost["total_without_dashboard"] + 3.0, abs=0.01)
    assert cells["pacing from idle"]["trials"] == 2
