"""A hot function leaves what its cold start made out of every garbage collection,
and its batches' rows to their reference counts."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from outbox import runtime
from support import ScriptedChannel, claim, enqueue, install_channel, send

ROOT = Path(__file__).resolve().parents[2]
PROBE = (
    "import gc; before = gc.get_freeze_count(); import app; "
    "print(before, gc.get_freeze_count(), len(gc.get_objects(generation=2)), "
    "gc.get_threshold()[0])"
)


@pytest.mark.parametrize("function", ["dispatcher", "email", "webhook"])
def test_the_cold_start_of_a_hot_function_is_frozen(
    function: str, relay_env: dict[str, str]
) -> None:
    env = {
        **os.environ,
        **relay_env,
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "functions" / function), str(ROOT / "layers/outbox")]
        ),
        "AWS_DEFAULT_REGION": "us-east-1",
        "POWERTOOLS_METRICS_NAMESPACE": "Outbox",
    }
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    before, after, oldest, young_threshold = map(int, out)
    assert before == 0
    assert young_threshold == runtime.YOUNG_GENERATION_THRESHOLD
    # the imported modules and the settings: tens of thousands of objects
    assert after > 10_000
    assert oldest < after / 10  # the full collections no longer walk them


def test_a_batch_of_a_thousand_leaves_the_collector_idle(engine: sa.Engine) -> None:
    """After the cold start, a hand-off of 1,000 messages is received, sent and
    settled without one garbage collection: its rows are freed by their
    reference counts when it ends. At CPython's default threshold (700) the
    same batch set off a dozen collections, which moved its live rows into
    older generations for the larger collections to walk again."""
    install_channel(ScriptedChannel())
    enqueue(engine, 1000, "scripted")
    claims = claim(engine, 1000)
    assert len(claims) == 1000
    runtime.cold_start_done()
    generations: list[int] = []

    def started(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            generations.append(info["generation"])

    gc.callbacks.append(started)
    try:
        report = send(engine, claims, send_concurrency=8)
    finally:
        gc.callbacks.remove(started)
    assert report.statuses == {"delivered": 1000}
    assert generations == []
