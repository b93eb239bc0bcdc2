"""The hot path's statements: the dispatcher's claim and release, the sender's
receipt and settle (docs/design.md, invariants 1, 2, 3 and 7).

Every write after a claim is fenced on (id, status = 'claimed', claim_token);
a writer whose lease was lost matches nothing, and the returned ids say so.
"""

from __future__ import annotations

import re
import uuid
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import sqlalchemy as sa

from ..limits import CHANNEL_WIDE
from ..payloads import MAX_STORED_BYTES
from ..states import SETTLE_OUTCOMES
from ._sql import (
    CLAIM_RUNS_AFTER_A_MOVE,
    array_literal,
    execute_fenced,
    json_document,
    prepared,
    statement,
)
from .cooldown import CLAIM_GATE as COOLDOWN_GATE
from .cooldown import CLAIM_PASSES as COOLDOWN_PASSES
from .cooldown import SETTLE_WINDOW as COOLDOWN_WINDOW
from .policy import BACKOFF_SQL, DEADLINE_SQL, EXHAUSTED_SQL, EXPIRED_PREFIX, Backoff, bounded_delay
from .rates import BUCKETED_SQL, TOKENS_NOW_SQL
from .tenants import TENANT_TOKENS_NOW_SQL

__all__ = [
    "ChannelLoad",
    "Claim",
    "ClaimedMessage",
    "Held",
    "Settled",
    "Settlement",
    "channel_load",
    "claim",
    "claim_and_receive",
    "receive_claimed",
    "release",
    "settle",
    "settle_with_outcomes",
    "unowned_claims",
]


# The per-row records of the hot path (claim, receipt, settle) are NamedTuples,
# not frozen dataclasses: as immutable, and built in a fifth of the time (a
# frozen dataclass sets each field through object.__setattr__).
class Claim(NamedTuple):
    """A claimed row as the dispatcher hands it to a channel function."""

    id: int
    channel: str
    # The token's canonical text: it only goes into the hand-off event and back
    # into fenced statements, which cast it (a uuid.UUID parsed from every row
    # and printed again cost more than the rest of the claim's Python).
    claim_token: uuid.UUID | str
    attempt: int


class ClaimedMessage(NamedTuple):
    """A row the sender took its receipt for: it alone sends it, once.

    Its fields are the receipts' columns, in their order (``_received``)."""

    id: int
    channel: str
    # The stored JSON as text: the sender decodes each row by itself
    # (``payloads.decode``), so one undecodable row fails alone. None: far
    # past the size limit, left in the database (``_PAYLOAD_TEXT``).
    payload: str | None
    attempt: int
    max_attempts: int
    # As text: it only goes back into the fenced statements, which cast it;
    # a UUID object per row cost more than the rest of the row's decoding.
    claim_token: str
    dedupe_key: str | None
    ordering_key: str | None
    lease_left_seconds: float
    # The key a provider's rate applies to (docs/design.md, Data model).
    destination: str = ""
    # Whether the row's channel was paused when the receipt was taken (a
    # quota's or an operator's pause since the claim): then it is not sent but
    # given back as not started. Read in the receipt's own statement, so a
    # batch costs no second round trip for it.
    channel_paused: bool = False
    # Whether the row's destination was paused when the receipt was taken (a
    # throttle another sender heard since the claim): given back the same way.
    destination_paused: bool = False
    # Whether the signing secret the row's payload names is not its tenant's
    # (a mapping changed after the door let it in): failed, never signed
    # with another tenant's key (migration 0022, outbox_secret_refused).
    secret_refused: bool = False
    # The row's tenant (None: none). The Lambda sender settles the rows of
    # its first wave early when an event holds several tenants' rows.
    tenant: str | None = None


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


class Held(Protocol):
    """A claim as the fence sees it: a row's id and the token of its claim
    (a ``Claim``, a ``ClaimedMessage``)."""

    @property
    def id(self) -> int: ...

    @property
    def claim_token(self) -> uuid.UUID | str: ...


# How many throttled or limited destinations one claim draws from (each a
# probe of the per-destination index); the others wait for the next claim.
BUCKETS_PER_CLAIM = 8
# How many of those, least recently drawn first, one claim looks at for a row
# due (a probe each); those with none go to the back of the turn.
BUCKET_CANDIDATES = 64
# How many tenants with pending rows one claim shares its batch among (a
# probe of the per-tenant due index each, then at most a batch of ids read
# from it, unlocked); with more, the next claim starts after the last of them.
TENANTS_PER_CLAIM = 32
# Whether due row ``m``'s destination is paused or has a bucket (its rows are
# drawn from it, in the bucketed scan): a probe of the destinations' key for
# each row the scan reads, not a hashed list of them all, so that the claim's
# cost does not grow with the destinations that throttled. A scalar subquery,
# which the planner keeps as it is written.
_SKIPPED_DESTINATION = f"""COALESCE((
                SELECT true FROM outbox_destination AS d
                WHERE d.channel = m.channel AND d.destination = COALESCE(m.destination, '')
                  AND (d.paused_until > now() OR {BUCKETED_SQL})), false)"""
# Whether destination row ``d`` has a row due in the channels claimed. A
# scalar subquery (LIMIT 1), not EXISTS: the planner may turn an EXISTS into a
# join with every due row, aggregated (a read of the whole backlog a claim).
# Ordered as the per-destination due index is, so that it is read (the first
# due row of the destination), never the table.
_BUCKET_HAS_DUE = """COALESCE((
                SELECT true FROM outbox_message AS m
                WHERE m.channel = d.channel AND m.destination = d.destination
                  AND m.status = 'pending' AND m.available_at <= now() {channel_filter}
                ORDER BY m.channel, m.destination, m.priority DESC, m.available_at, m.id
                LIMIT 1), false)"""


def _idle_to_the_back(
    table: str, tokens_now: str, key: tuple[str, str], turn: str, due_turn: str
) -> str:
    """The UPDATE that sends a bucket turn's buckets with nothing due to the
    back of it (``table``, aliased as ``tokens_now`` reads it; its ``key``;
    the CTEs ``turn`` and ``due_turn``): their tokens as they are now,
    counted from now (the same bucket). Only rows nobody holds: a claimer
    never waits here."""
    alias = table.rsplit(" ", 1)[1]
    columns = ", ".join(key)
    return f"""UPDATE {table}
        SET tokens = {tokens_now}, tokens_at = now()
        FROM (SELECT {", ".join(f"i.{c}" for c in key)} FROM {table.split()[0]} AS i
              WHERE ({", ".join(f"i.{c}" for c in key)}) IN (
                    SELECT {columns} FROM {turn} EXCEPT SELECT {columns} FROM {due_turn})
              FOR UPDATE SKIP LOCKED) AS t
        WHERE {" AND ".join(f"{alias}.{c} = t.{c}" for c in key)}"""


# Whether tenant's channel ``t`` has a row due (as _BUCKET_HAS_DUE, on the
# per-tenant due index).
_TENANT_BUCKET_HAS_DUE = """COALESCE((
                SELECT true FROM outbox_message AS m
                WHERE m.tenant = t.tenant AND m.channel = t.channel
                  AND m.status = 'pending' AND m.available_at <= now() {channel_filter}
                ORDER BY m.tenant, m.priority DESC, m.available_at, m.id
                LIMIT 1), false)"""


# A claim test that the planner must take as passing nearly every row, as it
# does on a due row, whatever the statistics say: ``(CASE WHEN test THEN 1
# END) IS NOT NULL``, which it estimates as 0.995 (a NULL test of an
# expression it has no statistics for). Written plainly, each test was
# estimated from the whole table's columns, mostly settled rows (deliver-by
# times all past), or as a half (a subquery's test): four of them made a
# sixteenth of the due rows, and the claim then costed reading the due index
# in order as reading much of it. Beside 1M settled rows that flipped it to a
# read of every due row and a sort (230 ms a claim instead of 5 for a
# 100,000-row backlog), and at batch 1000 it crossed jit_above_cost even on a
# fresh table (some 250 ms of JIT compilation a claim).
def _passes(test: str) -> str:
    return f"(CASE WHEN {test} THEN 1 END) IS NOT NULL"


# What makes a pending row claimable now, whatever its destination (the
# claim's two scans below share it).
_CLAIMABLE = f"""
          m.status = 'pending' AND m.available_at <= now() {{channel_filter}}
          -- never hand out a row past its deliver-by time (the reaper expires it):
          -- ({DEADLINE_SQL} > now()) IS NOT FALSE
          AND {
    _passes(
        "CASE WHEN m.expires_at IS NOT NULL THEN m.expires_at > now() "
        "WHEN CAST(:default_ttl AS float8) IS NULL THEN true "
        "ELSE m.available_at > now() - make_interval(secs => CAST(:default_ttl AS float8)) "
        "END"
    )
}
          -- A paused channel is not claimed: its rows stay pending, no attempt counted.
          -- NOT IN (a hashed subplan, read once) rather than NOT EXISTS: the planner
          -- estimates an anti-join with a channel column of few distinct values
          -- (one channel: none) as matching nearly every row, then prefers a
          -- sequential scan and a sort of every pending row to the due index,
          -- JIT-compiled: 50 ms on 20,000 pending rows, 0.8 s on a grown table.
          -- The pause table's channel is its primary key, so never NULL.
          AND {
    _passes(
        "m.channel NOT IN (SELECT cp.channel FROM outbox_channel_pause AS cp "
        "WHERE cp.paused_until IS NULL OR cp.paused_until > now())"
    )
}
          -- A paused tenant's rows wait (outbox tenant pause), as a channel's do,
          -- and so do a tenant's rows of a channel paused for it alone
          -- (outbox pause CHANNEL --tenant T): hashed subplans, read once.
          AND {
    _passes("m.tenant NOT IN (SELECT tp.tenant FROM outbox_tenant AS tp WHERE tp.paused)")
}
          --<tenant channels
          AND {
    _passes(
        "(m.tenant, m.channel) NOT IN (SELECT tc.tenant, tc.channel "
        "FROM outbox_tenant_channel AS tc WHERE tc.paused)"
    )
}
          --tenant channels>
          -- One row of a tenant's ordering key at a time, in id order: none of its key
          -- is claimed, and no earlier one is unfinished or holds the key
          -- (failed, dead or expired: its successors wait for an operator).
          AND (m.ordering_key IS NULL OR NOT EXISTS (
                SELECT 1 FROM outbox_message AS p
                WHERE p.ordering_key = m.ordering_key AND p.tenant = m.tenant AND p.id <> m.id
                  AND (p.status = 'claimed'
                       OR (p.id < m.id
                           AND p.status IN ('pending', 'failed', 'dead', 'expired')))))
"""

# The tenants with pending rows, from just after ``{start}`` in name order
# (a loose scan of the per-tenant due index: one probe a tenant).
_TENANT_WALK = """
    {name}(tenant, k) AS (
        SELECT (SELECT m.tenant FROM outbox_message AS m
                WHERE m.status = 'pending' AND m.tenant {first} {start}
                ORDER BY m.tenant LIMIT 1), 1
        UNION ALL
        SELECT (SELECT m.tenant FROM outbox_message AS m
                WHERE m.status = 'pending' AND m.tenant > w.tenant
                ORDER BY m.tenant LIMIT 1), w.k + 1
        FROM {name} AS w WHERE w.tenant IS NOT NULL AND w.k < {limit}
    ),"""

# The claim's cooldown gate and compare-and-set, after its ``due`` rows (every
# form of the claim ends with them; ``received_at`` and ``returning`` are the
# claim's format fields).
_CLAIM_UPDATE = f"""{COOLDOWN_GATE}    claimed AS (
    UPDATE outbox_message AS m
    SET status = 'claimed', claim_token = gen_random_uuid(), claimed_at = now(),
        lease_expires_at = now() + make_interval(secs => :lease_seconds),
        received_at = {{received_at}}, expires_at = {DEADLINE_SQL}
    FROM due
    -- The compare-and-set again (the CTE's rows are locked and were pending),
    -- as IS TRUE: a plain status = 'pending' lets the planner, when the
    -- statistics saw no pending row, walk every pending row through a partial
    -- index against the batch instead of looking each id up (150 ms a claim
    -- after a burst of 10,000 rows on an idle table). The IN before it names
    -- the live rows' partition, which an IS TRUE alone cannot (every
    -- partition would be probed for each id).
    WHERE m.id = due.id AND m.status IN ('pending', 'claimed') AND (m.status = 'pending') IS TRUE
      AND {COOLDOWN_PASSES}
    RETURNING {{returning}}
    )"""

# Whether the claim's gates beyond the due row's own are all idle now: no
# tenant's channel paused or limited, no destination paused or bucketed (a
# limit, a learned rate), so no channel limited as a whole, and at most one
# tenant with pending rows (nobody to share the batch with). Each a probe of
# a small table or of the per-tenant due index: the last tenant with pending
# rows, then any before it. Both are asked for in the index's order (ORDER BY
# ... DESC LIMIT 1), not as an EXISTS: the planner cannot see the last tenant
# (a subquery's), so it took a third of the live rows to match, and once the
# live partition had churned since its last vacuum it read the whole
# partition for the first match that never came, on every claim
# (test_claim.py, the one-tenant check). From the index's end, not its
# start: a tenant's oldest entries come first, and those of rows claimed
# since the last vacuum are dead (a thousand pages to step over beside a
# busy day's 200,000); its newest are the pending rows still to claim.
_LEAN_FITS = f"""(NOT EXISTS (SELECT 1 FROM outbox_tenant_channel)
        AND NOT EXISTS (SELECT 1 FROM outbox_destination AS d
                        WHERE {BUCKETED_SQL} OR d.paused_until > now())
        AND (SELECT m.tenant FROM outbox_message AS m
             WHERE m.status = 'pending' AND m.tenant < (
                 SELECT f.tenant FROM outbox_message AS f
                 WHERE f.status = 'pending' ORDER BY f.tenant DESC LIMIT 1)
             ORDER BY m.tenant DESC LIMIT 1) IS NULL)"""
# Which claim the next one should be (the claim's last row says): the lean
# one, the full one without the tenants' channel parts, or with them.
LEAN, FULL, FULL_WITH_TENANT_CHANNELS = 0, 1, 2
_CLAIM_FORM = f"""CASE WHEN EXISTS (SELECT 1 FROM outbox_tenant_channel)
        THEN {FULL_WITH_TENANT_CHANNELS} WHEN {{fits}} THEN {LEAN} ELSE {FULL} END"""


_CLAIM = f"""
    WITH RECURSIVE
{
    _TENANT_WALK.format(
        name="tenant_after",
        first=">",
        limit=TENANTS_PER_CLAIM,
        start="(SELECT c.tenant FROM outbox_tenant_turn AS c)",
    )
}
{_TENANT_WALK.format(name="tenant_from_start", first=">=", limit=TENANTS_PER_CLAIM, start="''")}
    tenant_turn AS MATERIALIZED (
        -- Fair share among tenants (docs/design.md, Tenants): the tenants with
        -- pending rows after the one the last full turn ended at, then from the
        -- start, not paused, at most TENANTS_PER_CLAIM, with their weights.
        SELECT w.tenant, COALESCE(t.weight, 1) AS weight,
               row_number() OVER (ORDER BY w.lap, w.k) AS k,
               -- its part of the fair share's candidates (twice the batch), by weight
               CAST(ceil(2.0 * CAST(:batch_size AS int) * COALESCE(t.weight, 1)
                         / sum(COALESCE(t.weight, 1)) OVER ()) AS int) AS share
        FROM (SELECT a.tenant, 1 AS lap, a.k FROM tenant_after AS a
              UNION ALL
              SELECT b.tenant, 2, b.k FROM tenant_from_start AS b
              WHERE b.tenant <= (SELECT c.tenant FROM outbox_tenant_turn AS c)) AS w
        LEFT JOIN outbox_tenant AS t ON t.tenant = w.tenant
        WHERE w.tenant IS NOT NULL AND t.paused IS NOT TRUE
        ORDER BY w.lap, w.k
        LIMIT {TENANTS_PER_CLAIM}
    ),
    tenant_pick AS (
        -- With more than one tenant in the turn, each one's first rows (a
        -- probe of the per-tenant due index, unlocked: ids only), numbered in
        -- its own claim order; a tenant alone is the scan below.
        SELECT r.id, r.priority, r.available_at, tt.k,
               ceil(row_number() OVER (PARTITION BY tt.tenant
                                       ORDER BY r.priority DESC, r.available_at, r.id)
                    / CAST(tt.weight AS numeric)) AS round
        FROM tenant_turn AS tt
        CROSS JOIN LATERAL (
            SELECT f.* FROM (
                SELECT m.id, m.priority, m.available_at FROM outbox_message AS m
                WHERE m.tenant = tt.tenant AND m.status = 'pending' AND m.available_at <= now()
                  {{channel_filter}}
                ORDER BY m.tenant, m.priority DESC, m.available_at, m.id
                -- (at most the batch: a LIMIT the planner can read. One it
                -- cannot, such as each tenant's share, it costs as a tenth of
                -- the tenant's rows: beside a 100,000-row backlog that crossed
                -- jit_above_cost, 320 ms of JIT compilation a claim for 5 of work)
                LIMIT CAST(:batch_size AS int)
            ) AS f
            -- and of those its share: read, never planned on (a tenth of the
            -- batch at most, as the planner counts the LIMIT it cannot read)
            LIMIT tt.share
        ) AS r
        WHERE (SELECT count(*) FROM tenant_turn) > 1
    ),
    tenant_share AS (
        -- Of those, the first rounds (each tenant's weight in rows a round),
        -- checked as every claimed row is and locked, so that the rows of the
        -- other tenants are candidates whatever the oldest tenant's backlog.
        SELECT m.id, m.priority, m.available_at, m.channel,
               COALESCE(m.destination, '') AS destination, m.cooldown_key, m.tenant
        FROM outbox_message AS m
        WHERE m.id IN (SELECT p.id FROM tenant_pick AS p
                       ORDER BY p.round, p.k, p.priority DESC, p.available_at, p.id
                       LIMIT CAST(:batch_size AS int) * 2)
          AND {{claimable}}
          AND {{unskipped_destination}}
          AND {{not_limited_channel}}
          --<tenant channels
          AND {{not_limited_tenant_channel}}
          --tenant channels>
        FOR UPDATE SKIP LOCKED
    ),
    bucket_turn AS (
        -- The destinations that throttled or have a limit, are not paused and
        -- hold a token, the least recently drawn first (so all take turns): at
        -- most BUCKET_CANDIDATES, so that the claim's cost never grows with the
        -- number of receivers that ever throttled.
        SELECT d.channel, d.destination
        FROM outbox_destination AS d
        WHERE {BUCKETED_SQL} AND (d.paused_until IS NULL OR d.paused_until <= now())
          AND {TOKENS_NOW_SQL} >= 1 AND d.destination <> '{CHANNEL_WIDE}'
        ORDER BY d.tokens_at NULLS FIRST
        LIMIT {BUCKET_CANDIDATES}
    ),
    due_turn AS MATERIALIZED (
        -- Of those, the ones with a row due in the channels claimed (a probe of
        -- the per-destination due index each).
        SELECT t.channel, t.destination FROM bucket_turn AS t
        JOIN outbox_destination AS d ON d.channel = t.channel AND d.destination = t.destination
        WHERE {{bucket_has_due}}
    ),
    bucket AS (
        -- Of those, the rows each may have now (its token bucket, refilled at
        -- its limit or its learned rate, whichever is lower). Locked, so that
        -- concurrent claimers draw from one bucket one after the other (a
        -- second claimer reads the tokens the first left). At most
        -- BUCKETS_PER_CLAIM: the planner then costs their probes below as that
        -- many, never as a guess at the table.
        SELECT d.channel, d.destination, {TOKENS_NOW_SQL} AS tokens
        FROM outbox_destination AS d
        WHERE (d.channel, d.destination) IN (SELECT channel, destination FROM due_turn)
          AND {BUCKETED_SQL} AND (d.paused_until IS NULL OR d.paused_until <= now())
          AND {TOKENS_NOW_SQL} >= 1
        ORDER BY d.tokens_at NULLS FIRST
        LIMIT {BUCKETS_PER_CLAIM}
        FOR UPDATE
    ),
    idle_bucket AS (
        -- The turn's destinations with nothing due go to the back of the turn
        -- (their tokens as they are now, counted from now: the same bucket),
        -- so that idle ones never keep the turn from those with work. Only
        -- rows nobody holds: a claimer never waits here.
        {
    _idle_to_the_back(
        "outbox_destination AS d",
        TOKENS_NOW_SQL,
        ("channel", "destination"),
        "bucket_turn",
        "due_turn",
    )
}
    ),
    channel_bucket AS (
        -- The channels limited as a whole (destination '{CHANNEL_WIDE}': all their
        -- destinations together), empty or not, locked like the buckets above and
        -- always after them (the scalar subquery reads all of bucket first), so
        -- two claimers never wait for each other's locks in a circle.
        SELECT d.channel, {TOKENS_NOW_SQL} AS tokens
        FROM outbox_destination AS d
        WHERE d.destination = '{CHANNEL_WIDE}' AND d.limit_rate IS NOT NULL
          AND (SELECT count(*) FROM bucket) >= 0
        FOR UPDATE
    ),
    --<tenant channels
    tenant_bucket_turn AS (
        -- The tenants' channels with a limit of their own (outbox limit set
        -- CHANNEL --tenant T) that hold a token, the least recently drawn
        -- first, at most BUCKET_CANDIDATES: the destinations' turn, for them.
        SELECT tc.tenant, tc.channel FROM outbox_tenant_channel AS tc
        WHERE tc.limit_rate IS NOT NULL AND NOT tc.paused AND {TENANT_TOKENS_NOW_SQL} >= 1
          {{tenant_channel_filter}}
        ORDER BY tc.tokens_at NULLS FIRST
        LIMIT {BUCKET_CANDIDATES}
    ),
    tenant_due_turn AS MATERIALIZED (
        -- Of those, the ones with a row due (a probe of the per-tenant due index).
        SELECT t.tenant, t.channel FROM tenant_bucket_turn AS t
        WHERE {{tenant_bucket_has_due}}
    ),
    tenant_bucket AS (
        -- Of those, the rows each may have now, locked as a destination's
        -- bucket is, and always after the destinations' and channels' (the
        -- scalar subquery reads all of channel_bucket first).
        SELECT tc.tenant, tc.channel, {TENANT_TOKENS_NOW_SQL} AS tokens
        FROM outbox_tenant_channel AS tc
        WHERE (tc.tenant, tc.channel) IN (SELECT tenant, channel FROM tenant_due_turn)
          AND tc.limit_rate IS NOT NULL AND {TENANT_TOKENS_NOW_SQL} >= 1
          AND (SELECT count(*) FROM channel_bucket) >= 0
        ORDER BY tc.tokens_at NULLS FIRST
        LIMIT {BUCKETS_PER_CLAIM}
        FOR UPDATE
    ),
    idle_tenant_bucket AS (
        -- The turn's ones with nothing due go to the back of the turn, as idle
        -- destinations do (only rows nobody holds: never a wait).
        {
    _idle_to_the_back(
        "outbox_tenant_channel AS tc",
        TENANT_TOKENS_NOW_SQL,
        ("tenant", "channel"),
        "tenant_bucket_turn",
        "tenant_due_turn",
    )
}
    ),
    tenant_limited AS (
        -- Each of them that holds a token: its first due rows in its own claim
        -- order (the per-tenant due index), but those of its paused or
        -- bucketed destinations. The other scans leave a limited tenant's
        -- channel out, so that a campaign beyond its limit never fills them
        -- while the tenant's other channels and everyone else's rows wait.
        SELECT r.* FROM tenant_bucket AS tb
        CROSS JOIN LATERAL (
            SELECT m.id, m.priority, m.available_at, m.channel,
                   COALESCE(m.destination, '') AS destination, m.cooldown_key, m.tenant
            FROM outbox_message AS m
            WHERE m.tenant = tb.tenant AND m.channel = tb.channel AND {{claimable}}
              AND {{unskipped_destination}}
            ORDER BY m.tenant, m.priority DESC, m.available_at, m.id
            LIMIT CAST(:batch_size AS int)
            FOR UPDATE SKIP LOCKED
        ) AS r
    ),
    --tenant channels>
    unbucketed AS (
        -- The due rows of every other destination, in claim order (the due index).
        -- A paused or bucketed destination is skipped in the scan (one hashed
        -- subplan), so the rows of the others fill the batch.
        SELECT m.id, m.priority, m.available_at, m.channel,
               COALESCE(m.destination, '') AS destination, m.cooldown_key, m.tenant
        FROM outbox_message AS m
        WHERE {{claimable}}
          AND {{unskipped_destination}}
          -- A channel limited as a whole has a scan of its own (channel_limited),
          -- and so has a tenant's channel limited for it (tenant_limited).
          AND {{not_limited_channel}}
          --<tenant channels
          AND {{not_limited_tenant_channel}}
          --tenant channels>
        ORDER BY m.priority DESC, m.available_at, m.id
        -- Twice the batch, for the fair share below to choose from; locked, so
        -- that concurrent claimers each get rows of their own.
        LIMIT CAST(:batch_size AS int) * 2
        FOR UPDATE SKIP LOCKED
    ),
    unbucketed_kept AS (
        -- With tenants sharing the batch their share brings the candidates,
        -- and of the scan's only the batch is locked: read as far as needed
        -- (a LIMIT the planner does not plan on: a tenth of the scan's).
        SELECT u.* FROM unbucketed AS u
        LIMIT CASE WHEN (SELECT count(*) FROM tenant_turn) > 1
                   THEN CAST(:batch_size AS int) ELSE CAST(:batch_size AS int) * 2 END
    ),
    bucketed AS (
        -- Each bucketed destination's first rows, as many as its bucket holds
        -- (the per-destination due index: a probe each).
        SELECT r.* FROM bucket AS b
        CROSS JOIN LATERAL (
            SELECT m.id, m.priority, m.available_at, m.channel, b.destination, m.cooldown_key,
                   m.tenant
            FROM outbox_message AS m
            WHERE m.channel = b.channel AND m.destination = b.destination AND {{claimable}}
            ORDER BY m.priority DESC, m.available_at, m.id
            -- (at most the batch; the fair share below takes what its bucket
            -- holds: a limit the planner cannot see would cost it a tenth of
            -- the table per destination, and the claim a JIT compile)
            LIMIT CAST(:batch_size AS int)
            FOR UPDATE SKIP LOCKED
        ) AS r
    ),
    channel_limited AS (
        -- Each channel limited as a whole that holds a token: its due rows but
        -- those of its paused or bucketed destinations, in claim order (the
        -- per-channel due index: a probe each), so that a long backlog of it
        -- never fills the scan above while other channels' rows wait behind it.
        SELECT r.* FROM channel_bucket AS cb
        CROSS JOIN LATERAL (
            SELECT m.id, m.priority, m.available_at, m.channel,
                   COALESCE(m.destination, '') AS destination, m.cooldown_key, m.tenant
            FROM outbox_message AS m
            WHERE m.channel = cb.channel AND {{claimable}}
              AND {{unskipped_destination}}
              --<tenant channels
              AND {{not_limited_tenant_channel}}
              --tenant channels>
            ORDER BY m.priority DESC, m.available_at, m.id
            LIMIT CAST(:batch_size AS int) * 2
            FOR UPDATE SKIP LOCKED
        ) AS r
        WHERE cb.tokens >= 1
    ),
    candidate AS (
        SELECT * FROM unbucketed_kept UNION ALL SELECT * FROM bucketed
        UNION ALL SELECT * FROM channel_limited
        --<tenant channels
        -- (UNION: a row of a limited tenant's channel that its destination's
        -- bucket found too, once)
        UNION SELECT * FROM tenant_limited
        --tenant channels>
        -- (UNION: a row both the scan above and the tenant's share found, once)
        UNION SELECT * FROM tenant_share
    ),
    turn AS (
        -- Fair share: each destination's rows take turns (its first row, then
        -- every destination's second, ...) within a priority, so one busy
        -- destination cannot fill the batch while another waits.
        SELECT c.*, row_number() OVER (
                   PARTITION BY c.channel, c.destination
                   ORDER BY c.priority DESC, c.available_at, c.id) AS turn
        FROM candidate AS c
    ),
    rounds AS (
        -- Fair share among tenants: each tenant's rows take turns with the
        -- other tenants' (its weight in rows a round), in its own order, so a
        -- tenant's campaign cannot fill the batch while another's rows wait.
        -- Priority orders rows within a tenant only. One tenant: the order
        -- above, unchanged.
        -- Within a round the tenants go in the turn's order, which starts
        -- after the tenant the last batch ended at: a round a batch cuts short
        -- goes on where it stopped.
        -- A tenant outside the turn (more tenants than one turn holds, its
        -- rows found by the other scans) comes after every round of those in
        -- it, or the oldest tenant would take a share in every batch.
        SELECT t.*, ceil(row_number() OVER (
                   PARTITION BY t.tenant ORDER BY t.priority DESC, t.turn, t.available_at, t.id)
                   / CAST(COALESCE(w.weight, 1) AS numeric))
               + CASE WHEN tt.k IS NULL THEN CAST(:batch_size AS int) ELSE 0 END AS round,
               COALESCE(tt.k, {TENANTS_PER_CLAIM} + 1) AS tenant_k
        FROM turn AS t
        LEFT JOIN outbox_tenant AS w ON w.tenant = t.tenant
        LEFT JOIN tenant_turn AS tt ON tt.tenant = t.tenant
    ),
    allowed AS (
        -- A destination that throttled takes at most the tokens its bucket holds;
        -- the rows left are numbered within their channel in the batch's order.
        SELECT t.*, row_number() OVER (
                   PARTITION BY t.channel
                   ORDER BY t.round, t.tenant_k, t.priority DESC, t.turn, t.available_at, t.id
               ) AS in_channel
               --<tenant channels
               , row_number() OVER (
                   PARTITION BY t.tenant, t.channel
                   ORDER BY t.round, t.tenant_k, t.priority DESC, t.turn, t.available_at, t.id
               ) AS in_tenant_channel
               --tenant channels>
        FROM rounds AS t
        LEFT JOIN bucket AS b ON b.channel = t.channel AND b.destination = t.destination
        WHERE b.tokens IS NULL OR t.turn <= floor(b.tokens)
    ),
    due AS (
        -- A channel limited as a whole takes at most the tokens its own bucket
        -- holds, whichever of its destinations the rows go to: its first rows in
        -- the batch's order, so the batch's LIMIT can only take fewer.
        SELECT a.id, a.channel, a.cooldown_key, a.tenant, a.priority, a.available_at,
               a.round, a.tenant_k
        FROM allowed AS a
        LEFT JOIN channel_bucket AS cb ON cb.channel = a.channel
        --<tenant channels
        LEFT JOIN tenant_bucket AS tb ON tb.tenant = a.tenant AND tb.channel = a.channel
        --tenant channels>
        WHERE (cb.tokens IS NULL OR a.in_channel <= floor(cb.tokens))
          --<tenant channels
          -- a tenant's channel limited for it: only from its bucket, locked
          -- above, at most the tokens it holds (a row another scan found, of
          -- a bucket this claim did not draw from, waits for its turn)
          AND CASE WHEN tb.tokens IS NOT NULL THEN a.in_tenant_channel <= floor(tb.tokens)
                   ELSE {{not_limited_tenant_channel_a}} END
          --tenant channels>
        ORDER BY a.round, a.tenant_k, a.priority DESC, a.turn, a.available_at, a.id
        LIMIT :batch_size
    ),
    tenant_moved AS (
        -- With tenants sharing the batch, the next claim's turn starts after
        -- the tenant of the batch's last row (a round the batch cut short goes
        -- on there); with more tenants than a turn holds, after the turn's
        -- last tenant (so that the turn goes round all of them). Only if no
        -- other claimer holds the row: never a wait.
        UPDATE outbox_tenant_turn AS c
        SET tenant = CASE WHEN (SELECT count(*) FROM tenant_turn) >= {TENANTS_PER_CLAIM}
            THEN (SELECT tt.tenant FROM tenant_turn AS tt ORDER BY tt.k DESC LIMIT 1)
            ELSE (SELECT d.tenant FROM due AS d ORDER BY d.round DESC, d.tenant_k DESC LIMIT 1)
            END
        FROM (SELECT l.one FROM outbox_tenant_turn AS l FOR UPDATE SKIP LOCKED) AS l
        WHERE c.one = l.one AND (SELECT count(*) FROM tenant_turn) > 1
          AND EXISTS (SELECT 1 FROM due)
    ),
{_CLAIM_UPDATE},
    spent AS (
        -- Every bucket drawn from pays for the rows it gave, in this statement:
        -- a destination's, and its channel's when the channel is limited as a whole.
        UPDATE outbox_destination AS d
        SET tokens = p.tokens - p.rows, tokens_at = now()
        FROM (
            SELECT b.channel, b.destination, b.tokens, c.rows
            FROM bucket AS b
            JOIN (SELECT channel, destination, count(*) AS rows FROM claimed
                  GROUP BY channel, destination) AS c
              ON c.channel = b.channel AND c.destination = b.destination
            UNION ALL
            SELECT cb.channel, '{CHANNEL_WIDE}', cb.tokens, c.rows
            FROM channel_bucket AS cb
            JOIN (SELECT channel, count(*) AS rows FROM claimed GROUP BY channel) AS c
              ON c.channel = cb.channel
        ) AS p
        WHERE d.channel = p.channel AND d.destination = p.destination
    )
    --<tenant channels
    , tenant_spent AS (
        -- And a tenant's channel limited for it pays for the rows it gave.
        UPDATE outbox_tenant_channel AS tc
        SET tokens = tb.tokens - c.rows, tokens_at = now()
        FROM tenant_bucket AS tb
        JOIN (SELECT d.tenant, d.channel, count(*) AS rows
              FROM due AS d WHERE d.id IN (SELECT id FROM claimed)
              GROUP BY d.tenant, d.channel) AS c
          ON c.tenant = tb.tenant AND c.channel = tb.channel
        WHERE tc.tenant = tb.tenant AND tc.channel = tb.channel
    )
    --tenant channels>
    -- In the batch's order (the fair share's rounds, then priority): the
    -- dispatcher's events and a sender's waves of calls keep it, so a tenant's
    -- one due row or an urgent row goes in the first wave, not wherever its id
    -- falls. With the rows (_answer), which form the claimer's next claim
    -- should be (_run_claim): whether the lean one fits now, or a tenant's
    -- channel is paused or limited.
    {{answer_in_batch_order}}
"""

# The claim while every gate but the due row's own is idle (_LEAN_FITS): the
# full claim's scan of the due index, its destinations' turns and its
# cooldown gate, without the tenants', buckets' and limits' parts, whose
# start and end alone were a fifth of the full claim's server time at batch
# 100 (bench/README.md). Those parts would change nothing here: one tenant
# takes its rows in the order the turns give, and no bucket pays. It checks
# that it fits in its own snapshot; when it does not it claims nothing and
# its last row names the full claim, which the claimer runs at once.
_LEAN_CLAIM = f"""
    WITH fits AS MATERIALIZED (SELECT {_LEAN_FITS} AS ok),
    unbucketed AS (
        SELECT m.id, m.priority, m.available_at, m.channel,
               COALESCE(m.destination, '') AS destination, m.cooldown_key, m.tenant
        FROM outbox_message AS m
        WHERE (SELECT f.ok FROM fits AS f) AND {{claimable}}
        ORDER BY m.priority DESC, m.available_at, m.id
        LIMIT CAST(:batch_size AS int) * 2
        FOR UPDATE SKIP LOCKED
    ),
    turn AS (
        SELECT c.*, row_number() OVER (
                   PARTITION BY c.channel, c.destination
                   ORDER BY c.priority DESC, c.available_at, c.id) AS turn
        FROM unbucketed AS c
    ),
    due AS (
        SELECT t.id, t.channel, t.cooldown_key, t.tenant, t.priority, t.available_at, t.turn
        FROM turn AS t
        ORDER BY t.priority DESC, t.turn, t.available_at, t.id
        LIMIT :batch_size
    ),
{_CLAIM_UPDATE}
    {{answer_in_batch_order}}
"""
_CHANNEL_FILTER = "AND m.channel = ANY(CAST(:channels AS text[]))"
# What the claim returns: the columns, then the destination the buckets pay for.
_DESTINATION = "COALESCE(m.destination, '') AS destination"
_CLAIMED = (
    "m.id, m.channel, CAST(m.claim_token AS text) AS claim_token, m.attempts + 1 AS attempt, "
    + _DESTINATION
)
_CLAIMED_COLUMNS = Claim._fields


# The channels limited as a whole (``outbox limit set webhook --rate 50``).
_CHANNELS_LIMITED = (
    "SELECT d.channel FROM outbox_destination AS d "
    f"WHERE d.destination = '{CHANNEL_WIDE}' AND d.limit_rate IS NOT NULL"
)


# The tenants' channels limited for them (``outbox limit set CHANNEL --tenant T``).
_TENANT_CHANNELS_LIMITED = (
    "SELECT tc.tenant, tc.channel FROM outbox_tenant_channel AS tc WHERE tc.limit_rate IS NOT NULL"
)


# The claim's parts for the tenants' own channel pauses and limits (between
# these markers): a relay where no operator set one claims without them, a
# tenth faster (bench/README.md).
_TENANT_CHANNEL_PARTS = re.compile(r"[ \t]*--<tenant channels\n.*?--tenant channels>\n", re.S)


def _answer(rows: str, order: str, columns: Sequence[str], claim_form: str = "NULL") -> str:
    """A claim's or a receipt's answer: the ``columns`` of each of ``rows``
    (aliased ``c``) in ``order``, but the payload, as one JSON value
    (``fields``: [[column, ...], ...], NULL for no row) in the first row,
    with ``claim_form``; then, where the columns name a payload, one row
    each with its payload as text (``payload``), in the same order. Read
    back by ``_answered``.

    pg8000 decodes each column of each row in Python (a third of ``outbox
    worker``'s own CPU at batch 100 went to fourteen columns a row); JSON is
    parsed in C. The payloads stay rows of their own: in the JSON value they
    would be escaped again on the server's CPU, and a batch of large ones
    could pass the 1 GB one value may hold. (Append keeps UNION ALL's
    branches in the order they are written.)"""
    fields = ", ".join(f"c.{c}" for c in columns if c != "payload")
    answer = f"""SELECT (SELECT json_agg(json_build_array({fields}) ORDER BY {order})
            FROM {rows}) AS fields, NULL AS payload, {claim_form} AS claim_form"""
    if "payload" in columns:
        answer += f"""
    UNION ALL (SELECT NULL, c.payload, NULL FROM {rows} ORDER BY {order})"""
    return answer


def _answered(rows: Sequence[sa.Row[Any]]) -> tuple[list[list[Any]], Any]:
    """The rows of an ``_answer``, each a list of its columns in order (the
    payload in its place), and its claim form."""
    head, *payloads = rows
    answered = head.fields or []
    if payloads:
        for fields, row in zip(answered, payloads, strict=True):
            fields.insert(_PAYLOAD_FIELD, row.payload)
    return answered, head.claim_form


# The batch's order: the fair share's rounds (the full claim), then priority
# and the destinations' turns.
_FULL_ORDER = "d.round, d.tenant_k, d.priority DESC, d.available_at, d.id"
_LEAN_ORDER = "d.priority DESC, d.turn, d.available_at, d.id"


def _claim_statement(
    form: int, channel_filter: str, received_at: str, returning: str, columns: Sequence[str]
) -> Any:
    """The claim of ``form`` (LEAN, FULL, FULL_WITH_TENANT_CHANNELS), of the
    channels ``channel_filter`` names, returning ``returning`` as ``columns``."""
    template, claimable = _CLAIM, _CLAIMABLE
    if form == LEAN:
        template = _LEAN_CLAIM
    if form != FULL_WITH_TENANT_CHANNELS:
        template = _TENANT_CHANNEL_PARTS.sub("", template)
        claimable = _TENANT_CHANNEL_PARTS.sub("", claimable)
    return statement(
        template.format(
            channel_filter=channel_filter,
            bucket_has_due=_BUCKET_HAS_DUE.format(channel_filter=channel_filter),
            unskipped_destination=_passes(f"NOT {_SKIPPED_DESTINATION}"),
            not_limited_channel=_passes(f"m.channel NOT IN ({_CHANNELS_LIMITED})"),
            not_limited_tenant_channel=_passes(
                f"(m.tenant, m.channel) NOT IN ({_TENANT_CHANNELS_LIMITED})"
            ),
            not_limited_tenant_channel_a=(
                f"(a.tenant, a.channel) NOT IN ({_TENANT_CHANNELS_LIMITED})"
            ),
            tenant_channel_filter=channel_filter.replace("m.channel", "tc.channel"),
            tenant_bucket_has_due=_TENANT_BUCKET_HAS_DUE.format(channel_filter=channel_filter),
            claimable=claimable.format(channel_filter=channel_filter),
            received_at=received_at,
            returning=returning,
            answer_in_batch_order=_answer(
                "claimed AS c JOIN due AS d ON d.id = c.id",
                _LEAN_ORDER if form == LEAN else _FULL_ORDER,
                columns,
                _CLAIM_FORM.format(
                    fits="(SELECT f.ok FROM fits AS f)" if form == LEAN else _LEAN_FITS
                ),
            ),
        )
    )


_FORMS = (LEAN, FULL, FULL_WITH_TENANT_CHANNELS)
# The dispatcher's claims by form, of every channel or of some (``channels``).
_CLAIMS = {
    (form, channels): _claim_statement(
        form, _CHANNEL_FILTER if channels else "", "NULL", _CLAIMED, _CLAIMED_COLUMNS
    )
    for form in _FORMS
    for channels in (False, True)
}
# The claim of a process that sends its rows itself (``outbox worker``): the
# same compare-and-set, with the receipt taken in the same statement and the
# payloads returned, so no hand-off and no second statement before the sends.
# A receipt's payload: its stored text, or NULL when that text is far past the
# size limit (written past the producer, by raw SQL): the sender fails such a
# row alone, and no sender ever holds megabytes for one row. The size on disk
# (pg_column_size: the value's header, nothing decompressed) lets every
# ordinary payload through at once; only one over 2 KiB there is measured as
# text. Compression (pglz, lz4) shrinks a value at most some 255 times and
# jsonb's text is at most 6 times its binary form (an escaped control
# character), so what passes unmeasured stays under 3 MB.
_PAYLOAD_TEXT = f"""CASE WHEN pg_column_size(m.payload) > {MAX_STORED_BYTES // 256}
        AND octet_length(CAST(m.payload AS text)) > {MAX_STORED_BYTES}
    THEN NULL ELSE CAST(m.payload AS text) END AS payload"""


# Only a webhook names a secret; the other channels' rows ask nothing.
_SECRET_REFUSED = """CASE WHEN m.channel = 'webhook'
        THEN outbox_secret_refused(m.tenant, m.channel, m.payload) ELSE false END"""  # noqa: S105


def _received(lease_left: str, channel_paused: str, destination_paused: str) -> str:
    """What a receipt returns: ClaimedMessage's fields, in their order (the rows
    are taken as they are). ``lease_left``: the lease's seconds left, float8;
    ``channel_paused`` and ``destination_paused``: whether the row's channel,
    and its destination, are paused now, boolean."""
    return f"""m.id, m.channel, {_PAYLOAD_TEXT}, m.attempts + 1 AS attempt,
    COALESCE(m.max_attempts, :default_max) AS max_attempts,
    CAST(m.claim_token AS text) AS claim_token, m.dedupe_key, m.ordering_key,
    {lease_left} AS lease_left_seconds, {_DESTINATION}, {channel_paused} AS channel_paused,
    {destination_paused} AS destination_paused, {_SECRET_REFUSED} AS secret_refused,
    m.tenant"""


# The claim's receipt: the lease was just taken, so all of it is left, and the
# claim takes no row of a paused channel or a paused destination.
_RECEIVED = _received("CAST(:lease_seconds AS float8)", "false", "false")
_RECEIVED_COLUMNS = ClaimedMessage._fields
_PAYLOAD_FIELD = ClaimedMessage._fields.index("payload")
# The worker's claims by form, as _CLAIMS.
_CLAIMS_AND_RECEIPTS = {
    (form, channels): _claim_statement(
        form, _CHANNEL_FILTER if channels else "", "now()", _RECEIVED, _RECEIVED_COLUMNS
    )
    for form in _FORMS
    for channels in (False, True)
}

# The form of claim each engine's last claim named for its next (its last
# row says). Unknown, the next is the lean one, which checks that it fits.
# Whatever makes the full claim needed, set elsewhere, the lean claim sees at
# once; only the tenants' channel parts hold from the second claim after
# (the first finds them), or one set in this process, from the next.
_claim_form_seen: weakref.WeakKeyDictionary[sa.Engine, int] = weakref.WeakKeyDictionary()


def _run_claim(
    conn: sa.Connection, statement: sa.TextClause, params: dict[str, Any], prepare: bool
) -> tuple[list[list[Any]], int]:
    """Run a claim statement (``prepare``: as this connection's prepared
    statement, ``_sql.prepared``): its claimed rows, and the form it names
    for the next claim."""
    if prepare:
        execute = prepared(conn, statement, params)
        if execute is not None:
            statement, params = execute, {}
    claimed, form = _answered(execute_fenced(conn, statement, params, runs=CLAIM_RUNS_AFTER_A_MOVE))
    return claimed, int(form)


def _claim_rows(
    conn: sa.Connection,
    statements: dict[tuple[int, bool], sa.TextClause],
    channels: bool,
    params: dict[str, Any],
    prepare: bool,
) -> list[list[Any]]:
    """Claim with the form the engine's last claim named (``statements``, by
    form and whether ``channels`` are named), and return the claimed rows. A
    lean claim that did not fit claimed nothing: the full one runs at once."""
    form = _claim_form_seen.get(conn.engine, LEAN)
    claimed, next_form = _run_claim(conn, statements[form, channels], params, prepare)
    if form == LEAN and next_form != LEAN:
        claimed, next_form = _run_claim(conn, statements[next_form, channels], params, prepare)
    _claim_form_seen[conn.engine] = next_form
    return claimed


def tenant_channels_changed() -> None:
    """Forget what every engine's last claim found (a tenant channel's pause
    or limit was just set or cleared in this process): its next claim is the
    lean one, which checks."""
    _claim_form_seen.clear()


# The most rows one claim statement takes (settings.BATCH_SIZE's bound).
MAX_BATCH_SIZE = 10_000


def _claim_params(batch_size: Any, lease_seconds: Any) -> dict[str, Any]:
    """The claim's numbers, checked before they reach Postgres (which would
    take 0 rows for 0, fail obscurely for -1 and round 2.5)."""
    if (
        isinstance(batch_size, bool)
        or not isinstance(batch_size, int)
        or not 1 <= batch_size <= MAX_BATCH_SIZE
    ):
        raise ValueError(
            f"batch_size must be a whole number from 1 to {MAX_BATCH_SIZE}, not {batch_size!r}"
        )
    if (
        isinstance(lease_seconds, bool)
        or not isinstance(lease_seconds, int | float)
        or not 0 < lease_seconds <= 86_400
    ):
        raise ValueError(
            f"lease_seconds must be a number of seconds in (0, 86400], not {lease_seconds!r}"
        )
    return {"batch_size": batch_size, "lease_seconds": float(lease_seconds)}


def claim(
    conn: sa.Connection,
    batch_size: int,
    lease_seconds: float,
    channels: Sequence[str] | None = None,
    default_ttl_seconds: float | None = None,
    prepare: bool = False,
) -> list[Claim]:
    """Claim up to ``batch_size`` due rows, highest priority first, for one lease.

    ``default_ttl_seconds``: the deliver-by time of rows without their own
    (counted from when they were first due); None: no default. ``prepare``:
    prepare the claim on the connection, for a caller that claims again and
    again with the same arguments (``_sql.prepared``)."""
    params: dict[str, Any] = {
        **_claim_params(batch_size, lease_seconds),
        "default_ttl": None if default_ttl_seconds is None else float(default_ttl_seconds),
    }
    if channels is not None:
        params["channels"] = array_literal(channels)
    # _CLAIMED's columns are Claim's fields, in order; the rows in the batch's.
    # (concurrent claimers that move rows, the cooldown's suppressed ones:
    # a row one of them moved is read again where it went)
    rows = _claim_rows(conn, _CLAIMS, channels is not None, params, prepare)
    return list(map(Claim._make, rows))


def claim_and_receive(
    conn: sa.Connection,
    batch_size: int,
    lease_seconds: float,
    default_max_attempts: int,
    channels: Sequence[str] | None = None,
    default_ttl_seconds: float | None = None,
    prepare: bool = False,
) -> list[ClaimedMessage]:
    """``claim`` and ``receive_claimed`` in one statement, for a process that sends
    what it claims: the rows come back received, with their payloads (as text),
    in the batch's order (as ``claim``). Every write after it is fenced on the claim token as usual.
    ``prepare``: as ``claim``'s."""
    params: dict[str, Any] = {
        **_claim_params(batch_size, lease_seconds),
        "default_ttl": None if default_ttl_seconds is None else float(default_ttl_seconds),
        "default_max": default_max_attempts,
    }
    if channels is not None:
        params["channels"] = array_literal(channels)
    return _claimed_messages(
        _claim_rows(conn, _CLAIMS_AND_RECEIPTS, channels is not None, params, prepare)
    )


@dataclass(frozen=True)
class ChannelLoad:
    """Which channels have pending rows, and how many rows some have claimed."""

    pending_channels: list[str]
    claimed: dict[str, int]


_CHANNEL_LOAD = statement(
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


# A claimed row, looked up by id: the IN names the live rows' partition (the
# history's are never planned), the IS TRUE keeps the planner from the partial
# lease index (every claimed row walked against the batch, where each id is
# one probe of the key), as the claim does for its pending rows.
_CLAIMED_ROW = "m.status IN ('pending', 'claimed') AND (m.status = 'claimed') IS TRUE"
# The same for a statement that looks its rows up by the ids of its claims
# (the fenced receipt, release and settle): the planner must not take the claimed
# rows as few. The statistics of the live partition are mostly taken with its
# rows pending (claims last seconds), so `status = 'claimed'`, a lease end in
# the future and the like were each estimated as matching next to nothing;
# the receipt then read the partition first, as one row, and joined the
# claims' unnest to each row it found: a thousand claims were a million
# comparisons, 85 ms of a 1000-row receipt instead of a few (bench/README.md,
# "The receipt's plan, and the first claim").
_HELD_ROW = "m.status IN ('pending', 'claimed') AND " + _passes("m.status = 'claimed'")

# Only a claim no sender started: a hand-off whose Invoke call timed out may
# still have been queued by Lambda, and its sender may hold the receipt and be
# calling the provider. Taking that claim back would refuse its settle and let
# the next pass send the message again; the reaper is the one recovery path
# for a received claim (invariant 5). The one exception is the receipt's own
# holder giving back rows it did not start (``outbox worker`` stopping, whose
# claim is its receipt): ``own_receipt`` releases those, and only those.
_RELEASE = statement(
    f"""
    UPDATE outbox_message AS m
    SET status = 'pending', claim_token = NULL, lease_expires_at = NULL,
        available_at = now() + make_interval(secs => :delay_seconds), last_error = :reason
    FROM unnest(CAST(:ids AS bigint[]), CAST(:tokens AS uuid[])) AS h(id, token)
    WHERE m.id = h.id AND m.claim_token = h.token AND {_HELD_ROW}
      AND {_passes("(m.received_at IS NOT NULL) = :own_receipt")}
    RETURNING m.id
    """
)


def release(
    conn: sa.Connection,
    claims: Iterable[Held],
    reason: str,
    delay_seconds: float = 0,
    *,
    own_receipt: bool = False,
) -> set[int]:
    """Give claims back without counting an attempt (a failed hand-off).
    Fenced, and only those no sender took a receipt for (their sender may be
    sending: the reaper recovers them); returns the ids released.
    ``own_receipt``: the caller holds the receipt of these claims itself and
    never started them (a stopping worker): those are released instead."""
    held = list(claims)
    if not held:
        return set()
    rows = execute_fenced(
        conn,
        _RELEASE,
        {
            "ids": array_literal(c.id for c in held),
            "tokens": array_literal(c.claim_token for c in held),
            "reason": reason,
            "delay_seconds": float(delay_seconds),
            "own_receipt": own_receipt,
        },
    )
    return {r.id for r in rows}


# --- the sender's receipt and settle ----------------------------------------

# The receipt replaces a plain fenced read: the same one statement, but a
# compare-and-set, so of two senders handed one claim (a duplicated or
# replayed event, an Invoke retried after a timeout, an id listed twice) only
# one gets the row back; the other finds nothing to send. A row locked by the
# first is re-checked by the second after the first commits (READ COMMITTED),
# when ``received_at`` is no longer NULL.
#
# A channel paused since the claim (a quota another sender heard, an operator's
# pause) is read in the same statement: the receipt is still taken, so no other
# sender gets the rows and their settle is fenced as usual, and each row says
# the channel is paused. An uncorrelated subquery: one probe of the pause
# table's key for the whole statement, not one a row.
_RECEIPT_PAUSED = """EXISTS (SELECT 1 FROM outbox_channel_pause AS cp
                   WHERE cp.channel = :channel
                     AND (cp.paused_until IS NULL OR cp.paused_until > now()))"""
# A destination another sender paused since the claim (its key: a probe a row,
# and only rows whose destination ever throttled or has a limit have one).
_RECEIPT_DESTINATION_PAUSED = """EXISTS (SELECT 1 FROM outbox_destination AS d
                   WHERE d.channel = m.channel AND d.destination = COALESCE(m.destination, '')
                     AND d.paused_until > now())"""
_RECEIVE_CLAIMED = statement(
    f"""
    WITH received AS (
        UPDATE outbox_message AS m
        SET received_at = now()
        FROM unnest(CAST(:ids AS bigint[]), CAST(:tokens AS uuid[])) AS h(id, token)
        WHERE m.id = h.id AND m.claim_token = h.token AND {_HELD_ROW}
          AND m.channel = :channel
          AND {_passes("m.lease_expires_at > now() AND m.received_at IS NULL")}
        RETURNING {
        _received(
            "EXTRACT(EPOCH FROM m.lease_expires_at - now())::float8",
            _RECEIPT_PAUSED,
            _RECEIPT_DESTINATION_PAUSED,
        )
    }
    )
    {_answer("received AS c", "c.id", _RECEIVED_COLUMNS)}
    """
)


def receive_claimed(
    conn: sa.Connection,
    channel: str,
    claims: Iterable[Held],
    default_max_attempts: int,
) -> list[ClaimedMessage]:
    """Take the receipt of the claims this sender may send, once: a row missing
    here is not ours (settled, reaped, claimed again) or already taken by another
    sender. A claim listed twice counts once. In the order of ``claims`` (the
    claim's: the batch's fair share and priority). Each row's
    ``channel_paused`` and ``destination_paused`` say whether ``channel``, and
    the row's destination, are paused now (then it is not to be sent)."""
    claims = list(claims)
    fence = _fence_arrays(claims)
    if fence is None:
        return []
    rows = execute_fenced(
        conn,
        _RECEIVE_CLAIMED,
        {**fence, "channel": channel, "default_max": default_max_attempts},
    )
    position: dict[int, int] = {}
    for c in claims:
        position.setdefault(c.id, len(position))
    return sorted(_claimed_messages(_answered(rows)[0]), key=lambda r: position[r.id])


def could_be_a_claim_token(token: str) -> bool:
    """Whether a claim could have issued ``token``: the claim draws every
    token with gen_random_uuid(), a version-4 UUID. The sample events in
    events/ carry placeholders of no version (00000000-0000-0000-0000-...),
    so a sample is known for what it is without asking the database."""
    try:
        return uuid.UUID(token).version == 4
    except ValueError:
        return False


_UNOWNED_CLAIMS = statement(
    """
    SELECT h.id,
           m.id IS NULL AS unknown,
           COALESCE(m.status = 'claimed' AND m.claim_token = h.token
                    AND m.received_at IS NOT NULL, false) AS duplicate
    FROM unnest(CAST(:ids AS bigint[]), CAST(:tokens AS uuid[])) AS h(id, token)
    LEFT JOIN outbox_message AS m ON m.id = h.id AND m.channel = :channel
    """
)


@dataclass(frozen=True)
class UnownedClaims:
    """Why a sender did not get the receipt of some claims of its event."""

    # another sender holds them under the very same claim: the same hand-off
    # delivered twice (Lambda's async events are at least once), not a lost lease
    duplicates: frozenset[int]
    # never a live claim here: a placeholder token no claim issues (the events/
    # samples), or no message of this channel has the id (an event meant for
    # another database)
    unknown: frozenset[int]
    # the rest: the claim is over (settled, reaped, claimed again); a duplicate
    # that comes after its twin settled reads as one


def unowned_claims(conn: sa.Connection, channel: str, claims: Iterable[Held]) -> UnownedClaims:
    """Of claims whose receipt this sender did not get, say why, in one
    statement; only asked when a receipt came back short, never on the way
    of a delivered hand-off."""
    claims = list(claims)
    placeholders = frozenset(c.id for c in claims if not could_be_a_claim_token(str(c.claim_token)))
    fence = _fence_arrays(c for c in claims if c.id not in placeholders)
    if fence is None:
        return UnownedClaims(frozenset(), placeholders)
    rows = conn.execute(_UNOWNED_CLAIMS, {**fence, "channel": channel}).all()
    return UnownedClaims(
        duplicates=frozenset(r.id for r in rows if r.duplicate),
        unknown=placeholders | {r.id for r in rows if r.unknown},
    )


def _fence_arrays(claims: Iterable[Held]) -> dict[str, str] | None:
    """The distinct (id, token) pairs of ``claims`` as the ``ids`` and
    ``tokens`` arrays the receipt statements unnest; None for no claim."""
    pairs = list(dict.fromkeys((c.id, c.claim_token) for c in claims))
    if not pairs:
        return None
    return {
        "ids": array_literal(i for i, _ in pairs),
        "tokens": array_literal(t for _, t in pairs),
    }


def _claimed_messages(rows: Iterable[Sequence[Any]]) -> list[ClaimedMessage]:
    # The receipts' columns are ClaimedMessage's fields, in order (``_received``):
    # each row is taken as it is, in the order it came.
    return list(map(ClaimedMessage._make, rows))


_SETTLE = statement(
    f"""
    WITH input AS (
        -- one JSON document for the whole batch: no per-element escaping; each
        -- row an array [id, token, outcome, error, provider_id, delay_s, duration_ms]
        -- (half the text of objects, a third of the time to encode)
        SELECT CAST(e->>0 AS bigint) AS id, CAST(e->>1 AS uuid) AS token, e->>2 AS outcome,
               e->>3 AS error, e->>4 AS provider_id, CAST(e->>5 AS float8) AS delay_s,
               CAST(e->>6 AS int) AS duration_ms
        FROM jsonb_array_elements(CAST(:settlements AS jsonb)) AS e
        -- the batch's size, for the planner (it guesses 100 rows for any
        -- set-returning function): without it, a small batch against a small
        -- table (a fresh or a well-pruned outbox) scanned the whole table
        LIMIT :rows
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
        -- (_HELD_ROW: statistics taken with the rows pending made the claimed
        -- ones next to none, and the document was unpacked again for each)
        FROM input AS i JOIN outbox_message AS m ON m.id = i.id AND {_HELD_ROW}
    ),
    timed AS (
        SELECT m.*,
               m.attempts + CASE WHEN m.outcome IN ('deferred', 'not_started') THEN 0 ELSE 1 END
                   AS attempts_after,
               -- a counted deferral waits at least the backoff, so a receiver that
               -- keeps throttling cannot spend the attempts in seconds
               now() + make_interval(secs => CASE
                   WHEN m.capped THEN GREATEST(m.delay_s, {BACKOFF_SQL})
                   WHEN m.outcome = 'retry' THEN COALESCE(m.delay_s, {BACKOFF_SQL})
                   ELSE COALESCE(m.delay_s, 0) END) AS next_at
        FROM classified AS m
    ),
    decided AS (
        SELECT m.*,
               CASE WHEN m.outcome IN ('delivered', 'failed', 'suppressed') THEN m.outcome
                    WHEN m.outcome = 'retry' AND {EXHAUSTED_SQL} THEN 'dead'
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
                              THEN '{EXPIRED_PREFIX} before the next try; last error: '
                                   || COALESCE(d.error, m.last_error, 'none')
                              ELSE COALESCE(d.error, m.last_error) END,
            settled_at = CASE WHEN d.next_status = 'pending' THEN NULL ELSE now() END
        FROM decided AS d
        -- The fence: a sender whose lease was taken matches nothing here.
        WHERE m.id = d.id AND m.claim_token = d.token AND {_HELD_ROW}
        RETURNING m.id, m.status, m.claimed_at, m.last_error, m.channel,
                  m.recipient_fingerprints, d.outcome, d.attempts_after, d.error,
                  d.provider_id, d.duration_ms, m.cooldown_key, m.cooldown, m.tenant
    ),{COOLDOWN_WINDOW}
    logged AS (
        INSERT INTO outbox_attempt
            (message_id, attempt, outcome, error, provider_message_id, claimed_at, duration_ms,
             channel, recipient_fingerprints, tenant)
        SELECT id,
               attempts_after + CASE WHEN outcome IN ('deferred', 'not_started') THEN 1 ELSE 0 END,
               CASE WHEN status IN ('dead', 'expired') THEN status ELSE outcome END,
               CASE WHEN status = 'expired' THEN last_error ELSE error END,
               provider_id, claimed_at, duration_ms, channel, recipient_fingerprints, tenant
        FROM settled
    )
    -- One value for the batch, not a row each: the driver decodes rows in
    -- Python, column by column (a seventh of a 1000-row settle's time,
    -- bench/README.md); JSON text is parsed in C.
    SELECT json_agg(json_build_array(id, status, outcome)) FROM settled
    """,
    kept_prepared=True,
)


class Settled(NamedTuple):
    """What the settle wrote for one row: its new status, and the outcome as
    counted (a deferral past the deferral limit is a ``retry``)."""

    status: str
    outcome: str


def settle(
    conn: sa.Connection, settlements: Sequence[Settlement], backoff: Backoff
) -> dict[int, str]:
    """Write every outcome of a batch and its attempt rows in one statement.

    Returns {id: new status} for the rows that were still ours; any id absent
    from the result had its lease taken, and nothing was written for it. Each
    delay is bounded first (``bounded_delay``): a bad one affects its row only.
    """
    return {i: s.status for i, s in settle_with_outcomes(conn, settlements, backoff).items()}


def settle_with_outcomes(
    conn: sa.Connection, settlements: Sequence[Settlement], backoff: Backoff
) -> dict[int, Settled]:
    """``settle``, with the outcome each row was counted with."""
    if not settlements:
        return {}
    unknown = {s.outcome for s in settlements} - set(SETTLE_OUTCOMES)
    if unknown:
        raise ValueError(f"unknown outcome(s): {sorted(unknown)}")
    rows = execute_fenced(
        conn,
        _SETTLE,
        {
            "settlements": json_document(
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
                ]
            ),
            "rows": len(settlements),
            "max_deferrals": backoff.max_deferrals,
            **backoff.params(),
        },
    )
    # [[id, status, outcome], ...], or NULL when no row was still ours
    written = rows[0][0] or []
    return {row[0]: Settled(row[1], row[2]) for row in written}
