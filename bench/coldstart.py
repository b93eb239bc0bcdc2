"""Cold start: wall time to import each handler module in a fresh interpreter.

Each ``functions/<role>/app.py`` is imported by a new ``python`` process with
the environment a deployed function has (so ``Runtime()`` passes its checks at
import), timed inside that process from just before the import to just after.
The interpreter's own start-up is reported apart.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from . import common

ROOT = Path(__file__).resolve().parent.parent
FUNCTIONS = ROOT / "functions"

_PROBE = """
import importlib.util, json, sys, time
path = sys.argv[1]
started = time.perf_counter()
spec = importlib.util.spec_from_file_location("app", path)
module = importlib.util.module_from_spec(spec)
sys.modules["app"] = module
spec.loader.exec_module(module)
elapsed = time.perf_counter() - started
print(json.dumps({"import_s": elapsed, "modules": len(sys.modules)}))
"""


def handler_env(database_url: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "DATABASE_URL": database_url,
            "CHANNEL_FUNCTIONS": '{"email": "outbox-email"}',
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_REGION": "us-east-1",
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "POWERTOOLS_SERVICE_NAME": "outbox",
            "POWERTOOLS_METRICS_NAMESPACE": "OutboxRelay",
            "PYTHONDONTWRITEBYTECODE": "0",
        }
    )
    return env


def handlers() -> list[Path]:
    return sorted(FUNCTIONS.glob("*/app.py"))


def measure(database_url: str, repeats: int = 3) -> list[dict[str, Any]]:
    """Median import time per handler over ``repeats`` fresh interpreters (after one warm-up
    run, so .pyc files exist as they do in a deployed package)."""
    env = handler_env(database_url)
    results = []
    for path in handlers():
        runs = []
        for i in range(repeats + 1):
            done = subprocess.run(
                [sys.executable, "-c", _PROBE, str(path)],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            if done.returncode != 0:
                raise RuntimeError(f"importing {path} failed:\n{done.stderr[-2000:]}")
            if i > 0:
                runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        results.append(
            {
                "handler": path.parent.name,
                "import_s": common.median([r["import_s"] for r in runs]),
                "min_import_s": min(r["import_s"] for r in runs),
                "modules": runs[-1]["modules"],
            }
        )
    return results


def interpreter_start_s(repeats: int = 3) -> float:
    import time

    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        times.append(time.perf_counter() - started)
    return common.median(times)
