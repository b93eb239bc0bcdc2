"""A hot function leaves what its cold start made out of every garbage collection."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = (
    "import gc; before = gc.get_freeze_count(); import app; "
    "print(before, gc.get_freeze_count(), len(gc.get_objects(generation=2)))"
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
    before, after, oldest = map(int, out)
    assert before == 0
    # the imported modules and the settings: tens of thousands of objects
    assert after > 10_000
    assert oldest < after / 10  # the full collections no longer walk them
