"""A pytest plugin: every log record the ``outbox`` loggers emit during the
whole session is kept, formatted the way Powertools writes it to stdout, and
scanned at the end. The session fails if any record carries a payload body,
an email address, a phone number, a claim token (any UUID outside the
correlation keys), or a secret value (invariant 8).

Registered from tests/conftest.py (``pytest_plugins = ["logscan"]``).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable
from typing import Any

import pytest

# Bodies of the payloads the tests enqueue (support.EMAIL and friends).
PAYLOAD_SENTINELS = ("Your order shipped", "It is on its way.")
# Correlation keys that legitimately hold UUIDs (Lambda request id, X-Ray, Scheduler;
# the dispatcher and reaper take the Scheduler's execution id as correlation_id).
UUID_ALLOWED_KEYS = {
    "function_request_id",
    "xray_trace_id",
    "schedule_execution_id",
    "correlation_id",
    "function_arn",
}
# Attribute names that must never appear on a record: their values are payload or secret.
FORBIDDEN_KEYS = {
    "payload",
    "body",
    "subject",
    "text",
    "html",
    "password",
    "secret",
    "claim_token",
    "claim_tokens",
    "token",
    "tokens",
}

EMAIL_RE = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}")
PHONE_RE = re.compile(r"(?<![\w.])\+[1-9]\d{7,14}\b")
UUID_RE = re.compile(
    r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"
)
SECRET_RES = (
    re.compile(r"AKIA[0-9A-Z]{16}"),
    re.compile(r"://[^/\s:@]+:[^/\s@]+@"),  # a URL with a password in it
    re.compile(r"(?i)\b(password|passwd|secret)\s*[=:]\s*\S+"),
)

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


def secret_values(env: dict[str, str] | None = None) -> list[str]:
    env = dict(os.environ) if env is None else env
    return [
        v for k, v in env.items() if re.search(r"SECRET|PASSWORD|TOKEN|PRIVATE", k) and len(v) >= 6
    ]


def find_leaks(fields: dict[str, Any], secrets: Iterable[str] = ()) -> list[str]:
    """What in one formatted record must not be logged."""
    found = [f"key {k!r}" for k in fields if k.lower() in FORBIDDEN_KEYS]
    scanned = {k: v for k, v in fields.items() if k not in UUID_ALLOWED_KEYS}
    unescaped = json.dumps(scanned, default=str, ensure_ascii=False)
    for sentinel in PAYLOAD_SENTINELS:
        if sentinel in unescaped:
            found.append(f"payload body {sentinel!r}")
    if m := EMAIL_RE.search(unescaped):
        found.append(f"email address {m.group(0)!r}")
    if m := PHONE_RE.search(unescaped):
        found.append(f"phone number {m.group(0)!r}")
    if m := UUID_RE.search(unescaped):
        found.append(f"UUID (claim token?) {m.group(0)!r}")
    for pattern in SECRET_RES:
        if m := pattern.search(unescaped):
            found.append(f"secret-looking {m.group(0)[:12]!r}...")
    for value in secrets:
        if value in unescaped:
            found.append("a secret environment value")
    return found


def record_fields(record: logging.LogRecord, formatter: logging.Formatter | None) -> dict[str, Any]:
    """The record as Powertools would print it (falling back to its attributes)."""
    if formatter is not None:
        try:
            data = json.loads(formatter.format(record))
            if isinstance(data, dict):
                return data
        except Exception:  # noqa: S110 - fall back to the raw attributes
            pass
    fields = {k: v for k, v in vars(record).items() if k not in _STANDARD}
    fields["message"] = record.getMessage()
    if record.exc_info:
        fields["exception"] = logging.Formatter().formatException(record.exc_info)
    return fields


class Collector(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[dict[str, Any]] = []
        self.formatter_: logging.Formatter | None = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.records.append(record_fields(record, self.formatter_))
        except Exception:  # never break the code under test
            self.records.append({"message": "<unformattable record>", "logger": record.name})


_collector = Collector()


def pytest_configure(config: pytest.Config) -> None:
    from outbox.observability import logger

    _collector.formatter_ = logger.registered_formatter  # type: ignore[assignment]
    logging.getLogger("outbox").addHandler(_collector)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    secrets = secret_values()
    leaks = []
    for fields in _collector.records:
        problems = find_leaks(fields, secrets)
        if problems:
            leaks.append((problems, fields.get("message"), fields.get("location")))
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    write = reporter.write_line if reporter is not None else print
    write(f"logscan: {len(_collector.records)} outbox log records scanned, {len(leaks)} leaking")
    for problems, message, location in leaks[:20]:
        write(f"logscan LEAK: {problems} in {message!r} at {location}")
    if leaks:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def collected() -> list[dict[str, Any]]:
    """The records kept so far (for the plugin's own test)."""
    return _collector.records
