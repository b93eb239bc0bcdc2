"""The session-wide log scan (tests/logscan.py) is wired in and can fail."""

from __future__ import annotations

import logging
import uuid

import logscan
import pytest


def test_outbox_records_are_collected_in_powertools_format() -> None:
    before = len(logscan.collected())
    logging.getLogger("outbox.selftest").warning("scan me", extra={"message_ids": [1, 2]})
    records = logscan.collected()[before:]
    assert [r["message"] for r in records] == ["scan me"]
    assert records[0]["message_ids"] == [1, 2] and records[0]["service"] == "outbox"


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"message": "settled", "error": "bounced: ada@example.net"}, "email address"),
        ({"message": "sms", "to": "+447700900123"}, "phone number"),
        ({"message": "lost", "detail": str(uuid.uuid4())}, "UUID"),
        ({"message": "x", "claim_token": "abc"}, "key 'claim_token'"),
        ({"message": "x", "payload": {"n": 1}}, "key 'payload'"),
        ({"message": "sent: Your order shipped"}, "payload body"),
        ({"message": "connect postgresql://relay:hunter22@db/app"}, "secret-looking"),
        ({"message": "key AKIAABCDEFGHIJKLMNOP"}, "secret-looking"),
        ({"message": "value s3cr3t-value"}, "a secret environment value"),
    ],
)
def test_scanner_flags_each_kind_of_leak(fields: dict[str, object], problem: str) -> None:
    leaks = logscan.find_leaks(fields, secrets=["s3cr3t-value"])
    assert any(problem in leak for leak in leaks), leaks


def test_scanner_passes_ids_counts_and_correlation_keys() -> None:
    clean = {
        "message": "settled",
        "message_id": 42,
        "message_ids": [1, 2, 3],
        "channel": "email",
        "outcome": "retry",
        "error": "ses: TooManyRequestsException",
        "duration_ms": 12,
        "timestamp": "2026-11-29 12:00:00,123+0000",
        "function_request_id": str(uuid.uuid4()),
        "schedule_execution_id": str(uuid.uuid4()),
        "location": "run:143",
    }
    assert logscan.find_leaks(clean, secrets=["s3cr3t-value"]) == []
