"""The operator's statements: what ``outbox status | list | show | history``
read, and the transitions only an operator makes (redrive, cancel, prune,
pause). Filters are checked against closed sets before they reach a
statement (``_sql.check_channels``, ``states.Status.parse``), and every value
travels as a bound parameter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import sqlalchemy as sa

from ..states import CANCELLABLE_STATUSES, REDRIVABLE_STATUSES, TERMINAL_STATUSES
from ._sql import array_literal, check_channels, check_statuses, statement
from .history import prunable_before, prune_before

__all__ = [
    "ChannelStatusCount",
    "PausedChannel",
    "TenantStatus",
    "attempt_history",
    "cancel",
    "channel_status_counts",
    "channels_with_rows",
    "count_prunable",
    "get_message",
    "list_messages",
    "matching_ids",
    "pause_channel",
    "paused_channels",
    "prune_cutoff",
    "prune_settled_before",
    "recipient_history",
    "redrive",
    "resume_channel",
    "statuses_of",
    "tenant_status",
    "uncancel",
]

# --- operator transitions ---------------------------------------------------

_CANCEL = statement(
    """
    UPDATE outbox_message SET status = 'cancelled', settled_at = now(),
        last_error = COALESCE(:reason, last_error)
    WHERE id = ANY(CAST(:ids AS bigint[])) AND status = ANY(CAST(:statuses AS text[]))
    RETURNING id
    """
)


def cancel(conn: sa.Connection, ids: Sequence[int], reason: str | None = None) -> set[int]:
    """pending | failed | dead | expired -> cancelled. Rows in any other state
    are left alone (returned ids say which)."""
    rows = conn.execute(
        _CANCEL,
        {
            "ids": array_literal(ids),
            "reason": reason,
            "statuses": array_literal(CANCELLABLE_STATUSES),
        },
    ).all()
    return {r.id for r in rows}


# A redrive starts the row afresh: attempts and deferrals from zero, and a
# deliver-by time that has passed is lifted (the relay's default applies again,
# from now), or the row would expire at once.
# The attempt numbering goes on (attempts_at_redrive: the budget and the backoff
# count from here); what the last claim and its end left behind is cleared.
_REDRIVE_SET = """
    status = 'pending', attempts_at_redrive = attempts, deferrals = 0, available_at = now(),
    settled_at = NULL, last_error = NULL, claim_token = NULL, claimed_at = NULL,
    lease_expires_at = NULL, received_at = NULL,
    expires_at = CASE WHEN expires_at <= now() THEN NULL ELSE expires_at END
"""
_REDRIVE = statement(
    f"""
    UPDATE outbox_message SET {_REDRIVE_SET}
    WHERE id = ANY(CAST(:ids AS bigint[])) AND status = ANY(CAST(:statuses AS text[]))
    RETURNING id
    """
)


def redrive(conn: sa.Connection, ids: Sequence[int]) -> set[int]:
    """dead | failed | expired -> pending with a fresh set of attempts, numbered
    on from the last one (no second "attempt 1"); the stale claim fields and the
    last error are cleared, the attempt history stays. Rows held behind it in
    its ordering key follow once it is delivered."""
    rows = conn.execute(
        _REDRIVE, {"ids": array_literal(ids), "statuses": array_literal(REDRIVABLE_STATUSES)}
    ).all()
    return {r.id for r in rows}


# Uncancel is a redrive of a cancelled row. A row of an ordering key comes
# back only while none of the key's later rows has gone ahead (claimed or
# settled since the cancel let them): it would be sent after them.
_UNCANCEL = statement(
    f"""
    UPDATE outbox_message m SET {_REDRIVE_SET}
    WHERE id = ANY(CAST(:ids AS bigint[])) AND status = 'cancelled'
      AND (ordering_key IS NULL OR NOT EXISTS (
            SELECT 1 FROM outbox_message later
            WHERE later.ordering_key = m.ordering_key AND later.tenant = m.tenant
              AND later.id > m.id
              AND later.status NOT IN ('pending', 'cancelled')))
    RETURNING id
    """
)


def uncancel(conn: sa.Connection, ids: Sequence[int]) -> set[int]:
    """cancelled -> pending, as a redrive does (a fresh set of attempts,
    numbered on; the history stays). Only cancelled rows, and of an ordering
    key only a row none of whose later rows went ahead: the others are left
    alone (returned ids say which)."""
    rows = conn.execute(_UNCANCEL, {"ids": array_literal(ids)}).all()
    return {r.id for r in rows}


# --- operator read queries and filtered redrive (the `outbox` CLI) ----------

_CHANNEL_STATUS_COUNTS = statement(
    """
    SELECT channel, status, count(*) AS n,
           COALESCE(EXTRACT(EPOCH FROM now() - min(available_at)
                    FILTER (WHERE status = 'pending' AND available_at <= now())), 0)::float8
               AS oldest_due_age,
           count(*) FILTER (WHERE status = 'claimed' AND lease_expires_at < now())
               AS expired_claims
    FROM outbox_message GROUP BY channel, status ORDER BY channel, status
    """
)


@dataclass(frozen=True)
class ChannelStatusCount:
    channel: str
    status: str
    count: int
    oldest_due_age_seconds: float
    expired_claims: int


_TENANT_STATUS = statement(
    """
    SELECT tenant,
           count(*) FILTER (WHERE status = 'pending' AND available_at <= now()) AS due,
           COALESCE(EXTRACT(EPOCH FROM now() - min(available_at)
                    FILTER (WHERE status = 'pending' AND available_at <= now())), 0)::float8
               AS oldest_due_age,
           count(*) FILTER (WHERE status = 'claimed') AS in_flight,
           count(*) FILTER (WHERE status = 'delivered') AS delivered,
           count(*) FILTER (WHERE status IN ('failed', 'dead', 'expired')) AS unresolved
    FROM outbox_message GROUP BY tenant ORDER BY tenant
    """
)


class TenantStatus(NamedTuple):
    """One tenant's figures (``outbox status --by tenant``); tenant '' is none."""

    tenant: str
    due: int
    oldest_due_age_seconds: float
    in_flight: int
    delivered: int
    unresolved: int


def tenant_status(conn: sa.Connection) -> list[TenantStatus]:
    """Per tenant: rows due now and the oldest one's age, in flight, delivered
    (those still kept), and failed, dead or expired."""
    return [TenantStatus(*r) for r in conn.execute(_TENANT_STATUS).all()]


def channel_status_counts(conn: sa.Connection) -> list[ChannelStatusCount]:
    """Messages per (channel, status), with the age of the oldest due pending
    row and the number of claims past their lease in each group."""
    return [
        ChannelStatusCount(r.channel, r.status, r.n, float(r.oldest_due_age), r.expired_claims)
        for r in conn.execute(_CHANNEL_STATUS_COUNTS).all()
    ]


_MESSAGE_COLUMNS = """
    id, channel, status, priority, attempts, max_attempts, deferrals, dedupe_key, ordering_key,
    on_predecessor_failure, provider_message_id, last_error, claim_token, created_at,
    available_at, claimed_at, received_at, lease_expires_at, expires_at, settled_at,
    cooldown_key, CAST(EXTRACT(EPOCH FROM cooldown) AS float8) AS cooldown_seconds, on_cooldown,
    NULLIF(tenant, '') AS tenant
"""

_LIST_MESSAGES = statement(
    f"""
    SELECT {_MESSAGE_COLUMNS} FROM outbox_message
    WHERE (CAST(:statuses AS text[]) IS NULL OR status = ANY(CAST(:statuses AS text[])))
      AND (CAST(:channels AS text[]) IS NULL OR channel = ANY(CAST(:channels AS text[])))
      AND (CAST(:dedupe_key AS text) IS NULL OR dedupe_key = CAST(:dedupe_key AS text))
      AND (CAST(:ordering_key AS text) IS NULL OR ordering_key = CAST(:ordering_key AS text))
      AND (CAST(:tenant AS text) IS NULL OR tenant = CAST(:tenant AS text))
      AND (CAST(:after_id AS bigint) IS NULL OR id < CAST(:after_id AS bigint))
    ORDER BY id DESC
    LIMIT :limit
    """
)


def list_messages(
    conn: sa.Connection,
    statuses: Sequence[str] | None = None,
    channels: Sequence[str] | None = None,
    limit: int = 50,
    *,
    dedupe_key: str | None = None,
    ordering_key: str | None = None,
    tenant: str | None = None,
    after_id: int | None = None,
) -> list[sa.Row[Any]]:
    """The newest ``limit`` rows matching the filters (no payloads), newest
    first; ``after_id`` continues a listing after that row (older ids only);
    ``tenant``: only that tenant's ('' : the rows of no tenant)."""
    wanted = check_statuses(statuses)
    check_channels(channels)
    if not 1 <= limit <= 10_000:
        raise ValueError("limit must be between 1 and 10000")
    return list(
        conn.execute(
            _LIST_MESSAGES,
            {
                "statuses": array_literal(wanted) if wanted else None,
                "channels": array_literal(channels) if channels else None,
                "dedupe_key": dedupe_key,
                "ordering_key": ordering_key,
                "tenant": tenant,
                "after_id": after_id,
                "limit": limit,
            },
        ).all()
    )


_CHANNELS_WITH_ROWS = statement(
    """
    SELECT c.channel FROM unnest(CAST(:channels AS text[])) AS c(channel)
    WHERE EXISTS (SELECT 1 FROM outbox_message AS m WHERE m.channel = c.channel)
    """
)


def channels_with_rows(conn: sa.Connection, channels: Sequence[str]) -> set[str]:
    """Which of ``channels`` have messages in the outbox (any status)."""
    check_channels(channels)
    if not channels:
        return set()
    rows = conn.execute(_CHANNELS_WITH_ROWS, {"channels": array_literal(channels)}).scalars()
    return set(rows)


# The payload as text: the caller decodes it (a row too deep to decode must
# still show, and must not leave the connection half-read).
_GET_MESSAGE = statement(
    f"SELECT {_MESSAGE_COLUMNS}, CAST(payload AS text) AS payload "
    "FROM outbox_message WHERE id = :id"
)
_ATTEMPT_HISTORY = statement(
    """
    SELECT attempt, outcome, error, provider_message_id, claimed_at, finished_at, duration_ms
    FROM outbox_attempt WHERE message_id = :id ORDER BY id
    """
)


def get_message(conn: sa.Connection, message_id: int) -> sa.Row[Any] | None:
    """One row, payload included, or None."""
    return conn.execute(_GET_MESSAGE, {"id": message_id}).one_or_none()


def attempt_history(conn: sa.Connection, message_id: int) -> list[sa.Row[Any]]:
    """The attempts of one message, oldest first."""
    return list(conn.execute(_ATTEMPT_HISTORY, {"id": message_id}).all())


_STATUSES_OF = statement(
    """
    SELECT id, status FROM outbox_message WHERE id = ANY(CAST(:ids AS bigint[]))
    ORDER BY id FOR UPDATE
    """
)


def statuses_of(conn: sa.Connection, ids: Sequence[int]) -> dict[int, str]:
    """{id: status} of the given rows that exist, locked until the transaction
    ends, so an operator command can check every id before changing any."""
    if not ids:
        return {}
    rows = conn.execute(_STATUSES_OF, {"ids": array_literal(ids)}).all()
    return {r.id: r.status for r in rows}


_MATCHING_IDS = statement(
    """
    SELECT id FROM outbox_message
    WHERE status = ANY(CAST(:statuses AS text[]))
      AND (CAST(:channels AS text[]) IS NULL OR channel = ANY(CAST(:channels AS text[])))
      AND (CAST(:since_seconds AS float8) IS NULL
           OR settled_at >= now() - make_interval(secs => CAST(:since_seconds AS float8)))
      AND (CAST(:dedupe_key AS text) IS NULL OR dedupe_key = CAST(:dedupe_key AS text))
      AND (CAST(:ordering_key AS text) IS NULL OR ordering_key = CAST(:ordering_key AS text))
      AND (CAST(:tenant AS text) IS NULL OR tenant = CAST(:tenant AS text))
    ORDER BY id
    """
)


def matching_ids(
    conn: sa.Connection,
    statuses: Sequence[str],
    channels: Sequence[str] | None = None,
    since_seconds: float | None = None,
    *,
    dedupe_key: str | None = None,
    ordering_key: str | None = None,
    tenant: str | None = None,
) -> list[int]:
    """The ids a bulk redrive or cancel would change (settled within the last
    ``since_seconds`` when given), for the operator to confirm before
    :func:`redrive` or :func:`cancel` changes exactly those (if still in state)."""
    if not statuses:
        raise ValueError("at least one status is needed")
    wanted = check_statuses(statuses)
    check_channels(channels)
    return list(
        conn.execute(
            _MATCHING_IDS,
            {
                "statuses": array_literal(wanted),
                "channels": array_literal(channels) if channels else None,
                "since_seconds": None if since_seconds is None else float(since_seconds),
                "dedupe_key": dedupe_key,
                "ordering_key": ordering_key,
                "tenant": tenant,
            },
        ).scalars()
    )


# An operator's prune counts, confirms, then deletes against one cutoff taken
# from the database clock, so it never deletes more than it counted.
_PRUNE_CUTOFF = statement("SELECT now() - make_interval(secs => :older_than_seconds)")


def _prunable(statuses: Sequence[str]) -> list[str]:
    """The statuses, once each is known to be terminal."""
    return list(check_statuses(statuses, TERMINAL_STATUSES, "prune"))


def prune_cutoff(conn: sa.Connection, older_than_seconds: float) -> Any:
    """``now() - older_than`` on the database clock."""
    return conn.execute(
        _PRUNE_CUTOFF, {"older_than_seconds": float(older_than_seconds)}
    ).scalar_one()


def count_prunable(conn: sa.Connection, cutoff: Any, statuses: Sequence[str]) -> int:
    """How many rows ``prune_settled_before`` would remove: every one settled
    before ``cutoff``."""
    return prunable_before(conn, cutoff, _prunable(statuses), exact=True)


def prune_settled_before(
    conn: sa.Connection, cutoff: Any, batch_size: int, statuses: Sequence[str]
) -> int:
    """Remove rows in ``statuses`` settled before ``cutoff``: the resolved rows'
    day partitions that end by it dropped whole, up to ``batch_size`` rows of
    the rest deleted (the cutoff's own day among them); returns how many went
    (never a prior count)."""
    return prune_before(conn, cutoff, batch_size, _prunable(statuses), exact=True)


# --- the send log: attempts by recipient -------------------------------------

_ADDRESS_FINGERPRINTS = statement(
    """
    SELECT c AS channel,
           encode(outbox_fingerprint(outbox_normalize_address(c, :address)), 'hex') AS fp
    FROM unnest(CAST(:channels AS text[])) AS c
    """
)
# The matches are gathered first from the GIN index (materialised, so the
# planner cannot trade it for a walk down the finished_at index, which would
# read the whole history of a recipient with fewer than `limit` attempts),
# then sorted. Made for people, whose histories are short; a busy queue's or
# bus's history is read in full before its newest rows are picked.
_RECIPIENT_HISTORY = statement(
    """
    WITH hits AS MATERIALIZED (
        SELECT a.* FROM outbox_attempt AS a
        WHERE a.recipient_fingerprints && CAST(:fps AS bytea[])
          AND (CAST(:tenant AS text) IS NULL OR a.tenant = CAST(:tenant AS text))
    )
    SELECT a.finished_at, a.channel, a.message_id, a.attempt, a.outcome, a.error,
           a.provider_message_id, a.claimed_at, a.duration_ms,
           m.status AS message_status, m.dedupe_key, NULLIF(a.tenant, '') AS tenant
    FROM hits AS a
    LEFT JOIN outbox_message AS m ON m.id = a.message_id
    -- each fingerprint counts for the channel whose normalisation made it
    WHERE EXISTS (SELECT 1 FROM unnest(CAST(:channels AS text[]), CAST(:fps AS bytea[]))
                             AS w(channel, fp)
                  WHERE w.channel = a.channel AND w.fp = ANY(a.recipient_fingerprints))
    ORDER BY a.finished_at DESC, a.id DESC
    LIMIT :limit
    """
)


def recipient_history(
    conn: sa.Connection,
    address: str,
    channels: Sequence[str],
    limit: int = 50,
    *,
    tenant: str | None = None,
) -> list[sa.Row[Any]]:
    """The attempts that went to ``address`` on the given channels, newest
    first; with ``tenant``, that tenant's only ('' is no tenant's). The
    address is fingerprinted in the database with the installation's key, as
    at enqueue; it is never stored. ``message_status`` and ``dedupe_key`` are
    None once the message was pruned (the attempt keeps its tenant)."""
    check_channels(channels)
    if not channels:
        raise ValueError("at least one channel is needed")
    if not 1 <= limit <= 10_000:
        raise ValueError("limit must be between 1 and 10000")
    wanted = conn.execute(
        _ADDRESS_FINGERPRINTS, {"address": address, "channels": array_literal(channels)}
    ).all()
    return list(
        conn.execute(
            _RECIPIENT_HISTORY,
            {
                "channels": array_literal(w.channel for w in wanted),
                "fps": array_literal("\\x" + w.fp for w in wanted),
                "limit": limit,
                "tenant": tenant,
            },
        ).all()
    )


# --- pausing a channel ---------------------------------------------------------
# A row in outbox_channel_pause keeps the claim away from the channel's rows;
# claims taken before the pause finish normally. A pause a quota answer wrote
# ends by itself at ``paused_until``; an operator's has none and waits for
# ``outbox resume``.

_FORGET_ENDED = statement(
    "DELETE FROM outbox_channel_pause WHERE channel = :channel AND paused_until <= now()"
)
# The operator's pause outlasts a quota's: it ends only when resumed.
_PAUSE = statement(
    """
    INSERT INTO outbox_channel_pause (channel, reason) VALUES (:channel, :reason)
    ON CONFLICT (channel) DO UPDATE
        SET reason = COALESCE(EXCLUDED.reason, outbox_channel_pause.reason), paused_until = NULL
    RETURNING paused_at, (xmax = 0) AS newly_paused
    """
)
_RESUME = statement("DELETE FROM outbox_channel_pause WHERE channel = :channel RETURNING channel")
_PAUSED = statement(
    """
    SELECT channel, reason, paused_at, paused_until FROM outbox_channel_pause
    WHERE paused_until IS NULL OR paused_until > now()
    ORDER BY channel
    """
)


@dataclass(frozen=True)
class PausedChannel:
    channel: str
    reason: str | None
    paused_at: Any
    # When the pause ends by itself (a quota's reset); None: when resumed.
    paused_until: Any = None


def pause_channel(conn: sa.Connection, channel: str, reason: str | None = None) -> bool:
    """Stop claiming ``channel``'s rows. True if it was not paused before (a repeat
    keeps the first pause time, and its reason unless a new one is given)."""
    check_channels([channel])
    conn.execute(_FORGET_ENDED, {"channel": channel})
    return bool(conn.execute(_PAUSE, {"channel": channel, "reason": reason}).one().newly_paused)


def resume_channel(conn: sa.Connection, channel: str) -> bool:
    """Claim ``channel`` again. True if it was paused."""
    check_channels([channel])
    return conn.execute(_RESUME, {"channel": channel}).one_or_none() is not None


def paused_channels(conn: sa.Connection) -> list[PausedChannel]:
    """The channels paused now (a quota pause that has ended is not)."""
    return [
        PausedChannel(r.channel, r.reason, r.paused_at, r.paused_until)
        for r in conn.execute(_PAUSED).all()
    ]
