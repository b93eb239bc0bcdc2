"""The reaper's statements: expired leases, deliver-by times, held rows,
retention, the backlog figures (docs/design.md, invariants 5 and 6), and the
oldest snapshot that holds vacuum back in the relay's database."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Self

import sqlalchemy as sa

from ..states import TERMINAL_STATUSES
from ._sql import check_statuses, execute_fenced, statement
from .history import prune_before
from .policy import BACKOFF_SQL, EXHAUSTED_SQL, EXPIRED_PREFIX, Backoff

__all__ = [
    "LEASE_EXPIRED_ERROR",
    "NOT_STARTED_ERROR",
    "OTHER_TENANTS",
    "TENANT_METRICS",
    "Backlog",
    "ChannelBacklog",
    "OldestSnapshot",
    "Reaped",
    "TenantBacklog",
    "backlog",
    "cancel_held",
    "channel_backlog",
    "expire_overdue",
    "held_count",
    "oldest_snapshot",
    "prune",
    "prune_attempts",
    "prune_dedupe_keys",
    "reap_expired",
    "tenant_backlog",
]


@dataclass(frozen=True)
class Backlog:
    """Backlog figures of the whole outbox (``backlog``), and the record that
    ``ChannelBacklog`` extends for one channel. ``held`` is counted for the
    whole outbox only (0 in a channel's figures)."""

    pending: int
    due: int
    oldest_due_age_seconds: float
    claimed: int
    expired_claims: int
    dead: int
    held: int = 0

    @classmethod
    def _of(cls, row: sa.Row[Any], **more: Any) -> Self:
        """The figures from a row of a backlog statement (both name them alike)."""
        return cls(
            pending=row.pending,
            due=row.due,
            oldest_due_age_seconds=float(row.oldest_due_age),
            claimed=row.claimed,
            expired_claims=row.expired_claims,
            **more,
        )


@dataclass(frozen=True, kw_only=True)
class ChannelBacklog(Backlog):
    """One channel's backlog figures (``channel_backlog``). A subclass rather
    than an optional ``channel`` on ``Backlog``: a channel's figures always
    name their channel (the reaper's per-channel metrics need it), and the
    whole outbox's figures (the reaper's result) carry no channel fields."""

    channel: str
    paused: bool


LEASE_EXPIRED_ERROR = "lease expired: the sender did not settle in time"
NOT_STARTED_ERROR = (
    "lease expired before any sender took the claim (no capacity, or the hand-off "
    "was lost): not counted as an attempt"
)


@dataclass(frozen=True)
class Reaped:
    """A claim the reaper took back: its new status, and whether a sender had
    started it (took its receipt; only then is an attempt counted)."""

    status: str
    started: bool


_REAP = statement(
    f"""
    WITH lapsed AS (
        SELECT id FROM outbox_message
        WHERE status = 'claimed' AND lease_expires_at < now()
        ORDER BY lease_expires_at
        LIMIT :batch_size
        FOR UPDATE SKIP LOCKED
    ),
    timed AS (
        -- No receipt: no sender ever started the row (capacity, a lost event).
        -- That is not the message's fault: no attempt, due again at once; its
        -- deliver-by time bounds how long that can go on.
        SELECT m.id, m.attempts, m.attempts_at_redrive, m.max_attempts, m.expires_at,
               m.received_at IS NOT NULL AS started,
               CASE WHEN m.received_at IS NULL THEN now()
                    ELSE now() + make_interval(secs => {BACKOFF_SQL}) END AS next_at
        FROM outbox_message AS m JOIN lapsed USING (id)
        -- (the status names the live partition: joined to all of them, a day's
        -- partition the statistics have not seen yet is costed at some thirty
        -- rows an id, and the statement crossed jit_above_cost, half a second
        -- of compilation every reaper run)
        WHERE m.status = 'claimed'
    ),
    decided AS (
        SELECT m.*,
               CASE WHEN m.started AND {EXHAUSTED_SQL} THEN 'dead'
                    WHEN m.next_at >= m.expires_at THEN 'expired'
                    ELSE 'pending' END AS next_status
        FROM timed AS m
    ),
    released AS (
        UPDATE outbox_message AS m
        SET status = d.next_status,
            attempts = m.attempts + CASE WHEN d.started THEN 1 ELSE 0 END,
            available_at = d.next_at,
            claim_token = NULL,
            lease_expires_at = NULL,
            last_error = CASE WHEN d.next_status = 'expired' THEN '{EXPIRED_PREFIX}; '
                              ELSE '' END
                         || CASE WHEN d.started THEN :error ELSE :not_started_error END,
            settled_at = CASE WHEN d.next_status <> 'pending' THEN now() END
        FROM decided AS d
        WHERE m.id = d.id AND m.status = 'claimed'
        RETURNING m.id, m.status, m.attempts, m.claimed_at, m.last_error, d.started, m.channel,
                  m.recipient_fingerprints, m.tenant
    ),
    logged AS (
        INSERT INTO outbox_attempt
            (message_id, attempt, outcome, error, claimed_at, channel, recipient_fingerprints,
             tenant)
        SELECT id, attempts + CASE WHEN started THEN 0 ELSE 1 END,
               CASE WHEN status IN ('dead', 'expired') THEN status
                    WHEN started THEN 'expired' ELSE 'not_started' END,
               last_error, claimed_at, channel, recipient_fingerprints, tenant
        FROM released
    )
    SELECT id, status, started FROM released
    """
)


def reap_expired(conn: sa.Connection, batch_size: int, backoff: Backoff) -> dict[int, Reaped]:
    """Release claims whose lease ran out (docs/design.md, invariant 5): after a receipt the
    attempt counts (``dead`` when out of attempts); without one it does not.
    Either ends ``expired`` when the next try would fall after the deliver-by time.
    A lapsed row that a settle moved into history after this statement's
    snapshot makes Postgres refuse its lock: the release runs again on a new
    snapshot (``execute_fenced``), where the row is settled."""
    rows = execute_fenced(
        conn,
        _REAP,
        {
            "batch_size": batch_size,
            "error": LEASE_EXPIRED_ERROR,
            "not_started_error": NOT_STARTED_ERROR,
            **backoff.params(),
        },
    )
    return {r.id: Reaped(r.status, r.started) for r in rows}


# Pending rows past their deliver-by time, in bounded batches: those with a
# time of their own (expiry index), and those under the relay's default,
# counted from when they are due (only rows never claimed have none written).
_EXPIRE_OVERDUE = statement(
    f"""
    WITH own AS (
        SELECT id FROM outbox_message
        WHERE status = 'pending' AND expires_at <= now()
        LIMIT :batch_size
        FOR UPDATE SKIP LOCKED
    ),
    by_default AS (
        SELECT id FROM outbox_message
        WHERE status = 'pending' AND expires_at IS NULL
          AND available_at <= now() - make_interval(secs => CAST(:default_ttl AS float8))
        LIMIT :batch_size
        FOR UPDATE SKIP LOCKED
    ),
    expired AS (
        UPDATE outbox_message AS m
        SET status = 'expired', settled_at = now(),
            last_error = '{EXPIRED_PREFIX} before it was delivered'
                         || COALESCE('; last error: ' || m.last_error, '')
        WHERE m.id IN (SELECT id FROM own UNION ALL SELECT id FROM by_default)
          AND m.status = 'pending'
        RETURNING m.id, m.attempts, m.last_error, m.channel, m.recipient_fingerprints, m.tenant
    ),
    logged AS (
        INSERT INTO outbox_attempt
            (message_id, attempt, outcome, error, channel, recipient_fingerprints, tenant)
        SELECT id, attempts + 1, 'expired', last_error, channel, recipient_fingerprints, tenant
        FROM expired
    )
    SELECT id FROM expired
    """
)


def expire_overdue(conn: sa.Connection, batch_size: int, backoff: Backoff) -> set[int]:
    """pending -> expired for rows past their deliver-by time (up to two batches)."""
    # (a row an operator's cancel moved meanwhile: as reap_expired's)
    rows = execute_fenced(
        conn, _EXPIRE_OVERDUE, {"batch_size": batch_size, "default_ttl": backoff.ttl_param()}
    )
    return {r.id for r in rows}


# Rows whose producer chose on_predecessor_failure='cancel', behind a row of
# their ordering key that ended failed, dead or expired. Driven from those
# few holding rows (the ordering index), bounded per run.
_CANCEL_HELD = statement(
    """
    WITH doomed AS (
        SELECT m.id, min(f.id) AS holder
        FROM outbox_message AS f
        JOIN outbox_message AS m ON m.ordering_key = f.ordering_key AND m.tenant = f.tenant
                               AND m.id > f.id
        WHERE f.ordering_key IS NOT NULL AND f.status IN ('failed', 'dead', 'expired')
          AND m.status = 'pending' AND m.on_predecessor_failure = 'cancel'
        GROUP BY m.id
        LIMIT :batch_size
    )
    UPDATE outbox_message AS m
    SET status = 'cancelled', settled_at = now(),
        last_error = 'cancelled: message ' || d.holder
                     || ' before it in its ordering key did not succeed'
    FROM doomed AS d
    WHERE m.id = d.id AND m.status = 'pending'
    RETURNING m.id
    """
)


def cancel_held(conn: sa.Connection, batch_size: int) -> set[int]:
    """Cancel the held rows whose producer asked for that (``on_predecessor_failure='cancel'``)."""
    return {r.id for r in execute_fenced(conn, _CANCEL_HELD, {"batch_size": batch_size})}


_CUTOFF = statement("SELECT now() - make_interval(secs => :older_than_seconds)")


def prune(
    conn: sa.Connection,
    older_than_seconds: float,
    batch_size: int,
    statuses: Sequence[str] = TERMINAL_STATUSES,
) -> int:
    """Remove terminal rows settled before the window (``history.prune_before``:
    the resolved rows by whole day partitions, the rest up to ``batch_size``).

    Their attempt history stays (``prune_attempts`` has its own retention), and
    so do their dedupe keys (``prune_dedupe_keys``, the dedupe window)."""
    wanted = check_statuses(statuses, TERMINAL_STATUSES, "prune")
    cutoff = conn.execute(_CUTOFF, {"older_than_seconds": float(older_than_seconds)}).scalar_one()
    return prune_before(conn, cutoff, batch_size, wanted)


_PRUNE_ATTEMPTS = statement(
    """
    WITH doomed AS (
        SELECT a.id FROM outbox_attempt AS a
        WHERE a.finished_at < now() - make_interval(secs => :older_than_seconds)
          -- a message still kept (unresolved, awaiting an operator) keeps its history
          AND NOT EXISTS (SELECT 1 FROM outbox_message AS m WHERE m.id = a.message_id)
        ORDER BY a.finished_at
        LIMIT :batch_size
        FOR UPDATE SKIP LOCKED
    )
    DELETE FROM outbox_attempt AS a USING doomed WHERE a.id = doomed.id
    """
)


def prune_attempts(conn: sa.Connection, older_than_seconds: float, batch_size: int) -> int:
    """Delete up to ``batch_size`` attempt rows that finished before the window
    and whose message is gone (the send log's own retention: it outlives the
    messages, and a message still kept keeps its history)."""
    result = conn.execute(
        _PRUNE_ATTEMPTS,
        {"older_than_seconds": float(older_than_seconds), "batch_size": batch_size},
    )
    return result.rowcount


_PRUNE_DEDUPE_KEYS = statement(
    """
    WITH doomed AS (
        SELECT channel, dedupe_key, recipient_fingerprint, tenant FROM outbox_dedupe
        WHERE created_at < now() - make_interval(secs => :older_than_seconds)
        ORDER BY created_at
        LIMIT :batch_size
        FOR UPDATE SKIP LOCKED
    )
    DELETE FROM outbox_dedupe AS d USING doomed
    WHERE (d.channel, d.dedupe_key, d.recipient_fingerprint, d.tenant)
        = (doomed.channel, doomed.dedupe_key, doomed.recipient_fingerprint, doomed.tenant)
    """
)


def prune_dedupe_keys(conn: sa.Connection, older_than_seconds: float, batch_size: int) -> int:
    """Release up to ``batch_size`` dedupe keys first used before the window:
    the same key for the same recipient then makes a new message."""
    result = conn.execute(
        _PRUNE_DEDUPE_KEYS,
        {"older_than_seconds": float(older_than_seconds), "batch_size": batch_size},
    )
    return result.rowcount


# The figures of the live rows, over the whole table (``backlog``) or per
# channel (``channel_backlog``): Backlog's fields.
_LIVE_FIGURES = """
      count(*) FILTER (WHERE status = 'pending') AS pending,
      count(*) FILTER (WHERE status = 'pending' AND available_at <= now()) AS due,
      COALESCE(EXTRACT(EPOCH FROM now() - min(available_at)
               FILTER (WHERE status = 'pending' AND available_at <= now())), 0)::float8
          AS oldest_due_age,
      count(*) FILTER (WHERE status = 'claimed') AS claimed,
      count(*) FILTER (WHERE status = 'claimed' AND lease_expires_at < now()) AS expired_claims"""
_BACKLOG = statement(
    f"""
    SELECT {_LIVE_FIGURES}
    FROM outbox_message WHERE status IN ('pending', 'claimed')
    """
)
_DEAD_COUNT = statement(
    "SELECT count(*) FROM outbox_message WHERE status = 'dead' AND settled_at IS NOT NULL"
)
# Pending rows held behind a failed, dead or expired row of their ordering
# key, counted from those few holding rows (the ordering index).
_HELD_COUNT = statement(
    """
    SELECT count(DISTINCT m.id)
    FROM outbox_message AS f
    JOIN outbox_message AS m ON m.ordering_key = f.ordering_key AND m.tenant = f.tenant
                               AND m.id > f.id
    WHERE f.ordering_key IS NOT NULL AND f.status IN ('failed', 'dead', 'expired')
      AND m.status = 'pending'
    """
)


def backlog(conn: sa.Connection) -> Backlog:
    """Backlog figures for metrics and `outbox status`; served by the partial indexes."""
    row = conn.execute(_BACKLOG).one()
    dead = conn.execute(_DEAD_COUNT).scalar_one()
    held = held_count(conn)
    return Backlog._of(row, dead=dead, held=held)


def held_count(conn: sa.Connection) -> int:
    """Pending rows waiting behind a failed, dead or expired row of their ordering key."""
    return int(conn.execute(_HELD_COUNT).scalar_one())


_CHANNEL_BACKLOG = statement(
    f"""
    WITH live AS (
        SELECT channel, {_LIVE_FIGURES},
          count(*) FILTER (WHERE status = 'dead') AS dead
        FROM outbox_message WHERE status IN ('pending', 'claimed', 'dead')
        GROUP BY channel
    )
    SELECT COALESCE(l.channel, p.channel) AS channel, COALESCE(l.pending, 0) AS pending,
           COALESCE(l.due, 0) AS due, COALESCE(l.oldest_due_age, 0) AS oldest_due_age,
           COALESCE(l.claimed, 0) AS claimed, COALESCE(l.expired_claims, 0) AS expired_claims,
           COALESCE(l.dead, 0) AS dead, p.channel IS NOT NULL AS paused
    FROM live AS l FULL JOIN outbox_channel_pause AS p ON p.channel = l.channel
    ORDER BY 1
    """
)


def channel_backlog(conn: sa.Connection) -> list[ChannelBacklog]:
    """Backlog figures per channel (one grouped statement): every channel with
    pending, claimed or dead rows, and every paused channel even without rows."""
    return [
        ChannelBacklog._of(r, dead=r.dead, channel=r.channel, paused=r.paused)
        for r in conn.execute(_CHANNEL_BACKLOG).all()
    ]


# The tenants whose backlog the reaper publishes by name: the busiest by rows
# due. A series per tenant would be one per customer, each billed by the hour
# it has data; every other tenant is summed into one series, OTHER_TENANTS
# (which no tenant can be named: a tenant starts with a letter or digit).
TENANT_METRICS = 10
OTHER_TENANTS = "(other)"

_TENANT_BACKLOG = statement(
    f"""
    WITH due AS (
        SELECT tenant, count(*) AS due,
               EXTRACT(EPOCH FROM now() - min(available_at))::float8 AS oldest_due_age
        FROM outbox_message
        WHERE status = 'pending' AND available_at <= now() AND tenant <> ''
        GROUP BY tenant
    ), ranked AS (
        SELECT *, row_number() OVER (ORDER BY due DESC, tenant) AS rank FROM due
    )
    SELECT CASE WHEN rank <= :top THEN tenant ELSE '{OTHER_TENANTS}' END AS tenant,
           sum(due)::bigint AS due, max(oldest_due_age) AS oldest_due_age
    FROM ranked GROUP BY 1 ORDER BY 2 DESC, 1
    """
)


class TenantBacklog(NamedTuple):
    """One tenant's rows due now and the oldest one's age (``tenant_backlog``)."""

    tenant: str
    due: int
    oldest_due_age_seconds: float


def tenant_backlog(conn: sa.Connection, top: int = TENANT_METRICS) -> list[TenantBacklog]:
    """The due rows of the ``top`` tenants with the most, by name, and of
    every other tenant as one (OTHER_TENANTS); messages of no tenant are not
    among them (the relay's totals count them). Empty when no tenant's row
    is due."""
    return [
        TenantBacklog(r.tenant, int(r.due), float(r.oldest_due_age))
        for r in conn.execute(_TENANT_BACKLOG, {"top": top}).all()
    ]


@dataclass(frozen=True)
class OldestSnapshot:
    """What holds back vacuum of the relay's tables (``oldest_snapshot``).

    ``age_seconds``: the oldest transaction that holds a snapshot or a
    transaction id, from its start (a session's ``xact_start``, an upper
    bound for a read-committed one; a prepared transaction's ``prepared``),
    over those whose start Postgres shows. ``xid_age``: the same horizon in
    transaction ids (``age()``), over everything: sessions whose start is
    hidden, standbys' feedback and replication slots have no time.
    ``hidden_sessions``: sessions of other roles whose start Postgres hides
    from a role without pg_read_all_stats (pg_monitor includes it)."""

    age_seconds: float
    xid_age: int
    sessions: int
    hidden_sessions: int
    prepared: int
    slots: int


# Horizons are per database since PostgreSQL 14: only this database's
# sessions and prepared transactions hold back its tables, and standbys'
# feedback (walsenders, no database) and slots' xmin hold back every
# database. A slot's catalog_xmin holds back only the catalogs: not counted.
# Autovacuum's own xmin holds nothing back (vacuum ignores vacuums).
# pg_stat_activity shows every role's datname, backend_xmin and backend_xid,
# but another role's xact_start, state and backend_type only to
# pg_read_all_stats: hidden, an autovacuum worker counts as a session (its
# xid age only) and a standby's walsender is not seen (its slot is).
_OLDEST_SNAPSHOT = statement(
    """
    -- source: 1 a session, 2 a standby's walsender, 3 a prepared
    -- transaction, 4 a replication slot (numbers, not words: the store's
    -- quoted words are statuses, tests/integration/test_states.py)
    WITH held AS (
        SELECT CASE WHEN backend_type = 'walsender' THEN 2 ELSE 1 END AS source,
               xact_start AS since,
               greatest(age(backend_xmin), age(backend_xid)) AS xids
        FROM pg_stat_activity
        WHERE pid <> pg_backend_pid()
          AND (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL)
          AND (datname = current_database() OR backend_type = 'walsender')
          AND backend_type IS DISTINCT FROM 'autovacuum worker'  -- NULL when hidden
        UNION ALL
        SELECT 3, prepared, age(transaction)
        FROM pg_prepared_xacts WHERE database = current_database()
        UNION ALL
        SELECT 4, NULL, age(xmin) FROM pg_replication_slots WHERE xmin IS NOT NULL
    )
    SELECT COALESCE(EXTRACT(EPOCH FROM now() - min(since)), 0)::float8 AS age_seconds,
           COALESCE(max(xids), 0) AS xid_age,
           count(*) FILTER (WHERE source = 1) AS sessions,
           count(*) FILTER (WHERE source = 1 AND since IS NULL) AS hidden_sessions,
           count(*) FILTER (WHERE source = 3) AS prepared,
           count(*) FILTER (WHERE source = 4) AS slots
    FROM held
    """
)


def oldest_snapshot(conn: sa.Connection) -> OldestSnapshot:
    """The oldest snapshot holding back vacuum in the relay's database, this
    session's own excluded. Readable by the relay's role: what Postgres hides
    from it counts in ``xid_age`` and ``hidden_sessions`` only."""
    r = conn.execute(_OLDEST_SNAPSHOT).one()
    return OldestSnapshot(
        age_seconds=max(0.0, float(r.age_seconds)),
        xid_age=int(r.xid_age),
        sessions=r.sessions,
        hidden_sessions=r.hidden_sessions,
        prepared=r.prepared,
        slots=r.slots,
    )
