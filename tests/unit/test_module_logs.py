"""The relay's modules log through ``logging.getLogger("outbox.<module>")``.
In a deployed stack the Powertools logger is named after the stack
(POWERTOOLS_SERVICE_NAME), not ``outbox``: those records must still come out
as the handler's structured JSON, with their fields and the correlation keys
(a warning's "error" is what an operator reads to fix it)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_a_module_record_is_structured_json_whatever_the_service_name() -> None:
    script = (
        "import logging\n"
        "from outbox import observability\n"
        "observability.logger.append_keys(correlation_id='exec-7')\n"
        "logging.getLogger('outbox.pacing').warning(\n"
        "    'could not move the wake schedule', extra={'error': 'AccessDeniedException'})\n"
    )
    process = subprocess.run(
        [sys.executable, "-c", script],
        env={"POWERTOOLS_SERVICE_NAME": "orders-relay-prod", "PATH": ""},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    lines = [line for line in (process.stdout + process.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, lines  # once, not also through the root logger
    record = json.loads(lines[0])
    assert record["message"] == "could not move the wake schedule"
    assert record["level"] == "WARNING"
    assert record["error"] == "AccessDeniedException"
    assert record["correlation_id"] == "exec-7"
    assert record["service"] == "orders-relay-prod"
