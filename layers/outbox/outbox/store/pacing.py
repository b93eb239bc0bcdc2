"""The dispatcher's next wake-up (docs/how-to/pacing.md): the earliest future
event the relay knows of, read in one statement when a run goes to sleep.

Every part is served by an index that already exists:

* the next pending row to come due (a delay, a backoff retry, a deferral, a
  hand-off given back): ``outbox_message_due`` is ordered by priority first,
  so the statement walks the few distinct priorities (a skip scan, one index
  probe each) and takes the earliest future ``available_at`` of each, instead
  of reading every pending row of a large delayed backlog; a row whose
  destination is paused past that time counts when the pause ends (a
  destination that refuses every call pauses longer than the retry's
  backoff: waking at the backoff's end would claim nothing);
* the next lease to expire: ``outbox_message_lease``, its first entry;
* the next deliver-by time of a pending row with one of its own:
  ``outbox_message_expiry``, its first entry past now;
* whether outcome events wait to be published: ``outbox_outcome_event_due``;
* when a paused destination or channel resumes, or a throttled or limited
  destination's empty bucket gets a token (``outbox_destination``, a few rows),
  if a row of it is due by then (store/rates.py).

Only future times count as wake-ups: a row that is due but not claimable
(paused channel, held ordering key) must not wake the dispatcher in a loop.
A lease that has already expired is "now": the reaping step of the next run
releases it.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import sqlalchemy as sa

from ._sql import statement
from .rates import NEXT_RESUME_SQL

__all__ = [
    "NextWake",
    "next_wake",
]

# The rows of each priority whose destination's pause the next due time
# heeds; a row further on counts at its own time (early, never late).
LOOKAHEAD = 8

_NEXT_WAKE = statement(
    f"""
    WITH RECURSIVE priorities AS (
        (SELECT priority FROM outbox_message WHERE status = 'pending'
         ORDER BY priority DESC LIMIT 1)
        UNION ALL
        SELECT (SELECT m.priority FROM outbox_message AS m
                WHERE m.status = 'pending' AND m.priority < p.priority
                ORDER BY m.priority DESC LIMIT 1)
        FROM priorities AS p WHERE p.priority IS NOT NULL
    )
    SELECT now() AS now,
        (SELECT min(w.at) FROM priorities AS p CROSS JOIN LATERAL (
            -- the first rows of each priority to come due, each at the time
            -- it can be claimed: not before its destination's pause ends (a
            -- retry's backoff ending inside a pause is no wake-up); past the
            -- first {LOOKAHEAD}, a row's own time bounds every later one's
            SELECT CASE WHEN f.n > {LOOKAHEAD} THEN f.available_at
                        ELSE GREATEST(f.available_at,
                            (SELECT d.paused_until FROM outbox_destination AS d
                             WHERE d.channel = f.channel AND d.destination = f.destination))
                   END AS at
            FROM (SELECT m.available_at, m.channel, m.destination,
                         row_number() OVER (ORDER BY m.available_at, m.id) AS n
                  FROM outbox_message AS m
                  WHERE m.status = 'pending' AND m.priority = p.priority
                    AND m.available_at > now()
                  ORDER BY m.priority DESC, m.available_at, m.id
                  LIMIT {LOOKAHEAD + 1}) AS f) AS w
         WHERE p.priority IS NOT NULL) AS next_due,
        (SELECT m.lease_expires_at FROM outbox_message AS m
         WHERE m.status = 'claimed' ORDER BY m.lease_expires_at LIMIT 1) AS next_lease_expiry,
        (SELECT m.expires_at FROM outbox_message AS m
         WHERE m.status = 'pending' AND m.expires_at IS NOT NULL AND m.expires_at > now()
         ORDER BY m.expires_at LIMIT 1) AS next_deadline,
        EXISTS (SELECT 1 FROM outbox_outcome_event AS e
                WHERE e.publish_after <= now()) AS outcome_events_due,
        -- due rows that wait for a destination's or channel's pause to end, or
        -- a token of their destination's bucket (store/rates.py)
        {NEXT_RESUME_SQL} AS next_resume
    """
)


@dataclass(frozen=True)
class NextWake:
    """What a sleeping relay must wake for, on the database's clock."""

    now: dt.datetime
    next_due: dt.datetime | None
    next_lease_expiry: dt.datetime | None
    next_deadline: dt.datetime | None
    outcome_events_due: bool
    # a paused destination or channel resumes, or an empty bucket gets a token
    next_resume: dt.datetime | None = None

    @property
    def earliest(self) -> dt.datetime | None:
        """The earliest of the times (an expired lease counts as now)."""
        times = [
            t
            for t in (self.next_due, self.next_lease_expiry, self.next_deadline, self.next_resume)
            if t is not None
        ]
        return max(min(times), self.now) if times else None


def next_wake(conn: sa.Connection) -> NextWake:
    row = conn.execute(_NEXT_WAKE).one()
    return NextWake(
        now=row.now,
        next_due=row.next_due,
        next_lease_expiry=row.next_lease_expiry,
        next_deadline=row.next_deadline,
        outcome_events_due=bool(row.outcome_events_due),
        next_resume=row.next_resume,
    )
