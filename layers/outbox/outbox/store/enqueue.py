"""The producer's statements: enqueue, with dedupe per recipient and the
per-ordering-key lock (what ``outbox.enqueue`` and ``enqueue_many`` run)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import sqlalchemy as sa

from ..errors import DedupeConflict, OutboxError
from ..states import PredecessorFailure
from ._sql import array_literal, statement


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
    on_predecessor_failure: str = PredecessorFailure.HOLD


def payload_json(payload: Any) -> str:
    """The canonical JSON text stored for a payload."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


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
_INSERT_UNKEYED = statement(
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

_INSERT = statement(
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
_LOCK_ORDERING_KEYS = statement(
    """
    SELECT count(pg_advisory_xact_lock(hashtextextended('outbox-ordering-key:' || k, 0)))
    FROM (SELECT DISTINCT k FROM unnest(CAST(:keys AS text[])) AS u(k) ORDER BY k) AS keys
    """
)

# Takes back what one _INSERT wrote, inside the caller's transaction (the
# keys by their primary key: outbox_dedupe has no index on message_id).
_UNDO_INSERT = statement(
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
        "priorities": array_literal(m.priority for m in messages),
        "delays": array_literal(float(m.delay_seconds) for m in messages),
        "max_attempts": array_literal(m.max_attempts for m in messages),
        "expires_at": array_literal([m.expires_at for m in messages]),
        "ttls": array_literal(m.ttl_seconds for m in messages),
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
