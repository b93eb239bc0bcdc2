"""The benchmark harness still runs end to end (a tiny quick mode; no timing asserts)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

# bench/ sits at the repository root, next to tests/.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
bench_main = importlib.import_module("bench.__main__")


def test_quick_run_writes_well_formed_cells(
    database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The harness creates its own databases on the same server as the test database.
    monkeypatch.setenv("DATABASE_URL", database_url)
    output = tmp_path / "results.json"
    args = [
        "--quick",
        "--rows",
        "300",
        "--batches",
        "100",
        "--workers",
        "1",
        "--latency-seconds",
        "1",
        "--provider-latencies",
        "20",
        "--output",
        str(output),
    ]
    assert bench_main.main(args) == 0

    cells = json.loads(output.read_text())
    assert isinstance(cells, list)
    by_name: dict[str, list[dict]] = {}
    for cell in cells:
        by_name.setdefault(cell["name"], []).append(cell)

    (throughput,) = by_name["throughput"]
    for key in ("name", "batch", "workers", "rows_per_s", "baseline_rows_per_s", "ratio"):
        assert key in throughput
    assert (throughput["batch"], throughput["workers"]) == (100, 1)
    for key in ("rows_per_s", "baseline_rows_per_s", "ratio", "statements_per_batch"):
        assert throughput[key] > 0
    # The relay's statements per batch: claim, receipt, settle.
    assert throughput["statements_per_batch"] == 3
    # The protocol-equivalent baseline runs the same statements, so the same count.
    assert throughput["protocol_rows_per_s"] > 0 and throughput["relay_vs_protocol"] > 0
    assert throughput["worker_rows_per_s"] > 0
    # The CPU per 100 rows: the kind's own processes, then the rest of the
    # machine (None only where there is no /proc).
    own, rest = throughput["cpu_ms_per_100_rows"]["worker"]
    assert own > 0 and (rest is None or rest >= 0)
    if bench_main.peer.available():
        assert throughput["pgqueuer_rows_per_s"] > 0

    wal = {c["kind"]: c for c in by_name["wal"]}
    assert {"baseline", "protocol", "relay", "worker"} <= set(wal)
    for cell in wal.values():
        assert cell["rows"] > 0 and cell["wal_bytes_per_message"] > 0
    # The raw baseline claims and settles: two statements per batch of 100.
    assert wal["baseline"]["statements_per_message"] == pytest.approx(0.02, abs=0.005)
    (drained,) = by_name["drain"]
    assert drained["delivered"] == drained["rows"] and drained["dropped_for_age"] == 0
    assert drained["violations"] == []
    (provider,) = by_name["provider"]
    assert provider["delivered"] == provider["rows"] and 0 < provider["of_bound"] <= 1.05

    # The receipt replaced the fenced read without a statement more per batch.
    (receipt,) = by_name["receipt"]
    assert receipt["rows_per_s"] > 0 and receipt["fenced_read_rows_per_s"] > 0
    assert receipt["statements_per_batch"] == receipt["fenced_read_statements_per_batch"] == 3

    (enqueue,) = by_name["enqueue"]
    assert enqueue["rows_per_s"] > 0 and enqueue["baseline_rows_per_s"] > 0 and enqueue["ratio"] > 0
    fresh, grown = by_name["growth_fresh"][0], by_name["growth_grown"][0]
    assert fresh["p50_ms"] > 0 and grown["p99_ms"] > 0
    vacuumed = by_name["growth_vacuumed"][0]
    assert vacuumed["drain_rows_per_s"] > 0 and by_name["growth"][0]["drain_ratio"] > 0
    (latency,) = by_name["latency"]
    assert latency["delivered"] > 0 and latency["p50_ms"] > 0
    (bulk_door,) = by_name["bulk_door"]
    assert bulk_door["ms_per_call_0020"] > 0 and bulk_door["ms_per_call_head"] > 0
    # Retention: the day dropped leaves no history, the rows deleted leave their table
    retention = {c["layout"]: c for c in by_name["retention"]}
    assert retention["by day"]["pruned"] == retention["by row"]["pruned"] == 2_000
    assert retention["by day"]["history_mb_after"] == 0
    assert {c["handler"] for c in by_name["coldstart"]} >= {"dispatcher", "email", "reaper"}
    assert all(c["import_s"] > 0 for c in by_name["coldstart"])


def test_the_ab_harness_runs_each_variant_from_its_own_tree(
    database_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ab = importlib.import_module("bench.ab")
    monkeypatch.setenv("DATABASE_URL", database_url)
    root = str(Path(__file__).resolve().parents[2])
    variants = [f"relay={root}:relay", f"protocol={root}:protocol"]
    assert ab.main(["--rounds", "1", "--rows", "200", *variants]) == 0
    out = capsys.readouterr().out
    assert "relay " in out and "protocol " in out and "of the first" in out
