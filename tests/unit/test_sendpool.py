"""The send threads under the sender (``outbox.sendpool``)."""

from __future__ import annotations

import time

from outbox import sendpool


def test_tasks_added_after_a_batch_ended_never_start() -> None:
    ran: list[int] = []
    threads = sendpool.SendThreads(2, "countdown")
    countdown = threads.start(lambda: ran.append(1), 1)
    assert countdown.wait(5)
    threads.add(countdown, lambda: ran.append(2), 1)
    assert countdown.wait(0)
    time.sleep(0.05)  # a task wrongly queued would have run by now
    assert ran == [1]
    threads.retire()
