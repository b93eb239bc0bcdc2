"""The worker's idle wait: the poll interval, or a paused destination's
resume when that comes first (then forgotten, so the loop polls as before)."""

from __future__ import annotations

import pytest

from outbox.worker import idle_wait


@pytest.mark.parametrize(
    ("resumes_at", "expected"),
    [
        (None, (0.2, None)),  # nothing paused: the poll interval
        (100.05, (pytest.approx(0.05), None)),  # a resume sooner: wait for it, then forget it
        (99.0, (0.0, None)),  # a resume already past: claim at once
        (105.0, (0.2, 105.0)),  # a resume later: poll, and keep it for the next wait
    ],
)
def test_an_idle_worker_waits_for_the_poll_or_a_sooner_resume(
    resumes_at: float | None, expected: tuple[object, float | None]
) -> None:
    assert idle_wait(0.2, resumes_at, now=100.0) == expected
