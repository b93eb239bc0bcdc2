"""Delivery under Lambda's real semantics: the sender's receipt, counted
deferrals, a deliver-by time (status ``expired``), and the ordering-key
failure policy.

Revision ID: 0002
Revises: 0001
"""

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

# Every status of the final design (other revisions add the transitions).
_STATUSES = (
    "'pending', 'claimed', 'delivered', 'failed', 'dead', 'suppressed', 'cancelled', "
    "'expired', 'bounced', 'complained'"
)
_OLD_STATUSES = "'pending', 'claimed', 'delivered', 'failed', 'dead', 'suppressed', 'cancelled'"
_OUTCOMES = "'delivered', 'retry', 'failed', 'dead', 'suppressed', 'deferred', 'expired'"


def upgrade() -> None:
    op.execute(
        """
        ALTER TABLE outbox_message
            -- Stamped by the sender's compare-and-set when it takes a claim to send;
            -- a claim is sent at most once, and a lease that ends without a
            -- receipt was never started (no attempt counted). Reset by each claim.
            ADD COLUMN received_at timestamptz,
            -- Deferrals (no attempt counted) so far; capped by MAX_DEFERRALS.
            ADD COLUMN deferrals integer NOT NULL DEFAULT 0 CHECK (deferrals >= 0),
            -- Deliver-by time: not delivered by then ends 'expired'. NULL: the relay's
            -- DEFAULT_TTL_SECONDS from the time the row is first due (set at its first claim).
            ADD COLUMN expires_at timestamptz,
            -- What happens to this row when an earlier row of its ordering key ends
            -- failed, dead or expired: 'hold' (wait for an operator) or 'cancel'.
            ADD COLUMN on_predecessor_failure text NOT NULL DEFAULT 'hold'
                CHECK (on_predecessor_failure IN ('hold', 'cancel'))
        """
    )
    _replace_checks(_STATUSES, _OUTCOMES + ", 'not_started'")
    # The ordering index also holds the rows that hold their successors
    # (failed, dead, expired), so the claim's "may this key go?" probe and
    # the held count stay index lookups however many delivered rows a key has.
    op.execute("DROP INDEX outbox_message_ordering")
    op.execute(
        "CREATE INDEX outbox_message_ordering ON outbox_message (ordering_key, id) "
        "WHERE ordering_key IS NOT NULL "
        "AND status IN ('pending', 'claimed', 'failed', 'dead', 'expired')"
    )
    # Pending rows with their own deliver-by time, for the reaper's expiry sweep.
    op.execute(
        "CREATE INDEX outbox_message_expiry ON outbox_message (expires_at) "
        "WHERE status = 'pending' AND expires_at IS NOT NULL"
    )


def _replace_checks(statuses: str, outcomes: str) -> None:
    op.execute(
        "ALTER TABLE outbox_message DROP CONSTRAINT outbox_message_status_check, "
        f"ADD CONSTRAINT outbox_message_status_check CHECK (status IN ({statuses}))"
    )
    op.execute(
        "ALTER TABLE outbox_attempt DROP CONSTRAINT outbox_attempt_outcome_check, "
        f"ADD CONSTRAINT outbox_attempt_outcome_check CHECK (outcome IN ({outcomes}))"
    )


def downgrade() -> None:
    op.execute("DROP INDEX outbox_message_expiry")
    op.execute("DROP INDEX outbox_message_ordering")
    op.execute(
        "CREATE INDEX outbox_message_ordering ON outbox_message (ordering_key, id) "
        "WHERE ordering_key IS NOT NULL AND status IN ('pending', 'claimed')"
    )
    _replace_checks(_OLD_STATUSES, _OUTCOMES)
    op.execute(
        "ALTER TABLE outbox_message DROP COLUMN received_at, DROP COLUMN deferrals, "
        "DROP COLUMN expires_at, DROP COLUMN on_predecessor_failure"
    )
