"""A channel's error text (a custom channel's, a remote server's) is scrubbed
and bounded at settle time: never stored whole, logged whole or published
with a phone number, a one-time code or an address in it (issue 23, finding 6)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import pytest
import sqlalchemy as sa
from channel_support import deliver, settled

from outbox.channels import Deadline, Message, Outcome, SchemaChannel

REASON = (
    "gateway refused: code 482913 for +1 (415) 555-2671, owner ada.lovelace@example.net; "
    + "x" * 10_000
)


class Chatty(SchemaChannel):
    """A custom channel that returns its gateway's whole answer as the reason."""

    name = "chatty"
    schema: Mapping[str, Any] = {"type": "object"}

    def send(self, message: Message, deadline: Deadline) -> Outcome:
        return Outcome.failed(REASON)


def test_a_custom_channels_long_reason_is_scrubbed_and_bounded(
    engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    message_id, report = deliver(engine, "chatty", {"n": 1}, channel=Chatty())
    row, history = settled(engine, message_id)
    assert report.statuses == {"failed": 1} and row.status == "failed"
    stored = [row.last_error, history[-1].error]
    for text in stored:
        assert text.startswith("gateway refused: code <number> for <number>, owner <address>;")
        assert len(text) <= 200
    logged = "\n".join(str(r.__dict__) for r in caplog.records)
    assert "482913" not in logged and "555-2671" not in logged and "ada.lovelace" not in logged
    assert "x" * 300 not in logged
