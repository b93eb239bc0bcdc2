"""Provider feedback (SES bounce, complaint and delivery events): recorded
once per event, and ``delivered -> bounced | complained``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import sqlalchemy as sa

from ..states import FEEDBACK_OUTCOMES
from ._sql import json_document, statement


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


_RECORD_FEEDBACK = statement(
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
            "events": json_document(
                [
                    {
                        "ord": n,
                        "provider_id": e.provider_message_id,
                        "outcome": e.outcome,
                        "error": e.reason,
                        "feedback_id": e.feedback_id,
                    }
                    for n, e in enumerate(events)
                ]
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
