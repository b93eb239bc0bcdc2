"""Adding a channel touches nothing but the channel: register a class, and the
producer, dispatcher, sender runtime and reaper take it as they are."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import sqlalchemy as sa

import outbox
import support
from outbox import channels, dispatcher, reaper, sender
from outbox.channels import Deadline, Message, Outcome, SchemaChannel
from outbox.handoff import CallableInvoker


class Memo(SchemaChannel):
    """The whole channel: a name, a schema, and send() classifying the answer."""

    name = "memo"
    schema: Mapping[str, Any] = {
        "type": "object",
        "required": ["text"],
        "additionalProperties": False,
        "properties": {"text": {"type": "string", "minLength": 1}},
    }
    board: list[str] = []

    def send(self, message: Message, deadline: Deadline) -> Outcome:
        if message.payload["text"] == "busy":
            return Outcome.retry("board busy")
        self.board.append(message.payload["text"])
        return Outcome.delivered(f"memo-{len(self.board)}")


def test_a_registered_channel_goes_through_dispatcher_and_sender(engine: sa.Engine) -> None:
    channels.register("memo", Memo)
    Memo.board.clear()
    settings = support.settings(max_attempts=1)
    with engine.begin() as conn:
        ok = outbox.enqueue(conn, "memo", {"text": "hello"})
        busy = outbox.enqueue(conn, "memo", {"text": "busy"})
        with pytest.raises(outbox.ValidationError) as caught:
            outbox.enqueue(conn, "memo", {"text": ""})
    assert caught.value.field == "payload.text"

    def memo_function(event: dict[str, Any]) -> None:  # what functions/memo/app.py would do
        sender.run(engine, event, settings, lambda: 30.0, channel_name="memo")

    report = dispatcher.run(
        engine, CallableInvoker({"memo": memo_function}), settings, lambda: 1.0, until_empty=True
    )
    assert report.claimed == 2 and report.handed_off == 2
    assert Memo.board == ["hello"]
    with engine.connect() as conn:
        delivered, dead = support.row(conn, ok), support.row(conn, busy)
    assert (delivered.status, delivered.provider_message_id) == ("delivered", "memo-1")
    assert (dead.status, dead.last_error) == ("dead", "board busy")
    assert "memo" in channels.names()
    assert reaper.run(engine, settings, lambda: 1.0) is not None  # the reaper needs nothing new
