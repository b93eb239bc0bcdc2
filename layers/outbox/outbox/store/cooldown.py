"""Cooldown per key (docs/design.md, invariant 11): at most one message per
(channel, cooldown_key) of a tenant delivered within a window, decided in the database.

A message enqueued with a cooldown carries ``cooldown_key``, ``cooldown``
(its window) and ``on_cooldown`` (``wait`` or ``suppress``).
``outbox_cooldown`` holds, per (channel, cooldown_key), the message that took
the cooldown and the end of its window (``until``; NULL while that message is
not delivered yet).

* **The claim** takes the cooldown in its own statement: the first due row of
  each key in the batch upserts the key's row, so concurrent claimers
  serialise on it (the upsert locks it; keys in order, so two claimers cannot
  deadlock). The row passes when the key is free: no row, its own row (a
  retry of the holder), a window that has ended, or a holder that ended
  without being delivered (failed, dead, expired, suppressed, cancelled).
  Every other row of the key in the batch does not pass: inside a delivered
  holder's window it waits until the window ends (``available_at``) or ends
  ``suppressed``, as its producer chose; behind a holder not delivered yet it
  looks again after the shorter of its window and the lease (the holder may
  still fail, then it goes). Either way it leaves the due index, so no claim
  reads it again before then, and a sleeping relay wakes for it (a pending
  row coming due, ``store/pacing.py``).
* **The settle** of a delivered holder opens its window: ``until = now() +
  cooldown``, in the settle's statement.
* **The reaper** removes the rows whose window ended and those whose holder
  ended undelivered (``prune_cooldowns``).

Rows without a cooldown key pay nothing but a NULL test.
"""

from __future__ import annotations

import sqlalchemy as sa

from ._sql import statement
from .policy import DEADLINE_SQL

__all__ = ["prune_cooldowns"]

# Whether the key's row is free for the contender (EXCLUDED) on conflict: its
# own; a window that has ended; or a holder not delivered that is neither
# pending nor claimed (or pruned). That last test reads the holder in this
# statement's snapshot, which may predate a holder that another claimer took
# the key for meanwhile (a message committed since): so a key taken after this
# statement's transaction began (``taken_at``, the clock at that upsert) is
# held, whatever the snapshot says.
_IN_FLIGHT = """EXISTS (SELECT 1 FROM outbox_message AS h
                           WHERE h.id = c.message_id AND h.status IN ('pending', 'claimed'))"""
_FREE = f"""c.message_id = EXCLUDED.message_id OR c.until <= now()
                      OR (c.until IS NULL AND c.taken_at < now() AND NOT {_IN_FLIGHT})"""

# Two CTEs of the claim (store/delivery.py), after ``due``: ``cooldown``
# takes or reads each key's row, ``cooled`` moves the rows that do not pass.
CLAIM_GATE = f"""
    -- Cooldown per key (store/cooldown.py): the first due row of each key in
    -- the batch takes the key's row, or reads who holds it.
    cooldown AS (
        INSERT INTO outbox_cooldown AS c (channel, cooldown_key, tenant, message_id)
        SELECT DISTINCT ON (d.channel, d.cooldown_key, d.tenant)
               d.channel, d.cooldown_key, d.tenant, d.id
        FROM due AS d WHERE d.cooldown_key IS NOT NULL
        ORDER BY d.channel, d.cooldown_key, d.tenant, d.priority DESC, d.available_at, d.id
        ON CONFLICT (channel, cooldown_key, tenant) DO UPDATE SET
            (message_id, until, taken_at) = (
                SELECT CASE WHEN f.free THEN EXCLUDED.message_id ELSE c.message_id END,
                       CASE WHEN f.free THEN NULL ELSE c.until END,
                       CASE WHEN f.free THEN clock_timestamp() ELSE c.taken_at END
                FROM (SELECT {_FREE}) AS f(free))
        RETURNING c.channel, c.cooldown_key, c.tenant, c.message_id, c.until
    ),
    cooled AS (
        -- The rows of a key held by another message: inside a delivered
        -- holder's window, wait for its end or end suppressed; behind a holder
        -- not delivered yet, look again later. The deliver-by time is written
        -- down first, as the claim does, so that waiting does not move it.
        UPDATE outbox_message AS m
        SET status = CASE WHEN c.until > now() AND m.on_cooldown = 'suppress'
                          THEN 'suppressed' ELSE 'pending' END,
            available_at = CASE
                WHEN c.until > now() AND m.on_cooldown = 'suppress' THEN m.available_at
                WHEN c.until > now() THEN c.until
                ELSE now() + LEAST(m.cooldown, make_interval(secs => :lease_seconds)) END,
            expires_at = {DEADLINE_SQL},
            settled_at = CASE WHEN c.until > now() AND m.on_cooldown = 'suppress'
                              THEN now() END,
            last_error = CASE WHEN c.until > now() AND m.on_cooldown = 'suppress'
                              THEN 'cooldown: message ' || c.message_id
                                   || ' of this key was delivered within the window'
                              ELSE m.last_error END
        FROM due JOIN cooldown AS c
          ON c.channel = due.channel AND c.cooldown_key = due.cooldown_key
         AND c.tenant = due.tenant
        WHERE m.id = due.id AND due.id <> c.message_id
          AND m.status IN ('pending', 'claimed') AND (m.status = 'pending') IS TRUE
        RETURNING m.id, m.status, m.attempts, m.last_error, m.channel, m.recipient_fingerprints,
                  m.tenant
    ),
    suppressed_log AS (
        -- A suppressed message ends without a call, but in the send log all the
        -- same, with its recipients: "did X get it?" shows it, suppressed.
        INSERT INTO outbox_attempt
            (message_id, attempt, outcome, error, claimed_at, channel, recipient_fingerprints,
             tenant)
        SELECT s.id, s.attempts, 'suppressed', s.last_error, now(), s.channel,
               s.recipient_fingerprints, s.tenant
        FROM cooled AS s WHERE s.status = 'suppressed'
    ),
"""
# The claim's condition on ``due``: a row without a key, or the key's holder.
CLAIM_PASSES = "(due.cooldown_key IS NULL OR due.id IN (SELECT message_id FROM cooldown))"

# Two CTEs of the settle (store/delivery.py), after ``settled``: a delivered
# holder opens its window. The rows are locked in key order, as the claim
# takes them, so that a settle and a claim cannot deadlock on two keys.
SETTLE_WINDOW = """
    cooldown_held AS (
        SELECT c.channel, c.cooldown_key, c.tenant, s.cooldown
        FROM settled AS s
        JOIN outbox_cooldown AS c ON c.channel = s.channel
             AND c.cooldown_key = s.cooldown_key AND c.tenant = s.tenant AND c.message_id = s.id
        WHERE s.status = 'delivered' AND s.cooldown_key IS NOT NULL
        ORDER BY c.channel, c.cooldown_key, c.tenant
        FOR UPDATE OF c
    ),
    window_opened AS (
        UPDATE outbox_cooldown AS c SET until = now() + h.cooldown
        FROM cooldown_held AS h
        WHERE c.channel = h.channel AND c.cooldown_key = h.cooldown_key AND c.tenant = h.tenant
    ),
"""

_PRUNE_COOLDOWNS = statement(
    f"""
    WITH ended AS (
        SELECT channel, cooldown_key, tenant FROM outbox_cooldown
        WHERE until < now()
        ORDER BY until
        LIMIT :batch_size
        FOR UPDATE SKIP LOCKED
    ),
    released AS (
        -- a holder that ended undelivered holds nothing (pruned: nothing
        -- either); one taken since this statement began may not be visible yet
        SELECT c.channel, c.cooldown_key, c.tenant FROM outbox_cooldown AS c
        WHERE c.until IS NULL AND c.taken_at < now() AND NOT {_IN_FLIGHT}
        LIMIT :batch_size
        FOR UPDATE OF c SKIP LOCKED
    )
    DELETE FROM outbox_cooldown AS c
    USING (SELECT * FROM ended UNION ALL SELECT * FROM released) AS doomed
    WHERE (c.channel, c.cooldown_key, c.tenant)
        = (doomed.channel, doomed.cooldown_key, doomed.tenant)
    """
)


def prune_cooldowns(conn: sa.Connection, batch_size: int) -> int:
    """Remove up to twice ``batch_size`` cooldown rows that hold nothing any
    more: their window ended, or their holder ended undelivered (a key without
    a row is free: its next message takes it)."""
    return conn.execute(_PRUNE_COOLDOWNS, {"batch_size": batch_size}).rowcount
