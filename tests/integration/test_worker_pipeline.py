"""`outbox worker` claims its next batch once every row of the last one has
started, so the send threads the last calls leave idle take the next batch's
rows (docs/design.md, invariant 10): a throttle or quota one batch hears
blocks the calls of the batch claimed beside it that have not started, and
its settle (which writes the pause) comes first."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import sqlalchemy as sa

from outbox import sender, store
from outbox.channels import CHANNEL, Deadline, Message, Outcome
from outbox.worker import Worker
from support import ScriptedChannel, enqueue, install_channel, settings

# A bound on each wait, never a timing: every wait ends as soon as its event
# is set, and the verdict is what was set, not how long anything took.
BOUND = 30.0


def statuses(engine: sa.Engine, ids: list[int]) -> dict[int, tuple[str, int, str | None]]:
    """id -> (status, attempts, last_error)."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT id, status, attempts, last_error FROM outbox_message WHERE id = ANY(:ids)"
            ),
            {"ids": ids},
        ).all()
    return {r.id: (r.status, r.attempts, r.last_error) for r in rows}


class HeldChannel(ScriptedChannel):
    """Rows 0 and 1 are the first batch (batch size 2), 2 and 3 the second.
    The first batch's second call is held until a call of the second batch
    has started; it then answers ``held_answer``. Calls of the second batch
    wait until the first batch has taken note of that answer."""

    def __init__(self, held_answer: Outcome) -> None:
        super().__init__()
        self.ids: list[int] = []
        self.held_answer = held_answer
        self.second_batch_started = threading.Event()
        self.noted = threading.Event()
        self.called: list[int] = []
        self._lock = threading.Lock()

    def send(self, message: Message, deadline: Deadline) -> Outcome:
        with self._lock:
            self.called.append(message.id)
        if message.id == self.ids[1]:
            self.second_batch_started.wait(BOUND)
            return self.held_answer
        if message.id in self.ids[2:]:
            self.second_batch_started.set()
            if self.held_answer.pause is not None:
                self.noted.wait(BOUND)
        return super().send(message, deadline)


def noting(monkeypatch: pytest.MonkeyPatch, channel: HeldChannel) -> None:
    note = sender.Limits.note

    def note_then_tell(self: Any, row: Any, outcome: Outcome) -> None:
        note(self, row, outcome)
        if outcome.pause is not None:
            channel.noted.set()

    monkeypatch.setattr(sender.Limits, "note", note_then_tell)


def test_the_next_batch_starts_while_the_last_calls_of_a_batch_run(engine: sa.Engine) -> None:
    channel = install_channel(HeldChannel(Outcome.delivered()))
    ids = channel.ids = enqueue(engine, 4, "scripted")
    worker = Worker(engine, settings(batch_size=2, send_concurrency=2), reap_interval_seconds=3600)
    worker.run(until_empty=True)
    # The held call was let go by a call of the second batch, not by its bound:
    # a worker that claimed only after the first batch ended would have held it
    # for the whole bound.
    assert channel.second_batch_started.is_set()
    assert {statuses(engine, ids)[i] for i in ids} == {("delivered", 1, None)}
    assert worker.report.batches == 3  # two of two rows, then an empty claim


@pytest.mark.parametrize(
    ("answer", "not_started"),
    [
        (Outcome.throttled("HTTP 429", 60), sender.DESTINATION_THROTTLED),
        (Outcome.quota("daily quota exceeded", 3600), sender.CHANNEL_QUOTA),
    ],
    ids=["throttle", "quota"],
)
def test_what_one_batch_hears_blocks_the_next_batchs_calls_not_started(
    engine: sa.Engine, monkeypatch: pytest.MonkeyPatch, answer: Outcome, not_started: str
) -> None:
    channel = install_channel(HeldChannel(answer))
    ids = channel.ids = enqueue(engine, 4, "scripted")
    noting(monkeypatch, channel)
    worker = Worker(engine, settings(batch_size=2, send_concurrency=2), reap_interval_seconds=3600)
    worker.run(until_empty=True)
    assert channel.second_batch_started.is_set()
    # Row 2's call was under way when the first batch heard the answer; row 3
    # of the second batch had not started, and never was.
    assert sorted(channel.called) == ids[:3]
    after = statuses(engine, ids)
    assert after[ids[0]] == after[ids[2]] == ("delivered", 1, None)
    assert after[ids[1]] == ("pending", 0, answer.error)
    assert after[ids[3]] == ("pending", 0, not_started)
    with engine.connect() as conn:
        if answer.pause == CHANNEL:
            [paused] = store.paused_channels(conn)
            assert paused.channel == "scripted"
        else:
            [destination] = [d for d in store.destination_figures(conn) if d.channel == "scripted"]
            assert destination.paused_until is not None
            assert destination.throttled_total == 1  # written once, by the batch that heard it
