"""The retry policy, in Python and in the SQL that applies it.

Settle and reap decide a row's next state in the database (all times come
from its clock, invariant 3); Python gives them only the policy's numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .. import settings
from ..states import AttemptOutcome

__all__ = [
    "Backoff",
    "bounded_delay",
]


@dataclass(frozen=True)
class Backoff:
    """The retry policy. Exponential backoff with equal jitter: base * 2^(n-1),
    capped, then * [0.5, 1); ``default_max_attempts`` for rows without their own.

    ``max_deferrals``: deferrals a row may take without counting an attempt;
    later ones count one and wait at least the backoff. ``min_deferral_seconds``:
    the shortest deferral (a receiver answering "retry after 0 s" must not
    loop a row).
    ``default_ttl_seconds``: the deliver-by time of a row without its own,
    counted from when it is first due; None: no default.
    """

    base_seconds: float
    cap_seconds: float
    default_max_attempts: int
    max_deferrals: int = settings.MAX_DEFERRALS.default
    min_deferral_seconds: float = settings.MIN_DEFERRAL_SECONDS.default
    default_ttl_seconds: float | None = None

    def params(self) -> dict[str, Any]:
        """The parameters of BACKOFF_SQL and EXHAUSTED_SQL."""
        return {
            "backoff_base": self.base_seconds,
            "backoff_cap": self.cap_seconds,
            "default_max": self.default_max_attempts,
        }

    def ttl_param(self) -> float | None:
        """The parameter of DEADLINE_SQL (``:default_ttl``)."""
        return None if self.default_ttl_seconds is None else float(self.default_ttl_seconds)


# The longest a channel may defer a row by; longer asks are cut to this.
MAX_DEFERRAL_SECONDS = 24 * 3600.0

# The backoff before attempt ``attempts + 2`` for a row that has failed
# ``attempts + 1`` times. The exponent is clamped so power() cannot overflow.
# Both count from the last redrive: a redriven message gets a fresh set of
# attempts (and backoff) while its attempt numbers carry on.
BACKOFF_SQL = (
    "LEAST(CAST(:backoff_cap AS float8), CAST(:backoff_base AS float8) "
    "* power(2.0, LEAST(m.attempts - m.attempts_at_redrive, 40))) * (0.5 + random() / 2)"
)
EXHAUSTED_SQL = "m.attempts - m.attempts_at_redrive + 1 >= COALESCE(m.max_attempts, :default_max)"
# A row's deliver-by time: its own, or the relay's default counted from when
# it is first due (the claim writes that down, so it does not move with retries).
DEADLINE_SQL = (
    "COALESCE(m.expires_at, m.available_at + make_interval(secs => CAST(:default_ttl AS float8)))"
)
# How the last_error of a row that ended expired begins.
EXPIRED_PREFIX = "deliver-by time passed"


def bounded_delay(outcome: str, delay: Any, backoff: Backoff) -> float | None:
    """A channel's delay made safe to write, so one bad answer cannot break the
    batch's settle statement (a NaN or an infinity is no JSON number) or park a
    row for ever. A deferral is held to [min_deferral_seconds, 24 h]; a retry
    delay to [0, the backoff cap]. A delay that is no number (NaN, text, a
    bool) is ignored: the deferral floor, or the normal backoff. Other
    outcomes carry no delay."""
    if outcome not in (AttemptOutcome.DEFERRED, AttemptOutcome.RETRY):
        return None
    seconds: float | None
    if isinstance(delay, bool) or not isinstance(delay, int | float):
        seconds = None
    else:
        try:
            seconds = float(delay)
        except OverflowError:  # an int beyond float range
            seconds = math.inf if delay > 0 else -math.inf
        if math.isnan(seconds):
            seconds = None
    if outcome == AttemptOutcome.RETRY:
        return None if seconds is None else min(max(seconds, 0.0), backoff.cap_seconds)
    floor = backoff.min_deferral_seconds
    return min(max(seconds if seconds is not None else floor, floor), MAX_DEFERRAL_SECONDS)
