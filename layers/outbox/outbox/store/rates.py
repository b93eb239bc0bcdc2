"""Destinations' rates and pauses: what a throttling or quota answer writes,
and the SQL the claim reads them with (docs/design.md, invariant 10).

A destination (``outbox_message.destination``, set on insert from the
channel and payload) that answers "slow down" gets a row in
``outbox_destination``: paused until the time it asked for (or the relay's
own short pause), and a learned rate. The claim draws each such
destination's rows from a token bucket refilled at that rate, so a steady
backlog settles at what the receiver admits and each refused call costs one
call, not one per message.

The learned rate follows TCP CUBIC's shape (RFC 8312), in messages a second
instead of a window. Each fresh throttling answer marks a *plateau*: the rate
then (no higher than the operator's limit). The rate is cut to
``RATE_DECREASE`` of the plateau, grows back quickly while far below it,
flattens as it nears it (reached ``PLATEAU_SECONDS`` after the cut), stays
close to it for a while, then probes above it ever faster. A receiver's
admitted rate sits just under the plateau, so the relay asks at about that
rate for a long time and is refused rarely; a rate that is too high (the
first guess, or a receiver that slowed down) is refused again within
``RESUMED_SECONDS`` of the pause's end and is cut at once to what the
receiver admitted since the pause began (at most by half).

Only ``rate`` (the rate just after the cut: the plateau is ``rate /
RATE_DECREASE``) and ``rate_at`` (when) are stored; the claim computes the
rate now from them.

A quota answer pauses the whole channel (``outbox_channel_pause``) until the
provider's reset or ``QUOTA_PAUSE_SECONDS``; the claim skips it till then.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from ..limits import CONFIG, OPERATOR, PROVIDER, RateLimit, check_limit
from ._sql import array_literal, check_channels, json_document, statement
from .tenants import TENANT_TOKENS_NOW_SQL

__all__ = [
    "MAX_BACKOFF_SECONDS",
    "REFUSING_AFTER_SECONDS",
    "AppliedLimits",
    "DestinationFigures",
    "Throttled",
    "apply_configured_limits",
    "clear_limit",
    "destination_figures",
    "forget_idle_destinations",
    "forget_learned",
    "next_resume",
    "record_throttling",
    "seconds_to_resume",
    "set_limit",
    "set_provider_limit",
]

# How long a destination waits after a throttling answer that named no time.
THROTTLE_PAUSE_SECONDS = 1.0
# How long a channel waits after a quota answer that named no reset time.
QUOTA_PAUSE_SECONDS = 3600.0
# The learned rate after a throttling answer, as a share of the plateau (the
# rate then). A gentle cut: the pause the provider asked for has already
# slowed the destination down, and every second spent well under what the
# receiver admits is lost (bench/README.md, "Rate limits").
RATE_DECREASE = 0.9
# Seconds from a cut until the rate is back at the plateau. Long, so that the
# relay stays near the plateau and is refused seldom; it grows fast while far
# below it (the curve is a cube), so little is lost on the way up.
PLATEAU_SECONDS = 15.0
# How fast the curve bends: the cube through (0, RATE_DECREASE) and
# (PLATEAU_SECONDS, 1), as shares of the plateau.
_CUBE = (1 - RATE_DECREASE) / PLATEAU_SECONDS**3
# A throttling answer within this many seconds of the last pause's end means
# the rate was far too high (the receiver's burst, which refilled during the
# pause, was spent at once: the first guess, which a batch measures over its
# own short burst, or a receiver that slowed down). Near the plateau the
# receiver's burst lasts many seconds. The plateau is then what the receiver
# admitted since that pause began: the relay's calls since it ended (the one
# token at its end, then the rate) over the pause and the time since, since
# the receiver's bucket refilled during the one and was spent in the other;
# never less than FAST_DECREASE of the rate (a receiver whose burst is
# smaller than its rate over the pause makes that estimate too low).
RESUMED_SECONDS = 2.0
FAST_DECREASE = 0.5
# The learned rate never falls below this (messages a second).
MIN_RATE = 0.1
# No pause is longer than a day, whatever a provider answers.
MAX_PAUSE_SECONDS = 86400.0
# A destination that refuses the first call after its pause (within
# RESUMED_SECONDS of its end) is paused twice as long as the last time (the
# learned rate then paces it, but one token comes at every pause's end), up
# to this: a receiver that answers 503 for an hour costs some 15 calls.
MAX_BACKOFF_SECONDS = 600.0
# Once such a destination refused after a pause this long, the call that
# heard the refusal counts an attempt: throttling ends somewhere, and a
# receiver that never admits anything takes its messages to dead (after
# MAX_ATTEMPTS such calls) rather than keeping them pending for ever.
REFUSING_AFTER_SECONDS = 300.0
# A destination's learned row is forgotten this long after its last cut and
# its pause's end (the reaper): by then its learned rate has grown some
# 20,000-fold past the plateau (the cube), so it paces nothing, and every idle
# bucketed destination costs the claim's turn a probe.
FORGET_AFTER_SECONDS = 900.0

# The learned rate of destination row ``d`` now: the plateau (``d.rate /
# RATE_DECREASE``) times the cube of the seconds since the cut (``d.rate_at``):
# ``d.rate`` at the cut, the plateau after PLATEAU_SECONDS, above it after.
_FROM_PLATEAU_SQL = f"(GREATEST(0, EXTRACT(EPOCH FROM now() - d.rate_at)) - {PLATEAU_SECONDS!r})"
RATE_NOW_SQL = (
    f"(d.rate / {RATE_DECREASE!r} * (1 + {_CUBE!r} * {_FROM_PLATEAU_SQL} "
    f"* {_FROM_PLATEAU_SQL} * {_FROM_PLATEAU_SQL}))"
)
# What a fresh throttling answer takes as the rate then: the learned rate now,
# held to the operator's limit and, after a long quiet spell, to the higher
# of the sender's estimate and the last plateau (see _THROTTLED).
_PLATEAU_SQL = (
    f"LEAST({RATE_NOW_SQL}, d.limit_rate, GREATEST(EXCLUDED.rate, d.rate) / {RATE_DECREASE!r})"
)
# For an answer within RESUMED_SECONDS of the last pause's end: the share of
# that rate the receiver admitted since the pause began (see RESUMED_SECONDS).
_RESUMED_FOR_SQL = "GREATEST(0, EXTRACT(EPOCH FROM now() - d.paused_until))"
_PAUSED_FOR_SQL = "GREATEST(0, EXTRACT(EPOCH FROM d.paused_until - d.rate_at))"
_ADMITTED_SHARE_SQL = (
    f"GREATEST({FAST_DECREASE!r}, LEAST(1, (1 / {_PLATEAU_SQL} + {_RESUMED_FOR_SQL})"
    f" / GREATEST({_PAUSED_FOR_SQL} + {_RESUMED_FOR_SQL}, 0.001)))"
)
# The rate its bucket refills at: the operator's limit, or the learned rate,
# whichever is lower (NULL: neither, no bucket).
_REFILL_SQL = f"LEAST(d.limit_rate, {RATE_NOW_SQL})"
# Whether the row has a bucket at all.
BUCKETED_SQL = "(d.rate IS NOT NULL OR d.limit_rate IS NOT NULL)"
# The tokens its bucket holds now: refilled since ``tokens_at`` (a time in
# the future while paused: none yet), holding at most the operator's burst,
# else one second's worth (at least one message).
TOKENS_NOW_SQL = (
    f"LEAST(COALESCE(d.limit_burst, GREATEST(1, {_REFILL_SQL})), "
    f"COALESCE(d.tokens, 0) + {_REFILL_SQL} "
    "* GREATEST(0, EXTRACT(EPOCH FROM now() - d.tokens_at)))"
)


def bounded_pause(seconds: Any, default: float) -> float:
    """A provider's pause made safe to write: a number within (0, a day];
    anything else (None, NaN, negative, text) is ``default``."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        return default
    seconds = float(seconds)
    if not seconds > 0:  # NaN too
        return default
    return min(seconds, MAX_PAUSE_SECONDS)


@dataclass(frozen=True)
class Throttled:
    """What one sender saw of a destination that throttled: the longest pause
    asked for, how many answers said so, and the rate this sender had asked
    at until then (calls a second), the first estimate of what it admits;
    and how long ago the last of those answers came."""

    pause_seconds: float | None  # None: the relay's own pause
    answers: int
    asked_rate: float
    # The pause runs from the answer, not from this write: the provider's
    # bucket started to refill then, and every moment the relay waits beyond
    # the pause is capacity the provider had and nobody used.
    heard_seconds_ago: float = 0.0
    # How many calls to it this sender had delivered (none: it refused every
    # call, and a refusal at once after a pause doubles the pause).
    delivered: int = 0

    def pause_left(self) -> float:
        """The seconds of the pause still to run, from now."""
        pause = bounded_pause(self.pause_seconds, THROTTLE_PAUSE_SECONDS)
        return max(0.0, pause - max(0.0, self.heard_seconds_ago))


# Whether destination row ``d`` is in the pause of its first throttling
# answers: its rate was cut once, in the minute it counts throttles from
# (``rate_at`` is then ``minute_start``, and every answer it counted is of
# that minute).
FIRST_PAUSE_SQL = "(d.rate_at = d.minute_start AND d.throttled_total = d.throttled_minute)"

# One statement for every throttled destination of a batch. The bucket is
# emptied but for one token, which it holds from the pause's end: the first
# call goes the moment the provider said it may, not a token's refill later.
# A destination already paused when the answer came (an answer to a call
# that was already under way) lengthens the pause but does not cut the rate
# again: one cut per signal, however many senders heard it. Except in its first pause: the
# first estimate is what each sender saw delivered, and several senders at
# once (a function's execution environments, several workers) each saw their
# own share, so their estimates add up (the sum is too high rather than too
# low: a rate far too high is cut hard within seconds, while one far too low
# takes a minute or more to climb back). The plateau of a fresh answer is
# the rate now, held to the operator's limit; on a destination's first answer
# (nothing learned yet) its limit, else the rate the sender had asked at: with
# a limit every sender drew from its one bucket, so the destination was asked
# at about the limit while each sender saw only its share (four workers, 25 a
# second each: the one that heard the answer would have cut 100 to 22). A
# limit far above what the receiver admits is then halved at each answer
# within RESUMED_SECONDS of a pause's end, as any rate far too high. After a
# long quiet spell the curve has grown far past anything the receiver ever
# admitted, so the plateau is also held to the higher of the sender's
# estimate and the last plateau.
# Whether destination row ``d``'s throttling answer refused the first call
# after its pause: the pause over, not RESUMED_SECONDS ago.
_REFUSED_AT_ONCE_SQL = (
    "(d.paused_until <= now() AND now() < d.paused_until "
    f"+ make_interval(secs => {RESUMED_SECONDS!r}))"
)

_THROTTLED = statement(
    f"""
    WITH t AS (
        SELECT * FROM jsonb_to_recordset(CAST(:throttled AS jsonb))
            AS t(destination text, pause_s float8, answers int, asked_rate float8,
                 delivered int)
    ),
    refused AS (
        -- Read before the upsert below changes them: the destinations that
        -- refused the first call after their pause, this sender having had
        -- nothing through since (a receiver that admits a rate refuses after
        -- some calls went through), and their last pause (cut to end).
        SELECT d.destination, EXTRACT(EPOCH FROM d.paused_until - d.rate_at) AS last_pause_s
        FROM outbox_destination AS d JOIN t ON t.destination = d.destination
        WHERE d.channel = :channel AND t.delivered = 0 AND {_REFUSED_AT_ONCE_SQL}
    ),
    paused AS (
        -- Such a destination is paused twice as long as the last time (at
        -- most MAX_BACKOFF_SECONDS), or as long as it asked if that is longer.
        SELECT t.*, CASE WHEN r.destination IS NULL THEN t.pause_s
                         ELSE GREATEST(t.pause_s, LEAST({MAX_BACKOFF_SECONDS!r},
                                                        2 * r.last_pause_s)) END AS pause_for
        FROM t LEFT JOIN refused AS r ON r.destination = t.destination
    ),
    written AS (
    INSERT INTO outbox_destination AS d
        (channel, destination, paused_until, rate, rate_at, tokens, tokens_at,
         throttled_total, throttled_minute, minute_start)
    SELECT :channel, t.destination, now() + make_interval(secs => t.pause_for),
           GREATEST({MIN_RATE}, t.asked_rate * {RATE_DECREASE}), now(),
           1, now() + make_interval(secs => t.pause_for), t.answers, t.answers, now()
    FROM paused AS t
    ON CONFLICT (channel, destination) DO UPDATE SET
        paused_until = GREATEST(d.paused_until, EXCLUDED.paused_until),
        rate = CASE WHEN d.paused_until > now() AND d.rate IS NOT NULL
                    THEN CASE WHEN {FIRST_PAUSE_SQL}
                              THEN LEAST(d.rate + EXCLUDED.rate, {RATE_DECREASE} * d.limit_rate)
                              ELSE d.rate END
                    -- (LEAST and GREATEST ignore a NULL: no limit, or nothing learned yet)
                    ELSE GREATEST({MIN_RATE}, {RATE_DECREASE} * CASE
                        WHEN d.rate IS NULL
                        THEN COALESCE(d.limit_rate, EXCLUDED.rate / {RATE_DECREASE})
                        ELSE {_PLATEAU_SQL}
                             * CASE WHEN now() < d.paused_until
                                                 + make_interval(secs => {RESUMED_SECONDS})
                                    THEN {_ADMITTED_SHARE_SQL} ELSE 1 END
                        END) END,
        rate_at = CASE WHEN d.paused_until > now() AND d.rate IS NOT NULL THEN d.rate_at
                       ELSE now() END,
        tokens = 1,
        tokens_at = GREATEST(d.tokens_at, EXCLUDED.tokens_at),
        throttled_total = d.throttled_total + EXCLUDED.throttled_total,
        throttled_minute = CASE WHEN d.minute_start > now() - interval '1 minute'
                                THEN d.throttled_minute + EXCLUDED.throttled_minute
                                ELSE EXCLUDED.throttled_minute END,
        minute_start = CASE WHEN d.minute_start > now() - interval '1 minute'
                            THEN d.minute_start ELSE now() END
    )
    SELECT destination FROM refused
    WHERE last_pause_s >= {REFUSING_AFTER_SECONDS!r}
    """
)

# A quota pause ends by itself; an operator's pause (no end) is never
# shortened by one, and keeps its reason.
_QUOTA = statement(
    """
    INSERT INTO outbox_channel_pause AS cp (channel, reason, paused_until)
    VALUES (:channel, :reason, now() + make_interval(secs => :pause_s))
    ON CONFLICT (channel) DO UPDATE SET
        reason = CASE WHEN cp.paused_until IS NULL THEN cp.reason ELSE EXCLUDED.reason END,
        paused_at = CASE WHEN cp.paused_until <= now() THEN now() ELSE cp.paused_at END,
        paused_until = CASE WHEN cp.paused_until IS NULL THEN NULL
                            WHEN cp.paused_until <= now() THEN EXCLUDED.paused_until
                            ELSE GREATEST(cp.paused_until, EXCLUDED.paused_until) END
    """
)


def record_throttling(
    conn: sa.Connection,
    channel: str,
    throttled: Mapping[str, Throttled],
    quota: tuple[str, float | None] | None = None,
) -> set[str]:
    """Pause each throttled destination of ``channel`` and cut its rate, and
    with ``quota`` (reason, seconds) pause the channel: in the caller's
    transaction, before the settle gives the rows back, so no claim between
    the two can take them. Returns the destinations that refused every call
    for long enough that the calls they refused count attempts
    (REFUSING_AFTER_SECONDS)."""
    check_channels([channel])
    refusing: set[str] = set()
    if throttled:
        rows = [
            {
                "destination": destination,
                "pause_s": t.pause_left(),
                "answers": t.answers,
                "asked_rate": max(float(t.asked_rate), MIN_RATE),
                "delivered": t.delivered,
            }
            for destination, t in throttled.items()
        ]
        refusing = set(
            conn.execute(
                _THROTTLED, {"channel": channel, "throttled": json_document(rows)}
            ).scalars()
        )
    if quota is not None:
        reason, seconds = quota
        conn.execute(
            _QUOTA,
            {
                "channel": channel,
                "reason": reason,
                "pause_s": bounded_pause(seconds, QUOTA_PAUSE_SECONDS),
            },
        )
    return refusing


@dataclass(frozen=True)
class DestinationFigures:
    """One destination as ``outbox status`` shows it."""

    channel: str
    destination: str
    rate: float | None  # the learned rate now, messages a second (None: none)
    limit_rate: float | None  # the operator's limit, messages a second (None: none)
    limit_burst: float | None
    paused_until: Any  # a datetime while paused, else None
    throttled_last_minute: int
    throttled_total: int
    # Where the limit came from: 'operator', 'config' or 'provider' (None: no limit).
    limit_source: str | None = None


_DESTINATIONS = statement(
    f"""
    SELECT d.channel, d.destination, {RATE_NOW_SQL} AS rate, d.limit_rate, d.limit_burst,
           CASE WHEN d.paused_until > now() THEN d.paused_until END AS paused_until,
           CASE WHEN d.minute_start > now() - interval '1 minute'
                THEN d.throttled_minute ELSE 0 END AS throttled_last_minute,
           d.throttled_total, d.limit_source
    FROM outbox_destination AS d
    ORDER BY d.channel, d.destination
    """
)


def destination_figures(conn: sa.Connection) -> list[DestinationFigures]:
    """Every destination that ever throttled or has a limit, with its figures now."""
    return [
        DestinationFigures(
            r.channel,
            r.destination,
            None if r.rate is None else float(r.rate),
            None if r.limit_rate is None else float(r.limit_rate),
            None if r.limit_burst is None else float(r.limit_burst),
            r.paused_until,
            int(r.throttled_last_minute),
            int(r.throttled_total),
            r.limit_source,
        )
        for r in conn.execute(_DESTINATIONS)
    ]


# --- the operator's limits ------------------------------------------------------

# A new limit starts with a full bucket; a changed one keeps what is left.
# An operator's limit replaces any other; the configuration's replaces the
# provider's; the provider's replaces none (limits.LIMIT_SOURCES).
_LIMIT_UPSERT = """
    INSERT INTO outbox_destination AS d
        (channel, destination, limit_rate, limit_burst, limit_source, tokens, tokens_at)
    {rows}
    ON CONFLICT (channel, destination) DO UPDATE SET
        limit_rate = EXCLUDED.limit_rate, limit_burst = EXCLUDED.limit_burst,
        limit_source = EXCLUDED.limit_source,
        tokens = LEAST(COALESCE(d.tokens, EXCLUDED.limit_burst), EXCLUDED.limit_burst),
        tokens_at = COALESCE(d.tokens_at, now())
    WHERE {replaces}
"""
_SET_LIMIT = statement(
    _LIMIT_UPSERT.format(
        rows=f"VALUES (:channel, :destination, :rate, :burst, '{OPERATOR}', :burst, now())",
        replaces="true",
    )
)
# Cleared: the row goes, unless it holds what the relay learned (then only
# the limit goes). Two statements: one statement's two CTEs cannot both
# change one row.
_DROP_LIMITED = statement(
    """
    DELETE FROM outbox_destination
    WHERE channel = :channel AND destination = :destination
      AND limit_rate IS NOT NULL AND rate IS NULL
    RETURNING channel
    """
)
_CLEAR_LIMIT = statement(
    """
    UPDATE outbox_destination SET limit_rate = NULL, limit_burst = NULL, limit_source = NULL
    WHERE channel = :channel AND destination = :destination AND limit_rate IS NOT NULL
    RETURNING channel
    """
)


def set_limit(
    conn: sa.Connection, channel: str, destination: str, rate: float, burst: float | None = None
) -> tuple[float, float]:
    """Hold ``channel``'s ``destination`` ('' for the account) to ``rate``
    messages a second, ``burst`` at once, for every dispatcher and worker.
    Returns (rate, burst) as stored; ValueError (nothing changed) for a bad one."""
    check_channels([channel])
    rate, burst = check_limit(rate, burst)
    conn.execute(
        _SET_LIMIT, {"channel": channel, "destination": destination, "rate": rate, "burst": burst}
    )
    return rate, burst


def clear_limit(conn: sa.Connection, channel: str, destination: str) -> bool:
    """Remove the limit, whoever set it; True if there was one. (A limit the
    configuration names comes back at the next cold start that applies it.)"""
    check_channels([channel])
    key = {"channel": channel, "destination": destination}
    dropped = conn.execute(_DROP_LIMITED, key).first() is not None
    return conn.execute(_CLEAR_LIMIT, key).first() is not None or dropped


_FORGET_IDLE = statement(
    f"""
    DELETE FROM outbox_destination AS d
    USING (
        SELECT channel, destination FROM outbox_destination
        WHERE limit_rate IS NULL
          AND (paused_until IS NULL
               OR paused_until < now() - make_interval(secs => {FORGET_AFTER_SECONDS!r}))
          AND (rate_at IS NULL
               OR rate_at < now() - make_interval(secs => {FORGET_AFTER_SECONDS!r}))
        LIMIT :batch_size
        FOR UPDATE SKIP LOCKED
    ) AS idle
    WHERE d.channel = idle.channel AND d.destination = idle.destination
    """
)


def forget_idle_destinations(conn: sa.Connection, batch_size: int) -> int:
    """Remove up to ``batch_size`` destination rows that hold only what the
    relay learned, FORGET_AFTER_SECONDS after their last throttling answer and
    pause (a limit, whoever set it, stays until cleared)."""
    return conn.execute(_FORGET_IDLE, {"batch_size": batch_size}).rowcount


_FORGET_LEARNED = statement(
    """
    WITH learned AS (
        SELECT channel, destination, limit_rate FROM outbox_destination
        WHERE channel = :channel AND destination = :destination
          AND (rate IS NOT NULL OR paused_until > now() OR tokens_at IS NOT NULL)
        FOR UPDATE
    ),
    dropped AS (
        DELETE FROM outbox_destination AS d USING learned AS l
        WHERE d.channel = l.channel AND d.destination = l.destination AND l.limit_rate IS NULL
    ),
    cleared AS (
        UPDATE outbox_destination AS d
        SET rate = NULL, rate_at = NULL, paused_until = NULL, tokens = NULL, tokens_at = NULL,
            throttled_minute = 0, minute_start = NULL
        FROM learned AS l
        WHERE d.channel = l.channel AND d.destination = l.destination
          AND l.limit_rate IS NOT NULL
    )
    SELECT count(*) FROM learned
    """
)


def forget_learned(conn: sa.Connection, channel: str, destination: str) -> bool:
    """Forget what the relay learned of a destination (its rate, its pause,
    its bucket), keeping a limit set on it; True if there was something."""
    check_channels([channel])
    key = {"channel": channel, "destination": destination}
    return bool(conn.execute(_FORGET_LEARNED, key).scalar_one())


# For a relay that sleeps until its next event (docs/how-to/pacing.md): the
# rows of a paused destination or channel, or of an empty bucket, are due but
# not claimable, so their next chance is when the pause ends or a token comes.
# Such a time counts only when a pending row of that destination (of the
# channel, for a channel-wide limit '*') or channel is due by then: a pause
# that ends before its rows' backoff does is no wake-up (the rows' own time
# is, in next_wake's next_due). A scalar subquery ordered as a due index is
# (its first row, never the table), as delivery._BUCKET_HAS_DUE is.
def _row_due_by(at: str, channel: str, destination: str | None = None) -> str:
    match, order = f"m.channel = {channel}", "m.channel"
    if destination is not None:
        match, order = f"{match} AND m.destination = {destination}", "m.channel, m.destination"
    return f"""COALESCE((SELECT true FROM outbox_message AS m
              WHERE {match} AND m.status = 'pending' AND m.available_at <= {at}
              ORDER BY {order}, m.priority DESC, m.available_at, m.id LIMIT 1), false)"""


def _destination_row_due_by(at: str) -> str:
    return (
        f"CASE WHEN d.destination = '*' THEN {_row_due_by(at, 'd.channel')} "
        f"ELSE {_row_due_by(at, 'd.channel', 'd.destination')} END"
    )


def _tenant_row_due_by(at: str) -> str:
    """Whether tenant's channel ``tc`` has a pending row due by ``at`` (the
    per-tenant due index)."""
    return f"""COALESCE((SELECT true FROM outbox_message AS m
              WHERE m.tenant = tc.tenant AND m.channel = tc.channel
                AND m.status = 'pending' AND m.available_at <= {at}
              ORDER BY m.tenant, m.priority DESC, m.available_at, m.id LIMIT 1), false)"""


_TENANT_TOKEN_AT_SQL = (
    f"now() + make_interval(secs => (1 - {TENANT_TOKENS_NOW_SQL}) / tc.limit_rate)"
)
_TOKEN_AT_SQL = f"now() + make_interval(secs => (1 - {TOKENS_NOW_SQL}) / {_REFILL_SQL})"
NEXT_RESUME_SQL = f"""LEAST(
        (SELECT min(d.paused_until) FROM outbox_destination AS d
         WHERE d.paused_until > now() AND {_destination_row_due_by("d.paused_until")}),
        (SELECT min(cp.paused_until) FROM outbox_channel_pause AS cp
         WHERE cp.paused_until > now() AND {_row_due_by("cp.paused_until", "cp.channel")}),
        (SELECT min({_TOKEN_AT_SQL}) FROM outbox_destination AS d
         WHERE {BUCKETED_SQL} AND (d.paused_until IS NULL OR d.paused_until <= now())
           AND {TOKENS_NOW_SQL} < 1 AND {_destination_row_due_by(_TOKEN_AT_SQL)}),
        (SELECT min({_TENANT_TOKEN_AT_SQL}) FROM outbox_tenant_channel AS tc
         WHERE tc.limit_rate IS NOT NULL AND NOT tc.paused AND {TENANT_TOKENS_NOW_SQL} < 1
           AND {_tenant_row_due_by(_TENANT_TOKEN_AT_SQL)}))"""
_NEXT_RESUME = statement(f"SELECT {NEXT_RESUME_SQL} AS next_resume")


def next_resume(conn: sa.Connection) -> Any:
    """The earliest future time a paused destination or channel resumes, or an
    empty bucket holds a token again (a datetime), or None."""
    return conn.execute(_NEXT_RESUME).scalar_one()


_SECONDS_TO_RESUME = statement(
    f"SELECT CAST(EXTRACT(EPOCH FROM {NEXT_RESUME_SQL} - now()) AS float8) AS seconds"
)


def seconds_to_resume(conn: sa.Connection) -> float | None:
    """``next_resume`` as seconds from now on the database's clock (for a
    loop that waits on its own monotonic clock), or None."""
    seconds = conn.execute(_SECONDS_TO_RESUME).scalar_one()
    return None if seconds is None else float(seconds)


# --- limits from the configuration and from the provider --------------------------

_APPLY_CONFIGURED = statement(
    _LIMIT_UPSERT.format(
        rows=f"""SELECT c.channel, c.destination, c.rate, c.burst, '{CONFIG}', c.burst, now()
    FROM jsonb_to_recordset(CAST(:limits AS jsonb))
        AS c(channel text, destination text, rate float8, burst float8)""",
        replaces=f"d.limit_source IS DISTINCT FROM '{OPERATOR}'",
    )
)
# The configuration's limits it no longer names, on the channels the caller
# serves: the row goes when it holds nothing learned, else only the limit.
_UNCONFIGURED = f"""
    WHERE d.limit_source = '{CONFIG}'
      AND (CAST(:channels AS text[]) IS NULL OR d.channel = ANY(CAST(:channels AS text[])))
      AND (d.channel, d.destination) NOT IN (
            SELECT c.channel, c.destination
            FROM jsonb_to_recordset(CAST(:limits AS jsonb)) AS c(channel text, destination text))
"""
_DROP_UNCONFIGURED = statement(
    f"DELETE FROM outbox_destination AS d {_UNCONFIGURED} AND d.rate IS NULL"
)
_CLEAR_UNCONFIGURED = statement(
    "UPDATE outbox_destination AS d "
    f"SET limit_rate = NULL, limit_burst = NULL, limit_source = NULL {_UNCONFIGURED}"
)


@dataclass(frozen=True)
class AppliedLimits:
    """What applying the configuration changed: limits written, and removed."""

    written: int
    removed: int


def apply_configured_limits(
    conn: sa.Connection, limits: Sequence[RateLimit], channels: Sequence[str] | None = None
) -> AppliedLimits:
    """Make the configuration's limits (``RATE_LIMITS``) the database's, for
    every claimer: write each one, except over an operator's; remove those
    it wrote before and no longer names, on ``channels`` (None: every
    channel). Idempotent; three statements, whatever the number of limits."""
    check_channels([limit.channel for limit in limits])
    check_channels(channels)
    document = json_document([limit._asdict() for limit in limits])
    served = None if channels is None else array_literal(channels)
    written = conn.execute(_APPLY_CONFIGURED, {"limits": document}).rowcount
    removed = conn.execute(_DROP_UNCONFIGURED, {"limits": document, "channels": served}).rowcount
    removed += conn.execute(_CLEAR_UNCONFIGURED, {"limits": document, "channels": served}).rowcount
    return AppliedLimits(written, removed)


_SET_PROVIDER_LIMIT = statement(
    _LIMIT_UPSERT.format(
        rows=f"VALUES (:channel, :destination, :rate, :burst, '{PROVIDER}', :burst, now())",
        replaces=f"d.limit_source IS NULL OR d.limit_source = '{PROVIDER}'",
    )
)


def set_provider_limit(
    conn: sa.Connection, channel: str, destination: str, rate: float, burst: float | None = None
) -> bool:
    """The provider's own figure as ``channel``'s ``destination``'s limit, where
    neither an operator nor the configuration set one; True if written.
    ValueError (nothing changed) for a figure outside the limits' bounds."""
    check_channels([channel])
    rate, burst = check_limit(rate, burst)
    key = {"channel": channel, "destination": destination, "rate": rate, "burst": burst}
    return conn.execute(_SET_PROVIDER_LIMIT, key).rowcount > 0
