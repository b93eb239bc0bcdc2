"""The rate-limit bench cells run end to end at tiny sizes (bench/ratelimit.py):
both ways of sending (the worker loop, the Lambda simulator), both providers
(the webhook receiver, the SES stub), a configured limit, the quota cell.
Counts only, never speed."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
ratelimit = importlib.import_module("bench.ratelimit")
common = importlib.import_module("bench.common")


@pytest.fixture(scope="module")
def databases(database_url: str) -> Iterator[object]:
    dbs = common.Databases(common.pg8000_url(database_url))
    try:
        dbs.prepare_template()
        yield dbs
    finally:
        dbs.close()


@pytest.mark.parametrize(
    ("path", "provider", "limit"),
    [("lambda", "ses", None), ("lambda", "webhook", 100.0), ("worker", "ses", 100.0)],
)
def test_a_cell_delivers_everything_and_counts_no_attempt(
    databases: common.Databases, path: str, provider: str, limit: float | None
) -> None:
    with databases.fresh(f"rl_{path}_{provider}") as url:
        cell = ratelimit.run(
            url, 30, 1000.0, provider=provider, path=path, limit=limit, concurrency=2, trace=True
        )
    assert (cell["delivered"], cell["dead"], cell["left"]) == (30, 0, 0)
    assert cell["delivered_by_attempts"] == {1: 30}
    assert cell["attempts_counted_for_throttling"] == 0
    assert cell["admitted_per_second"] and sum(cell["admitted_per_second"]) == 30


def test_a_throttling_provider_is_learned_without_an_attempt(
    databases: common.Databases,
) -> None:
    # 40 rows at once to a provider that admits 20 (its bucket: one second's worth)
    with databases.fresh("rl_throttled") as url:
        cell = ratelimit.run(url, 40, 20.0, provider="ses", path="lambda", concurrency=2)
    assert (cell["delivered"], cell["dead"], cell["left"]) == (40, 0, 0)
    assert cell["refused_calls"] >= 1 and cell["learned_rate_per_s"] is not None
    assert cell["attempts_counted_for_throttling"] == 0
    assert cell["delivered_by_attempts"] == {1: 40}


def test_two_receivers_in_one_run(databases: common.Databases) -> None:
    with databases.fresh("rl_two") as url:
        cell = ratelimit.run(url, 10, 1000.0, other_rows=20, other_latency=0.001)
    assert (cell["delivered"], cell["left"]) == (30, 0)
    assert cell["other_rows"] == 20 and cell["other_rows_per_s"] > 0
    assert cell["bare_client_rows_per_s"] > 0 and cell["other_of_bare_client"] > 0


@pytest.mark.parametrize("path", ["lambda", "worker"])
def test_the_quota_cell_pauses_then_delivers_after_the_resume(
    databases: common.Databases, path: str
) -> None:
    with databases.fresh(f"rl_quota_{path}") as url:
        cell = ratelimit.run_quota(url, 30, 5, path=path, concurrency=2, settle_seconds=0.5)
    assert cell["paused"] and cell["drained_after_resume"]
    assert (cell["delivered"], cell["dead"]) == (30, 0)
    assert cell["refused_for_quota"] >= 1
    # no attempt was counted while paused: one attempt each, the delivered one
    assert cell["delivered_by_attempts"] == {1: 30}
    assert cell["attempts_counted_for_throttling"] == 0
