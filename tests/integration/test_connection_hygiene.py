"""Nothing the relay sends pins an RDS Proxy connection: no session SET, no
LISTEN, no session advisory lock, no prepared statement kept across transactions."""

from __future__ import annotations

import re
from typing import Any

import pg8000.legacy
import pytest
import sqlalchemy as sa

import outbox
from outbox import dispatcher, reaper, sender
from outbox.channels.email import EmailChannel
from outbox.config import DatabaseSettings
from outbox.db import create_engine
from outbox.handoff import CallableInvoker
from support import EMAIL, LambdaContext, ScriptedChannel, install_channel, settings

PINNING = re.compile(
    r"^\s*(SET\s|RESET|LISTEN|PREPARE|DECLARE|SELECT\s+pg_advisory_lock)", re.IGNORECASE
)


def test_a_full_cycle_sends_no_pinning_statement(
    engine: sa.Engine, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[str] = []
    real_execute = pg8000.legacy.Cursor.execute

    def recording_execute(self: Any, operation: str, *args: Any, **kwargs: Any) -> Any:
        sent.append(operation)
        return real_execute(self, operation, *args, **kwargs)

    monkeypatch.setattr(pg8000.legacy.Cursor, "execute", recording_execute)

    class FakeEmail(ScriptedChannel):
        schema = EmailChannel.schema

    install_channel(FakeEmail(name="email"))
    relay = create_engine(DatabaseSettings(url=database_url, sslmode="disable"))  # a fresh pool
    with relay.begin() as conn:
        outbox.enqueue_many(conn, [{"channel": "email", "payload": EMAIL}] * 5)

    def send(event: dict[str, Any]) -> None:
        ctx = LambdaContext()
        sender.run(relay, event, settings(), lambda: ctx.get_remaining_time_in_millis() / 1000)

    dispatcher.run(
        relay, CallableInvoker({"email": send}), settings(), lambda: 1.0, until_empty=True
    )
    reaper.run(relay, settings(), lambda: 10.0)
    relay.dispose()
    assert len(sent) > 5
    assert [s for s in sent if PINNING.match(s)] == []
