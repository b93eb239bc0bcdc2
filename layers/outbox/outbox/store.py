"""All SQL of the state machine, and nothing else.

    pending -> claimed -> delivered | failed | dead | suppressed | expired
    claimed -> pending   (retry with backoff, an attempt counted; a deferral, none
                          counted until MAX_DEFERRALS; a lease that ended after the
                          sender's receipt, counted; one that ended with no receipt,
                          not counted: no sender ever started it)
    pending -> cancelled | expired (deliver-by time passed);
    dead | failed | expired -> pending (operator redrive)
    delivered -> bounced | complained   (provider feedback)

An ordering key runs one row at a time, in id order (= commit order: enqueue
takes a transaction-scoped advisory lock per key). A row that ends failed, dead
or expired holds its key's later rows (they stay pending, "held") until an
operator redrives or cancels it; rows enqueued with
``on_predecessor_failure='cancel'`` are cancelled instead, by the reaper.

Transitions to failed, dead, expired, bounced and complained (and delivered,
when turned on) also write an ``outbox_outcome_event`` row: a trigger of the
schema does it in the same statement, so no statement here has to remember.

Rules every statement here keeps (docs/design.md, invariants 1-7):
* the claim is one compare-and-set UPDATE over ``FOR UPDATE SKIP LOCKED`` rows;
* a claim is sent at most once: the sender's receipt is a compare-and-set too
  (``received_at`` stamped on a claimed, unreceived row of a live lease);
* every write after a claim is fenced on (id, status = 'claimed', claim_token);
* every time comes from the database clock, ``now()``; Python only supplies
  durations (lease, delays, backoff parameters);
* batches are written by one statement over arrays (``unnest``), never a loop.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import sqlalchemy as sa

from .errors import DedupeConflict, OutboxError

TERMINAL_STATUSES = (
    "delivered",
    "failed",
    "dead",
    "suppressed",
    "cancelled",
    "expired",
    "bounced",
    "complained",
)
SEND_OUTCOMES = ("delivered", "retry", "failed", "suppressed", "deferred")
# The statuses of an ordering key's row that hold the rows after it.
HOLDING_STATUSES = ("failed", "dead", "expired")
ON_PREDECESSOR_FAILURE = ("hold", "cancel")
# The longest a channel may defer a row by; longer asks are cut to this.
MAX_DEFERRAL_SECONDS = 24 * 3600.0


# The per-row records of the relay's hot path (claim, receipt, settle) are
# NamedTuples, not frozen dataclasses: as immutable, and built in a fifth of
# the time (a frozen dataclass sets each field through object.__setattr__).
class Claim(NamedTuple):
    """A claimed row as the dispatcher hands it to a channel function."""

    id: int
    channel: str
    claim_token: uuid.UUID
    attempt: int


class ClaimedMessage(NamedTuple):
    """A row the sender took its receipt for: it alone sends it, once.

    The fields in the order of the receipt's columns (``_RECEIVED``)."""

    id: int
    channel: str
    # The stored JSON as text: the sender decodes each row by itself
    # (``payloads.decode``), so one undecodable row fails alone.
    payload: str
    attempt: int
    max_attempts: int
    # As text: it only goes back into the fenced statements, which cast it;
    # a UUID object per row cost more than the rest of the row's decoding.
    claim_token: str
    dedupe_key: str | None
    ordering_key: str | None
    lease_left_seconds: float


class Settlement(NamedTuple):
    """The result of one send, to be written under the fence.

    ``delay_seconds``: for ``deferred``, when to try again (no attempt counted,
    up to the deferral limit); for ``retry``, an explicit delay instead of the
    exponential backoff. ``settle`` bounds it (see ``bounded_delay``).
    """

    id: int
    claim_token: uuid.UUID | str
    outcome: str
    error: str | None = None
    provider_message_id: str | None = None
    delay_seconds: float | None = None
    duration_ms: int | None = None


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
    max_deferrals: int = 20
    min_deferral_seconds: float = 5.0
    default_ttl_seconds: float | None = None


@dataclass(frozen=True)
class NewMessage:
    channel: str
    payload_json: str
    dedupe_key: str | None = None
    ordering_key: str | None = None
    priority: int = 0
    delay_seconds: float = 0.0
    max_attempts: int | None = None
    # ISO 8601 with a zone, or None: the relay's default deliver-by.
    expires_at: str | None = None
    ttl_seconds: float | None = None
    on_predecessor_failure: str = "hold"


@dataclass(frozen=True)
class Backlog:
    pending: int
    due: int
    oldest_due_age_seconds: float
    claimed: int
    expired_claims: int
    dead: int
    held: int = 0


# The backoff before attempt ``attempts + 2`` for a row that has failed
# ``attempts + 1`` times. The exponent is clamped so power() cannot overflow.
# Both count from the last redrive: a redriven message gets a fresh set of
# attempts (and backoff) while its attempt numbers carry on.
_BACKOFF_SQL = (
    "LEAST(CAST(:backoff_cap AS float8), CAST(:backoff_base AS float8) "
    "* power(2.0, LEAST(m.attempts - m.attempts_at_redrive, 40))) * (0.5 + random() / 2)"
)
_EXHAUSTED_SQL = "m.attempts - m.attempts_at_redrive + 1 >= COALESCE(m.max_attempts, :default_max)"


# --- parameter encoding (performance) ----------------------------------------
# pg8000 escapes every element of a list parameter character by character, and
# scans the whole statement text for placeholders on every execute. Arrays
# are therefore sent as one ready array literal, batches of free text as one
# JSON document, and statement texts without their layout.


def _sql(text: str) -> sa.TextClause:
    """A statement with its comments and indentation removed (same SQL, fewer
    characters). No statement here has ``--`` inside a string literal."""
    lines = (line.split("--", 1)[0].strip() for line in text.splitlines())
    return sa.text(" ".join(line for line in lines if line))


def _backoff_params(backoff: Backoff) -> dict[str, Any]:
    return {
        "backoff_base": backoff.base_seconds,
        "backoff_cap": backoff.cap_seconds,
        "default_max": backoff.default_max_attempts,
    }


def _ttl_param(backoff: Backoff) -> float | None:
    ttl = backoff.default_ttl_seconds
    return None if ttl is None else float(ttl)


def array_literal(values: Iterable[Any]) -> str:
    """A Postgres array literal, every element quoted (ids and UUIDs need not be), bound as one text
    parameter that the SQL casts (``CAST(:ids AS bigint[])``, ``uuid[]``,
    ``text[]``). One string instead of pg8000's per-element escaping of a list;
    and pg8000's list adapter leaves ``null`` in any case but ``NULL`` unquoted,
    which Postgres reads as a NULL element: a key "null" would silently vanish.
    A value that is no id or UUID is still refused, by Postgres, at the cast."""

    def element(v: Any) -> str:
        if v is None:
            return "NULL"
        if type(v) is int or type(v) is uuid.UUID:  # ids and tokens: nothing to escape
            return str(v)
        return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'

    return "{" + ",".join(element(v) for v in values) + "}"


# --- enqueue ---------------------------------------------------------------

# Dedupe is scoped to (channel, dedupe_key, recipient): a key names an event,
# and one event fans out to many recipients. The keys live in outbox_dedupe
# for the dedupe window, apart from the messages (which may be pruned sooner).
# The recipient fingerprints and payload digests are computed in the database
# (functions of migration 0006, inlined by the planner), so a producer in any
# language gets the same.
_INPUT_ROWS = """
    ROWS FROM (
        unnest(CAST(:channels AS text[])),
        -- the payloads travel as one JSON array: no per-element escaping
        jsonb_array_elements(CAST(:payloads AS jsonb)),
        unnest(CAST(:dedupe_keys AS text[])), unnest(CAST(:ordering_keys AS text[])),
        unnest(CAST(:priorities AS int[])), unnest(CAST(:delays AS float8[])),
        unnest(CAST(:max_attempts AS int[])), unnest(CAST(:expires_at AS timestamptz[])),
        unnest(CAST(:ttls AS float8[])), unnest(CAST(:on_predecessor_failure AS text[]))
    ) WITH ORDINALITY AS i(channel, payload, dedupe_key, ordering_key, priority,
                           delay_s, max_attempts, expires_at, ttl_s, on_predecessor_failure, ord)
    CROSS JOIN outbox_fingerprint_key AS k
"""
# a ttl counts from the time the message is first due
_EXPIRES_AT = "COALESCE(i.expires_at, now() + make_interval(secs => i.delay_s + i.ttl_s))"
_ADDRESSES = "ARRAY(SELECT a FROM outbox_addresses(i.channel, i.payload) AS a ORDER BY a)"
_RECIPIENT_FINGERPRINTS = (
    "ARRAY(SELECT outbox_hmac(k.inner_pad, k.outer_pad, a) "
    "FROM outbox_addresses(i.channel, i.payload) AS a ORDER BY a)"
)

# A batch without dedupe keys (bulk sends): one plain INSERT.
_INSERT_UNKEYED = _sql(
    f"""
    INSERT INTO outbox_message (channel, payload, ordering_key, priority, available_at,
                                max_attempts, expires_at, on_predecessor_failure,
                                recipient_fingerprints)
    SELECT i.channel, i.payload, i.ordering_key, i.priority,
           now() + make_interval(secs => i.delay_s), i.max_attempts, {_EXPIRES_AT},
           i.on_predecessor_failure, {_RECIPIENT_FINGERPRINTS}
    FROM {_INPUT_ROWS}
    ORDER BY i.ord
    RETURNING id
    """
)

_INSERT = _sql(
    f"""
    WITH input AS (
        SELECT i.*,
               -- ids are drawn first so that a key's entry can name its message
               nextval('outbox_message_id_seq') AS new_id,
               {_RECIPIENT_FINGERPRINTS} AS recipient_fingerprints,
               CASE WHEN i.dedupe_key IS NOT NULL THEN outbox_hmac(k.inner_pad, k.outer_pad,
                   outbox_dedupe_identity(i.channel, i.payload, {_ADDRESSES})) END AS fingerprint,
               CASE WHEN i.dedupe_key IS NOT NULL
                    THEN outbox_payload_digest(i.payload) END AS digest
        FROM {_INPUT_ROWS}
        ORDER BY i.ord
    ),
    keyed AS (  -- the first of each (channel, key, recipient) in the list stands for it
        SELECT DISTINCT ON (channel, dedupe_key, fingerprint)
               ord, new_id, channel, dedupe_key, fingerprint, digest
        FROM input WHERE dedupe_key IS NOT NULL
        ORDER BY channel, dedupe_key, fingerprint, ord
    ),
    held AS (  -- keys already taken when this statement began
        SELECT k.ord, d.message_id, d.payload_digest
        FROM keyed AS k JOIN outbox_dedupe AS d
          ON d.channel = k.channel AND d.dedupe_key = k.dedupe_key
         AND d.recipient_fingerprint = k.fingerprint
    ),
    conflicts AS (  -- a payload other than the one its key was first given
        SELECT i.ord FROM input AS i
        JOIN keyed AS k ON k.channel = i.channel AND k.dedupe_key = i.dedupe_key
                       AND k.fingerprint = i.fingerprint
        LEFT JOIN held AS h ON h.ord = k.ord
        WHERE i.digest <> COALESCE(h.payload_digest, k.digest)
    ),
    taken AS (  -- nothing at all is written when any message conflicts
        INSERT INTO outbox_dedupe
            (channel, dedupe_key, recipient_fingerprint, payload_digest, message_id)
        SELECT k.channel, k.dedupe_key, k.fingerprint, k.digest, k.new_id FROM keyed AS k
        WHERE NOT EXISTS (SELECT 1 FROM conflicts)
          AND NOT EXISTS (SELECT 1 FROM held AS h WHERE h.ord = k.ord)
        ORDER BY k.ord
        ON CONFLICT DO NOTHING  -- taken meanwhile by a transaction that committed since
        RETURNING message_id
    ),
    inserted AS (
        INSERT INTO outbox_message (id, channel, payload, dedupe_key, ordering_key, priority,
                                    available_at, max_attempts, expires_at,
                                    on_predecessor_failure, recipient_fingerprints)
        OVERRIDING SYSTEM VALUE
        SELECT new_id, channel, payload, dedupe_key, ordering_key, priority,
               now() + make_interval(secs => delay_s), max_attempts, {_EXPIRES_AT},
               on_predecessor_failure, recipient_fingerprints
        FROM input AS i
        WHERE NOT EXISTS (SELECT 1 FROM conflicts)
          AND (dedupe_key IS NULL OR new_id IN (SELECT message_id FROM taken))
        ORDER BY ord
    )
    SELECT i.ord,
           i.ord IN (SELECT ord FROM conflicts) AS conflict,
           CASE WHEN i.dedupe_key IS NULL THEN i.new_id
                WHEN k.new_id IN (SELECT message_id FROM taken) THEN k.new_id
                ELSE h.message_id END AS id,  -- NULL: taken since the snapshot
           i.dedupe_key IS NULL OR i.new_id IN (SELECT message_id FROM taken) AS created,
           k.ord AS first_ord, h.message_id AS held_id
    FROM input AS i
    LEFT JOIN keyed AS k ON k.channel = i.channel AND k.dedupe_key = i.dedupe_key
                        AND k.fingerprint = i.fingerprint
    LEFT JOIN held AS h ON h.ord = k.ord
    ORDER BY i.ord
    """
)

# Within an ordering key, ids must follow commit order: otherwise a transaction
# that drew a lower id but commits later makes its row the key's head after a
# later row was already sent. A transaction-scoped advisory lock per key (taken
# in a fixed order, so two producers cannot deadlock on each other) makes
# producers of one key take turns from their first enqueue to their commit.
_LOCK_ORDERING_KEYS = _sql(
    """
    SELECT count(pg_advisory_xact_lock(hashtextextended('outbox-ordering-key:' || k, 0)))
    FROM (SELECT DISTINCT k FROM unnest(CAST(:keys AS text[])) AS u(k) ORDER BY k) AS keys
    """
)

# Takes back what one _INSERT wrote, inside the caller's transaction (the
# keys by their primary key: outbox_dedupe has no index on message_id).
_UNDO_INSERT = _sql(
    """
    WITH gone AS (
        DELETE FROM outbox_message WHERE id = ANY(CAST(:ids AS bigint[]))
        RETURNING id, channel, dedupe_key, payload
    )
    DELETE FROM outbox_dedupe AS d USING gone AS g
    WHERE d.channel = g.channel AND d.dedupe_key = g.dedupe_key
      AND d.recipient_fingerprint = outbox_recipient_fingerprint(g.channel, g.payload)
      AND d.message_id = g.id
    """
)
# A key taken by a transaction that committed after our statement's snapshot
# leaves its message without an id; the statement is then taken back and run
# again, and the fresh snapshot sees the key. Only a key pruned in between
# needs another round.
_INSERT_ROUNDS = 3


class Enqueued(NamedTuple):
    """The id of an enqueued message, and whether this call created it (False:
    a replay of its (channel, dedupe_key, recipient) returned the existing one)."""

    id: int
    created: bool


def insert_messages(conn: sa.Connection, messages: Sequence[NewMessage]) -> list[Enqueued]:
    """Insert validated messages in one statement; returns their ids in order.

    A (channel, dedupe_key, recipient) that already exists, or repeats within
    the list, with the same payload yields the existing id; with another
    payload, DedupeConflict is raised and nothing is written.
    """
    if not messages:
        return []
    ordering_keys = sorted({m.ordering_key for m in messages if m.ordering_key is not None})
    if ordering_keys:  # one more statement, only when a key is present
        conn.execute(_LOCK_ORDERING_KEYS, {"keys": array_literal(ordering_keys)})
    params = {
        "channels": array_literal([m.channel for m in messages]),
        # the payloads travel as one JSON array (canonical JSON text already)
        "payloads": "[" + ",".join(m.payload_json for m in messages) + "]",
        "dedupe_keys": array_literal([m.dedupe_key for m in messages]),
        "ordering_keys": array_literal([m.ordering_key for m in messages]),
        "priorities": [m.priority for m in messages],
        "delays": [float(m.delay_seconds) for m in messages],
        "max_attempts": [m.max_attempts for m in messages],
        "expires_at": array_literal([m.expires_at for m in messages]),
        "ttls": [m.ttl_seconds for m in messages],
        "on_predecessor_failure": array_literal([m.on_predecessor_failure for m in messages]),
    }
    if all(m.dedupe_key is None for m in messages):
        # Identity values are drawn in the order the SELECT produces rows (ORDER
        # BY ord), so the ids sorted ascending are the messages in input order.
        ids = sorted(conn.execute(_INSERT_UNKEYED, params).scalars().all())
        return [Enqueued(i, True) for i in ids]
    for _ in range(_INSERT_ROUNDS):
        rows = conn.execute(_INSERT, params).all()
        conflict = next((r for r in rows if r.conflict), None)
        if conflict is not None:
            index = conflict.ord - 1
            message = messages[index]
            raise DedupeConflict(
                message.channel,
                str(message.dedupe_key),
                index=index,
                existing_id=conflict.held_id,
                first_index=None if conflict.held_id is not None else conflict.first_ord - 1,
            )
        if all(r.id is not None for r in rows):
            return [Enqueued(r.id, r.created) for r in rows]
        conn.execute(_UNDO_INSERT, {"ids": array_literal(r.id for r in rows if r.created)})
    raise OutboxError("dedupe keys kept changing under a concurrent enqueue; try again")


# --- claim -----------------------------------------------------------------

# A row's deliver-by time: its own, or the relay's default counted from when
# it is first due (the claim writes that down, so it does not move with retries).
_DEADLINE_SQL = (
    "COALESCE(m.expires_at, m.available_at + make_interval(secs => CAST(:default_ttl AS float8)))"
)

_CLAIM = f"""
    WITH due AS (
        SELECT m.id FROM outbox_message AS m
        WHERE m.status = 'pending' AND m.available_at <= now() {{channel_filter}}
          -- never hand out a row past its deliver-by time (the reaper expires it)
          AND ({_DEADLINE_SQL} > now()) IS NOT FALSE
          -- A paused channel is not claimed: its rows stay pending, no attempt counted.
          -- NOT IN (a hashed subplan, read once) rather than NOT EXISTS: the planner
          -- estimates an anti-join with a channel column of few distinct values
          -- (one channel: none) as matching nearly every row, then prefers a
          -- sequential scan and a sort of every pending row to the due index,
          -- JIT-compiled: 50 ms on 20,000 pending rows, 0.8 s on a grown table.
          -- The pause table's channel is its primary key, so never NULL.
          AND m.channel NOT IN (SELECT cp.channel FROM outbox_channel_pause AS cp)
          -- One row of an ordering key at a time, in id order: none of its key
          -- is claimed, and no earlier one is unfinished or holds the key
          -- (failed, dead or expired: its successors wait for an operator).
          AND (m.ordering_key IS NULL OR NOT EXISTS (
                SELECT 1 FROM outbox_message AS p
                WHERE p.ordering_key = m.ordering_key AND p.id <> m.id
                  AND (p.status = 'claimed'
                       OR (p.id < m.id
                           AND p.status IN ('pending', 'failed', 'dead', 'expired')))))
        ORDER BY m.priority DESC, m.available_at, m.id
        LIMIT :batch_size
        FOR UPDATE SKIP LOCKED
    )
    UPDATE outbox_message AS m
    SET status = 'claimed', claim_token = gen_random_uuid(), claimed_at = now(),
        lease_expires_at = now() + make_interval(secs => :lease_seconds),
        received_at = {{received_at}}, expires_at = {_DEADLINE_SQL}
    FROM due
    WHERE m.id = due.id AND m.status = 'pending'
    RETURNING {{returning}}
"""
_CHANNEL_FILTER = "AND m.channel = ANY(CAST(:channels AS text[]))"
_CLAIMED = "m.id, m.channel, m.claim_token, m.attempts + 1 AS attempt"
_CLAIM_ALL = _sql(_CLAIM.format(channel_filter="", received_at="NULL", returning=_CLAIMED))
_CLAIM_CHANNELS = _sql(
    _CLAIM.format(channel_filter=_CHANNEL_FILTER, received_at="NULL", returning=_CLAIMED)
)
# The claim of a process that sends its rows itself (``outbox worker``): the
# same compare-and-set, with the receipt taken in the same statement and the
# payloads returned, so no hand-off and no second statement before the sends.
_RECEIVED = """m.id, m.channel, CAST(m.payload AS text) AS payload, m.attempts + 1 AS attempt,
    COALESCE(m.max_attempts, :default_max) AS max_attempts, CAST(m.claim_token AS text),
    m.dedupe_key, m.ordering_key, CAST(:lease_seconds AS float8) AS lease_left"""
_CLAIM_AND_RECEIVE_ALL = _sql(
    _CLAIM.format(channel_filter="", received_at="now()", returning=_RECEIVED)
)
_CLAIM_AND_RECEIVE_CHANNELS = _sql(
    _CLAIM.format(channel_filter=_CHANNEL_FILTER, received_at="now()", returning=_RECEIVED)
)


def claim(
    conn: sa.Connection,
    batch_size: int,
    lease_seconds: float,
    channels: Sequence[str] | None = None,
    default_ttl_seconds: float | None = None,
) -> list[Claim]:
    """Claim up to ``batch_size`` due rows, highest priority first, for one lease.

    ``default_ttl_seconds``: the deliver-by time of rows without their own
    (counted from when they were first due); None: no default."""
    params: dict[str, Any] = {
        "batch_size": batch_size,
        "lease_seconds": float(lease_seconds),
        "default_ttl": None if default_ttl_seconds is None else float(default_ttl_seconds),
    }
    statement = _CLAIM_ALL
    if channels is not None:
        statement, params["channels"] = _CLAIM_CHANNELS, array_literal(channels)
    # _CLAIMED's columns are Claim's fields, in order.
    return sorted(map(Claim._make, conn.execute(statement, params)))


def claim_and_receive(
    conn: sa.Connection,
    batch_size: int,
    lease_seconds: float,
    default_max_attempts: int,
    channels: Sequence[str] | None = None,
    default_ttl_seconds: float | None = None,
) -> list[ClaimedMessage]:
    """``claim`` and ``receive_claimed`` in one statement, for a process that sends
    what it claims: the rows come back received, with their payloads (as text),
    ordered by id. Every write after it is fenced on the claim token as usual."""
    params: dict[str, Any] = {
        "batch_size": batch_size,
        "lease_seconds": float(lease_seconds),
        "default_ttl": None if default_ttl_seconds is None else float(default_ttl_seconds),
        "default_max": default_max_attempts,
    }
    statement = _CLAIM_AND_RECEIVE_ALL
    if channels is not None:
        statement, params["channels"] = _CLAIM_AND_RECEIVE_CHANNELS, array_literal(channels)
    return _claimed_messages(conn.execute(statement, params).all())


@dataclass(frozen=True)
class ChannelLoad:
    """Which channels have pending rows, and how many rows some have claimed."""

    pending_channels: list[str]
    claimed: dict[str, int]


_CHANNEL_LOAD = _sql(
    """
    WITH RECURSIVE pending AS (
        -- A skip scan of the per-channel index: one probe per channel name.
        (SELECT channel FROM outbox_message WHERE status = 'pending' ORDER BY channel LIMIT 1)
        UNION ALL
        SELECT (SELECT m.channel FROM outbox_message AS m
                WHERE m.status = 'pending' AND m.channel > p.channel
                ORDER BY m.channel LIMIT 1)
        FROM pending AS p WHERE p.channel IS NOT NULL
    )
    SELECT channel, NULL::bigint AS claimed FROM pending WHERE channel IS NOT NULL
    UNION ALL
    -- The claimed rows are few (bounded by the budgets): the lease index finds them.
    SELECT channel, count(*) FROM outbox_message
    WHERE status = 'claimed' AND channel = ANY(CAST(:channels AS text[]))
    GROUP BY channel
    """
)


def channel_load(conn: sa.Connection, channels: Sequence[str]) -> ChannelLoad:
    """The channels that have pending rows (due or not), and the rows claimed
    now for each of ``channels`` (absent: none), in one statement."""
    rows = conn.execute(_CHANNEL_LOAD, {"channels": array_literal(channels)}).all()
    return ChannelLoad(
        pending_channels=[r.channel for r in rows if r.claimed is None],
        claimed={r.channel: int(r.claimed) for r in rows if r.claimed is not None},
    )


_RELEASE = _sql(
    """
    UPDATE outbox_message AS m
    SET status = 'pending', claim_token = NULL, lease_expires_at = NULL,
        available_at = now() + make_interval(secs => :delay_seconds), last_error = :reason
    FROM unnest(CAST(:ids AS bigint[]), CAST(:tokens AS uuid[])) AS h(id, token)
    WHERE m.id = h.id AND m.claim_token = h.token AND m.status = 'claimed'
    RETURNING m.id
    """
)


def release(
    conn: sa.Connection,
    claims: Iterable[tuple[int, uuid.UUID | str]],
    reason: str,
    delay_seconds: float = 0,
) -> set[int]:
    """Give claims back without counting an attempt (a failed hand-off). Fenced."""
    pairs = list(claims)
    if not pairs:
        return set()
    rows = conn.execute(
        _RELEASE,
        {
            "ids": array_literal(i for i, _ in pairs),
            "tokens": array_literal(t for _, t in pairs),
            "reason": reason,
            "delay_seconds": float(delay_seconds),
        },
    ).all()
    return {r.id for r in rows}


# --- the sender's receipt and settle ----------------------------------------

# The receipt replaces a plain fenced read: the same one statement, but a
# compare-and-set, so of two senders handed one claim (a duplicated or
# replayed event, an Invoke retried after a timeout, an id listed twice) only
# one gets the row back; the other finds nothing to send. A row locked by the
# first is re-checked by the second after the first commits (READ COMMITTED),
# when ``received_at`` is no longer NULL.
_RECEIVE_CLAIMED = _sql(
    """
    UPDATE outbox_message AS m
    SET received_at = now()
    FROM unnest(CAST(:ids AS bigint[]), CAST(:tokens AS uuid[])) AS h(id, token)
    WHERE m.id = h.id AND m.claim_token = h.token
      AND m.status = 'claimed' AND m.channel = :channel AND m.lease_expires_at > now()
      AND m.received_at IS NULL
    RETURNING m.id, m.channel, CAST(m.payload AS text) AS payload, m.attempts + 1 AS attempt,
              COALESCE(m.max_attempts, :default_max) AS max_attempts,
              CAST(m.claim_token AS text), m.dedupe_key, m.ordering_key,
              EXTRACT(EPOCH FROM m.lease_expires_at - now())::float8 AS lease_left
    """
)


def receive_claimed(
    conn: sa.Connection,
    channel: str,
    claims: Iterable[tuple[int, uuid.UUID]],
    default_max_attempts: int,
) -> list[ClaimedMessage]:
    """Take the receipt of the claims this sender may send, once: a row missing
    here is not ours (settled, reaped, claimed again) or already taken by another
    sender. Repeated pairs count once. Ordered by id."""
    pairs = list(dict.fromkeys(claims))
    if not pairs:
        return []
    rows = conn.execute(
        _RECEIVE_CLAIMED,
        {
            "ids": array_literal(i for i, _ in pairs),
            "tokens": array_literal(t for _, t in pairs),
            "channel": channel,
            "default_max": default_max_attempts,
        },
    ).all()
    return _claimed_messages(rows)


def _claimed_messages(rows: Sequence[sa.Row[Any]]) -> list[ClaimedMessage]:
    # The receipts' columns are ClaimedMessage's fields, in order (lease_left
    # is float8 in both statements): each row is taken as it is.
    return sorted(map(ClaimedMessage._make, rows))


def bounded_delay(outcome: str, delay: Any, backoff: Backoff) -> float | None:
    """A channel's delay made safe to write, so one bad answer cannot break the
    batch's settle statement (a NaN or an infinity is no JSON number) or park a
    row for ever. A deferral is held to [min_deferral_seconds, 24 h]; a retry
    delay to [0, the backoff cap]. A delay that is no number (NaN, text, a
    bool) is ignored: the deferral floor, or the normal backoff. Other
    outcomes carry no delay."""
    if outcome not in ("deferred", "retry"):
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
    if outcome == "retry":
        return None if seconds is None else min(max(seconds, 0.0), backoff.cap_seconds)
    floor = backoff.min_deferral_seconds
    return min(max(seconds if seconds is not None else floor, floor), MAX_DEFERRAL_SECONDS)


_EXPIRED_PREFIX = "deliver-by time passed"

_SETTLE = _sql(
    f"""
    WITH input AS (
        -- one JSON document for the whole batch: no per-element escaping; each
        -- row an array [id, token, outcome, error, provider_id, delay_s, duration_ms]
        -- (half the text of objects, a third of the time to encode)
        SELECT CAST(e->>0 AS bigint) AS id, CAST(e->>1 AS uuid) AS token, e->>2 AS outcome,
               e->>3 AS error, e->>4 AS provider_id, CAST(e->>5 AS float8) AS delay_s,
               CAST(e->>6 AS int) AS duration_ms
        FROM jsonb_array_elements(CAST(:settlements AS jsonb)) AS e
    ),
    classified AS (
        -- A deferral past the row's deferral limit counts an attempt, like a retry.
        SELECT i.id, i.token, i.provider_id, i.delay_s, i.duration_ms,
               i.outcome = 'deferred' AS deferral,
               i.outcome = 'deferred' AND m.deferrals >= :max_deferrals AS capped,
               CASE WHEN i.outcome = 'deferred' AND m.deferrals >= :max_deferrals
                    THEN 'retry' ELSE i.outcome END AS outcome,
               CASE WHEN i.outcome = 'deferred' AND m.deferrals >= :max_deferrals
                    THEN 'deferred ' || m.deferrals || ' times, now counted as an attempt: '
                         || COALESCE(i.error, 'deferred')
                    ELSE i.error END AS error,
               m.attempts, m.attempts_at_redrive, m.max_attempts, m.deferrals, m.expires_at
        FROM input AS i JOIN outbox_message AS m ON m.id = i.id
    ),
    timed AS (
        SELECT m.*,
               m.attempts + CASE WHEN m.outcome = 'deferred' THEN 0 ELSE 1 END AS attempts_after,
               -- a counted deferral waits at least the backoff, so a receiver that
               -- keeps throttling cannot spend the attempts in seconds
               now() + make_interval(secs => CASE
                   WHEN m.capped THEN GREATEST(m.delay_s, {_BACKOFF_SQL})
                   WHEN m.outcome = 'retry' THEN COALESCE(m.delay_s, {_BACKOFF_SQL})
                   ELSE COALESCE(m.delay_s, 0) END) AS next_at
        FROM classified AS m
    ),
    decided AS (
        SELECT m.*,
               CASE WHEN m.outcome IN ('delivered', 'failed', 'suppressed') THEN m.outcome
                    WHEN m.outcome = 'retry' AND {_EXHAUSTED_SQL} THEN 'dead'
                    -- the next try would come too late: expire now, not then
                    WHEN m.next_at >= m.expires_at THEN 'expired'
                    ELSE 'pending' END AS next_status
        FROM timed AS m
    ),
    settled AS (
        UPDATE outbox_message AS m
        SET status = d.next_status,
            attempts = d.attempts_after,
            deferrals = d.deferrals + CASE WHEN d.deferral THEN 1 ELSE 0 END,
            available_at = CASE WHEN d.next_status = 'pending' THEN d.next_at
                                ELSE m.available_at END,
            claim_token = NULL,
            lease_expires_at = NULL,
            provider_message_id = COALESCE(d.provider_id, m.provider_message_id),
            last_error = CASE WHEN d.outcome = 'delivered' THEN NULL
                              WHEN d.next_status = 'expired'
                              THEN '{_EXPIRED_PREFIX} before the next try; last error: '
                                   || COALESCE(d.error, m.last_error, 'none')
                              ELSE COALESCE(d.error, m.last_error) END,
            settled_at = CASE WHEN d.next_status = 'pending' THEN NULL ELSE now() END
        FROM decided AS d
        -- The fence: a sender whose lease was taken matches nothing here.
        WHERE m.id = d.id AND m.claim_token = d.token AND m.status = 'claimed'
        RETURNING m.id, m.status, m.claimed_at, m.last_error, m.channel,
                  m.recipient_fingerprints, d.outcome, d.attempts_after, d.error,
                  d.provider_id, d.duration_ms
    ),
    logged AS (
        INSERT INTO outbox_attempt
            (message_id, attempt, outcome, error, provider_message_id, claimed_at, duration_ms,
             channel, recipient_fingerprints)
        SELECT id,
               attempts_after + CASE WHEN outcome = 'deferred' THEN 1 ELSE 0 END,
               CASE WHEN status IN ('dead', 'expired') THEN status ELSE outcome END,
               CASE WHEN status = 'expired' THEN last_error ELSE error END,
               provider_id, claimed_at, duration_ms, channel, recipient_fingerprints
        FROM settled
    )
    SELECT id, status FROM settled
    """
)


def settle(
    conn: sa.Connection, settlements: Sequence[Settlement], backoff: Backoff
) -> dict[int, str]:
    """Write every outcome of a batch and its attempt rows in one statement.

    Returns {id: new status} for the rows that were still ours; any id absent
    from the result had its lease taken, and nothing was written for it. Each
    delay is bounded first (``bounded_delay``): a bad one affects its row only.
    """
    if not settlements:
        return {}
    unknown = {s.outcome for s in settlements} - set(SEND_OUTCOMES)
    if unknown:
        raise ValueError(f"unknown outcome(s): {sorted(unknown)}")
    rows = conn.execute(
        _SETTLE,
        {
            "settlements": json.dumps(
                [
                    [
                        s.id,
                        str(s.claim_token),
                        s.outcome,
                        s.error,
                        s.provider_message_id,
                        bounded_delay(s.outcome, s.delay_seconds, backoff),
                        s.duration_ms,
                    ]
                    for s in settlements
                ],
                separators=(",", ":"),
            ),
            "max_deferrals": backoff.max_deferrals,
            **_backoff_params(backoff),
        },
    ).all()
    return {r.id: r.status for r in rows}


# --- the reaper ------------------------------------------------------------

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


_REAP = _sql(
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
                    ELSE now() + make_interval(secs => {_BACKOFF_SQL}) END AS next_at
        FROM outbox_message AS m JOIN lapsed USING (id)
    ),
    decided AS (
        SELECT m.*,
               CASE WHEN m.started AND {_EXHAUSTED_SQL} THEN 'dead'
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
            last_error = CASE WHEN d.next_status = 'expired' THEN '{_EXPIRED_PREFIX}; '
                              ELSE '' END
                         || CASE WHEN d.started THEN :error ELSE :not_started_error END,
            settled_at = CASE WHEN d.next_status <> 'pending' THEN now() END
        FROM decided AS d
        WHERE m.id = d.id
        RETURNING m.id, m.status, m.attempts, m.claimed_at, m.last_error, d.started, m.channel,
                  m.recipient_fingerprints
    ),
    logged AS (
        INSERT INTO outbox_attempt
            (message_id, attempt, outcome, error, claimed_at, channel, recipient_fingerprints)
        SELECT id, attempts + CASE WHEN started THEN 0 ELSE 1 END,
               CASE WHEN status IN ('dead', 'expired') THEN status
                    WHEN started THEN 'expired' ELSE 'not_started' END,
               last_error, claimed_at, channel, recipient_fingerprints
        FROM released
    )
    SELECT id, status, started FROM released
    """
)


def reap_expired(conn: sa.Connection, batch_size: int, backoff: Backoff) -> dict[int, Reaped]:
    """Release claims whose lease ran out (docs/design.md, invariant 5): after a receipt the
    attempt counts (``dead`` when out of attempts); without one it does not.
    Either ends ``expired`` when the next try would fall after the deliver-by time."""
    rows = conn.execute(
        _REAP,
        {
            "batch_size": batch_size,
            "error": LEASE_EXPIRED_ERROR,
            "not_started_error": NOT_STARTED_ERROR,
            **_backoff_params(backoff),
        },
    ).all()
    return {r.id: Reaped(r.status, r.started) for r in rows}


# Pending rows past their deliver-by time, in bounded batches: those with a
# time of their own (expiry index), and those under the relay's default,
# counted from when they are due (only rows never claimed have none written).
_EXPIRE_OVERDUE = _sql(
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
            last_error = '{_EXPIRED_PREFIX} before it was delivered'
                         || COALESCE('; last error: ' || m.last_error, '')
        WHERE m.id IN (SELECT id FROM own UNION ALL SELECT id FROM by_default)
          AND m.status = 'pending'
        RETURNING m.id, m.attempts, m.last_error, m.channel, m.recipient_fingerprints
    ),
    logged AS (
        INSERT INTO outbox_attempt
            (message_id, attempt, outcome, error, channel, recipient_fingerprints)
        SELECT id, attempts + 1, 'expired', last_error, channel, recipient_fingerprints
        FROM expired
    )
    SELECT id FROM expired
    """
)


def expire_overdue(conn: sa.Connection, batch_size: int, backoff: Backoff) -> set[int]:
    """pending -> expired for rows past their deliver-by time (up to two batches)."""
    rows = conn.execute(
        _EXPIRE_OVERDUE, {"batch_size": batch_size, "default_ttl": _ttl_param(backoff)}
    ).all()
    return {r.id for r in rows}


# Rows whose producer chose on_predecessor_failure='cancel', behind a row of
# their ordering key that ended failed, dead or expired. Driven from those
# few holding rows (the ordering index), bounded per run.
_CANCEL_HELD = _sql(
    """
    WITH doomed AS (
        SELECT m.id, min(f.id) AS holder
        FROM outbox_message AS f
        JOIN outbox_message AS m ON m.ordering_key = f.ordering_key AND m.id > f.id
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
    return {r.id for r in conn.execute(_CANCEL_HELD, {"batch_size": batch_size}).all()}


_PRUNE = sa.text(
    """
    WITH doomed AS (
        SELECT id FROM outbox_message
        WHERE status = ANY(CAST(:statuses AS text[]))
          AND settled_at < now() - make_interval(secs => :older_than_seconds)
        LIMIT :batch_size
        FOR UPDATE SKIP LOCKED
    )
    DELETE FROM outbox_message AS m USING doomed WHERE m.id = doomed.id
    """
)


def prune(
    conn: sa.Connection,
    older_than_seconds: float,
    batch_size: int,
    statuses: Sequence[str] = TERMINAL_STATUSES,
) -> int:
    """Delete up to ``batch_size`` terminal rows settled before the window.

    Their attempt history stays (``prune_attempts`` has its own retention), and
    so do their dedupe keys (``prune_dedupe_keys``, the dedupe window)."""
    bad = set(statuses) - set(TERMINAL_STATUSES)
    if bad:
        raise ValueError(f"only terminal rows can be pruned, not {sorted(bad)}")
    result = conn.execute(
        _PRUNE,
        {
            "statuses": list(statuses),
            "older_than_seconds": float(older_than_seconds),
            "batch_size": batch_size,
        },
    )
    return result.rowcount


_PRUNE_ATTEMPTS = sa.text(
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


_PRUNE_DEDUPE_KEYS = sa.text(
    """
    WITH doomed AS (
        SELECT channel, dedupe_key, recipient_fingerprint FROM outbox_dedupe
        WHERE created_at < now() - make_interval(secs => :older_than_seconds)
        ORDER BY created_at
        LIMIT :batch_size
        FOR UPDATE SKIP LOCKED
    )
    DELETE FROM outbox_dedupe AS d USING doomed
    WHERE (d.channel, d.dedupe_key, d.recipient_fingerprint)
        = (doomed.channel, doomed.dedupe_key, doomed.recipient_fingerprint)
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


_BACKLOG = sa.text(
    """
    SELECT
      count(*) FILTER (WHERE status = 'pending') AS pending,
      count(*) FILTER (WHERE status = 'pending' AND available_at <= now()) AS due,
      COALESCE(EXTRACT(EPOCH FROM now() - min(available_at)
               FILTER (WHERE status = 'pending' AND available_at <= now())), 0)::float8
          AS oldest_due_age,
      count(*) FILTER (WHERE status = 'claimed') AS claimed,
      count(*) FILTER (WHERE status = 'claimed' AND lease_expires_at < now()) AS expired_claims
    FROM outbox_message WHERE status IN ('pending', 'claimed')
    """
)
_DEAD_COUNT = sa.text(
    "SELECT count(*) FROM outbox_message WHERE status = 'dead' AND settled_at IS NOT NULL"
)
# Pending rows held behind a failed, dead or expired row of their ordering
# key, counted from those few holding rows (the ordering index).
_HELD_COUNT = _sql(
    """
    SELECT count(DISTINCT m.id)
    FROM outbox_message AS f
    JOIN outbox_message AS m ON m.ordering_key = f.ordering_key AND m.id > f.id
    WHERE f.ordering_key IS NOT NULL AND f.status IN ('failed', 'dead', 'expired')
      AND m.status = 'pending'
    """
)


def backlog(conn: sa.Connection) -> Backlog:
    """Backlog figures for metrics and `outbox status`; served by the partial indexes."""
    row = conn.execute(_BACKLOG).one()
    dead = conn.execute(_DEAD_COUNT).scalar_one()
    held = held_count(conn)
    return Backlog(
        pending=row.pending,
        due=row.due,
        oldest_due_age_seconds=float(row.oldest_due_age),
        claimed=row.claimed,
        expired_claims=row.expired_claims,
        dead=dead,
        held=held,
    )


def held_count(conn: sa.Connection) -> int:
    """Pending rows waiting behind a failed, dead or expired row of their ordering key."""
    return int(conn.execute(_HELD_COUNT).scalar_one())


_CHANNEL_BACKLOG = sa.text(
    """
    WITH live AS (
        SELECT channel,
          count(*) FILTER (WHERE status = 'pending') AS pending,
          count(*) FILTER (WHERE status = 'pending' AND available_at <= now()) AS due,
          COALESCE(EXTRACT(EPOCH FROM now() - min(available_at)
                   FILTER (WHERE status = 'pending' AND available_at <= now())), 0)::float8
              AS oldest_due_age,
          count(*) FILTER (WHERE status = 'claimed') AS claimed,
          count(*) FILTER (WHERE status = 'claimed' AND lease_expires_at < now())
              AS expired_claims,
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


@dataclass(frozen=True)
class ChannelBacklog:
    channel: str
    pending: int
    due: int
    oldest_due_age_seconds: float
    claimed: int
    expired_claims: int
    dead: int
    paused: bool


def channel_backlog(conn: sa.Connection) -> list[ChannelBacklog]:
    """Backlog figures per channel (one grouped statement): every channel with
    pending, claimed or dead rows, and every paused channel even without rows."""
    return [
        ChannelBacklog(
            channel=r.channel,
            pending=r.pending,
            due=r.due,
            oldest_due_age_seconds=float(r.oldest_due_age),
            claimed=r.claimed,
            expired_claims=r.expired_claims,
            dead=r.dead,
            paused=r.paused,
        )
        for r in conn.execute(_CHANNEL_BACKLOG).all()
    ]


# --- operator transitions ---------------------------------------------------

# Pending rows, and the rows that hold their ordering key: cancelling a
# failed, dead or expired row is how an operator lets its successors go
# without sending it again.
CANCELLABLE_STATUSES = ("pending", *HOLDING_STATUSES)
_CANCEL = sa.text(
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
        {"ids": list(ids), "reason": reason, "statuses": list(CANCELLABLE_STATUSES)},
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
_REDRIVE = sa.text(
    f"""
    UPDATE outbox_message SET {_REDRIVE_SET}
    WHERE id = ANY(CAST(:ids AS bigint[])) AND status IN ('dead', 'failed', 'expired')
    RETURNING id
    """
)


def redrive(conn: sa.Connection, ids: Sequence[int]) -> set[int]:
    """dead | failed | expired -> pending with a fresh set of attempts, numbered
    on from the last one (no second "attempt 1"); the stale claim fields and the
    last error are cleared, the attempt history stays. Rows held behind it in
    its ordering key follow once it is delivered."""
    rows = conn.execute(_REDRIVE, {"ids": list(ids)}).all()
    return {r.id for r in rows}


def payload_json(payload: Any) -> str:
    """The canonical JSON text stored for a payload."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


# --- operator read queries and filtered redrive (the `outbox` CLI) ----------
# Filters are checked against closed sets before they reach a statement, and
# every value travels as a bound parameter.

STATUSES = ("pending", "claimed", *TERMINAL_STATUSES)
REDRIVABLE_STATUSES = ("dead", "failed", "expired")


def _check_statuses(statuses: Sequence[str] | None, allowed: Sequence[str] = STATUSES) -> None:
    bad = set(statuses or ()) - set(allowed)
    if bad:
        raise ValueError(f"unknown status(es) {sorted(bad)}; choose from {', '.join(allowed)}")


_CHANNEL_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,63}$")  # the table's CHECK constraint


def _check_channels(channels: Sequence[str] | None) -> None:
    bad = [c for c in channels or () if not isinstance(c, str) or not _CHANNEL_NAME.match(c)]
    if bad:
        raise ValueError(f"not a channel name: {bad[0]!r}")


_CHANNEL_STATUS_COUNTS = sa.text(
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
    available_at, claimed_at, received_at, lease_expires_at, expires_at, settled_at
"""

_LIST_MESSAGES = sa.text(
    f"""
    SELECT {_MESSAGE_COLUMNS} FROM outbox_message
    WHERE (CAST(:statuses AS text[]) IS NULL OR status = ANY(CAST(:statuses AS text[])))
      AND (CAST(:channels AS text[]) IS NULL OR channel = ANY(CAST(:channels AS text[])))
      AND (CAST(:dedupe_key AS text) IS NULL OR dedupe_key = CAST(:dedupe_key AS text))
      AND (CAST(:ordering_key AS text) IS NULL OR ordering_key = CAST(:ordering_key AS text))
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
    after_id: int | None = None,
) -> list[sa.Row[Any]]:
    """The newest ``limit`` rows matching the filters (no payloads), newest
    first; ``after_id`` continues a listing after that row (older ids only)."""
    _check_statuses(statuses)
    _check_channels(channels)
    if not 1 <= limit <= 10_000:
        raise ValueError("limit must be between 1 and 10000")
    return list(
        conn.execute(
            _LIST_MESSAGES,
            {
                "statuses": list(statuses) if statuses else None,
                "channels": array_literal(channels) if channels else None,
                "dedupe_key": dedupe_key,
                "ordering_key": ordering_key,
                "after_id": after_id,
                "limit": limit,
            },
        ).all()
    )


_CHANNELS_WITH_ROWS = sa.text(
    """
    SELECT c.channel FROM unnest(CAST(:channels AS text[])) AS c(channel)
    WHERE EXISTS (SELECT 1 FROM outbox_message AS m WHERE m.channel = c.channel)
    """
)


def channels_with_rows(conn: sa.Connection, channels: Sequence[str]) -> set[str]:
    """Which of ``channels`` have messages in the outbox (any status)."""
    _check_channels(channels)
    if not channels:
        return set()
    rows = conn.execute(_CHANNELS_WITH_ROWS, {"channels": array_literal(channels)}).scalars()
    return set(rows)


# The payload as text: the caller decodes it (a row too deep to decode must
# still show, and must not leave the connection half-read).
_GET_MESSAGE = sa.text(
    f"SELECT {_MESSAGE_COLUMNS}, CAST(payload AS text) AS payload "
    "FROM outbox_message WHERE id = :id"
)
_ATTEMPT_HISTORY = sa.text(
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


_STATUSES_OF = sa.text(
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
    return {r.id: r.status for r in conn.execute(_STATUSES_OF, {"ids": list(ids)}).all()}


_MATCHING_IDS = sa.text(
    """
    SELECT id FROM outbox_message
    WHERE status = ANY(CAST(:statuses AS text[]))
      AND (CAST(:channels AS text[]) IS NULL OR channel = ANY(CAST(:channels AS text[])))
      AND (CAST(:since_seconds AS float8) IS NULL
           OR settled_at >= now() - make_interval(secs => CAST(:since_seconds AS float8)))
      AND (CAST(:dedupe_key AS text) IS NULL OR dedupe_key = CAST(:dedupe_key AS text))
      AND (CAST(:ordering_key AS text) IS NULL OR ordering_key = CAST(:ordering_key AS text))
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
) -> list[int]:
    """The ids a bulk redrive or cancel would change (settled within the last
    ``since_seconds`` when given), for the operator to confirm before
    :func:`redrive` or :func:`cancel` changes exactly those (if still in state)."""
    if not statuses:
        raise ValueError("at least one status is needed")
    _check_statuses(statuses)
    _check_channels(channels)
    return list(
        conn.execute(
            _MATCHING_IDS,
            {
                "statuses": list(statuses),
                "channels": array_literal(channels) if channels else None,
                "since_seconds": None if since_seconds is None else float(since_seconds),
                "dedupe_key": dedupe_key,
                "ordering_key": ordering_key,
            },
        ).scalars()
    )


# An operator's prune counts, confirms, then deletes against one cutoff taken
# from the database clock, so it never deletes more than it counted.
_PRUNE_CUTOFF = sa.text("SELECT now() - make_interval(secs => :older_than_seconds)")
_PRUNABLE = sa.text(
    """
    SELECT count(*) FROM outbox_message
    WHERE status = ANY(CAST(:statuses AS text[])) AND settled_at < :cutoff
    """
)
_PRUNE_BEFORE = sa.text(
    """
    WITH doomed AS (
        SELECT id FROM outbox_message
        WHERE status = ANY(CAST(:statuses AS text[])) AND settled_at < :cutoff
        LIMIT :batch_size
        FOR UPDATE SKIP LOCKED
    )
    DELETE FROM outbox_message AS m USING doomed WHERE m.id = doomed.id
    """
)


# --- provider feedback (SES bounce, complaint and delivery events) ------------

FEEDBACK_OUTCOMES = ("bounced", "complained", "transient_bounce", "delivery_confirmed")


@dataclass(frozen=True)
class Feedback:
    """One provider event about a sent message, as the feedback function parsed it.

    ``feedback_id`` names the event (the provider's feedback id, or a digest of
    the event): the same event recorded twice writes nothing the second time.
    ``reason`` is free of addresses (the parser scrubs them).
    """

    provider_message_id: str
    outcome: str
    feedback_id: str
    reason: str | None = None


@dataclass(frozen=True)
class FeedbackResult:
    provider_message_id: str
    outcome: str
    message_id: int | None  # None: no email message has this provider id
    recorded: bool  # False for a matched event recorded before (a repeat)
    new_status: str | None  # set when the event moved the message


_RECORD_FEEDBACK = _sql(
    """
    WITH input AS (
        SELECT * FROM jsonb_to_recordset(CAST(:events AS jsonb))
            AS i(ord int, provider_id text, outcome text, error text, feedback_id text)
    ),
    matched AS (
        SELECT i.*, m.id AS message_id, m.attempts, m.channel, m.recipient_fingerprints
        FROM input AS i
        JOIN outbox_message AS m
          ON m.provider_message_id = i.provider_id AND m.channel = 'email'
    ),
    logged AS (
        INSERT INTO outbox_attempt
            (message_id, attempt, outcome, error, provider_message_id, feedback_id, channel,
             recipient_fingerprints)
        SELECT message_id, attempts, outcome, error, provider_id, feedback_id, channel,
               recipient_fingerprints
        FROM matched
        ORDER BY ord
        -- the same event twice (an SNS redelivery, two subscriptions) is one row
        ON CONFLICT (message_id, feedback_id) WHERE feedback_id IS NOT NULL DO NOTHING
        RETURNING id, message_id, outcome, error, feedback_id
    ),
    first_final AS (
        -- a bounce and a complaint in one batch: the first one decides
        SELECT DISTINCT ON (message_id) id AS attempt_id, message_id, outcome, error
        FROM logged WHERE outcome IN ('bounced', 'complained')
        ORDER BY message_id, id
    ),
    moved AS (
        -- only a delivered message moves: a repeat, or feedback on a message
        -- that already bounced, leaves its status alone
        UPDATE outbox_message AS m SET status = f.outcome, last_error = f.error
        FROM first_final AS f
        WHERE m.id = f.message_id AND m.status = 'delivered'
        RETURNING f.attempt_id, m.status
    )
    SELECT i.ord, mt.message_id, (l.id IS NOT NULL) AS recorded, mv.status AS new_status
    FROM input AS i
    LEFT JOIN matched AS mt ON mt.ord = i.ord
    LEFT JOIN logged AS l ON l.message_id = mt.message_id AND l.feedback_id = i.feedback_id
    LEFT JOIN moved AS mv ON mv.attempt_id = l.id
    ORDER BY i.ord
    """
)


def record_feedback(conn: sa.Connection, events: Sequence[Feedback]) -> list[FeedbackResult]:
    """Record a batch of provider events in one statement: an attempt row each
    (with the provider's reason), and ``delivered -> bounced | complained`` for
    permanent bounces and complaints. Idempotent per (message, feedback id).

    ``events`` must not repeat a (provider id, feedback id) pair.
    """
    if not events:
        return []
    unknown = {e.outcome for e in events} - set(FEEDBACK_OUTCOMES)
    if unknown:
        raise ValueError(f"unknown feedback outcome(s): {sorted(unknown)}")
    rows = conn.execute(
        _RECORD_FEEDBACK,
        {
            "events": json.dumps(
                [
                    {
                        "ord": n,
                        "provider_id": e.provider_message_id,
                        "outcome": e.outcome,
                        "error": e.reason,
                        "feedback_id": e.feedback_id,
                    }
                    for n, e in enumerate(events)
                ],
                separators=(",", ":"),
            )
        },
    ).all()
    return [
        FeedbackResult(
            provider_message_id=events[r.ord].provider_message_id,
            outcome=events[r.ord].outcome,
            message_id=r.message_id,
            recorded=bool(r.recorded),
            new_status=r.new_status,
        )
        for r in rows
    ]


# --- outcome events (the transitions applications react to) -------------------
# A trigger (migration 0007) writes one outbox_outcome_event row per transition
# in the transition's own statement. The publisher takes due rows under a lease
# (SKIP LOCKED, so publishers never share a row), puts them on EventBridge, and
# deletes what was published. A publisher that dies between PutEvents and the
# delete leaves its rows leased: they are published again, with the same event
# id, once the lease ends (at least once).

OUTCOME_EVENT_STATUSES = ("failed", "dead", "expired", "bounced", "complained", "delivered")
_DELIVERED_EVENT_TRIGGER = "outbox_message_delivered_event"


@dataclass(frozen=True)
class OutcomeEvent:
    id: int
    message_id: int
    channel: str
    status: str
    attempts: int
    last_error: str | None
    provider_message_id: str | None
    dedupe_key: str | None
    ordering_key: str | None
    occurred_at: Any  # datetime, from the database clock


_TAKE_OUTCOME_EVENTS = _sql(
    """
    WITH due AS (
        SELECT id FROM outbox_outcome_event
        WHERE publish_after <= now()
        ORDER BY publish_after, id
        LIMIT :batch_size
        FOR UPDATE SKIP LOCKED
    )
    UPDATE outbox_outcome_event AS e
    SET publish_after = now() + make_interval(secs => :lease_seconds),
        publish_attempts = e.publish_attempts + 1
    FROM due
    WHERE e.id = due.id
    RETURNING e.id, e.message_id, e.channel, e.status, e.attempts, e.last_error,
              e.provider_message_id, e.dedupe_key, e.ordering_key, e.occurred_at
    """
)


def _check_prunable(statuses: Sequence[str]) -> None:
    bad = set(statuses) - set(TERMINAL_STATUSES)
    if bad:
        raise ValueError(f"only terminal rows can be pruned, not {sorted(bad)}")


def prune_cutoff(conn: sa.Connection, older_than_seconds: float) -> Any:
    """``now() - older_than`` on the database clock."""
    return conn.execute(
        _PRUNE_CUTOFF, {"older_than_seconds": float(older_than_seconds)}
    ).scalar_one()


def count_prunable(conn: sa.Connection, cutoff: Any, statuses: Sequence[str]) -> int:
    _check_prunable(statuses)
    return int(conn.execute(_PRUNABLE, {"statuses": list(statuses), "cutoff": cutoff}).scalar_one())


def prune_settled_before(
    conn: sa.Connection, cutoff: Any, batch_size: int, statuses: Sequence[str]
) -> int:
    """Delete up to ``batch_size`` rows in ``statuses`` settled before ``cutoff``."""
    _check_prunable(statuses)
    result = conn.execute(
        _PRUNE_BEFORE, {"statuses": list(statuses), "cutoff": cutoff, "batch_size": batch_size}
    )
    return result.rowcount


def take_outcome_events(
    conn: sa.Connection, batch_size: int, lease_seconds: float
) -> list[OutcomeEvent]:
    """Lease up to ``batch_size`` due events to this publisher, oldest first.

    No cursor: every row not yet deleted is found, whatever order the
    transactions that wrote them committed in."""
    rows = conn.execute(
        _TAKE_OUTCOME_EVENTS, {"batch_size": batch_size, "lease_seconds": float(lease_seconds)}
    ).all()
    events = [
        OutcomeEvent(
            id=r.id,
            message_id=r.message_id,
            channel=r.channel,
            status=r.status,
            attempts=r.attempts,
            last_error=r.last_error,
            provider_message_id=r.provider_message_id,
            dedupe_key=r.dedupe_key,
            ordering_key=r.ordering_key,
            occurred_at=r.occurred_at,
        )
        for r in rows
    ]
    events.sort(key=lambda e: e.id)
    return events


_FINISH_OUTCOME_EVENTS = _sql(
    """
    WITH published AS (
        DELETE FROM outbox_outcome_event WHERE id = ANY(CAST(:published AS bigint[]))
        RETURNING id
    ),
    refused AS (
        -- kept, and tried again when the lease taken with them ends
        UPDATE outbox_outcome_event AS e SET publish_error = f.error
        FROM jsonb_to_recordset(CAST(:failures AS jsonb)) AS f(id bigint, error text)
        WHERE e.id = f.id
        RETURNING e.id
    )
    SELECT (SELECT count(*) FROM published) AS published, (SELECT count(*) FROM refused) AS refused
    """
)


def finish_outcome_events(
    conn: sa.Connection, published: Sequence[int], failures: dict[int, str]
) -> int:
    """Delete the published events and note why the others were refused (they
    stay leased until their lease ends, which is their back-off). Returns how
    many were deleted."""
    if not published and not failures:
        return 0
    row = conn.execute(
        _FINISH_OUTCOME_EVENTS,
        {
            "published": array_literal(published),
            "failures": json.dumps([{"id": i, "error": e} for i, e in failures.items()]),
        },
    ).one()
    return int(row.published)


_DROP_OUTCOME_EVENTS = sa.text(
    """
    WITH doomed AS (
        SELECT id FROM outbox_outcome_event
        WHERE occurred_at < now() - make_interval(secs => :older_than_seconds)
        LIMIT :batch_size
        FOR UPDATE SKIP LOCKED
    )
    DELETE FROM outbox_outcome_event AS e USING doomed WHERE e.id = doomed.id
    """
)


def drop_outcome_events(conn: sa.Connection, older_than_seconds: float, batch_size: int) -> int:
    """Delete up to ``batch_size`` unpublished events older than the window
    (when no bus is configured, nothing else ever removes them)."""
    result = conn.execute(
        _DROP_OUTCOME_EVENTS,
        {"older_than_seconds": float(older_than_seconds), "batch_size": batch_size},
    )
    return result.rowcount


_OUTCOME_EVENT_BACKLOG = sa.text(
    """
    SELECT count(*) AS waiting,
           COALESCE(EXTRACT(EPOCH FROM now() - min(occurred_at)), 0)::float8 AS oldest_age
    FROM outbox_outcome_event
    """
)


def outcome_event_backlog(conn: sa.Connection) -> tuple[int, float]:
    """(events not yet published, age in seconds of the oldest)."""
    row = conn.execute(_OUTCOME_EVENT_BACKLOG).one()
    return int(row.waiting), float(row.oldest_age)


_DELIVERED_EVENTS_ENABLED = sa.text(
    """
    SELECT tgenabled <> 'D' FROM pg_trigger
    WHERE tgrelid = 'outbox_message'::regclass AND tgname = :name
    """
)


def set_delivered_outcome_events(conn: sa.Connection, enabled: bool) -> bool:
    """Turn the ``delivered`` outcome event on or off (the trigger that writes
    it); off, a delivery costs nothing extra. Needs the table's owner (the
    migrate function). Returns whether anything changed."""
    current = conn.execute(_DELIVERED_EVENTS_ENABLED, {"name": _DELIVERED_EVENT_TRIGGER}).scalar()
    if current is None or bool(current) == enabled:
        return False
    action = "ENABLE" if enabled else "DISABLE"  # a closed choice, never input
    conn.execute(sa.text(f"ALTER TABLE outbox_message {action} TRIGGER {_DELIVERED_EVENT_TRIGGER}"))
    return True


# --- the send log: attempts by recipient -------------------------------------

_ADDRESS_FINGERPRINTS = sa.text(
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
_RECIPIENT_HISTORY = sa.text(
    """
    WITH hits AS MATERIALIZED (
        SELECT a.* FROM outbox_attempt AS a
        WHERE a.recipient_fingerprints && CAST(:fps AS bytea[])
    )
    SELECT a.finished_at, a.channel, a.message_id, a.attempt, a.outcome, a.error,
           a.provider_message_id, a.claimed_at, a.duration_ms,
           m.status AS message_status, m.dedupe_key
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
    conn: sa.Connection, address: str, channels: Sequence[str], limit: int = 50
) -> list[sa.Row[Any]]:
    """The attempts that went to ``address`` on the given channels, newest
    first. The address is fingerprinted in the database with the installation's
    key, as at enqueue; it is never stored. ``message_status`` and
    ``dedupe_key`` are None once the message was pruned."""
    _check_channels(channels)
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
            },
        ).all()
    )


# --- pausing a channel ---------------------------------------------------------
# A row in outbox_channel_pause keeps the claim away from the channel's rows;
# claims taken before the pause finish normally.

_PAUSE = sa.text(
    """
    INSERT INTO outbox_channel_pause (channel, reason) VALUES (:channel, :reason)
    ON CONFLICT (channel) DO UPDATE
        SET reason = COALESCE(EXCLUDED.reason, outbox_channel_pause.reason)
    RETURNING paused_at, (xmax = 0) AS newly_paused
    """
)
_RESUME = sa.text("DELETE FROM outbox_channel_pause WHERE channel = :channel RETURNING channel")
_PAUSED = sa.text("SELECT channel, reason, paused_at FROM outbox_channel_pause ORDER BY channel")
_CHANNEL_HAS_ROWS = sa.text("SELECT EXISTS (SELECT 1 FROM outbox_message WHERE channel = :channel)")


@dataclass(frozen=True)
class PausedChannel:
    channel: str
    reason: str | None
    paused_at: Any


def pause_channel(conn: sa.Connection, channel: str, reason: str | None = None) -> bool:
    """Stop claiming ``channel``'s rows. True if it was not paused before (a repeat
    keeps the first pause time, and its reason unless a new one is given)."""
    _check_channels([channel])
    return bool(conn.execute(_PAUSE, {"channel": channel, "reason": reason}).one().newly_paused)


def resume_channel(conn: sa.Connection, channel: str) -> bool:
    """Claim ``channel`` again. True if it was paused."""
    _check_channels([channel])
    return conn.execute(_RESUME, {"channel": channel}).one_or_none() is not None


def paused_channels(conn: sa.Connection) -> list[PausedChannel]:
    return [PausedChannel(r.channel, r.reason, r.paused_at) for r in conn.execute(_PAUSED).all()]


def channel_has_rows(conn: sa.Connection, channel: str) -> bool:
    return bool(conn.execute(_CHANNEL_HAS_ROWS, {"channel": channel}).scalar_one())
