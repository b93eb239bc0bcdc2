"""Provider feedback (SES bounce, complaint and delivery events): matched by
message id and recipient, recorded once per notice's content, and
``delivered -> bounced | complained`` once every recipient bounced or complained."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import sqlalchemy as sa

from ..states import FEEDBACK_OUTCOMES
from ._sql import array_literal, json_document, statement

__all__ = [
    "Feedback",
    "FeedbackResult",
    "record_feedback",
]


@dataclass(frozen=True)
class Feedback:
    """One provider notice about one recipient of a sent message, as the
    feedback function parsed it.

    ``recipient`` is the address the notice is about: it is never stored, only
    its keyed fingerprint, compared with the fingerprints of the recipients the
    message was sent to. ``kind`` is the notice's type and subtype
    (``Permanent/General``, ``abuse``, ``delivery``): with the message, the
    recipient and the outcome it names the notice, so the same notice recorded
    twice (an SNS redelivery, a replay with a fresh feedback id) writes nothing
    the second time. ``reason`` is scrubbed (the parser uses ``outbox.redact``).
    """

    provider_message_id: str
    outcome: str
    recipient: str
    kind: str
    reason: str | None = None


@dataclass(frozen=True)
class FeedbackResult:
    provider_message_id: str
    outcome: str
    message_id: int | None  # None: no email message was sent to this recipient under this id
    recorded: bool  # False for a matched notice recorded before (a repeat)
    new_status: str | None  # set when the notice moved the message


# Concurrent invocations (SNS delivers one event to two at once; two
# recipients' bounces arrive together) take the messages' row locks first, in
# id order, so that the statement after, with a snapshot taken once the locks
# are held, sees every notice the others committed: "every recipient bounced"
# is never missed by two transactions that each saw half of it.
_LOCK_MESSAGES = statement(
    """
    SELECT id FROM outbox_message
    WHERE provider_message_id = ANY(CAST(:provider_ids AS text[])) AND channel = 'email'
    ORDER BY id
    FOR UPDATE
    """
)

_RECORD_FEEDBACK = statement(
    """
    WITH input AS (
        SELECT i.*, outbox_fingerprint(outbox_normalize_address('email', i.address)) AS fp
        FROM jsonb_to_recordset(CAST(:events AS jsonb))
            AS i(ord int, provider_id text, outcome text, kind text, address text, error text)
    ),
    matched AS (
        -- the email with this SES id, and only for a recipient its delivered
        -- attempt went to (the fingerprints recorded with that attempt)
        SELECT i.ord, i.provider_id, i.outcome, i.error, i.fp,
               i.outcome || ':' || i.kind || ':' || encode(i.fp, 'hex') AS feedback_id,
               m.id AS message_id, m.attempts, m.tenant, sent.recipient_fingerprints AS sent_to
        FROM input AS i
        JOIN outbox_message AS m
          ON m.provider_message_id = i.provider_id AND m.channel = 'email'
        JOIN LATERAL (
            -- an attempt written before the send log (revision 0006) has no
            -- fingerprints: the message's, computed at enqueue, are the same
            SELECT COALESCE(a.recipient_fingerprints, m.recipient_fingerprints)
                       AS recipient_fingerprints
            FROM outbox_attempt AS a
            WHERE a.message_id = m.id AND a.outcome = 'delivered'
            ORDER BY a.id DESC LIMIT 1
        ) AS sent ON i.fp = ANY(sent.recipient_fingerprints)
    ),
    logged AS (
        INSERT INTO outbox_attempt
            (message_id, attempt, outcome, error, provider_message_id, feedback_id, channel,
             recipient_fingerprints, tenant)
        SELECT message_id, attempts, outcome, error, provider_id, feedback_id, 'email',
               ARRAY[fp], tenant
        FROM matched
        ORDER BY ord
        -- the same notice twice (a redelivery, a replay) is one row: the
        -- feedback id names its content, not the provider's event
        ON CONFLICT (message_id, feedback_id) WHERE feedback_id IS NOT NULL DO NOTHING
        RETURNING id, message_id, outcome, error, feedback_id
    ),
    final_notices AS (
        -- each recipient's permanent bounce or complaint: recorded before, or now
        SELECT a.message_id, a.outcome, fp
        FROM outbox_attempt AS a CROSS JOIN unnest(a.recipient_fingerprints) AS fp
        WHERE a.message_id IN (SELECT message_id FROM logged)
          AND a.outcome IN ('bounced', 'complained')
        UNION ALL
        SELECT l.message_id, l.outcome, mt.fp
        FROM logged AS l
        JOIN matched AS mt ON mt.message_id = l.message_id AND mt.feedback_id = l.feedback_id
        WHERE l.outcome IN ('bounced', 'complained')
    ),
    last_final AS (
        -- the newest permanent notice of this batch gives its reason
        SELECT DISTINCT ON (message_id) id AS attempt_id, message_id, error
        FROM logged WHERE outcome IN ('bounced', 'complained')
        ORDER BY message_id, id DESC
    ),
    verdict AS (
        -- every recipient the message was sent to has a permanent notice
        SELECT f.attempt_id, f.message_id, f.error,
               CASE WHEN EXISTS (SELECT 1 FROM final_notices AS n
                                 WHERE n.message_id = f.message_id AND n.outcome = 'complained')
                    THEN 'complained' ELSE 'bounced' END AS status
        FROM last_final AS f
        WHERE NOT EXISTS (
            SELECT 1
            FROM (SELECT DISTINCT ON (message_id) message_id, sent_to FROM matched) AS mt
            CROSS JOIN unnest(mt.sent_to) AS r
            WHERE mt.message_id = f.message_id
              AND NOT EXISTS (SELECT 1 FROM final_notices AS n
                              WHERE n.message_id = f.message_id AND n.fp = r)
        )
    ),
    moved AS (
        -- only a delivered message moves: a repeat, or feedback on a message
        -- that already bounced, leaves its status alone
        UPDATE outbox_message AS m SET status = v.status, last_error = v.error
        FROM verdict AS v
        WHERE m.id = v.message_id AND m.status = 'delivered'
        RETURNING v.attempt_id, m.status
    )
    SELECT i.ord, mt.message_id, (l.id IS NOT NULL) AS recorded, mv.status AS new_status
    FROM input AS i
    LEFT JOIN matched AS mt ON mt.ord = i.ord
    LEFT JOIN logged AS l ON l.message_id = mt.message_id AND l.feedback_id = mt.feedback_id
    LEFT JOIN moved AS mv ON mv.attempt_id = l.id
    ORDER BY i.ord
    """
)


def record_feedback(conn: sa.Connection, events: Sequence[Feedback]) -> list[FeedbackResult]:
    """Record a batch of provider notices: an attempt row each (with the
    provider's reason), and ``delivered -> bounced | complained`` once every
    recipient has a permanent bounce or a complaint. Idempotent per (message,
    recipient, outcome, kind). One statement takes the messages' locks, one
    records the batch.

    ``events`` must not repeat a (provider id, outcome, kind, recipient).
    """
    if not events:
        return []
    unknown = {e.outcome for e in events} - set(FEEDBACK_OUTCOMES)
    if unknown:
        raise ValueError(f"unknown feedback outcome(s): {sorted(unknown)}")
    conn.execute(
        _LOCK_MESSAGES,
        {"provider_ids": array_literal(sorted({e.provider_message_id for e in events}))},
    )
    rows = conn.execute(
        _RECORD_FEEDBACK,
        {
            "events": json_document(
                [
                    {
                        "ord": n,
                        "provider_id": e.provider_message_id,
                        "outcome": e.outcome,
                        "kind": e.kind,
                        "address": e.recipient,
                        "error": e.reason,
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
