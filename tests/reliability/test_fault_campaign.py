"""The fault campaign (campaign.py): nothing lost, duplicates only where a
settle was lost, no stale write, attempts bounded, every kill point hit.

The quick version runs in the default test run; the long one is
``pytest -m slow tests/reliability`` or
``PYTHONPATH=tests .venv/bin/python -m reliability.campaign --iterations 20``.
"""

from __future__ import annotations

import json
from pathlib import Path

import logscan
import pytest

from reliability import campaign


def test_quick_fault_campaign_loses_nothing_and_covers_every_kill_point(
    server_url: str, tmp_path: Path
) -> None:
    reports = campaign.campaign(
        server_url,
        iterations=8,  # stops as soon as every kill point and fault kind was hit (often 2-4)
        seconds=10,
        messages=60,
        seed=20261129,
        log_dir=tmp_path,
        stop_when_covered=True,
    )
    violations = [v for r in reports for v in r.violations]
    assert not violations, violations
    assert not campaign.missing_points(reports), "kill points or faults never hit"
    assert all(r.statuses.get("delivered", 0) > 0 for r in reports)
    assert sum(r.terminated_backends for r in reports) > 0
    assert any(r.duplicates for r in reports) or any(r.kills for r in reports)
    # The relay processes' own structured logs leak nothing either.
    lines = [
        json.loads(line)
        for log in tmp_path.glob("run-*.log")
        for line in log.read_text().splitlines()
        if line.startswith("{")
    ]
    assert lines
    leaks = [(leak, line["message"]) for line in lines for leak in logscan.find_leaks(line)]
    assert not leaks, leaks[:5]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 10 runs of 30 s plus set-up and drains
def test_long_fault_campaign(server_url: str, tmp_path: Path) -> None:
    reports = campaign.campaign(
        server_url, iterations=10, seconds=30, messages=200, log_dir=tmp_path
    )
    violations = [v for r in reports for v in r.violations]
    assert not violations, violations
    assert not campaign.missing_points(reports)


@pytest.mark.parametrize("mode", ["poison", "drip"])
def test_calm_runs_against_poisoned_payloads_and_a_dripping_receiver(
    server_url: str, tmp_path: Path, mode: str
) -> None:
    """Relay processes meet one hostile input and nothing else: rows the driver
    cannot decode (or beyond the payload limits), or a receiver that drips its
    answer. 0 sends for another's claim, 0 good messages dead, the poisoned
    rows failed alone, every process stopped within its grace."""
    report = campaign.one_run(
        server_url,
        0,
        20261201,
        seconds=6,
        messages=48,
        counts={"dispatcher": 1, "sender": 2, "reaper": 1},
        log_dir=tmp_path,
        mode=mode,
    )
    assert report.violations == [], report.violations
    assert report.statuses.get("delivered", 0) == 48
    if mode == "poison":
        assert report.poisoned == 8 and report.statuses.get("failed") == 8
    assert set(report.slowest_stop) == {"dispatcher", "sender", "reaper"}
